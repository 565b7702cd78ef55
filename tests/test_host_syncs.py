"""A training step reads the device back to the host once, at its end: no .item(), bool(tensor), float(tensor),
.tolist(), .cpu() or .numpy() between the first forward and the optimizer step, in every layout.

Counted: aten._local_scalar_dense (the op behind .item(), float(), int() and bool() of a tensor) through a dispatch
mode, and calls of Tensor.tolist/.cpu/.numpy. A run of 2k steps minus a run of k steps leaves k steps' reads, with
start-up and the final save cancelling out."""
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import train
from bench.ranks import run_ranks
from tests.layouts import BASE

STEPS = 2


class HostReads(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.count = 0
        self.patched = {}

    def __enter__(self):
        for name in ("tolist", "cpu", "numpy"):
            original = getattr(torch.Tensor, name)
            self.patched[name] = original

            def counted(t, *args, _original=original, **kwargs):
                self.count += 1
                return _original(t, *args, **kwargs)
            setattr(torch.Tensor, name, counted)
        return super().__enter__()

    def __exit__(self, *exc):
        for name, original in self.patched.items():
            setattr(torch.Tensor, name, original)
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            self.count += 1
        return func(*args, **(kwargs or {}))


def _reads(rank, world, flags, out_dir):
    counts = []
    for steps in (STEPS, 2 * STEPS):
        with HostReads() as reads:
            train.main(BASE + ["--peak-tflops", "1", "--steps", str(steps), "--out", f"{out_dir}/{steps}"] + flags)
        counts.append(reads.count)
    return counts


LAYOUTS = {"one process": (1, []), "fsdp2": (2, ["--dp-mode", "fsdp"]), "tp2": (2, ["--tp", "2"]),
           "pp2": (2, ["--pp", "2", "--micro-batch", "2"]), "cp2": (2, ["--cp", "2"])}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_at_most_one_host_read_per_step(name, tmp_path):
    world, flags = LAYOUTS[name]
    for rank, (short, long) in enumerate(run_ranks(_reads, world, args=(flags, str(tmp_path)), timeout=300)):
        assert long - short <= STEPS, f"rank {rank}: {(long - short) / STEPS:.1f} host reads per step"
