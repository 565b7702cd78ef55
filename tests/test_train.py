"""train.py on one process: the loss falls, fp16 skips overflowing steps, resume is bitwise exact,
a kill during a save leaves the previous checkpoint, and every bad input is one line with exit status 2."""
import os
import resource
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import data.saver
import data.saves
import model
import train
from bench.ranks import free_port
from data.metrics import read_metrics
from parallel import ckpt, memory
from tests.layouts import BASE

REPO = Path(__file__).resolve().parent.parent


def run(argv):
    return train.main(BASE + ["--micro-batch", "8"] + argv)


def test_loss_falls(tmp_path):
    losses = run(["--steps", "30", "--out", str(tmp_path)])
    assert losses[-1] < losses[0] - 1.5, losses


def test_fp16_scaler_skips_the_step_on_an_injected_overflow(tmp_path, monkeypatch):
    unscale_and_clip = train.unscale_and_clip
    calls = []

    def overflow_on_the_second_step(grads_and_replicas, *args):
        calls.append(1)
        if len(calls) == 2:
            grads_and_replicas[0][0].view(-1)[0] = float("inf")
        return unscale_and_clip(grads_and_replicas, *args)

    monkeypatch.setattr(train, "unscale_and_clip", overflow_on_the_second_step)
    metrics = tmp_path / "m.jsonl"
    run(["--steps", "4", "--dtype", "fp16", "--seq-len", "32", "--global-batch", "4", "--micro-batch", "4",
         "--metrics", str(metrics), "--out", str(tmp_path)])
    rows = read_metrics(metrics)[0]
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
    write_rank = data.saver.write_rank

    def slow(folder, *args):
        write_rank(folder, *args)
        time.sleep(120)
    data.saver.write_rank = slow
    run(["--steps", "2", "--resume", "--out", run_dir])


def test_a_kill_during_a_save_leaves_the_previous_checkpoint_loadable(tmp_path):
    run(["--steps", "2", "--save-every", "1", "--out", str(tmp_path)])
    shutil.rmtree(tmp_path / "step_0000002")
    step1 = data.saves.Saved(tmp_path / "step_0000001").tensor("lm_head.weight")
    proc = subprocess.Popen([sys.executable, "-c", f"import tests.test_train as t; t._slow_save({str(tmp_path)!r})"],
                            cwd=REPO)
    deadline = time.time() + 60
    while not list(tmp_path.glob(".tmp_*/rank00000.json")) and time.time() < deadline:
        time.sleep(0.01)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert list(tmp_path.glob(".tmp_*")), "the kill should land mid-save"
    state = data.saves.Saved(data.saves.complete_saves(tmp_path)[-1]).validate()
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
    "unknown dtype": (["--dtype", "fp4"], "--dtype"),
    "negative steps": (["--steps", "-3"], "--steps"),
    "dp 3 in a world of 1": (["--dp", "3"], "--dp"),
    "d_model not divisible by heads": (["--d-model", "100", "--n-head", "8"], "--d-model"),
    "unknown flag": (["--frobnicate"], "--frobnicate"),
    "resume without a checkpoint": (["--resume"], "--resume"),
    "sp without tp": (["--sp"], "--sp"),
    "dp-shard without hsdp": (["--dp-shard", "1"], "--dp-shard"),
    "reduce-dtype under ddp": (["--reduce-dtype", "bf16"], "--reduce-dtype"),
    "pp-split without pp": (["--pp-split", "2,2"], "--pp-split"),
    "absurd depth": (["--n-layer", "99999999999999999999"], "GB per rank"),
    "absurd width": (["--d-model", "1048576", "--n-head", "8"], "GB per rank"),
    "absurd vocabulary": (["--vocab-size", "1000000000"], "GB per rank"),
    "vocabulary past 2^31": (["--vocab-size", "3000000000"], "--vocab-size"),
    "absurd batch": (["--global-batch", "100000000000", "--micro-batch", "4"], "GB per rank"),
    "vocabulary below the data's": (["--vocab-size", "100"], "--vocab-size"),
    "zero steps": (["--steps", "0"], "--steps"),
    "nan lr": (["--lr", "nan"], "--lr"),
    "inf lr": (["--lr", "inf"], "--lr"),
    "negative lr": (["--lr", "-1"], "--lr"),
    "negative save-every": (["--save-every", "-1"], "--save-every"),
    "negative eval-every": (["--eval-every", "-1"], "--eval-every"),
    "negative log-every": (["--log-every", "-1"], "--log-every"),
    "negative warmup": (["--warmup", "-1"], "--warmup"),
    "negative bucket": (["--bucket-mb", "-1"], "--bucket-mb"),
    "negative grad-clip": (["--grad-clip", "-1"], "--grad-clip"),
    "negative peak": (["--peak-tflops", "-1"], "--peak-tflops"),
    "absurd startup timeout": (["--startup-timeout", "1e300"], "--startup-timeout"),  # was an OverflowError
    "timeout below a millisecond": (["--timeout", "1e-9"], "--timeout"),
    "unknown cp mode at cp 1": (["--cp-mode", "zigzag"], "--cp-mode"),
    "unknown schedule at pp 1": (["--pp-schedule", "zb9"], "--pp-schedule"),
    "out is a file": (["--out", "FILE"], "--out"),
    "out under a file": (["--out", "FILE/run"], "--out"),
    "out unwritable": (["--out", "/proc/no-such-dir/run"], "--out"),
    "metrics is a folder": (["--metrics", "FOLDER"], "--metrics"),
}


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_input_is_one_line_and_exit_2(case, tmp_path, capsys):
    flags, named = BAD_INPUTS[case]
    if "CORRUPT" in flags:
        flags = [str(_corrupt_data(tmp_path)) if f == "CORRUPT" else f for f in flags]
    (tmp_path / "FILE").write_text("a file, not a folder")
    (tmp_path / "FOLDER").mkdir()
    flags = [str(tmp_path / f) if f.startswith(("FILE", "FOLDER")) else f for f in flags]
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
        model.PRESETS)


def test_a_layout_error_is_found_before_the_process_group_forms(tmp_path):
    """Rank 0 of a world of 2 whose peer never starts: were the group formed first, it would wait for the peer.
    Every node's local rank 0 prints the line; every worker exits 2."""
    for rank, local_rank, prints in ((0, 0, True), (1, 0, True), (1, 1, False)):
        env = {**os.environ, "WORLD_SIZE": "2", "RANK": str(rank), "LOCAL_RANK": str(local_rank),
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
        proc = subprocess.run([sys.executable, "train.py", "--tp", "3", "--out", str(tmp_path / "run")], cwd=REPO,
                              env=env, capture_output=True, text=True, timeout=60)
        assert proc.returncode == 2
        assert proc.stderr.strip() == ("error: --tp: tp·pp·cp = 3·1·1 = 3 does not divide the world size 2"
                                       if prints else ""), proc.stderr
    assert not (tmp_path / "run").exists()


def test_resume_knows_the_data_by_its_identity_not_its_path(tmp_path):
    """The same data folder named two ways (relative and absolute) is the same data."""
    data = REPO / "data" / "pystdlib"
    run(["--steps", "3", "--save-every", "2", "--out", str(tmp_path), "--data", str(data)])
    shutil.rmtree(tmp_path / "step_0000003")
    relative = os.path.relpath(data, Path.cwd())
    assert len(run(["--steps", "3", "--out", str(tmp_path), "--data", relative, "--resume"])) == 1


def test_a_fresh_run_refuses_a_folder_holding_another_runs_saves(tmp_path, capsys):
    run(["--steps", "2", "--out", str(tmp_path)])
    before = sorted(p.name for p in tmp_path.iterdir())
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        run(["--steps", "3", "--keep", "1", "--out", str(tmp_path)])
    err = capsys.readouterr().err.strip()
    assert exit_info.value.code == 2 and err.count("\n") == 0 and "--resume" in err and str(tmp_path) in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # nothing pruned, nothing written


def test_a_full_disk_under_the_metrics_is_one_line_exit_3(tmp_path):
    """The metrics file cannot grow (RLIMIT_FSIZE, what a full disk does to a write): one line naming
    --metrics, exit 3, not a traceback; the rows written before it stay."""
    data = tmp_path / "data"
    subprocess.run([sys.executable, "-m", "data.prepare", "text", str(REPO / "README.md"), "--out", str(data)],
                   cwd=REPO, check=True, capture_output=True, timeout=120)
    metrics = tmp_path / "m.jsonl"
    metrics.write_text('{"step": 1, "loss": 5.0}\n' * 200)  # rows of an earlier run, under the limit
    limit = metrics.stat().st_size + 2000  # room for a few rows, not for ten

    def small_files():
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    proc = subprocess.run([sys.executable, "train.py", *BASE, "--data", str(data), "--steps", "10", "--out",
                           str(tmp_path / "run"), "--metrics", str(metrics), "--save-every", "0"], cwd=REPO,
                          capture_output=True, text=True, timeout=300, preexec_fn=small_files)
    assert proc.returncode == 3, proc.stderr[-2000:]
    line = proc.stderr.strip().splitlines()[-1]
    assert line.startswith(f"error: --metrics: cannot write {metrics}: File too large"), line
    rows = read_metrics(metrics)[0][200:]  # this run's, after the earlier run's
    assert rows and all(r["step"] == i + 1 for i, r in enumerate(rows))


# ---------------------------------------------------------------- build says what runs

def layers_in(chunks, wrapper):
    """The parallel/ files whose code the built chunks and wrapper run, once per layer, read from the modules."""
    modules = [m for c in chunks for m in c.modules()]
    kinds = {type(m).__module__.split(".")[-1] for m in modules} - {"tp_overlap"}
    for cls in type(wrapper).__mro__:  # the wrapper, and under a layer's subclass the class it extends
        kinds.add(cls.__module__.split(".")[-1])
        if kinds & {"ddp", "fsdp", "hsdp"}:
            break
    found = sorted(kinds & {"tp", "ddp", "fsdp", "hsdp", "fsdp_accumulate"})
    for layer, present in (
            ("tp_overlap", any(type(m).__name__ == "ColumnReader" for m in modules)),  # fused f
            ("tp_overlap", any(hasattr(m, "ring") for m in modules)),  # and its rings
            ("cp", any(getattr(m, "attend", model.causal_attention) is not model.causal_attention for m in modules)),
            ("fp8", any(getattr(m, "matmul", None) is not None for m in modules)),
            ("pp_bw_split", any(getattr(m, "weight_grads", None) is not None for m in modules)),
            ("ckpt", any(c.run_layers is not model.run_layers or (ckpt.pack_recomputable, ckpt.unpack_recomputable)
                         in vars(c).get("saved_rules", []) for c in chunks)),
            ("pp", any(hasattr(c, "pipeline") for c in chunks))):
        if present:
            found.append(layer)
    return sorted(found)


@pytest.mark.parametrize("flags, world", [
    (["--tp", "2", "--sp"], 2), (["--tp", "2", "--sp", "--sp-ring"], 2),
    (["--tp", "2", "--pp", "2", "--pp-schedule", "zb1", "--micro-batch", "2"], 4),
    (["--dp-mode", "fsdp", "--cp", "2", "--ckpt", "selective"], 4),
    (["--dp-mode", "hsdp", "--dp-shard", "2", "--accumulate", "unsharded", "--micro-batch", "2"], 4),
    (["--pp", "2", "--pp-schedule", "interleaved", "--pp-virtual", "2", "--n-layer", "8", "--ckpt", "full"], 2)])
def test_build_says_in_one_line_each_parallelism_and_layer_it_applied(flags, world):
    """A user sees which page's code runs: the fused tp path, the rings, the B/W split. The lines name the files
    whose modules the built model holds, each once, and nothing else."""
    run = train.config.resolve(BASE + ["--out", "unused"] + flags, environ={"WORLD_SIZE": str(world)})
    cfg = train.model_config(run, 257)
    mesh = train.Mesh(0, world, dp=run.dp, pp=run.pp, cp=run.cp, tp=run.tp, dp_shard=run.dp_shard)
    chunks, wrapper, applied = train.build(cfg, mesh, run)
    named = [line.split(".py:")[0].removeprefix("parallel/") for line in applied]
    assert sorted(named) == layers_in(chunks, wrapper), applied


def test_cuda_grows_its_segments_in_place_unless_the_user_configured_the_allocator():
    """Was: the allocator's fixed-size segments, whose fragmentation the fit check's margin must hold."""
    env = {}
    memory.expandable_segments(env)
    assert env == {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    for name in ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF"):
        env = {name: "max_split_size_mb:128"}
        memory.expandable_segments(env)
        assert env == {name: "max_split_size_mb:128"}


def test_stderr_into_a_file_gets_no_progress_bar(tmp_path):
    """Was: the bar's carriage returns filled a log file (`2> train.log`, Slurm's output) beside the log lines."""
    with open(tmp_path / "err", "w") as err:
        subprocess.run([sys.executable, "train.py", *BASE, "--steps", "20", "--log-every", "5", "--out",
                        str(tmp_path / "run")], cwd=Path(__file__).resolve().parent.parent, stderr=err,
                       stdout=subprocess.PIPE, check=True, timeout=300)
    assert b"\r" not in (tmp_path / "err").read_bytes()
