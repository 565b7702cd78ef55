"""train.py on one process: the loss falls, fp16 skips overflowing steps, resume is bitwise exact,
a kill during a save leaves the previous checkpoint, and every bad input is one line with exit status 2."""
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import model as M
import optim
import saves.load
import saves.write
import train
from tests.layouts import BASE

REPO = Path(__file__).resolve().parent.parent


def run(argv):
    return train.main(BASE + ["--micro-batch", "8"] + argv)


def test_loss_falls():
    losses = run(["--steps", "30", "--out", "/nonexistent-unused"])
    assert losses[-1] < losses[0] - 1.5, losses


def test_fp16_scaler_skips_the_step_on_an_injected_overflow(tmp_path, monkeypatch):
    unscale_and_clip = optim.unscale_and_clip
    calls = []

    def overflow_on_the_second_step(grads_and_replicas, *args):
        calls.append(1)
        if len(calls) == 2:
            grads_and_replicas[0][0].view(-1)[0] = float("inf")
        return unscale_and_clip(grads_and_replicas, *args)

    monkeypatch.setattr(optim, "unscale_and_clip", overflow_on_the_second_step)
    metrics = tmp_path / "m.jsonl"
    run(["--steps", "4", "--dtype", "fp16", "--seq-len", "32", "--global-batch", "4", "--micro-batch", "4",
         "--metrics", str(metrics), "--out", str(tmp_path)])
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["skipped"] for r in rows] == [False, True, False, False]
    assert [r["loss_scale"] for r in rows] == [2.0 ** 16, 2.0 ** 15, 2.0 ** 15, 2.0 ** 15]
    assert rows[1]["grad_norm"] == float("inf")


def test_resume_continues_bitwise(tmp_path):
    straight = run(["--steps", "10", "--out", str(tmp_path / "a")])
    run(["--steps", "10", "--save-every", "5", "--out", str(tmp_path / "b")])
    shutil.rmtree(tmp_path / "b" / "step_0000010")  # as if the run died after step 5's save
    resumed = run(["--steps", "10", "--resume", "--out", str(tmp_path / "b")])
    assert resumed == straight[5:]


def _slow_save(run_dir):
    """Resumes at step 1 and trains step 2, whose save stalls after writing its data (the kill lands there)."""
    write_rank = saves.write.write_rank

    def slow(folder, *args):
        write_rank(folder, *args)
        time.sleep(120)
    saves.write.write_rank = slow
    run(["--steps", "2", "--resume", "--out", run_dir])


def test_a_kill_during_a_save_leaves_the_previous_checkpoint_loadable(tmp_path):
    run(["--steps", "2", "--save-every", "1", "--out", str(tmp_path)])
    shutil.rmtree(tmp_path / "step_0000002")
    step1 = saves.load.Saved(tmp_path / "step_0000001").tensor("lm_head.weight")
    proc = subprocess.Popen([sys.executable, "-c", f"import tests.test_train as t; t._slow_save({str(tmp_path)!r})"],
                            cwd=REPO)
    deadline = time.time() + 60
    while not list(tmp_path.glob(".tmp_*/rank00000.json")) and time.time() < deadline:
        time.sleep(0.01)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert list(tmp_path.glob(".tmp_*")), "the kill should land mid-save"
    state = saves.load.Saved(saves.write.complete_saves(tmp_path)[-1]).validate()
    assert state.step == 1 and torch.equal(state.tensor("lm_head.weight"), step1)


def _corrupt_data(tmp_path):
    folder = tmp_path / "corrupt"
    folder.mkdir()
    src = REPO / "data" / "pystdlib"
    (folder / "meta.json").write_text((src / "meta.json").read_text())
    (folder / "pystdlib_train_000000.bin").write_bytes((src / "pystdlib_train_000000.bin").read_bytes()[:5000])
    (folder / "pystdlib_val_000000.bin").write_bytes((src / "pystdlib_val_000000.bin").read_bytes())
    return folder


BAD_INPUTS = {
    "unknown preset": (["--model", "gpt5"], "--model"),
    "batch not divisible": (["--global-batch", "10", "--micro-batch", "4"], "--global-batch"),
    "missing data folder": (["--data", "/no/such/folder"], "/no/such/folder"),
    "corrupt shard": (["--data", "CORRUPT"], "pystdlib_train_000000.bin"),
    "unknown dtype": (["--dtype", "fp8"], "--dtype"),
    "negative steps": (["--steps", "-3"], "--steps"),
    "dp 3 in a world of 1": (["--dp", "3"], "--dp"),
    "d_model not divisible by heads": (["--d-model", "100", "--n-head", "8"], "--d-model"),
    "unknown flag": (["--frobnicate"], "--frobnicate"),
    "resume without a checkpoint": (["--resume"], "--resume"),
    "sp without tp": (["--sp"], "--sp"),
    "dp-shard without hsdp": (["--dp-shard", "1"], "--dp-shard"),
    "reduce-dtype under ddp": (["--reduce-dtype", "bf16"], "--reduce-dtype"),
    "pp-split without pp": (["--pp-split", "2,2"], "--pp-split"),
}


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_input_is_one_line_and_exit_2(case, tmp_path, capsys):
    flags, named = BAD_INPUTS[case]
    if "CORRUPT" in flags:
        flags = [str(_corrupt_data(tmp_path)) if f == "CORRUPT" else f for f in flags]
    out = tmp_path / "run"
    with pytest.raises(SystemExit) as exit_info:
        train.main(BASE + ["--out", str(out), "--metrics", str(out / "m.jsonl")] + flags)
    err = capsys.readouterr().err.strip()
    assert exit_info.value.code == 2
    assert len(err.splitlines()) == 1 and err.startswith("error:") and named in err, err
    assert not out.exists()  # nothing written


def test_bad_input_from_the_command_line_has_no_traceback():
    proc = subprocess.run([sys.executable, "train.py", "--model", "nope"], cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == 2
    assert proc.stderr.strip() == "error: --model: unknown preset 'nope'; choose from " + ", ".join(
        M.PRESETS)
