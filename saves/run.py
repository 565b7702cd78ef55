"""The run folder (--out) as train.py sees it: one object, asked in the order a run goes.

    folder = RunFolder(out, mesh, device, config, layout, resume=..., keep=..., async_save=...)  # checked, locked
    step = folder.start(wrapper, opt, scaler, hf_weights)   # the save resumed (any layout), or step 0
    folder.save(step, wrapper, opt, scaler)                 # every --save-every steps and at the end
    folder.finish()                                         # the last async save written; the attempt "done"

One writer at a time: rank 0 holds an exclusive lock on OUT/.lock (flock) from the checks to the end. The kernel
drops it when the process dies, so a killed run leaves no stale lock; a second run into the same folder, fresh or
--resume, while the first still trains, stops with exit 2 and the holder's pid and host. Before anything is
written, a fresh run refuses a folder that holds another run's saves, and --resume takes the newest complete save
whose config matches (model, data, optimization; --steps may grow: the schedule is recomputed). A folder whose
run was killed before its first save resumes from step 0 under --resume.
A failure after the start (non-finite loss, a failed save, Ctrl-C) is recorded in OUT/attempts.json and named
with the newest save that verifies (exit 3).
"""
import fcntl
import json
import os
import socket
import time
from pathlib import Path

from parallel.comm import all_reduce_max
from saves import SaveError, TrainingFailure
from saves.hf import start_from
from saves.load import Saved, check_config, resume
from saves.restarts import Attempts, NonFiniteLoss, stop_run
from saves.write import (
    SaveFailed,
    Saver,
    agree_on_run_id,
    check_fresh_run_folder,
    complete_saves,
    last_good_save,
    remove_incomplete,
)


class RunFolder:
    def __init__(self, path, mesh, device, config, layout, resume=None, keep=2, async_save=False):
        self.path, self.mesh, self.device, self.rank = Path(path), mesh, device, mesh.global_rank
        self.config, self.layout, self.resuming = config, layout, resume is not None
        self.keep, self.async_save, self.saver, self.step = keep, async_save, None, None
        self.lock = self._lock()
        try:
            self.saved = self._find_save(resume)
            self.attempts = Attempts(self.path, self.rank, resuming=self.resuming)
            self.attempts.check()
        except BaseException:
            self.close()
            raise

    # ---------------------------------------------------------------- before anything is written
    def _lock(self):
        """Rank 0's exclusive lock on OUT/.lock, agreed on by every rank (an all-reduce): SaveError if another
        process holds it. A lock file it had to create is removed again if the run stops before it starts."""
        error, handle = "", None
        if self.rank == 0:
            self.created = [p for p in (self.path, self.path / ".lock") if not p.exists()]
            self.path.mkdir(parents=True, exist_ok=True)
            handle = open(self.path / ".lock", "a+")
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)  # the holder writes who it is once it starts
            except BlockingIOError:
                handle.seek(0)
                holder = handle.read().strip() or "another process"
                handle.close()
                handle, error = None, holder
        if all_reduce_max(self.mesh.world_group, float(bool(error)), self.device):
            raise SaveError(f"--out: {self.path} is in use by a run still writing to it ({error or 'see rank 0'}); "
                            "wait for it to end, or choose another --out")
        return handle

    def _find_save(self, mode):
        """The validated save to resume from, or None (a fresh run, checked not to take another run's folder)."""
        found = complete_saves(self.path)
        if mode is None:
            check_fresh_run_folder(self.path)  # never another run's folder (the lock file does not count)
            return None
        if not found:
            if mode == "auto" or (self.path / "attempts.json").exists():
                return None  # nothing saved yet: the run starts again from step 0
            raise SaveError(f"--resume: no complete save in {self.path} (use --resume auto to start fresh)")
        try:
            saved = Saved(found[-1]).validate()
            planned = {**self.config, "train": {**self.config["train"], "steps": None}}
            mine = saved.meta["config"]
            check_config({**mine, "train": {**mine.get("train", {}), "steps": None}}, planned, f"{found[-1]} ")
        except SaveError as e:
            raise SaveError(f"--resume: {e}") from None
        steps = self.config["train"]["steps"]
        if saved.step > steps:
            raise SaveError(f"--steps: the newest save, {found[-1]}, is at step {saved.step}, past --steps {steps}")
        if self.rank == 0 and mine["train"]["steps"] != steps:
            print(f"--steps {steps}: the save's run planned {mine['train']['steps']}; the learning-rate schedule is "
                  f"recomputed for {steps} steps", flush=True)
        return saved

    # ---------------------------------------------------------------- the run
    def start(self, wrapper, opt, scaler, weights=None):
        """Loads the save (any layout) or, on a fresh start, the Hugging Face weights; records the attempt. Returns the
        step to continue from."""
        if self.saved is None and weights is not None:
            self.step = start_from(weights, wrapper, opt, self.rank)
        else:
            self.step = resume(self.saved, wrapper, opt, scaler, self.layout, self.rank)
        run_id = agree_on_run_id(self.mesh, self.device)  # a barrier too: every rank has read the run folder
        if self.rank == 0 and self.resuming:
            remove_incomplete(self.path)
        self.created = []  # from here on the folder is this run's
        if self.lock is not None:
            self.lock.seek(0), self.lock.truncate()
            self.lock.write(json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "since": time.ctime()}))
            self.lock.flush()
        if all_reduce_max(self.mesh.world_group, float(not self.attempts.begin(self.step)), self.device):
            why = self.attempts.unwritten
            raise TrainingFailure(f"cannot write {self.path / 'attempts.json'} "
                                  f"({why.strerror if why else 'on rank 0'}); stopped before training, the newest "
                                  f"save is {last_good_save(self.path) or 'none'}")
        self.saver = Saver(self.path, self.mesh, self.device, keep=self.keep, async_save=self.async_save,
                           run_id=run_id)
        return self.step

    def progress(self, step):
        self.step = step
        self.attempts.progress(step)

    def save(self, step, wrapper, opt, scaler):
        """Saves (sync or async); the seconds training stalled. A failed save stops the run: TrainingFailure."""
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
        """Ctrl-C: the attempt recorded as interrupted; one line saying where the run stopped. No collective runs
        (every rank was interrupted wherever it was); an async save in flight is left to the next resume, which
        removes its temp folder."""
        if self.saver is not None:
            self.attempts.end(f"interrupted after step {self.step}")
        good = last_good_save(self.path)
        self.close()
        return f"interrupted after step {self.step}; the newest save is {good or 'none'}"

    def hung(self, what):
        """A collective timed out (`what` names it): the attempt recorded as failed, with no
        collective (a peer does not answer). Returns the line to stop with."""
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
        if self.lock is not None:
            self.lock.close()
            self.lock = None
        for p in reversed(getattr(self, "created", [])):
            if p.is_file():
                p.unlink(missing_ok=True)
            elif p.is_dir() and not any(p.iterdir()):
                p.rmdir()
        self.created = []


__all__ = ["RunFolder", "SaveError", "TrainingFailure"]
