"""Failures a long run must survive or stop on, with torchrun --max-restarts N and --resume auto.

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
import json
import os
import time
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist

from data.files import read_text, write_json
from saves import SaveError, TrainingFailure
from saves.write import SaveFailed, last_good_save

__all__ = ["Attempts", "NonFiniteLoss", "SaveFailed", "TrainingFailure", "restart_store",
           "stop_run"]
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


def restart_store(rank, world):
    """init_process_group's store arguments: each attempt gets its own key prefix.

    Under torchrun --max-restarts the rendezvous store outlives a failed attempt. Its keys
    (a killed peer's address) would be read again, and new workers would wait on a dead port.
    Outside torchrun's restarts this returns {}."""
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    if restart is None:
        return {}
    agent_hosts_it = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world,
                          is_master=rank == 0 and not agent_hosts_it, timeout=timedelta(minutes=5))
    return {"store": dist.PrefixStore(f"attempt_{restart}", store), "rank": rank,
            "world_size": world}
