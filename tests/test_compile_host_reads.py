"""A compiled step reads the device back to the host once, as an eager step does (tests/test_host_syncs.py): the
compiled parts (blocks, embedding, final norm, loss) add no read.

dynamo compiles nothing under a dispatch mode, so the reads are counted here from the profiler's record of
aten::_local_scalar_dense (the op behind .item(), float(), int() and bool() of a tensor) where the code asked for one,
not inside another aten op (CPU's fused AdamW reads its step that way, in C++, one read per parameter: no device
sync where the step lives on a GPU), with calls of Tensor.tolist/.cpu/.numpy counted as test_host_syncs counts them.
A run of 2k steps minus a run of k steps leaves k steps' reads; start-up, compilation and the final save cancel out."""
import pytest
import torch
import torch._dynamo
from torch.profiler import ProfilerActivity, profile

import train
from bench.ranks import run_ranks
from tests.layouts import BASE

STEPS = 2


def asked_for(event):
    """Whether a profiled op was called by Python code (or a compiled graph), not from inside another aten op."""
    parent = event.cpu_parent
    while parent is not None:
        if parent.name.startswith("aten::") and parent.name != "aten::item":
            return False
        parent = parent.cpu_parent
    return True


def host_reads(argv):
    """How many times train.main(argv) reads the device back to the host."""
    patched, calls = {}, [0]
    for name in ("tolist", "cpu", "numpy"):
        patched[name] = original = getattr(torch.Tensor, name)

        def counted(t, *args, _original=original, **kwargs):
            calls[0] += 1
            return _original(t, *args, **kwargs)
        setattr(torch.Tensor, name, counted)
    try:
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            train.main(argv)
    finally:
        for name, original in patched.items():
            setattr(torch.Tensor, name, original)
    return calls[0] + sum(e.name == "aten::_local_scalar_dense" and asked_for(e) for e in prof.events())


def _reads(rank, world, flags, out_dir):
    torch._dynamo.config.fail_on_recompile_limit_hit = True
    counts = []
    for steps in (STEPS, 2 * STEPS):
        torch._dynamo.reset()
        counts.append(host_reads(BASE + ["--peak-tflops", "1", "--steps", str(steps), "--n-layer", "2", "--compile",
                                         "--out", f"{out_dir}/{steps}"] + flags))
    return counts


LAYOUTS = {"one process": (1, [])}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_a_compiled_step_reads_the_host_once(name, tmp_path):
    world, flags = LAYOUTS[name]
    for rank, (short, long) in enumerate(run_ranks(_reads, world, args=(flags, str(tmp_path)), timeout=600)):
        assert long - short <= STEPS, f"rank {rank}: {(long - short) / STEPS:.1f} host reads per step"
