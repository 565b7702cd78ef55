"""The run folder (--out) as train.py sees it: one object, asked in the order a run goes.

    folder = RunFolder(out, mesh, device, config, layout,  # checked, locked
                       resume=..., keep=..., async_save=...)
    step = folder.start(wrapper, opt, scaler, hf_weights)  # the save resumed (any layout), or 0
    folder.save(step, wrapper, opt, scaler)                # every --save-every steps, and the last
    folder.finish()                                        # last async save written; attempt "done"

One writer at a time: rank 0 holds an flock on the folder (files.lock_folder) to the end, and
OUT/.lock names its pid and host. The folder is the run's own: its files are regular files or
missing, never a link out of it, and it lies in no save folder. A fresh run refuses a folder
holding another run's saves or attempts; --resume takes the newest complete save whose model,
data and optimization config match (--steps may grow). RUN/attempts.json keeps one record per
attempt, at most a minute behind. When the last two attempts failed at the same step, the next
refuses to start (exit 3) rather than loop until torchrun's restarts run out.
"""
import contextlib
import hashlib
import json
import math
import os
import signal
import socket
import time
from pathlib import Path

from data import SaveError, TrainingFailure
from data.files import (
    cannot_create,
    check_own_file,
    lock_folder,
    make_folders,
    read_json,
    read_text,
    remove_created,
    unlock_folder,
    write_json,
)
from data.hf import start_from
from data.loader import data_identity
from data.saver import SaveFailed, Saver, agree_on_run_id, not_finite
from data.saves import SAVE, Saved, complete_saves, last_good_save, load, remove_incomplete
from parallel.comm import all_reduce_max

RECORD = {"attempt": int, "resumed_from": int, "reached": int, "status": str}
WRITE_EVERY_S = 60  # progress between the events that write the record


class NonFinite(TrainingFailure):
    """A step whose loss, gradient norm, or updated weights or Adam state are not finite."""

    def __init__(self, step, what):
        super().__init__(f"step {step}: {what}")
        self.step = step


def non_finite_step(loss, grad_norm):
    """What of a step's loss and gradient norm is not finite, in words."""
    if not math.isfinite(loss):
        return f"non-finite loss {loss} (gradient norm {grad_norm})"
    return f"non-finite gradient norm {grad_norm} (loss {loss})"


class Attempts:
    """RUN/attempts.json: [{"attempt", "resumed_from", "reached", "status", "run"}]; status is
    running, done or "failed: ...", run the run_identity by which a run knows its folder."""

    def __init__(self, run_dir, rank, resuming, run=None):
        self.path, self.rank, self.run = Path(run_dir) / "attempts.json", rank, run
        self.records, self.written_at, self.unwritten = [], 0.0, None
        if resuming and self.path.exists():
            self.records = self._read()

    def _read(self):
        """The records, or SaveError if the file is not a list of them (an edit, not a tear)."""
        try:
            records = read_json(self.path, SaveError)
        except SaveError as e:
            raise SaveError(f"{e}; fix or delete it") from None
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
        """Rank 0 writes the records, atomically; returns whether they are on disk (a full disk
        is noted in unwritten, not raised: the run's own failure path reports it)."""
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
    """The TrainingFailure to raise on a non-finite loss or a failed save (SaveFailed), naming
    the last good save. An async save in flight finishes first. Every rank calls this."""
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

        SaveError if the folder cannot be this run's, or another process holds it."""
        problem, handle = "", None
        if self.rank == 0:
            try:
                problem = check_out(self.path)
                if not problem:
                    self.created = make_folders(self.path)  # removed if the run never starts
                    handle = lock_folder(self.path)
                    if handle is None:
                        problem = (f"--out: {self.path} is in use by a run still writing to it "
                                   f"({holder(self.path)}); "
                                   "wait for it to end, or choose another --out")
            except OSError as e:  # a name too long for the file system, a file on the way
                problem = f"--out: {cannot_create(self.path, e)}"
        if all_reduce_max(self.mesh.world_group, float(bool(problem)), self.device):
            self.lock = handle
            self.close()
            raise SaveError(problem
                            or f"--out: {self.path} cannot be this run's folder (see rank 0)")
        return handle

    def _find_save(self, mode):
        """The validated save to resume from, or None (a fresh run, never another run's folder)."""
        found = complete_saves(self.path)
        if mode is None:
            check_fresh_run_folder(self.path, self.config)
            return None
        if not found:
            if mode != "auto":
                raise SaveError(f"--resume: no complete save in {self.path} "
                                "(use --resume auto to start fresh)")
            if foreign_attempts(self.path, self.config, strict=False):
                raise SaveError(f"--resume: {self.path} holds another run's attempts.json "
                                "and no save to resume; choose another --out")
            if self.rank == 0:  # nothing saved yet: the run starts again from step 0, and says so
                print(f"--resume auto: no save in {self.path}; starting from step 0", flush=True)
            return None
        try:
            saved = Saved(found[-1]).validate()
            mine = saved.meta["config"]
            found_difference = first_difference(_plain(mine), _plain(self.config))
        except SaveError as e:
            raise SaveError(f"--resume: {e}") from None
        if found_difference:
            key, x, y = found_difference
            raise SaveError(f"--resume: {found[-1]} has {key}={x!r}, this run has {key}={y!r}")
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
        """Loads the save (any layout), or the Hugging Face weights on a fresh start; records the
        attempt; returns the step to continue from."""
        if self.saved is None and weights is not None:
            self.step = start_from(weights, wrapper, opt, self.rank)
        else:
            self.step = resume(self.saved, wrapper, opt, scaler, self.layout, self.rank)
        if self.saved is not None and weights is not None and self.rank == 0:
            print(f"note: --init-from {weights.path} is not read: a resumed run takes its "
                  "weights from its save", flush=True)
        run_id = agree_on_run_id(self.mesh, self.device)  # a barrier: every rank read the folder
        if self.rank == 0 and self.resuming:
            remove_incomplete(self.path)
        self.created = []  # from here on the folder is this run's
        # who holds the folder, for a second run's message (atomic: never through a link); on a
        # full disk it is not written, and attempts.json's write below says so in one line
        if self.lock is not None:
            with contextlib.suppress(OSError):
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
        """Saves, sync or async; returns the seconds training stalled (TrainingFailure if not)."""
        header = {"config": self.config, "layout": self.layout, "scaler": scaler.state_dict()}
        bad = not_finite(wrapper, opt, self.mesh.world_group, self.device)
        if bad:  # never a save that cannot train: the run stops, naming the last good one
            raise stop_run(NonFinite(step, f"the update left {bad} not finite; not saved"),
                           self.saver, self.attempts, self.path)
        try:
            stall = self.saver.save(step, wrapper, opt, header)
        except SaveFailed as e:
            raise stop_run(e, self.saver, self.attempts, self.path) from None
        self.attempts.progress(step, now=True)
        return stall

    def non_finite(self, step, loss, grad_norm):
        """The TrainingFailure to raise for a non-finite loss or gradient norm at `step`."""
        return stop_run(NonFinite(step, non_finite_step(loss, grad_norm)), self.saver,
                        self.attempts, self.path)

    def interrupted(self, sig=signal.SIGINT, agreed=False):
        """Ctrl-C or SIGTERM: records the attempt; returns a line saying where the run stopped and
        how to go on. Where every rank agreed to stop here (or there is one), an async save in
        flight is awaited; else no collective runs, and the next resume removes it."""
        if self.saver is not None and (agreed or self.mesh.world == 1):
            with contextlib.suppress(SaveFailed):
                self.saver.wait()
        how = "interrupted" if sig == signal.SIGINT else f"stopped by {sig.name}"
        line = self._stop(f"{how} after step {self.step}",
                          f"{how} after step {self.step}; the newest save is", agreed)
        return line + ("; --resume goes on from it" if not line.endswith(" none") else "")

    def stopped(self, what):
        """A collective timed out, or a write failed (`what` names it): records the failure;
        returns the line."""
        return self._stop(f"failed: {what}", f"{what}; stopped, the newest save is")

    def _stop(self, status, line, agreed=False):
        """Records status; the line with the newest save. Where every rank agreed to stop here,
        they verify the saves together: no rank leaves (and torchrun stops no peer) before rank 0
        has recorded the attempt. Else no collective runs: a peer may not answer."""
        if self.saver is not None:
            self.attempts.end(status)
        good = last_good_save(self.path, *((self.mesh.world_group, self.device) if agreed else ()))
        self.close()
        return f"{line} {good or 'none'}"

    def finished(self, start, steps):
        """Whether a resumed run had finished: then it ends here, saying so on rank 0."""
        if start < steps:
            return False
        self.finish()
        if self.rank == 0:
            print(f"already finished at step {start}: nothing to train; pass --steps N (N > "
                  f"{start}) to go on, or another --out (make: RUN=...) for a new run", flush=True)
        return True

    def finish(self):
        """Waits for the last async save, records the attempt as done, releases the folder."""
        try:
            self.saver.wait()
        except SaveFailed as e:
            raise stop_run(e, self.saver, self.attempts, self.path) from None
        self.attempts.end("done")
        self.close()

    def close(self):
        """Releases the lock; removes the folders the checks made if the run never started."""
        unlock_folder(self.lock)
        self.lock = None
        remove_created(getattr(self, "created", []))
        self.created = []


def check_out(path):
    """What makes `path` unfit to be a run folder, in one line: inside a save folder, or a file
    a run writes there that is a link out of it, a folder or a FIFO; "" if nothing."""
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


def _plain(config):
    """The config as --resume compares it: --steps aside, since a longer run is the same run."""
    return {**config, "train": {**config.get("train", {}), "steps": None}}


def run_identity(config):
    """The run a folder's attempts belong to: a hash of its config (model, data, optimization)."""
    text = json.dumps(_plain(config), sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def foreign_attempts(path, config, strict):
    """Whether attempts.json holds records of another run than config's. strict (a fresh run):
    an unreadable file or a record without an identity counts as another run's; else not."""
    try:
        records = json.loads(read_text(Path(path) / "attempts.json"))
    except (OSError, ValueError):
        return strict  # else Attempts reads it next, and says what is wrong with it
    mine = run_identity(config)
    if strict:
        return not (isinstance(records, list) and records and
                    all(isinstance(r, dict) and r.get("run") == mine for r in records))
    return isinstance(records, list) and any(isinstance(r, dict) and r.get("run", mine) != mine
                                             for r in records)


def holds_a_run(path, config=None):
    """Whether `path` holds work a fresh run of config would prune, mix or overwrite: a save, or
    attempts not all this run's (any, with config None). Leftovers of killed saves do not count."""
    path = Path(path)
    if any(path.glob("step_*")):
        return True
    if not (path / "attempts.json").exists():
        return False
    return config is None or foreign_attempts(path, config, strict=True)


def first_difference(a, b, prefix=""):
    """(key, a's value, b's value) of the first key where two configs differ, or None."""
    for key in sorted(set(a) | set(b)):
        x, y = a.get(key), b.get(key)
        if isinstance(x, dict) and isinstance(y, dict):
            found = first_difference(x, y, f"{prefix}{key}.")
            if found:
                return found
        elif x != y:
            return f"{prefix}{key}", x, y
    return None


def resume(saved, wrapper, opt, scaler, layout, rank):
    """Loads a save made in any layout into this one; returns the step to continue from (0
    without a save)."""
    if saved is None:
        return 0
    same_layout = saved.meta["layout"] == layout  # else resharding: a rank's RNG has no counterpart
    load(saved, wrapper, opt, rng_of_rank=rank if same_layout else None)
    scaler.load_state_dict(saved.meta["scaler"])
    if rank == 0:
        print(f"resumed from {saved.path} "
              f"(step {saved.step}{'' if same_layout else ', resharded'})", flush=True)
    return saved.step


def check_fresh_run_folder(run_dir, config=None):
    """For a run started without --resume: SaveError if run_dir holds another run's work."""
    run_dir = Path(run_dir)
    if not run_dir.exists():
        return
    if not run_dir.is_dir():
        raise SaveError(f"{run_dir} is not a folder: choose another --out")
    if holds_a_run(run_dir, config):
        found = sorted(p.name for p in run_dir.glob("step_*"))
        found += ["attempts.json"] * (run_dir / "attempts.json").exists()
        advice = "--resume" if complete_saves(run_dir) else "--resume auto"
        raise SaveError(f"{run_dir} holds saves of another run "
                        f"({', '.join(found[:3])}{', ...' * (len(found) > 3)}): "
                        f"pass {advice}, or choose another --out")


def name_part(flag, value):
    """One flag in a run's name, typed as it reads: steps30, ckpt_full, sp, no-overlap."""
    if isinstance(value, bool):
        return flag if value else f"no-{flag}"
    value = ",".join(map(str, value)) if isinstance(value, tuple) else value
    return f"{flag}{value}" if isinstance(value, (int, float)) else f"{flag}_{value}"


def default_out(preset, flags, resume, world=1, root=Path("runs")):
    """runs/NAME: the preset, the given flags and the ranks past one (hashed past 120 characters):
    tiny-steps30-2ranks. A fresh run takes the first of NAME, NAME.2, NAME.3, ... that holds no
    run; --resume the newest that exists."""
    shown = [name_part(k, v) for k, v in flags.items() if k != "model"]
    name = "-".join([preset] + shown + [f"{world}ranks"] * (world > 1)).replace("/", "_")
    if len(name) > 120:
        name = f"{name[:100]}-{hashlib.sha256(name.encode()).hexdigest()[:12]}"
    names = [root / name] + [root / f"{name}.{i}" for i in range(2, 10_000)]
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
