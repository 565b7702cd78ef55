"""Layout equivalence: train the same tiny model under any layout and compare losses.

    losses = train_losses(world=4, flags=["--dp-mode", "fsdp"])
    assert_same_losses(losses, train_losses(1, []))

Every run uses fp32 on CPU, the offline corpus, dropout off, and a short schedule; `flags` add the layout.
"""
import io
import tempfile
from contextlib import redirect_stderr

import numpy as np

import train
from bench.ranks import run_ranks

BASE = ["--model", "tiny", "--steps", "10", "--global-batch", "8", "--micro-batch", "4", "--seq-len", "64",
        "--dtype", "fp32", "--device", "cpu", "--lr", "3e-3", "--warmup", "2", "--log-every", "0",
        "--eval-every", "0"]


def _rank_main(rank, world, argv):
    return train.main(argv)


def exit_and_stderr(argv):
    """(train.main's exit status, what it wrote to stderr): 0 when it returns."""
    with redirect_stderr(io.StringIO()) as err:
        try:
            train.main(argv)
        except SystemExit as e:
            return e.code, err.getvalue()
    return 0, err.getvalue()


def train_losses(world, flags, out_dir=None, timeout=180):
    """Rank 0's per-step losses (every rank returns the same global mean). The run folder is a fresh
    temporary one unless out_dir is given."""
    with tempfile.TemporaryDirectory() as tmp:
        argv = BASE + ["--out", str(out_dir or tmp)] + list(flags)
        return run_ranks(_rank_main, world, args=(argv,), timeout=timeout)[0]


def assert_same_losses(got, expected, rtol=1e-5):
    np.testing.assert_allclose(np.array(got), np.array(expected), rtol=rtol, atol=0)
