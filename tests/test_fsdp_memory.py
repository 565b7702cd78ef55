"""FSDP's gradient accumulation on 2 gloo ranks: with the same micro-batch, 4 micro-batches per step instead of 1
add to the step's peak memory at most the fp32 gradient shard (4P/g bytes, P parameters, g ranks: one micro-batch
reaches its peak before any unit's shard is made) and P bytes more. Every micro-batch's gradient is reduce-scattered
into the shard, not kept unsharded (4P) until the last one.

Peak: the bytes of every tensor alive as the step starts (shards, and gradients kept between steps), plus the peak of
the storages that ops create during the step (LiveBytes, as in tests/test_plan_measured.py), from creation until
freed: the step's gradients, activations, gathered units and flat buffers. The warm-up step has one micro-batch, so
whatever the step allocates for more is counted."""
import gc
import warnings

import torch
from torch import nn

import model
from bench.ranks import run_ranks
from parallel.fsdp import FSDP
from parallel.materialize import local_init
from parallel.mesh import Mesh
from tests.memory import LiveBytes

# the gradients dominate: a wide model on few tokens (2 rows of 8)
CFG = model.ModelConfig(n_layer=2, d_model=64, n_head=4, n_kv_head=2, ffn_dim=256, vocab_size=256, seq_len=8)


def live_tensor_bytes():
    """Bytes of the distinct storages of every tensor alive in this process."""
    gc.collect()
    with warnings.catch_warnings():  # isinstance() on some module objects warns about deprecations
        warnings.simplefilter("ignore")
        tensors = [o for o in gc.get_objects() if isinstance(o, torch.Tensor) and o.device.type != "meta"]
    return sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}.values())


def step_peak(fsdp, rank, micro_batches):
    """Peak bytes of one step of `micro_batches` micro-batches of 2 rows, stepped as train.py does."""
    gen = torch.Generator().manual_seed(rank)
    before = live_tensor_bytes()
    with LiveBytes() as live:
        for i in range(micro_batches):
            fsdp.sync_grads = i == micro_batches - 1
            x = torch.randint(0, CFG.vocab_size, (2, CFG.seq_len + 1), generator=gen)
            (fsdp.module[0](x[:, :-1], x[:, 1:]) / micro_batches).backward()
        fsdp.finish_grad_sync()
    fsdp.zero_grad()
    return before + live.peak


def _peaks(rank, world):
    with torch.device("meta"):
        gpt = model.GPT(CFG)
    fsdp = FSDP(nn.ModuleList([gpt]), Mesh(rank, world), Mesh(rank, world).dp_cp_group,
                lambda name, p, flat=None, out=None: local_init(name, p, CFG, 0, flat, out), "cpu")
    step_peak(fsdp, rank, 1)  # warm-up: caches (RoPE) made once
    return {a: step_peak(fsdp, rank, a) for a in (1, 4)}


def test_accumulating_four_micro_batches_adds_at_most_p_bytes():
    P = sum(p.numel() for p in model.GPT(CFG).parameters())
    for peaks in run_ranks(_peaks, 2, timeout=120):
        print(f"\nFSDP g=2, P={P} ({4 * P} B fp32): peak of a step, A=1 {peaks[1]} B, A=4 {peaks[4]} B, "
              f"+{peaks[4] - peaks[1]} B")
        assert peaks[4] - peaks[1] <= 4 * P / 2 + P
