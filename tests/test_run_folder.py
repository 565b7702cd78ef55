"""One writer per run folder, and a run's start and end told in one line: a second run into a folder whose run still
trains, fresh or --resume, exits 2 (the lock dies with its holder, so a killed run's folder resumes); a save past
--steps, a full disk at the start, Ctrl-C, and flags that would do nothing are one line each; a run that wrote no save
restarts from step 0 under --resume; a longer --steps continues a finished run."""
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import weakref
from pathlib import Path

import pytest

import data.prepare
import data.run
import data.saver
import data.saves
import train
from tests.test_checkpoint import ARGS, quiet, snapshot
from tests.test_data_writers import no_bigger_files_than
from tests.test_faults import full_disk_open
from tests.test_save_integrity import exit_of, one_error_line

REPO = Path(__file__).resolve().parent.parent
RUN = ARGS + ["--micro-batch", "8"]


def start_slow_run(out, steps=2000):
    """A training process that holds its run folder for a while; returns it once it has begun training."""
    proc = subprocess.Popen([sys.executable, "train.py", *RUN, "--steps", str(steps), "--out", str(out)], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.time() + 120
    while not (out / "attempts.json").exists():
        assert proc.poll() is None and time.time() < deadline, proc.stdout.read() if proc.poll() is not None else ""
        time.sleep(0.1)
    return proc


def test_a_second_writer_is_refused_while_the_first_trains_and_welcome_once_it_died(tmp_path):
    out = tmp_path / "run"
    first = start_slow_run(out)
    try:
        for flags in ([], ["--resume"]):  # fresh: both would have passed the folder check; resume: two attempts
            code, err = exit_of(train.main, RUN + ["--steps", "4", "--out", str(out)] + flags)
            assert code == 2, err
            line = one_error_line(err)
            assert line.startswith(f"error: --out: {out} is in use by a run still writing to it") and '"pid"' in line
    finally:
        first.send_signal(signal.SIGKILL)  # its lock goes with it: nothing stale is left to clear by hand
        first.wait()
    losses = quiet(train.main, RUN + ["--steps", "3", "--out", str(out), "--resume", "auto"])
    assert len(losses) == 3  # it saved nothing before it died: the run starts again


def test_a_run_that_wrote_no_save_restarts_under_resume_auto_and_says_so(tmp_path, capsys):
    """Plain --resume with nothing to resume is the error --help promises (it used to start from 0 whenever an
    attempts.json was there); --resume auto starts from 0 and says so in one line."""
    out = tmp_path / "run"
    out.mkdir()
    (out / "attempts.json").write_text(json.dumps([{"attempt": 1, "resumed_from": 0, "reached": 2,
                                                    "status": "running"}]))
    code, err = exit_of(train.main, RUN + ["--steps", "2", "--out", str(out)])  # a fresh run would overwrite it
    assert code == 2 and "holds saves of another run (attempts.json): pass --resume auto" in one_error_line(err)
    code, err = exit_of(train.main, RUN + ["--steps", "2", "--out", str(out), "--resume"])
    assert code == 2 and one_error_line(err) == (f"error: --resume: no complete save in {out} (use --resume auto "
                                                 "to start fresh)")
    capsys.readouterr()
    assert len(train.main(RUN + ["--steps", "2", "--out", str(out), "--resume", "auto"])) == 2
    assert f"--resume auto: no save in {out}; starting from step 0" in capsys.readouterr().out
    attempts = json.loads((out / "attempts.json").read_text())
    assert [a["status"] for a in attempts] == ["running", "done"]


def test_a_longer_run_continues_a_finished_one_and_a_shorter_one_is_refused(tmp_path, capsys):
    out = tmp_path / "run"
    quiet(train.main, RUN + ["--steps", "3", "--out", str(out)])
    losses = train.main(RUN + ["--steps", "5", "--out", str(out), "--resume"])
    assert len(losses) == 2 and "the learning-rate schedule is recomputed for 5 steps" in capsys.readouterr().out
    code, err = exit_of(train.main, RUN + ["--steps", "4", "--out", str(out), "--resume"])
    assert code == 2 and one_error_line(err) == (f"error: --steps: the newest save, {out / 'step_0000005'}, is at "
                                                 f"step 5, past --steps 4")


def test_a_full_disk_at_the_start_is_one_line_exit_3(tmp_path, monkeypatch):
    write_json = data.run.write_json

    def full(path, *args, **kwargs):  # the attempt record cannot be written
        if Path(path).name == "attempts.json":
            raise OSError(28, "No space left on device")
        return write_json(path, *args, **kwargs)
    monkeypatch.setattr(data.run, "write_json", full)
    code, err = exit_of(train.main, RUN + ["--steps", "2", "--out", str(tmp_path / "run")])
    assert code == 3, err
    assert one_error_line(err).startswith(f"error: cannot write {tmp_path / 'run' / 'attempts.json'} (No space left "
                                          "on device); stopped before training, the newest save is none")


def test_a_fresh_run_onto_a_disk_that_takes_no_file_is_one_line_exit_3(tmp_path):
    """A real write refused (RLIMIT_FSIZE: past 50 bytes a file cannot grow, as on a full disk), not a patched one.
    Was: the folder's .lock, the first file a run writes, failed with a traceback."""
    out = tmp_path / "run"
    proc = subprocess.run([sys.executable, "train.py", *RUN, "--steps", "2", "--out", str(out)], cwd=REPO,
                          capture_output=True, text=True, timeout=300, preexec_fn=no_bigger_files_than(50))
    assert proc.returncode == 3, proc.stderr[-3000:]
    assert one_error_line(proc.stderr) == (f"error: cannot write {out / 'attempts.json'} (File too large); stopped "
                                           "before training, the newest save is none"), proc.stderr[-3000:]


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="Linux's /proc, where nothing can be created")
def test_an_out_where_nothing_can_be_created_is_named_with_the_folder_that_refuses_it():
    """Was: `--out: cannot write in /proc: No such file or directory`, as if /proc were missing or the fault."""
    why = "cannot create /proc/nope: nothing can be created in /proc (No such file or directory)"
    code, err = exit_of(train.main, RUN + ["--out", "/proc/nope"])
    assert code == 2 and one_error_line(err) == f"error: --out: {why}", err
    code, err = exit_of(lambda: sys.exit(data.prepare.main(["text", str(REPO / "README.md"), "--out", "/proc/nope"])))
    assert code == 2 and one_error_line(err) == f"error: {why}", err


def test_ctrl_c_is_one_line_naming_where_it_stopped(tmp_path):
    out = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "train.py", *RUN, "--steps", "2000", "--save-every", "1",
                             "--out", str(out)], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 120
    while not any(out.glob("step_*")) and time.time() < deadline:
        time.sleep(0.1)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    line = one_error_line(err)
    assert line.startswith("error: interrupted after step ") and "; the newest save is " in line, line
    assert json.loads((out / "attempts.json").read_text())[-1]["status"].startswith("interrupted after step")


def test_ctrl_c_that_lands_in_a_finalizer_still_stops_the_run(tmp_path, monkeypatch):
    """Was: a KeyboardInterrupt raised inside a finalizer (LiveBytes counts frees with them) is printed and dropped by
    Python, and the run trained on to its last step."""
    step = train.train_step
    calls = []

    def pressed_in_a_finalizer(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            anything = type("Anything", (), {})()
            weakref.finalize(anything, signal.raise_signal, signal.SIGINT)
            del anything  # the finalizer runs here: the signal's handler runs inside it
        return step(*args, **kwargs)

    monkeypatch.setattr(train, "train_step", pressed_in_a_finalizer)
    code, err = exit_of(train.main, RUN + ["--steps", "6", "--save-every", "1", "--out", str(tmp_path / "run")])
    assert code == 130 and one_error_line(err).startswith("error: interrupted after step 2;"), err
    assert len(calls) == 2


@pytest.mark.parametrize("flags, needle", [
    (["--pp-schedule", "zb1"], "--pp-split/--pp-virtual/--pp-schedule: has no effect without --pp > 1"),
    (["--cp-mode", "ulysses"], "--cp-mode: has no effect without --cp > 1"),
    (["--seed", "-1"], "--seed: invalid integer in [0, 2^63) value: '-1'"),
    (["--seed", str(2 ** 70)], "--seed: invalid integer in [0, 2^63) value"),
    (["--global-batch", str(10 ** 11), "--micro-batch", "1"], "--global-batch: a step needs about"),
])
def test_bad_flags_are_one_line_naming_the_flag(tmp_path, flags, needle):
    code, err = exit_of(train.main, RUN + ["--steps", "1", "--out", str(tmp_path / "run")] + flags)
    assert code == 2 and needle in one_error_line(err), err
    assert not (tmp_path / "run").exists()


def test_lr_0_is_accepted_and_moves_no_weight(tmp_path):
    losses = quiet(train.main, RUN + ["--steps", "3", "--lr", "0", "--min-lr", "0", "--out", str(tmp_path)])
    assert len(set(round(x, 6) for x in losses)) == 3  # other batches, the same weights: no NaN, no refusal
    for bad in ("-1", "nan", "inf"):
        code, err = exit_of(train.main, RUN + ["--lr", bad, "--out", str(tmp_path / bad)])
        assert code == 2 and "--lr" in one_error_line(err)


def test_an_async_save_on_a_full_disk_that_takes_the_attempt_record_too_is_one_line_exit_3(tmp_path, monkeypatch):
    """The disk fills during step 4's async save: the rank file and attempts.json both fail. Exit 3, one line naming
    the intact save, no temp folder left (the record could not be written: the message says what could)."""
    monkeypatch.setattr(data.saver, "open", full_disk_open(4, ".bin"), raising=False)
    write_json = data.run.write_json

    def full_after_step_2(path, records, **kwargs):
        if Path(path).name == "attempts.json" and records[-1]["reached"] > 2:
            raise OSError(28, "No space left on device")
        return write_json(path, records, **kwargs)
    monkeypatch.setattr(data.run, "write_json", full_after_step_2)
    out = tmp_path / "run"
    code, err = exit_of(train.main, RUN + ["--steps", "6", "--save-every", "2", "--async-save", "--out", str(out)])
    assert code == 3, err
    assert one_error_line(err) == (f"error: the save of step 4 failed (No space left on device) and was removed; the "
                                   f"last good save, {out / 'step_0000002'}, is intact")
    assert not list(out.glob(".tmp_*")) and [p.name for p in out.glob("step_*")] == ["step_0000002"]


# ---------------------------------------------------------------- the run folder is the run's own

@pytest.fixture(scope="module")
def saved_run(tmp_path_factory):
    """A run folder with one save (step 2): each test changes a copy."""
    out = tmp_path_factory.mktemp("saved") / "run"
    quiet(train.main, RUN + ["--steps", "2", "--out", str(out)])
    return out


@pytest.fixture
def copied(saved_run, tmp_path):
    shutil.copytree(saved_run, tmp_path / "run", symlinks=True)
    return tmp_path / "run"


@pytest.mark.parametrize("name", ["metrics.jsonl", ".lock", "attempts.json"])
def test_a_run_file_that_is_a_link_out_of_the_folder_is_refused(copied, tmp_path, name):
    """Was: --resume appended its metrics to the file a metrics.jsonl link points at (exit 0); a .lock link's target
    was truncated and overwritten; an attempts.json link's records were read as the run's."""
    outside = tmp_path / "outside"
    shutil.copy(copied / name, outside)  # something a run could read or append to without failing
    before = outside.read_bytes()
    (copied / name).unlink()
    (copied / name).symlink_to(outside)
    code, err = exit_of(train.main, RUN + ["--steps", "3", "--out", str(copied), "--resume"])
    assert code == 2 and one_error_line(err) == (f"error: --out: {copied / name} is a link to {outside}, outside "
                                                 f"{copied}: a run writes only its own files in its folder; remove "
                                                 "it, or choose another --out"), err
    assert outside.read_bytes() == before and (copied / name).is_symlink()


@pytest.mark.parametrize("kind", ["folder", "FIFO"])
def test_a_lock_that_is_a_folder_or_a_fifo_is_one_line(tmp_path, kind):
    """Was: IsADirectoryError, and for a FIFO 'Illegal seek', tracebacks."""
    out = tmp_path / "run"
    out.mkdir()
    (out / ".lock").mkdir() if kind == "folder" else os.mkfifo(out / ".lock")
    what = "a folder" if kind == "folder" else "a FIFO"
    code, err = exit_of(train.main, RUN + ["--steps", "2", "--out", str(out)])
    assert code == 2 and one_error_line(err) == (f"error: --out: {out / '.lock'} is {what}, not a regular file: a "
                                                 "run writes only its own files in its folder; remove it, or choose "
                                                 "another --out"), err
    assert sorted(p.name for p in out.iterdir()) == [".lock"]


@pytest.mark.parametrize("inside", ["step_0000002/mine", "step_0000002", ".tmp_step_0000004_abcdef/mine"])
def test_an_out_inside_another_runs_save_folder_is_refused(copied, inside):
    """Was: trained, and was deleted with that save when its run next pruned its saves."""
    out = copied / inside
    before = files_in(copied)
    code, err = exit_of(train.main, RUN + ["--steps", "2", "--out", str(out)])
    save = copied / inside.split("/")[0]
    assert code == 2 and one_error_line(err) == (f"error: --out: {out} lies in {save}, a save's folder (or named like "
                                                 f"one), which the run in {copied} deletes when it prunes its saves; "
                                                 "choose an --out outside it"), err
    assert files_in(copied) == before


def files_in(folder):
    """Every file under folder, with its size and mtime (a folder's own mtime aside: --out's write probe creates and
    removes a file in the nearest folder that exists)."""
    return {k: v for k, v in snapshot(folder).items() if not (folder / k).is_dir()}


def test_deleting_the_lock_file_lets_no_second_writer_in(tmp_path):
    """Was: the lock was an flock on OUT/.lock; once that file was deleted, a second run locked a new one and trained
    into the same folder."""
    out = tmp_path / "run"
    first = start_slow_run(out)
    try:
        (out / ".lock").unlink(missing_ok=True)
        code, err = exit_of(train.main, RUN + ["--steps", "2", "--out", str(out), "--resume"])
        assert code == 2, err
        assert one_error_line(err).startswith(f"error: --out: {out} is in use by a run still writing to it ("), err
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait()


def test_a_fresh_run_stopped_before_its_first_save_starts_again_under_the_same_command(tmp_path):
    """Was: Ctrl-C a few seconds into a fresh run, then the same command: refused as another run's folder, though it
    held only this run's attempts.json and no save. Another run's command is still refused."""
    out = tmp_path / "run"
    first = start_slow_run(out)
    first.send_signal(signal.SIGINT)
    assert first.wait(timeout=120) == 130
    assert not any(out.glob("step_*")) and len(json.loads((out / "attempts.json").read_text())) == 1
    code, err = exit_of(train.main, RUN + ["--steps", "2", "--lr", "1e-3", "--out", str(out)])
    assert code == 2 and "holds saves of another run (attempts.json): pass --resume auto" in one_error_line(err), err
    assert len(quiet(train.main, RUN + ["--steps", "2", "--out", str(out)])) == 2  # --steps aside, the same run
    attempts = json.loads((out / "attempts.json").read_text())
    assert [a["status"] for a in attempts] == [attempts[0]["status"], "done"]
    assert attempts[0]["status"].startswith("interrupted after step") and attempts[0]["run"] == attempts[1]["run"]


def test_holds_a_run_tells_this_runs_attempts_from_another_runs(tmp_path):
    config = {"model": {"n_layer": 1}, "train": {"lr": 1.0, "steps": 5}}
    assert not data.run.holds_a_run(tmp_path / "missing", config)
    assert not data.run.holds_a_run(tmp_path, config)
    records = [{"attempt": 1, "resumed_from": 0, "reached": 3, "status": "running",
                "run": data.run.run_identity({**config, "train": {"lr": 1.0, "steps": 9}})}]
    (tmp_path / "attempts.json").write_text(json.dumps(records))
    assert not data.run.holds_a_run(tmp_path, config)  # this run's, another --steps
    assert data.run.holds_a_run(tmp_path)  # without a config: any attempts count (a default --out's choice)
    assert data.run.holds_a_run(tmp_path, {**config, "train": {"lr": 2.0, "steps": 5}})
    (tmp_path / "attempts.json").write_text(json.dumps([{k: v for k, v in records[0].items() if k != "run"}]))
    assert data.run.holds_a_run(tmp_path, config)  # a record of before identities: another run's, as before
    (tmp_path / "attempts.json").write_text(json.dumps(records))
    (tmp_path / "step_0000002").mkdir()
    assert data.run.holds_a_run(tmp_path, config)


def test_a_metrics_file_that_is_a_fifo_is_one_line_not_a_hang(tmp_path):
    """--metrics naming a FIFO: open() would wait for a reader forever. train.py opens its metrics through
    data.files.open_append, which refuses it; a child process with a timeout, so that a hang fails the test."""
    fifo = tmp_path / "metrics.fifo"
    os.mkfifo(fifo)
    try:
        out = subprocess.run([sys.executable, "train.py", *RUN, "--steps", "1", "--out", str(tmp_path / "run"),
                              "--metrics", str(fifo)], cwd=REPO, capture_output=True, text=True, timeout=90)
    except subprocess.TimeoutExpired:
        pytest.fail("train.py waited on a FIFO given as --metrics")
    assert out.returncode == 2, out.stderr
    line = one_error_line(out.stderr)
    assert "--metrics" in line and "FIFO" in line, line


CONFIG = {"model": {"n_layer": 2}, "train": {"lr": 0.003, "steps": 3}}  # what a save's meta.json records


def test_pruning_deletes_only_saves_of_this_run(tmp_path):
    """Was: pruning deleted a user's folder only named like a save. A folder without meta.json, or with another
    run's, stays; this run's older saves go."""
    run = tmp_path / "run"
    other = {**CONFIG, "train": {"lr": 0.1, "steps": 3}}
    for step, meta in ((1, None), (2, other), (3, CONFIG), (4, {**CONFIG, "train": {"lr": 0.003, "steps": 9}})):
        (run / f"step_000000{step}").mkdir(parents=True)
        (run / f"step_000000{step}" / "complete").write_text(f"{step}\n")
        if meta is not None:
            (run / f"step_000000{step}" / "meta.json").write_text(json.dumps({"config": meta}))
    data.saves.prune(run, keep=1, config=CONFIG)
    assert sorted(p.name for p in run.iterdir()) == ["step_0000001", "step_0000002", "step_0000004"]


def test_links_in_a_run_folder_are_never_deleted_through(tmp_path):
    """A leftover .tmp_step_* link and a linked save: resume's cleanup and pruning leave them, and what they lead
    to, alone (prune used to rename a linked save to .del_*, and then fail to delete it)."""
    run, outside = tmp_path / "run", tmp_path / "outside"
    for name in ("killed", "saved"):
        (outside / name).mkdir(parents=True)
        (outside / name / "complete").write_text("1\n")
    run.mkdir()
    (run / ".tmp_step_0000009_abcdef").symlink_to(outside / "killed")
    (run / "step_0000001").symlink_to(outside / "saved")
    for step in (2, 3):
        (run / f"step_000000{step}").mkdir()
        (run / f"step_000000{step}" / "complete").write_text(f"{step}\n")
        (run / f"step_000000{step}" / "meta.json").write_text(json.dumps({"config": CONFIG}))
    data.saves.remove_incomplete(run)
    data.saves.prune(run, keep=1, config=CONFIG)
    assert sorted(p.name for p in run.iterdir()) == [".tmp_step_0000009_abcdef", "step_0000001", "step_0000003"]
    assert sorted(str(p.relative_to(outside)) for p in outside.rglob("*")) == [
        "killed", "killed/complete", "saved", "saved/complete"]


@pytest.mark.parametrize("flag", ["--out", "--data", "--metrics"])
def test_an_empty_path_flag_is_one_line(tmp_path, monkeypatch, flag):
    """Was: --out '' trained into the current folder, --data '' on the default corpus, --metrics '' into the default
    file, each silently. (--data's refusal is data/'s; --out's and --metrics' are config.py's to make.)"""
    monkeypatch.chdir(tmp_path)
    argv = RUN + ["--steps", "1"] + (["--out", str(tmp_path / "run")] if flag != "--out" else []) + [flag, ""]
    code, err = exit_of(train.main, argv)
    assert code == 2 and one_error_line(err).startswith(f"error: {flag}: "), err
    assert list(tmp_path.iterdir()) == []


def test_an_out_whose_name_is_too_long_is_one_line(tmp_path):
    """Was: OSError: [Errno 36] File name too long, a traceback (config.check_writable's exists(), then the run
    folder's mkdir: data.run names the flag)."""
    out = tmp_path / ("x" * 300) / "run"
    code, err = exit_of(train.main, RUN + ["--steps", "1", "--out", str(out)])
    assert code == 2 and one_error_line(err).startswith("error: --out: ") and "File name too long" in err, err
    assert list(tmp_path.iterdir()) == []


def test_resume_auto_refuses_another_runs_attempts_without_a_save(tmp_path):
    """A folder that holds no save but another run's attempts.json: --resume auto used to start at
    step 0 there and append to that run's records."""
    out = tmp_path / "run"
    code, err = exit_of(train.main, RUN + ["--steps", "1", "--out", str(out), "--resume", "auto"])
    assert code == 0, err
    for step in out.glob("step_*"):
        shutil.rmtree(step)  # that run's saves gone, its attempts.json left
    other = RUN + ["--steps", "1", "--lr", "1e-3", "--out", str(out), "--resume", "auto"]
    code, err = exit_of(train.main, other)
    assert code == 2 and "holds another run's attempts.json and no save" in one_error_line(err), err
    code, err = exit_of(train.main, RUN + ["--steps", "1", "--out", str(out), "--resume", "auto"])
    assert code == 0, err  # the same run takes its folder back


# ---------------------------------------------------------------- never written through another name

def test_a_metrics_file_that_links_to_a_save_inside_the_folder_is_refused(copied):
    """Was: metrics.jsonl linked to the save's meta.json got the rows appended, and the save was destroyed."""
    meta = copied / "step_0000002" / "meta.json"
    before = meta.read_bytes()
    (copied / "metrics.jsonl").unlink()
    (copied / "metrics.jsonl").symlink_to(meta)
    code, err = exit_of(train.main, RUN + ["--steps", "3", "--out", str(copied), "--resume"])
    assert code == 2 and one_error_line(err).startswith(f"error: --out: {copied / 'metrics.jsonl'} is a link to "
                                                        f"{meta}: a run writes only its own files"), err
    assert meta.read_bytes() == before


@pytest.mark.parametrize("target", ["step_0000002/meta.json", "step_0000002/rank00000.bin"])
def test_metrics_pointed_at_another_runs_file_is_refused(saved_run, tmp_path, target):
    """Was: --metrics naming another run's meta.json or rank file appended to it, exit 0."""
    theirs = tmp_path / "theirs"
    shutil.copytree(saved_run, theirs)
    before = (theirs / target).read_bytes()
    code, err = exit_of(train.main, RUN + ["--steps", "2", "--out", str(tmp_path / "mine"), "--metrics",
                                           str(theirs / target)])
    assert code == 2 and one_error_line(err) == (f"error: --metrics: {theirs / target} is not a metrics file (its "
                                                 "first line is no step row or summary): a run appends only to its "
                                                 "own kind; choose another"), err
    assert (theirs / target).read_bytes() == before


def test_sigterm_saves_the_step_it_finished_and_says_how_to_go_on(tmp_path):
    """What Slurm's time limit, scancel, timeout and kill send. Was: the run ended with no line at all, attempts.json
    still "running", nothing saved since the last --save-every. Now the step in progress finishes, one rank saves it,
    and the line is Ctrl-C's, exit 143, naming the save --resume goes on from."""
    out = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "train.py", *RUN, "--steps", "2000", "--out", str(out)], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    metrics, deadline = out / "metrics.jsonl", time.time() + 120
    while not (metrics.exists() and metrics.read_text().count("\n") >= 2) and time.time() < deadline:
        time.sleep(0.1)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 143, err
    line = one_error_line(err)
    step = int(line.removeprefix("error: stopped by SIGTERM after step ").split(";")[0])
    assert line == (f"error: stopped by SIGTERM after step {step}; the newest save is {out / f'step_{step:07d}'}; "
                    "--resume goes on from it"), line
    assert json.loads((out / "attempts.json").read_text())[-1]["status"] == f"stopped by SIGTERM after step {step}"
    losses = quiet(train.main, RUN + ["--steps", str(step + 1), "--out", str(out), "--resume"])
    assert len(losses) == 1  # one step more, from the save


def test_a_finished_run_resumed_says_so_and_trains_nothing(tmp_path, capsys):
    """Was: `make train` a second time drew a full progress bar and stopped, saying nothing."""
    argv = RUN + ["--steps", "2", "--out", str(tmp_path / "run")]
    assert len(quiet(train.main, argv)) == 2
    capsys.readouterr()
    assert train.main(argv + ["--resume"]) == []
    out = capsys.readouterr().out
    assert "already finished at step 2: nothing to train; pass --steps N (N > 2) to go on" in out, out
