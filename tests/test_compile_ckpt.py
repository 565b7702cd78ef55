"""--ckpt selective keeps, compiled, no more than it keeps eager, and drops at least one copy, in the compute dtype, of
every norm's and SwiGLU's output.

In a compiled block the partitioner decides what is saved; left alone it keeps a norm's output for the matmul reading
it, and tensors a graph keeps carry no autograd history for selective's rule to recognize (parallel/ckpt.py's
selective_in_graph steers it). Measured as tests/test_ckpt.py does: the bytes of the distinct storages a chunk's
forward saves for backward, seen by a last saved-tensor rule (after selective's own), here on the second forward of
this rank's first micro-batch, when every part is compiled. One set of ranks per world size measures its layouts."""
import pytest
import torch
import torch._dynamo

import config
import train
from bench.ranks import run_ranks
from parallel import cp, keep_saved

MODEL = ["--model", "tiny", "--n-layer", "2", "--seq-len", "64", "--global-batch", "8", "--micro-batch", "4",
         "--device", "cpu", "--peak-tflops", "1"]
LAYOUTS = {  # name: (world, flags)
    "one process": (1, ["--dtype", "fp32"]), "one process bf16": (1, ["--dtype", "bf16"]),
    "tp2 sp": (2, ["--tp", "2", "--sp", "--dtype", "fp32"]), "cp2 ring": (2, ["--cp", "2", "--dtype", "fp32"])}


def saved_bytes(rank, world, flags):
    """Bytes this rank's first chunk keeps for backward from one micro-batch's forward."""
    torch._dynamo.reset()
    run = config.resolve(MODEL + flags, environ={"RANK": str(rank), "WORLD_SIZE": str(world)})
    cfg = train.model_config(run, 257)
    mesh = train.start_distributed(run)
    trainer = train.prepare(run, cfg, mesh)
    chunk, seen = trainer.chunks[0], {}

    def count(t):
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t
    keep_saved(chunk, count, None)
    ids = torch.randint(0, cfg.vocab_size, (run.micro_batch, cfg.seq_len + 1),
                        generator=torch.Generator().manual_seed(0))
    batch = [(ids[:, :-1], ids[:, 1:])]  # one micro-batch; under cp this rank's tokens, as train.py cuts them
    batches, positions = cp.shard_batches(batch, mesh) if mesh.cp > 1 else (batch, None)
    for _ in range(2):  # the first forward compiles
        seen.clear()
        with trainer.autocast:
            loss = chunk(*batches[0], positions)
        loss.backward()
        trainer.wrapper.zero_grad()
    return sum(seen.values())


RUNS = [(compiled, policy) for compiled in (False, True) for policy in ("none", "selective")]


def _measure(rank, world, layouts):
    return {name: {(compiled, policy): saved_bytes(rank, world, flags + ["--ckpt", policy, "--compile" if compiled
                                                                         else "--no-compile"])
                   for compiled, policy in RUNS} for name, flags in layouts.items()}


@pytest.fixture(scope="module")
def kept():
    """{layout: {(compiled, policy): bytes}} from rank 0 of each world size."""
    out = {}
    for world in sorted({w for w, _ in LAYOUTS.values()}):
        out.update(run_ranks(_measure, world, args=({n: f for n, (w, f) in LAYOUTS.items() if w == world},),
                             timeout=900)[0])
    return out


def outputs_bytes(world, flags):
    """One copy of every norm's and SwiGLU's output on a rank, in the compute dtype: per token and layer 2·d/sh + f/tp
    elements (sh = tp under --sp), and d/sh for the final norm."""
    run = config.resolve(MODEL + flags, environ={"RANK": "0", "WORLD_SIZE": str(world)})
    cfg = train.model_config(run, 257)
    tokens = run.micro_batch * cfg.seq_len // run.cp
    sh = run.tp if run.sp else 1
    per_token = cfg.n_layer * (2 * cfg.d_model // sh + cfg.ffn_dim // run.tp) + cfg.d_model // sh
    return tokens * per_token * config.DTYPES[run.dtype].itemsize


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_compiled_selective_keeps_what_eager_selective_keeps(name, kept):
    got = kept[name]
    print(f"\n{name}: eager none {got[False, 'none']}, selective {got[False, 'selective']}; compiled none "
          f"{got[True, 'none']}, selective {got[True, 'selective']} bytes")
    assert got[True, "selective"] <= got[False, "selective"]
    assert got[True, "none"] - got[True, "selective"] >= outputs_bytes(*LAYOUTS[name])


def _grads(flags, dynamo_disabled=False):
    """Step-1 gradients of one process (fp32) built with `flags`, run with dynamo on or off."""
    torch._dynamo.reset()
    run = config.resolve(MODEL + ["--dtype", "fp32", "--ckpt", "selective"] + flags, environ={})
    cfg = train.model_config(run, 257)
    trainer = train.prepare(run, cfg, train.start_distributed(run))
    ids = torch.randint(0, cfg.vocab_size, (run.micro_batch, cfg.seq_len + 1),
                        generator=torch.Generator().manual_seed(0))
    with torch._dynamo.config.patch(disable=dynamo_disabled):
        trainer.chunks[0](ids[:, :-1], ids[:, 1:]).backward()
    return [p.grad.clone() for p in trainer.wrapper.optim_params()]


def test_selective_regions_of_a_compiled_block_are_right_when_it_runs_eagerly():
    """Dynamo may decline a compiled block's frame (its recompile limit, a dispatch mode, dynamo off):
    the block then runs eagerly, and the regions selective_in_graph installed must still give
    selective's eager gradients."""
    expected = _grads(["--no-compile"])
    for got, want in zip(_grads(["--compile"], dynamo_disabled=True), expected):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
