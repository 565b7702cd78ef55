"""The run folder (--out) as train.py sees it: one object, asked in the order a run goes.

    folder = RunFolder(out, mesh, device, config, layout,  # checked, locked
                       resume=..., keep=..., async_save=...)
    step = folder.start(wrapper, opt, scaler, hf_weights)  # the save resumed (any layout), or 0
    folder.save(step, wrapper, opt, scaler)                # every --save-every steps, and the last
    folder.finish()                                        # last async save written; attempt "done"

One writer at a time. Rank 0 holds an exclusive lock on the folder from the checks to the end:
data.files.lock_folder, an flock on the folder itself, not on a file in it that could be deleted.
The kernel drops it when the process dies, so a killed run leaves no stale lock. A second run
into the same folder while the first still trains, fresh or --resume, stops with exit 2.
It names the holder's pid and host, which OUT/.lock records once the run starts.

The folder is the run's own. Its files (.lock, attempts.json, metrics.jsonl) are regular files
or missing: never a link that leads out of it, a FIFO or a folder. It does not lie inside a save
folder, which its run would delete when it prunes. Before anything is written, a fresh run
refuses a folder holding another run's saves or attempts (holds_a_run). --resume takes the
newest complete save whose config matches: model, data, optimization. --steps may grow; the
schedule is recomputed. A run stopped before its first save (killed, Ctrl-C, a full disk) leaves
only its own attempts; the same run, fresh or under --resume, starts again from step 0.
A failure after the start (non-finite loss, a failed save, Ctrl-C) is recorded in
OUT/attempts.json, and named with the newest save that verifies (exit 3).

Restarts.
Failures a long run must survive or stop on, with torchrun --max-restarts N and --resume auto.

- A killed or crashed rank: torchrun restarts every process, and --resume auto continues from
  the newest complete save. The run ends with the losses of an uninterrupted one.
- A non-finite loss stops the run before its optimizer step and before any save: exit status 3.
  Without fp16's loss scaler, so does a non-finite gradient norm. The last good save stays newest.
- A failure that repeats. Rank 0 keeps RUN/attempts.json, one record per attempt: the step it
  resumed from, the last step it completed, and how it ended. It is written when something
  changes (the start, each save, the end or a failure), and at most once a minute in between.
  So a killed run's record is at most a minute behind. When the last two attempts failed at
  the same step, the next one refuses to start (exit 3), rather than loop until the restarts
  run out. An attempts.json that is not a list of such records (hand-edited, another program's)
  is refused (exit 2). Starting over would overwrite the history and forget a repeated failure.
- A save that fails (a full disk): every rank stops with exit 3 (write.SaveFailed).
  The previous save is intact.
- The last good save a stop names is the newest complete save that verifies
  (write.last_good_save).
"""
import gc
import hashlib
import json
import os
import signal
import socket
import sys
import threading
import time
from pathlib import Path

import torch.distributed as dist

from data import SaveError, TrainingFailure
from data.files import check_own_file, lock_folder, read_text, unlock_folder, write_json
from data.hf import start_from
from data.loader import data_identity
from data.saves import (
    SAVE,
    Saved,
    SaveFailed,
    Saver,
    agree_on_run_id,
    check_config,
    complete_saves,
    last_good_save,
    remove_incomplete,
    resume,
)
from parallel.comm import all_reduce_max

RECORD = {"attempt": int, "resumed_from": int, "reached": int, "status": str}
WRITE_EVERY_S = 60  # progress between the events that write the record


class NonFiniteLoss(TrainingFailure):
    def __init__(self, step, loss, grad_norm):
        super().__init__(f"step {step}: non-finite loss {loss} (grad norm {grad_norm})")
        self.step = step


class Attempts:
    """RUN/attempts.json: [{"attempt", "resumed_from", "reached", "status", "run"}].

    status is running, done, or "failed: ...". run is the identity of the run's config
    (run.run_identity): by it a run knows its own folder again."""

    def __init__(self, run_dir, rank, resuming, run=None):
        self.path, self.rank, self.run = Path(run_dir) / "attempts.json", rank, run
        self.records, self.written_at, self.unwritten = [], 0.0, None
        if resuming and self.path.exists():
            self.records = self._read()

    def _read(self):
        """The records, or SaveError if the file is not a list of them.

        Atomic writes cannot tear it; an edit can. It is refused, not started over,
        so neither the history nor a repeated failure is lost."""
        try:
            records = json.loads(read_text(self.path))
        except (OSError, ValueError) as e:
            raise SaveError(f"cannot read {self.path}: {type(e).__name__}: {e}; "
                            "fix or delete it") from None
        good = isinstance(records, list) and all(
            isinstance(r, dict) and all(isinstance(r.get(k), kind)
                                        and not isinstance(r.get(k), bool)
                                        for k, kind in RECORD.items()) for r in records)
        if not good:
            raise SaveError(f"{self.path} is not a list of attempt records "
                            f"{{{', '.join(RECORD)}}}; fix or delete it")
        return records

    @staticmethod
    def failed_step(record):
        return None if record["status"] == "done" else record["reached"] + 1

    def check(self):
        """TrainingFailure if the last two attempts failed at the same step. Every rank calls it."""
        if len(self.records) >= 2:
            a, b = self.records[-2:]
            if self.failed_step(a) is not None and self.failed_step(a) == self.failed_step(b):
                raise TrainingFailure(
                    f"step {self.failed_step(b)} failed in two attempts in a row "
                    f"(attempt {a['attempt']}: {a['status']}; "
                    f"attempt {b['attempt']}: {b['status']}); not restarting: fix the cause, "
                    f"then delete {self.path}")

    def begin(self, start):
        """Records a new attempt; False if rank 0 could not write it (a full disk)."""
        self.records.append({"attempt": len(self.records) + 1, "resumed_from": start,
                             "reached": start, "status": "running",
                             **({"run": self.run} if self.run else {})})
        return self.write()

    def progress(self, step, now=False):
        """The last completed step; written now (after a save) or if the record is a minute old."""
        self.records[-1]["reached"] = step
        if now or time.monotonic() - self.written_at >= WRITE_EVERY_S:
            self.write()

    def end(self, status):
        """'done', or 'failed: why'. A failure's note says if it repeats the previous attempt's."""
        record = self.records[-1]
        record["status"] = status
        self.write()
        if status != "done" and len(self.records) >= 2 and \
                self.failed_step(self.records[-2]) == self.failed_step(record):
            return f"; attempt {record['attempt'] - 1} failed at this step too: not retrying"
        return ""

    def write(self):
        """Rank 0 writes the records, atomically; returns whether they are on disk.

        A disk that cannot take them (full) is noted, not raised: the run's own failure path
        reports it."""
        if self.rank != 0:
            return True
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            write_json(self.path, self.records, indent=1)
        except OSError as e:
            self.unwritten = e
            return False
        self.written_at, self.unwritten = time.monotonic(), None
        return True


def stop_run(error, saver, attempts, run_dir):
    """The TrainingFailure to raise on a non-finite loss or a failed save; names the last good save.

    A failed save is SaveFailed, from saver.save or saver.wait. An async save in flight finishes
    first, then the failure is recorded. The last good save is the newest complete one that
    verifies. Every rank calls this: each reads a share of its files, and they agree."""
    note = ""
    try:
        saver.wait()
    except SaveFailed as e:  # the save in flight failed too: it is gone, say so
        note = f" (the save of step {e.step} in flight failed: {e.reason})"
    repeated = attempts.end(f"failed: {error}{note}")
    if isinstance(error, SaveFailed):  # its message names the save that is intact already
        return TrainingFailure(f"{error}{repeated}")
    good = last_good_save(run_dir, saver.mesh.world_group, saver.device)
    return TrainingFailure(f"{error}{note}; "
                           f"stopped, the last good save is {good or 'none'}{repeated}")


# ---------------------------------------------------------------- the run folder

OWN_FILES = (".lock", "attempts.json", "metrics.jsonl")  # what a run writes there besides saves


class RunFolder:
    def __init__(self, path, mesh, device, config, layout, resume=None, keep=2, async_save=False):
        self.path, self.mesh, self.device, self.rank = (
            Path(path), mesh, device, mesh.global_rank)
        self.config, self.layout, self.resuming = config, layout, resume is not None
        self.keep, self.async_save, self.saver, self.step = keep, async_save, None, None
        self.identity = run_identity(config)
        self.lock = self._lock()
        try:
            self.saved = self._find_save(resume)
            # this run's attempts, if any
            self.attempts = Attempts(self.path, self.rank, resuming=True, run=self.identity)
            self.attempts.check()
        except BaseException:
            self.close()
            raise

    # ---------------------------------------------------------------- before anything is written
    def _lock(self):
        """Rank 0 checks the folder (check_out) and locks it; an all-reduce makes every rank agree.

        SaveError if the folder cannot be this run's, or another process holds it.
        A folder it had to create is removed again if the run stops before it starts."""
        problem, handle = "", None
        if self.rank == 0:
            try:
                problem = check_out(self.path)
                if not problem:
                    self.created = [] if self.path.exists() else [self.path]
                    handle = lock_folder(self.path)
                    if handle is None:
                        problem = (f"--out: {self.path} is in use by a run still writing to it "
                                   f"({holder(self.path)}); "
                                   "wait for it to end, or choose another --out")
            except OSError as e:  # a name too long for the file system, a file on the way
                problem = f"--out: cannot create {self.path}: {e.strerror or e}"
        if all_reduce_max(self.mesh.world_group, float(bool(problem)), self.device):
            self.lock = handle
            self.close()
            raise SaveError(problem
                            or f"--out: {self.path} cannot be this run's folder (see rank 0)")
        return handle

    def _find_save(self, mode):
        """The validated save to resume from, or None.

        None is a fresh run, checked not to take another run's folder."""
        found = complete_saves(self.path)
        if mode is None:
            check_fresh_run_folder(self.path, self.config)  # never another run's folder
            return None
        if not found:
            if mode == "auto" or (self.path / "attempts.json").exists():
                if another_runs_attempts(self.path, self.config):  # no save: these must be ours
                    raise SaveError(f"--resume: {self.path} holds another run's attempts.json "
                                    "and no save to resume; choose another --out")
                return None  # nothing saved yet: the run starts again from step 0
            raise SaveError(f"--resume: no complete save in {self.path} "
                            "(use --resume auto to start fresh)")
        try:
            saved = Saved(found[-1]).validate()
            planned = {**self.config, "train": {**self.config["train"], "steps": None}}
            mine = saved.meta["config"]
            check_config({**mine, "train": {**mine.get("train", {}), "steps": None}}, planned,
                         f"{found[-1]} ")
        except SaveError as e:
            raise SaveError(f"--resume: {e}") from None
        steps = self.config["train"]["steps"]
        if saved.step > steps:
            raise SaveError(f"--steps: the newest save, {found[-1]}, is at step {saved.step}, "
                            f"past --steps {steps}")
        if self.rank == 0 and mine["train"]["steps"] != steps:
            print(f"--steps {steps}: the save's run planned {mine['train']['steps']}; "
                  f"the learning-rate schedule is recomputed for {steps} steps", flush=True)
        return saved

    # ---------------------------------------------------------------- the run
    def start(self, wrapper, opt, scaler, weights=None):
        """Loads the save (any layout), or the Hugging Face weights on a fresh start.

        It records the attempt, and returns the step to continue from."""
        if self.saved is None and weights is not None:
            self.step = start_from(weights, wrapper, opt, self.rank)
        else:
            self.step = resume(self.saved, wrapper, opt, scaler, self.layout, self.rank)
        run_id = agree_on_run_id(self.mesh, self.device)  # a barrier: every rank read the folder
        if self.rank == 0 and self.resuming:
            remove_incomplete(self.path)
        self.created = []  # from here on the folder is this run's
        # who holds the folder, for a second run's message (atomic: never through a link)
        if self.lock is not None:
            write_json(self.path / ".lock", {"pid": os.getpid(), "host": socket.gethostname(),
                                             "since": time.ctime()})
        if all_reduce_max(self.mesh.world_group, float(not self.attempts.begin(self.step)),
                          self.device):
            why = self.attempts.unwritten
            raise TrainingFailure(f"cannot write {self.path / 'attempts.json'} "
                                  f"({why.strerror if why else 'on rank 0'}); "
                                  "stopped before training, the newest "
                                  f"save is {last_good_save(self.path) or 'none'}")
        self.saver = Saver(self.path, self.mesh, self.device, keep=self.keep,
                           async_save=self.async_save, run_id=run_id)
        return self.step

    def progress(self, step):
        self.step = step
        self.attempts.progress(step)

    def save(self, step, wrapper, opt, scaler):
        """Saves, sync or async; returns the seconds training stalled.

        A failed save stops the run: TrainingFailure."""
        header = {"config": self.config, "layout": self.layout, "scaler": scaler.state_dict()}
        try:
            stall = self.saver.save(step, wrapper, opt, header)
        except SaveFailed as e:
            raise stop_run(e, self.saver, self.attempts, self.path) from None
        self.attempts.progress(step, now=True)
        return stall

    def non_finite(self, step, loss, grad_norm):
        """The TrainingFailure to raise for a non-finite loss at `step`, the failure recorded."""
        return stop_run(NonFiniteLoss(step, loss, grad_norm), self.saver, self.attempts, self.path)

    def interrupted(self):
        """Ctrl-C: records the attempt as interrupted; returns a line saying where the run stopped.

        No collective runs: every rank was interrupted wherever it was. An async save in flight
        is left to the next resume, which removes its temp folder."""
        if self.saver is not None:
            self.attempts.end(f"interrupted after step {self.step}")
        good = last_good_save(self.path)
        self.close()
        return f"interrupted after step {self.step}; the newest save is {good or 'none'}"

    def hung(self, what):
        """A collective timed out (`what` names it): records the attempt as failed.

        No collective runs, since a peer does not answer. Returns the line to stop with."""
        if self.saver is not None:
            self.attempts.end(f"failed: {what}")
        good = last_good_save(self.path)
        self.close()
        return f"{what}; stopped, the newest save is {good or 'none'}"

    def finish(self):
        """Waits for the last async save, records the attempt as done, releases the folder."""
        try:
            self.saver.wait()
        except SaveFailed as e:
            raise stop_run(e, self.saver, self.attempts, self.path) from None
        self.attempts.end("done")
        self.close()

    def close(self):
        """Releases the lock; removes what the checks created if the run never started."""
        unlock_folder(self.lock)
        self.lock = None
        for p in reversed(getattr(self, "created", [])):
            if p.is_file():
                p.unlink(missing_ok=True)
            elif p.is_dir() and not any(p.iterdir()):
                p.rmdir()
        self.created = []


def check_out(path):
    """What makes `path` unfit to be a run folder, in one line; "" if nothing.

    It may lie inside a save folder (or a folder named like one). Or a file a run writes there
    may be a link that leads out of it, a folder or a FIFO."""
    real = Path(os.path.realpath(path))
    for inside in (real, *real.parents):
        if SAVE.match(inside.name) or inside.name.startswith((".tmp_step_", ".del_step_")):
            return (f"--out: {path} lies in {inside}, a save's folder (or named like one), "
                    f"which the run in {inside.parent} deletes when it prunes its saves; "
                    "choose an --out outside it")
    for name in OWN_FILES:
        problem = check_own_file(Path(path) / name, path)
        if problem:
            return (f"--out: {Path(path) / name} is {problem}: "
                    "a run writes only its own files in its folder; "
                    "remove it, or choose another --out")
    return ""


def holder(path):
    """Who holds the run folder, as its .lock says ("another process" until that run starts)."""
    if check_own_file(path / ".lock", path):
        return "another process"
    try:
        return read_text(path / ".lock").strip() or "another process"
    except (OSError, UnicodeDecodeError):
        return "another process"


def run_identity(config):
    """The run a folder's attempts belong to: a hash of its config, --steps aside.

    The config is model, data and optimization, as --resume compares them.
    A longer run is the same run."""
    plain = {**config, "train": {**config.get("train", {}), "steps": None}}
    return hashlib.sha256(json.dumps(plain, sort_keys=True, default=str).encode()).hexdigest()[:16]


def holds_a_run(path, config=None):
    """Whether `path` holds another run's work, which a fresh run would prune, mix or overwrite.

    That is a save (any step_* folder), or attempts (attempts.json) not all this run's.
    This run is the identity of `config`; with config None, any attempts count.
    A run stopped before its first save holds only its own attempts, so the same run started
    again takes its folder back. Leftovers of killed saves (.tmp_*, .del_*) hold nothing loadable
    and do not count. It only reads."""
    path = Path(path)
    if any(path.glob("step_*")):
        return True
    if not (path / "attempts.json").exists():
        return False
    if config is None:
        return True
    try:
        records = json.loads(read_text(path / "attempts.json"))
    except (OSError, ValueError):
        return True
    mine = run_identity(config)
    return not (isinstance(records, list) and records and
                all(isinstance(r, dict) and r.get("run") == mine for r in records))


def another_runs_attempts(path, config):
    """Whether attempts.json holds a record that names another run (records from before runs had
    identities name none, and may be this run's)."""
    try:
        records = json.loads(read_text(Path(path) / "attempts.json"))
    except (OSError, ValueError):
        return False  # Attempts reads it next, and says what is wrong with it
    mine = run_identity(config)
    return isinstance(records, list) and any(isinstance(r, dict) and r.get("run", mine) != mine
                                             for r in records)


def check_fresh_run_folder(run_dir, config=None):
    """For a run started without --resume: SaveError if run_dir holds another run's work.

    holds_a_run decides. It only reads."""
    run_dir = Path(run_dir)
    if not run_dir.exists():
        return
    if not run_dir.is_dir():
        raise SaveError(f"{run_dir} is not a folder: choose another --out")
    if holds_a_run(run_dir, config):
        found = sorted(p.name for p in run_dir.glob("step_*"))
        found += ["attempts.json"] * (run_dir / "attempts.json").exists()
        raise SaveError(f"{run_dir} holds saves of another run "
                        f"({', '.join(found[:3])}{', ...' * (len(found) > 3)}): "
                        "pass --resume, or choose another --out")


def default_out(preset, flags, resume, root=Path("runs")):
    """runs/NAME: the preset and the given flags (hashed past 120 characters). A fresh run takes the
    first of NAME, NAME-2, NAME-3, ... that holds no run; --resume the newest that exists."""
    shown = [f"{k}={','.join(map(str, v)) if isinstance(v, tuple) else v}" for k, v in flags.items()
             if k != "model"]
    name = "-".join([preset] + shown).replace("/", "_")
    if len(name) > 120:
        name = f"{name[:100]}-{hashlib.sha256(name.encode()).hexdigest()[:12]}"
    names = [root / name] + [root / f"{name}-{i}" for i in range(2, 10_000)]
    if resume:
        existing = names[:next(i for i, p in enumerate(names) if not p.exists())]
        return existing[-1] if existing else names[0]
    for path in names:
        if not path.exists() or not holds_a_run(path):
            return path
    raise SaveError(f"--out: {root / name} and 9,999 more of that name hold runs; choose --out")


def saved_config(cfg, run, data_folder, meta):
    """What a save records of the run that --resume must match: model, data, tokenizer and
    optimization (--steps may grow)."""
    train = ("global_batch", "lr", "min_lr", "warmup", "weight_decay", "grad_clip", "seed", "dtype",
             "steps")
    return {"model": dict(cfg.__dict__), "data": data_identity(data_folder),
            "train": {**{k: getattr(run, k) for k in train},  # cosine: as before wsd existed
                      **({"warmdown": run.warmdown} if run.schedule == "wsd" else {})},
            "tokenizer": meta["tokenizer"],
            **{k: meta[k] for k in ("tokenizer_file",) if k in meta}}


def saved_layout(run):
    """The layout a save records, which a resume need not match."""
    return {"world": run.world, "dp": run.dp, "pp": run.pp, "cp": run.cp, "tp": run.tp,
            "dp_mode": run.dp_mode, "dp_shard": run.dp_shard or run.dp, "sp": run.sp,
            "pp_schedule": run.pp_schedule, "pp_virtual": run.pp_virtual,
            "pp_split": ",".join(map(str, run.pp_split)) if run.pp_split else None,
            "cp_mode": run.cp_mode}


# ---------------------------------------------------------------- how a run ends

class Interrupted(Exception):
    """Ctrl-C: one line saying where the run stopped and which save is the newest (exit 130)."""
    exit_status = 130


class Hung(TrainingFailure):
    """A collective timed out: one line naming it (exit 3). The process leaves at once: tearing
    the process group down would wait on the peer that does not answer."""


class CtrlC:
    """While the loop runs, Ctrl-C ends the step in progress, then stops the run. A second one stops
    it at once. (Raised at once, the first could land in a finalizer, where Python drops it.) Off
    the main thread, or where SIGINT was ignored from the start, nothing changes."""

    def __init__(self):
        self.pressed, self.previous = False, None

    def __enter__(self):
        main = threading.current_thread() is threading.main_thread()
        if main and signal.getsignal(signal.SIGINT) is not signal.SIG_IGN:
            self.previous = signal.signal(signal.SIGINT, self._press)
        return self

    def _press(self, signum, frame):
        if self.pressed:
            raise KeyboardInterrupt
        self.pressed = True

    def __exit__(self, *exc):
        if self.previous is not None:
            signal.signal(signal.SIGINT, self.previous)


def report_to_launcher(error):
    """Under torchrun the error line also goes to this worker's error file. torchrun's report then
    ends with it as the root cause."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if path:
        report = {"message": f"error: {error}", "timestamp": str(int(time.time()))}
        Path(path).write_text(json.dumps(report))


def run_or_exit(job):
    """job()'s result; or, if it fails as a run can, one line on stderr and its exit status: 2 bad
    input, 3 a run that failed after it started, 130 Ctrl-C (each error class's exit_status)."""
    joined = dist.is_initialized()  # a caller's process group (tests) outlives this run
    error = None
    try:
        return job()
    except KeyboardInterrupt:
        code, error = 130, "interrupted before training started; nothing was written"
    except Exception as e:
        if getattr(e, "exit_status", None) is None:
            raise
        code, error = e.exit_status, e
    finally:
        if not joined and dist.is_initialized() and not isinstance(error, Hung):
            dist.destroy_process_group()
            # The groups sit in reference cycles (hooks, modules, the mesh). Freed now, each joins
            # its worker threads; left to the interpreter's exit, a worker that drops a tensor
            # there needs the GIL and aborts the process after a run that succeeded.
            gc.collect()
    report_to_launcher(error)
    if int(os.environ.get("LOCAL_RANK", os.environ.get("RANK", 0))) == 0:  # one line per node
        print(f"error: {error}", file=sys.stderr)
    elif int(os.environ.get("WORLD_SIZE", 1)) > 1:
        time.sleep(1)  # torchrun stops every worker once one exits: let rank 0's line out first
    if isinstance(error, Hung) and not joined:
        sys.stdout.flush(), sys.stderr.flush()
        os._exit(code)
    sys.exit(code)
