"""Full 4D: dp 2 (fsdp) x cp 2 (ring) x pp 2 (1f1b) x tp 2 on 16 gloo ranks trains the same model as one process."""
import contextlib
import io
from pathlib import Path

import train
from bench.ranks import run_ranks
from tests.layouts import BASE, assert_same_losses, train_losses

REPO = Path(__file__).resolve().parent.parent
FLAGS = ["--steps", "5", "--peak-tflops", "1", "--dp", "2", "--dp-mode", "fsdp", "--cp", "2", "--cp-mode", "ring",
         "--pp", "2", "--pp-schedule", "1f1b", "--tp", "2"]


def _rank_main(rank, world, argv):
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        losses = train.main(argv)
    return losses, out.getvalue()


def test_dp2_fsdp_cp2_ring_pp2_1f1b_tp2_equals_one_process(tmp_path):
    reference = train_losses(1, ["--steps", "5", "--peak-tflops", "1"])
    argv = BASE + ["--out", str(tmp_path)] + FLAGS
    (losses, stdout), *_ = run_ranks(_rank_main, 16, args=(argv,), timeout=400)
    assert "mesh: world 16 = dp 2 x pp 2 x cp 2 x tp 2" in stdout  # rank 0 describes the mesh at start (L28)
    assert len(losses) == 5
    assert_same_losses(losses, reference, rtol=1e-4)
