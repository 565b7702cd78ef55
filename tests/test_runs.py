"""Runs a user compares: a default run folder named from the flags that never collides and that --resume auto finds
again, one summary line at the end (printed and in the metrics), compare.py side by side, and metrics that mean
something on CPU (no MFU without a peak; mem_gb the tensors' peak, not the process's resident size)."""
import contextlib
import io
import json

import pytest
import torch

import config
import train
from bench import compare
from data.metrics import read_metrics
from data.run import default_out
from parallel import memory
from tests.layouts import BASE
from tests.test_save_integrity import exit_of, one_error_line

FLAGS = BASE + ["--steps", "3", "--seq-len", "32", "--global-batch", "4", "--micro-batch", "4", "--warmup", "1"]


def run(argv):
    """train.main's losses and what it printed."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        losses = train.main(argv)
    return losses, out.getvalue()


@pytest.fixture
def in_tmp(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # runs/ is made in the working folder
    return tmp_path


def test_back_to_back_runs_get_their_own_folders_and_resume_finds_the_newest(in_tmp):
    base = "tiny-dtype_fp32-global-batch4-micro-batch4-seq-len32-steps3-warmup1"  # was dtype=fp32-global-batch=4-...
    first, printed = run(FLAGS)
    assert f"run folder: runs/{base}\n" in printed
    second, printed = run(FLAGS)  # the same flags again: a new folder, nothing refused, nothing lost
    assert f"run folder: runs/{base}.2\n" in printed and second == first
    third, printed = run(FLAGS + ["--ckpt", "full"])  # an ablation: its own name
    assert f"run folder: runs/{base.replace('-dtype', '-ckpt_full-dtype')}\n" in printed
    _, printed = run(FLAGS + ["--resume", "auto"])  # a torchrun restart: the newest folder of that name
    assert f"resumed from runs/{base}.2/step_0000003 (step 3)\nalready finished at step 3" in printed
    attempts = json.loads((in_tmp / "runs" / f"{base}.2" / "attempts.json").read_text())
    assert [a["resumed_from"] for a in attempts] == [0, 3]
    assert sorted(p.name for p in (in_tmp / "runs").iterdir()) == sorted([base, f"{base}.2",
                                                                           base.replace("-dtype", "-ckpt_full-dtype")])


def test_every_run_ends_with_one_summary_line_that_compare_reads(in_tmp, capsys):
    _, printed = run(FLAGS + ["--out", "a", "--eval-every", "3"])
    run(FLAGS + ["--out", "b", "--ckpt", "full", "--eval-every", "3"])
    done = [line for line in printed.splitlines() if line.startswith("done:")]
    assert len(done) == 1 and " val " in done[0] and "peak memory" in done[0] and done[0].endswith("in a"), printed
    rows, summaries = read_metrics(in_tmp / "a" / "metrics.jsonl")
    assert len(rows) == 3 and len(summaries) == 1
    assert summaries[0]["loss"] == rows[-1]["loss"] and summaries[0]["val_loss"] == rows[-1]["val_loss"]
    assert summaries[0]["flags"]["steps"] == 3 and "out" not in summaries[0]["flags"]
    assert compare.main(["a", "b/metrics.jsonl"]) == 0
    text = capsys.readouterr().out
    assert "| --ckpt |" in text and "| full |" in text and "--steps" not in text  # only the flags that differ
    assert compare.main(["a", "missing"]) == 2


def test_cpu_metrics_have_no_mfu_and_count_the_tensors(in_tmp):
    """On CPU: no MFU without --peak-tflops (a measured matmul rate is no peak), and mem_gb is the tensors' peak,
    which activation checkpointing lowers (the resident size, 0.8 GB for every run, did not move)."""
    flags = FLAGS + ["--n-layer", "8", "--global-batch", "8", "--micro-batch", "8", "--seq-len", "128"]
    peaks = {}
    for policy in ("none", "full"):
        run(flags + ["--out", policy, "--ckpt", policy])
        rows = read_metrics(in_tmp / policy / "metrics.jsonl")[0]
        assert all(r["mfu"] is None and r["hfu"] is None for r in rows)
        peaks[policy] = rows[-1]["mem_gb"]
    assert 0 < peaks["full"] < 0.5 * peaks["none"] < 0.5, peaks


def test_a_warmup_that_outlasts_the_run_is_said(in_tmp):
    _, printed = run(FLAGS + ["--out", "w", "--warmup", "20"])
    assert "note: --warmup 20 >= --steps 3: the learning rate never reaches --lr 0.003" in printed


@pytest.mark.parametrize("extra", [[], ["--ckpt", "full"], ["--ckpt", "selective"], ["--dtype", "bf16"]],
                         ids=["none", "full", "selective", "bf16"])
def test_the_memory_check_counts_what_a_step_holds(in_tmp, extra):
    """memory.step_bytes (model state, weights in use, activations, logits) against the tensors' measured peak of the
    same run: within 5% either way (measured: -0.3% .. +1.1%), so the check's margin (memory.MARGIN, 20%) holds the
    model's error with room to spare, and it refuses no run that fits by much."""
    argv = FLAGS + ["--n-layer", "8", "--global-batch", "8", "--micro-batch", "8", "--seq-len", "128", "--out", "r"]
    run(argv + extra)
    measured = read_metrics(in_tmp / "r" / "metrics.jsonl")[0][-1]["mem_gb"] * 1e9
    resolved = config.resolve(argv + extra)
    estimate = sum(memory.step_bytes(train.model_config(resolved, 257), resolved).values())
    assert estimate == pytest.approx(measured, rel=0.05), (measured, estimate)


def test_cpu_memory_counts_a_storage_resized_in_place_as_freed():
    """The pipeline frees an activation it sent by resizing its storage to 0 (parallel/pp.py), which no finalizer
    sees: mem_gb on CPU counted every sent activation as held until the step ended."""
    with memory.LiveBytes() as live:
        sent = torch.empty(1000)
        sent.untyped_storage().resize_(0)
        torch.empty(1000)
    assert live.peak == 4000 and sent.untyped_storage().nbytes() == 0


def test_a_model_that_cannot_fit_is_refused_before_anything_is_built(in_tmp, monkeypatch):
    """--model 1b on a 24 GB machine: 24 GB of model state alone passed the old check (against 25.3 GB), and the
    kernel killed the run 14 minutes later. A step's whole estimate, with a margin, refuses it at once."""
    monkeypatch.setattr(memory, "device_memory", lambda run: (24e9, "a 24 GB machine"))
    code, err = exit_of(train.main, ["--model", "1b", "--device", "cpu", "--out", "big", "--micro-batch", "1",
                                     "--global-batch", "8", "--seq-len", "512"])
    assert code == 2 and "a step needs about" in one_error_line(err) and "of a 24 GB machine" in err, err
    assert not (in_tmp / "big").exists()


def test_a_default_name_reads_as_typed_and_tells_the_ranks(tmp_path):
    """Was tiny-lr=0.001-sp=True, the same for 1 and 2 ranks, and tiny-steps=30-2 for a second fresh run (2 ranks?)."""
    flags = {"lr": 0.001, "sp": True, "overlap": False, "ckpt": "full", "pp-split": (3, 5)}
    assert default_out("tiny", flags, False, 1, tmp_path).name == "tiny-lr0.001-sp-no-overlap-ckpt_full-pp-split_3,5"
    assert default_out("tiny", {"steps": 30}, False, 2, tmp_path).name == "tiny-steps30-2ranks"
