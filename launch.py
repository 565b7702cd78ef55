"""How a training process starts and ends: the process group, timeouts, Ctrl-C and exit codes.

Exit status: 0 done, 2 bad input (before anything is written), 3 a run that failed after it
started (the newest good save is named and intact), 130 Ctrl-C. Each failure is one line.
"""
import json
import os
import signal
import sys
import threading
import time
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from config import UsageError
from data.loader import DataError
from parallel.mesh import LayoutError, Mesh
from saves import SaveError, TrainingFailure
from saves.restarts import restart_store

STARTUP_STEPS = 2  # steps under --startup-timeout (they compile, stage after stage), then --timeout


class Interrupted(Exception):
    """Ctrl-C: one line saying where the run stopped and which save is the newest (exit 130)."""


def start_distributed(run):
    """The process group and the mesh. NCCL on CUDA, with its communicators made now, not at each
    group's first collective; gloo on CPU. A caller's group (tests) is used as it is."""
    if run.backend == "nccl":
        torch.cuda.set_device(run.device)
    matmul_precision(run)
    if run.world > 1 and not dist.is_initialized():
        device = {"device_id": torch.device(run.device)} if run.backend == "nccl" else {}
        timeout = timedelta(seconds=run.startup_timeout)
        store = restart_store(run.rank, run.world)
        dist.init_process_group(run.backend, timeout=timeout, **device, **store)
    return Mesh(run.rank, run.world, dp=run.dp, pp=run.pp, cp=run.cp, tp=run.tp,
                dp_shard=run.dp_shard, timeout_s=run.startup_timeout)


def matmul_precision(run):
    """fp32 means fp32: matmuls that stay fp32 use TF32 only where the run asks (run.tf32)."""
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = run.tf32


@contextmanager
def startup_timeout(mesh, run, first):
    """Runs a block under --startup-timeout if `first` (the first evaluation compiles again)."""
    if first:
        mesh.set_timeout(run.startup_timeout)
    try:
        yield
    finally:
        if first:
            mesh.set_timeout(run.timeout)


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
    """job()'s result; or, if it fails as a run can, one line on stderr and the exit status."""
    joined = dist.is_initialized()  # a caller's process group (tests) outlives this run
    try:
        return job()
    except KeyboardInterrupt:
        code, error = 130, "interrupted before training started; nothing was written"
    except (UsageError, LayoutError, DataError, SaveError) as e:
        code, error = 2, e
    except TrainingFailure as e:
        code, error = 3, e
    except Interrupted as e:
        code, error = 130, e
    finally:
        if not joined and dist.is_initialized():
            dist.destroy_process_group()  # a clean exit: no collective thread left at the end
    report_to_launcher(error)
    if int(os.environ.get("LOCAL_RANK", os.environ.get("RANK", 0))) == 0:  # one line per node
        print(f"error: {error}", file=sys.stderr)
    elif int(os.environ.get("WORLD_SIZE", 1)) > 1:
        time.sleep(1)  # torchrun stops every worker once one exits: let rank 0's line out first
    sys.exit(code)
