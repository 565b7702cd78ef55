"""The compute path is GPU-shaped by construction, checked on CPU with a dispatch mode over one forward and backward:
grouped-query attention hands K and V to the fused kernel with their own head count (one process and tp; the
context-parallel paths are in test_attention_heads.py), and under bf16 no (tokens, vocab) tensor exists in fp32."""
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import model
from bench.ranks import run_ranks
from parallel import tp
from parallel.materialize import init_weights
from parallel.mesh import Mesh

FUSED_ATTENTION = {getattr(torch.ops.aten, name).default for name in (
    "_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention") if hasattr(torch.ops.aten, name)}
GQA = model.ModelConfig(n_layer=2, d_model=128, n_head=8, n_kv_head=2, ffn_dim=256, vocab_size=50257, seq_len=256)


class Recorder(TorchDispatchMode):
    """The k/v head counts every fused attention call got, every repeat_interleave, and the largest fp32 output."""

    def __init__(self):
        super().__init__()
        self.kv_heads, self.repeats, self.largest_fp32 = [], 0, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in FUSED_ATTENTION:
            self.kv_heads.append((args[1].shape[1], args[2].shape[1]))
        if "repeat_interleave" in func.name():
            self.repeats += 1
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor) and t.dtype == torch.float32:
                self.largest_fp32 = max(self.largest_fp32, t.numel())
        return out


def forward_backward(gpt, dtype, batch=2):
    gen = torch.Generator().manual_seed(0)
    x, y = (torch.randint(0, GQA.vocab_size, (batch, GQA.seq_len), generator=gen) for _ in range(2))
    with Recorder() as rec:
        with torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32):
            loss = gpt(x, y)
        loss.backward()
    return rec, batch * GQA.seq_len


def test_one_process_attention_takes_the_kv_heads_as_they_are():
    rec, _ = forward_backward(init_weights(model.GPT(GQA), 0, "cpu"), torch.float32)
    assert rec.kv_heads and set(rec.kv_heads) == {(GQA.n_kv_head, GQA.n_kv_head)}, rec.kv_heads
    assert rec.repeats == 0


def test_one_process_bf16_step_has_no_fp32_logits():
    rec, tokens = forward_backward(init_weights(model.GPT(GQA), 0, "cpu"), torch.bfloat16)
    logits_elements = tokens * GQA.padded_vocab
    assert rec.largest_fp32 * 4 < logits_elements * 2, (rec.largest_fp32, logits_elements)  # bytes: < the bf16 logits


def _tp_rank(rank, world):
    mesh = Mesh(rank, world, tp=world)
    with torch.device("meta"):
        gpt = model.GPT(GQA)
    tp.parallelize(gpt, mesh)
    init_weights(gpt, 0, "cpu")
    heads, _ = forward_backward(gpt, torch.float32)
    sizes, tokens = forward_backward(gpt, torch.bfloat16)
    return heads.kv_heads, heads.repeats, sizes.largest_fp32, tokens * GQA.padded_vocab // world


@pytest.mark.parametrize("world", [2])
def test_tp_attention_takes_the_local_kv_heads_and_keeps_no_fp32_logits(world):
    for kv_heads, repeats, largest_fp32, logits_elements in run_ranks(_tp_rank, world, timeout=120):
        local = GQA.n_kv_head // world
        assert kv_heads and set(kv_heads) == {(local, local)} and repeats == 0, kv_heads
        assert largest_fp32 * 4 < logits_elements * 2, (largest_fp32, logits_elements)
