"""Failures a long run must survive or stop on, with torchrun --max-restarts N and train.py --resume auto.

- A killed or crashed rank: torchrun restarts every process, and --resume auto continues from the newest
  complete save (checkpoint.py), so the run ends with the losses of an uninterrupted one.
- A non-finite loss (or, without fp16's loss scaler, a non-finite gradient norm) stops the run before its
  optimizer step and before any save: exit status 3, the last good save stays the newest.
- A failure that repeats: rank 0 keeps RUN/attempts.json, one record per attempt with the step it resumed
  from, the last step it completed and how it ended. When the last two attempts both failed at the same step,
  the next attempt refuses to start (exit 3) instead of looping until the restarts run out.
"""
import json
import os
from pathlib import Path


class TrainingFailure(Exception):
    """The run stopped itself: one line, exit status 3."""


class NonFiniteLoss(TrainingFailure):
    def __init__(self, step, loss, grad_norm):
        super().__init__(f"step {step}: non-finite loss {loss} (grad norm {grad_norm})")
        self.step = step


class Attempts:
    """RUN/attempts.json: [{"attempt", "resumed_from", "reached", "status"}]; status running|done|failed: ..."""

    def __init__(self, run_dir, rank, resuming):
        self.path, self.rank = Path(run_dir) / "attempts.json", rank
        self.records = []
        if resuming and self.path.exists():
            try:
                self.records = json.loads(self.path.read_text())
            except ValueError:  # a torn write cannot happen (atomic), a hand-edited file can: start over
                self.records = []

    @staticmethod
    def failed_step(record):
        return None if record["status"] == "done" else record["reached"] + 1

    def check(self):
        """Raises TrainingFailure if the last two attempts failed at the same step (every rank calls it)."""
        if len(self.records) >= 2:
            a, b = self.records[-2:]
            if self.failed_step(a) is not None and self.failed_step(a) == self.failed_step(b):
                raise TrainingFailure(
                    f"step {self.failed_step(b)} failed in two attempts in a row (attempt {a['attempt']}: "
                    f"{a['status']}; attempt {b['attempt']}: {b['status']}); not restarting: fix the cause, "
                    f"then delete {self.path}")

    def begin(self, start):
        self.records.append({"attempt": len(self.records) + 1, "resumed_from": start, "reached": start,
                             "status": "running"})
        self._write()

    def progress(self, step):
        self.records[-1]["reached"] = step
        self._write()

    def end(self, status):
        """'done', or 'failed: why'. For a failure, the message says whether it repeats the previous attempt's."""
        record = self.records[-1]
        record["status"] = status
        self._write()
        if status != "done" and len(self.records) >= 2 and \
                self.failed_step(self.records[-2]) == self.failed_step(record):
            return f"; attempt {record['attempt'] - 1} failed at this step too: not retrying"
        return ""

    def _write(self):
        if self.rank != 0:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(self.records, indent=1))
        os.replace(tmp, self.path)
