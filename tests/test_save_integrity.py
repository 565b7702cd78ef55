"""Hostile input to saves: a corrupted save of the right size is refused by resume (on every rank alike), export
and sampling, naming the file (exit 2); a stop names a last good save that verifies; sizes are reported truly;
nothing outside the save folder is read; a meta.json without a key and a malformed attempts.json are one line,
exit 2, and touch nothing; check_fresh_run_folder refuses a folder holding another run's saves, writing nothing."""
import contextlib
import errno
import io
import json
import os
import shutil
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch.distributed as dist

import data.export
import data.run
import data.saves
import model
import sample
import train
from bench.ranks import run_ranks
from tests.test_checkpoint import ARGS, quiet, run1, snapshot

CROSS_ENTROPY = model.cross_entropy_loss
SAVE = "step_0000002"
REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def base_run(tmp_path_factory):
    """One process, 2 steps, one save (step 2): each test damages a copy."""
    run = tmp_path_factory.mktemp("base") / "run"
    run1(["--out", str(run), "--steps", "2"])
    return run


@pytest.fixture
def run(base_run, tmp_path):
    shutil.copytree(base_run, tmp_path / "run")
    return tmp_path / "run"


def damage(path, offset, data):
    """Overwrites bytes in place: the file keeps its size."""
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(data)


def edit_meta(run, change):
    path = run / SAVE / "meta.json"
    meta = json.loads(path.read_text())
    change(meta)
    path.write_text(json.dumps(meta))


def exit_of(fn, *args):
    """(exit status, stderr) of a train.main-like call: 0 when it returns."""
    err = io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
        try:
            fn(*args)
            code = 0
        except SystemExit as e:
            code = e.code
    return code, err.getvalue()


def one_error_line(err):
    """The error line, asserting it is the only one (tqdm's bar may precede it, a traceback may not)."""
    lines = [line for line in err.splitlines() if line.strip()]
    assert "Traceback" not in err and sum("error" in line for line in lines) == 1, err
    assert lines[-1].startswith("error: "), err
    return lines[-1]


def resume_fails(run, flags=()):
    """Resuming exits 2 with one line and writes nothing; returns that line."""
    before = snapshot(run)
    code, err = exit_of(train.main, ARGS + ["--micro-batch", "8", "--steps", "2", "--out", str(run), "--resume",
                                            *flags])
    assert code == 2, err
    assert snapshot(run) == before
    return one_error_line(err)


# ---------------------------------------------------------------- corrupted bytes of the right size

CORRUPTIONS = {"random bytes": os.urandom(4096), "a block of 0xFF": b"\xff" * 4096, "one flipped bit": None}


@pytest.mark.parametrize("kind", list(CORRUPTIONS))
def test_a_corrupted_save_of_the_right_size_is_refused_on_resume(run, kind):
    binary = run / SAVE / "rank00000.bin"
    middle = binary.stat().st_size // 2
    if CORRUPTIONS[kind] is None:
        with open(binary, "rb") as f:
            f.seek(middle)
            byte = f.read(1)[0]
        damage(binary, middle, bytes([byte ^ 0x10]))
    else:
        damage(binary, middle, CORRUPTIONS[kind])
    line = resume_fails(run)
    assert line == f"error: --resume: {binary} is corrupt: its bytes do not match their CRC-32 in meta.json", line


def test_export_and_sampling_refuse_a_corrupted_save_and_write_nothing(run, tmp_path, capsys):
    binary = run / SAVE / "rank00000.bin"
    damage(binary, 64, b"\xff" * 256)  # inside the first piece's param: export and sampling read it
    out = tmp_path / "hf"
    capsys.readouterr()
    assert data.export.main([str(run / SAVE), str(out)]) == 2
    assert one_error_line(capsys.readouterr().err) == f"error: {binary} is corrupt: its bytes do not match their " \
                                                      "CRC-32 in meta.json"
    assert not out.exists()
    assert sample.main(["--run", str(run), "--prompt", "def ", "--max-new-tokens", "4", "--temperature", "0"]) == 2
    assert f"{binary} is corrupt" in one_error_line(capsys.readouterr().err)


def _corrupt_resume_rank(rank, world, run):
    flags = ["--dp-mode", "fsdp", "--out", run, "--steps", "2"]
    quiet(train.main, ARGS + flags)
    dist.barrier()
    if rank == 0:  # each fsdp rank reads only its own file back: only rank 1 reads this one
        binary = Path(run) / SAVE / "rank00001.bin"
        damage(binary, binary.stat().st_size // 3, os.urandom(64))
    dist.barrier()
    return exit_of(train.main, ARGS + flags + ["--resume"])


def test_a_file_only_one_rank_reads_stops_every_rank_alike(tmp_path):
    """fsdp on 2 ranks: rank 1 finds its file corrupt; both exit 2, and rank 0 (the one that prints) names it."""
    results = run_ranks(_corrupt_resume_rank, 2, args=(str(tmp_path / "run"),), timeout=200)
    assert [code for code, _ in results] == [2, 2], results
    line = one_error_line(results[0][1])
    assert line == f"error: --resume: {tmp_path / 'run' / SAVE / 'rank00001.bin'} is corrupt: its bytes do not " \
                   "match their CRC-32 in meta.json", line


def test_a_stop_names_a_last_good_save_that_verifies(tmp_path, monkeypatch, capsys):
    """Saves at steps 2 and 4; step 4's file is damaged on disk, then step 5's loss is nan: the stop names step 2."""
    calls = []

    def loss_fn(logits, targets, **padding):
        calls.append(1)
        loss = CROSS_ENTROPY(logits, targets, **padding)
        if len(calls) == 5:
            damage(tmp_path / "step_0000004" / "rank00000.bin", 100, os.urandom(16))
            return loss * float("nan")
        return loss
    monkeypatch.setattr(model, "cross_entropy_loss", loss_fn)
    code, err = exit_of(train.main, ARGS + ["--micro-batch", "8", "--out", str(tmp_path), "--steps", "6",
                                            "--save-every", "2", "--resume", "auto"])
    assert code == 3, err
    line = one_error_line(err)
    assert line.startswith("error: step 5: non-finite loss nan") and \
        line.endswith(f"the last good save is {tmp_path / SAVE}"), line


# ---------------------------------------------------------------- sizes, paths, keys

def test_a_file_longer_than_recorded_is_too_long_not_truncated(run):
    binary = run / SAVE / "rank00000.bin"
    size = binary.stat().st_size
    with open(binary, "ab") as f:
        f.write(b"\0" * 10)
    assert resume_fails(run) == f"error: --resume: {binary} is too long: {size + 10} bytes, meta.json records {size}"


@pytest.mark.parametrize("where", ["../../secret.bin", "absolute"])
def test_a_file_name_outside_the_save_is_refused(run, tmp_path, where):
    """meta.json naming ../../secret.bin (or an absolute path) would read a file outside the save."""
    secret = tmp_path / "secret.bin"
    shutil.move(run / SAVE / "rank00000.bin", secret)  # a file of the right size and content, outside the save
    name = str(secret) if where == "absolute" else where

    def point_outside(meta):
        meta["files"] = {name: meta["files"]["rank00000.bin"]}
        for t in meta["tensors"].values():
            for p in t["pieces"]:
                p["file"] = name
    edit_meta(run, point_outside)
    assert resume_fails(run) == f"error: --resume: {run / SAVE / 'meta.json'} names the file {name!r}: not a " \
                                "plain file name inside the save"


@pytest.mark.parametrize("key", ["format", "step", "config", "layout", "scaler", "optimizer", "rng", "files",
                                 "tensors"])
def test_a_meta_json_without_a_key_is_one_line_naming_key_and_file(run, key):
    edit_meta(run, lambda meta: meta.pop(key))
    assert resume_fails(run) == f"error: --resume: {run / SAVE / 'meta.json'} has no key {key!r}"


def test_export_of_a_save_without_its_config_is_one_line(run, tmp_path, capsys):
    edit_meta(run, lambda meta: meta["config"].pop("model"))
    capsys.readouterr()
    assert data.export.main([str(run), str(tmp_path / "hf")]) == 2
    assert one_error_line(capsys.readouterr().err) == f"error: {run / SAVE / 'meta.json'} has no key 'config.model'"


def test_a_malformed_rng_state_is_one_line(run):
    edit_meta(run, lambda meta: meta["rng"]["0"].pop("numpy"))
    assert resume_fails(run).startswith(f"error: --resume: {run / SAVE / 'meta.json'}: rng.0 is not an RNG state")


ATTEMPTS = {"an object": "{}", "records without their keys": '[{"attempt": 1}]', "numbers": "[1, 2]",
            "a string": '"x"', "invalid JSON": "[{"}


@pytest.mark.parametrize("case", list(ATTEMPTS))
def test_a_malformed_attempts_json_is_refused_and_kept(run, case):
    """Not started over: that would overwrite the history (and forget a repeated failure)."""
    (run / "attempts.json").write_text(ATTEMPTS[case])
    line = resume_fails(run)
    assert line.startswith(f"error: {run / 'attempts.json'} is not a list of attempt records" if case !=
                           "invalid JSON" else f"error: cannot read {run / 'attempts.json'}: JSONDecodeError"), line
    assert line.endswith("fix or delete it") and (run / "attempts.json").read_text() == ATTEMPTS[case]


# ---------------------------------------------------------------- a fresh run into another run's folder

REFUSED = {"a complete save": None, "an incomplete step_ folder": "step_0000005", "an attempts.json": "attempts.json"}


@pytest.mark.parametrize("case", list(REFUSED))
def test_check_fresh_run_folder_refuses_another_runs_folder_and_writes_nothing(base_run, tmp_path, case):
    run = tmp_path / "run"
    if REFUSED[case] is None:
        shutil.copytree(base_run, run)
    elif REFUSED[case] == "attempts.json":
        run.mkdir()
        (run / "attempts.json").write_text("[]")
    else:
        (run / REFUSED[case]).mkdir(parents=True)
    before = snapshot(run)
    with pytest.raises(data.SaveError) as error:
        data.run.check_fresh_run_folder(run)
    advice = "--resume" if REFUSED[case] is None else "--resume auto"  # what would take it over
    assert str(error.value).startswith(f"{run} holds saves of another run (") and \
        str(error.value).endswith(f"): pass {advice}, or choose another --out"), error.value
    assert "\n" not in str(error.value) and snapshot(run) == before


def test_check_fresh_run_folder_accepts_a_new_empty_or_unrelated_folder(tmp_path):
    assert data.run.check_fresh_run_folder(tmp_path / "new") is None
    assert not (tmp_path / "new").exists()
    (tmp_path / "metrics.jsonl").write_text("{}\n")
    (tmp_path / ".tmp_step_0000001_abcdef").mkdir()  # a killed save's leftover: nothing loadable
    before = snapshot(tmp_path)
    assert data.run.check_fresh_run_folder(tmp_path) is None
    assert snapshot(tmp_path) == before
    (tmp_path / "file").write_text("")
    with pytest.raises(data.SaveError, match="is not a folder: choose another --out"):
        data.run.check_fresh_run_folder(tmp_path / "file")


def test_export_on_a_full_disk_leaves_no_truncated_file(run, tmp_path, capsys, monkeypatch):
    """The safetensors file is written to a temporary name and renamed when whole: a write that fails midway
    (no space left) leaves neither a truncated model.safetensors nor a config.json, and says so in one line."""

    class FullDisk:
        def __init__(self, f):
            self.f, self.written = f, 0

        def write(self, data):
            self.written += len(data)
            if self.written > 4096:
                raise OSError(errno.ENOSPC, "No space left on device")
            return self.f.write(data)

        def __getattr__(self, name):
            return getattr(self.f, name)

    atomic_write = data.export.atomic_write

    def filling(path, mode="wb"):
        @contextmanager
        def wrapped():
            with atomic_write(path, mode) as f:
                yield FullDisk(f)
        return wrapped()
    monkeypatch.setattr(data.export, "atomic_write", filling)
    out = tmp_path / "hf"
    capsys.readouterr()
    assert data.export.main([str(run / SAVE), str(out)]) == 3  # a failed write, as training's
    err = capsys.readouterr().err.strip()
    assert err.startswith("error:") and "No space left" in err and "\n" not in err, err
    left = [p.name for p in out.iterdir()] if out.exists() else []
    assert left == [], left  # no truncated model.safetensors, no config.json, no temporary file


# ---------------------------------------------------------------- a save that contradicts itself

def test_a_save_copied_over_another_steps_folder_is_refused(run):
    """Was: step_0000002 copied whole over step_0000004 resumed silently at step 2, from the folder of step 4."""
    shutil.copytree(run / SAVE, run / "step_0000004")
    assert resume_fails(run) == f"error: --resume: {run / 'step_0000004' / 'meta.json'}: step is 2, but its folder " \
                                "is step_0000004: the folder holds another step's save"


def test_a_complete_marker_that_names_another_step_is_refused(run):
    (run / SAVE / "complete").write_text("7\n")
    assert resume_fails(run) == f"error: --resume: {run / SAVE / 'meta.json'}: step is 2, but " \
                                f"{run / SAVE / 'complete'} says 7: the save contradicts itself"


def swap_pieces(meta, a, b):
    """Two same-sized pieces' offsets and CRC-32s swapped: each still names intact bytes, another piece's."""
    pa, pb = meta["tensors"][a]["pieces"][0], meta["tensors"][b]["pieces"][0]
    for key in ("offsets", "crc32"):
        pa[key], pb[key] = pb[key], pa[key]


def test_pieces_that_point_at_each_others_bytes_are_refused(run, tmp_path, capsys):
    """Was: the CRC-32 covered the bytes alone, so two same-sized pieces' offsets and CRCs swapped in meta.json loaded
    each piece's weights into the other. Each CRC now starts from what its piece is."""
    a, b = "layers.0.input_layernorm.weight", "layers.1.input_layernorm.weight"
    edit_meta(run, lambda meta: swap_pieces(meta, a, b))
    binary = run / SAVE / "rank00000.bin"
    assert resume_fails(run) == (f"error: --resume: {binary} is corrupt: its bytes do not match their CRC-32 in "
                                 "meta.json")
    with pytest.raises(data.SaveError, match="is corrupt"):
        data.saves.Saved(run / SAVE).validate().verify()
    assert data.saves.last_good_save(run) is None
    capsys.readouterr()
    assert data.export.main([str(run), str(tmp_path / "hf")]) == 2
    assert one_error_line(capsys.readouterr().err) == f"error: {binary} is corrupt: its bytes do not match their " \
                                                      "CRC-32 in meta.json"


ABSURD = {"a loss scale of -1e308": (lambda m: m["scaler"].update(scale=-1e308), "scaler.scale is -1e+308"),
          "an infinite loss scale": (lambda m: m["scaler"].update(scale=float("inf")), "scaler.scale is inf"),
          "a loss scale without fp16": (lambda m: m["scaler"].update(scale=2.0), "scaler.scale is 2.0"),
          "an optimizer step of 10^30": (lambda m: m["optimizer"].update(step=10 ** 30),
                                         f"optimizer.step {10 ** 30} or scaler.clean_steps 0 is past step 2"),
          "clean steps past the step": (lambda m: m["scaler"].update(clean_steps=10 ** 30), "is past step 2"),
          "a data position of another step": (lambda m: m.update(data_position=5), "data_position 5 is not step 2")}


@pytest.mark.parametrize("case", list(ABSURD))
def test_absurd_numbers_in_a_saves_metadata_are_one_line(run, case):
    """Was: loaded, and trained on (a loss scale of -1e308 became -inf in the fp32 scaler)."""
    edit, needle = ABSURD[case]
    edit_meta(run, edit)
    line = resume_fails(run)
    assert line.startswith(f"error: --resume: {run / SAVE / 'meta.json'}: ") and needle in line, line


def test_a_fifo_where_meta_json_should_be_is_one_line_not_a_hang(run, tmp_path):
    """Was: --resume, sample.py and export waited forever on it. Child processes with a timeout, so that a hang fails
    the test instead of the suite."""
    meta = run / SAVE / "meta.json"
    meta.unlink()
    os.mkfifo(meta)
    expected = f"error: --resume: cannot read {meta}: a FIFO, not a regular file"
    commands = {"--resume": ["train.py", *ARGS, "--micro-batch", "8", "--steps", "3", "--out", str(run), "--resume"],
                "sample": ["sample.py", "--run", str(run), "--max-new-tokens", "2"],
                "export": ["-m", "data.export", str(run), str(tmp_path / "hf")]}
    for name, argv in commands.items():
        try:
            out = subprocess.run([sys.executable, *argv], cwd=REPO, capture_output=True, text=True, timeout=90)
        except subprocess.TimeoutExpired:
            pytest.fail(f"{name} waited on a FIFO where meta.json should be")
        assert out.returncode == 2 and one_error_line(out.stderr) == expected.replace(
            "--resume: ", "--resume: " if name == "--resume" else ""), (name, out.stderr)
    assert not (tmp_path / "hf").exists()
