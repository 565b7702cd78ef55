"""How a training process starts and ends: the process group, timeouts, Ctrl-C and exit codes.

Exit status: 0 done, 2 bad input (before anything is written), 3 a run that failed after it
started (the newest good save is named and intact), 130 Ctrl-C. Each failure is one line.
"""
import gc
import json
import os
import re
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


class Hung(TrainingFailure):
    """A collective timed out: one line naming it (exit 3). The process leaves at once: tearing
    the process group down would wait on the peer that does not answer."""


def start_distributed(run):
    """The process group and the mesh. NCCL on CUDA, with its communicators made now, not at each
    group's first collective; gloo on CPU. A caller's group (tests) is used as it is."""
    if run.backend == "nccl":
        torch.cuda.set_device(run.device)
    matmul_precision(run)
    if run.world > 1 and not dist.is_initialized():
        device = {"device_id": torch.device(run.device)} if run.backend == "nccl" else {}
        if run.backend == "nccl":
            for name, value in flight_recorder(run.out).items():
                os.environ.setdefault(name, value)  # what the user set stays
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


def flight_recorder(out):
    """NCCL's flight recorder: the last collectives of each rank, dumped into the run folder when
    one times out (torch reads these variables when the process group starts)."""
    return {"TORCH_NCCL_TRACE_BUFFER_SIZE": "20000", "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
            "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": str(Path(out) / "nccl_trace_rank_")}


TIMED_OUT = re.compile(r"timed out|timeout", re.I)
PEER_LEFT = re.compile(r"connection (closed|reset) by peer", re.I)  # a peer that timed out first


def timed_out(error):
    """Whether an error is a collective that waited past its timeout, or lost a peer that did
    (gloo's or NCCL's words)."""
    return isinstance(error, RuntimeError) and bool(TIMED_OUT.search(str(error)) or
                                                    PEER_LEFT.search(str(error)))


def name_the_hang(mesh, step, error, grace_s=6.0):
    """One line for a collective that timed out: the step, the collective, its group, and the
    ranks of the group that had not arrived, as far as this rank can tell.

    Each rank that times out posts its collective to the process group's store. A member that
    posts nothing within grace_s, or posts another collective, had not arrived at this one. Rank 0
    may host the store (torchrun's agent hosts it otherwise), so it leaves last: it waits (grace_s
    at most) until every member that posted has read.
    """
    stats = mesh.stats
    waiting = stats.in_flight()
    if not waiting:
        return f"step {step + 1}: a collective timed out outside the counted ones"
    index = waiting[0]
    kind, name, _ = stats.log[index]
    group = getattr(mesh, f"{name}_group", None)
    nth = sum(g == name for _, g, _ in stats.log[:index]) + 1  # the same on every member
    mine = f"{nth} {kind} {name}"
    where = f"step {step + 1}: {kind} #{nth} of the step on group {name}"
    how = "timed out" if TIMED_OUT.search(str(error)) else "lost a peer that timed out"
    try:
        store = dist.distributed_c10d._get_default_store()
        store.set(f"hang/{step}/{mesh.global_rank}", mine)
        keys = {r: f"hang/{step}/{r}" for r in (group.ranks if group else [])}
        wait_for(store, keys.values(), grace_s)
        posted = {r: store.get(k).decode() for r, k in keys.items() if store.check([k])}
        absent = [r for r in keys if posted.get(r) != mine]
        store.set(f"hang/{step}/{mesh.global_rank}/read", "1")
        if mesh.global_rank == 0:
            wait_for(store, [f"hang/{step}/{r}/read" for r in keys if r not in absent], grace_s)
    except (RuntimeError, ValueError):  # the store itself does not answer
        return f"{where} {how}; the store does not answer, so which ranks are late is unknown"
    ranks = f"ranks {group.ranks[0]}..{group.ranks[-1]}" if group and len(group.ranks) > 2 else \
        f"ranks {group.ranks}" if group else "its ranks"
    late = ", ".join(map(str, absent)) or "none (all arrived: look at the network)"
    return f"{where} ({ranks}) {how}; had not arrived: rank {late}"


def wait_for(store, keys, seconds):
    """Until every key is in the store, or the seconds are up."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and not all(store.check([k]) for k in keys):
        time.sleep(0.05)


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
    hung = False
    try:
        return job()
    except KeyboardInterrupt:
        code, error = 130, "interrupted before training started; nothing was written"
    except (UsageError, LayoutError, DataError, SaveError) as e:
        code, error = 2, e
    except Hung as e:
        code, error, hung = 3, e, True
    except TrainingFailure as e:
        code, error = 3, e
    except Interrupted as e:
        code, error = 130, e
    finally:
        if not joined and dist.is_initialized() and not hung:
            dist.destroy_process_group()
            # The groups sit in reference cycles (hooks, modules, the mesh). Freed now, each joins
            # its worker threads; left to the interpreter's exit, a worker that drops a tensor
            # there needs the GIL and aborts the process ("terminate called without an active
            # exception") after a run that succeeded.
            gc.collect()
    report_to_launcher(error)
    if int(os.environ.get("LOCAL_RANK", os.environ.get("RANK", 0))) == 0:  # one line per node
        print(f"error: {error}", file=sys.stderr)
    elif int(os.environ.get("WORLD_SIZE", 1)) > 1:
        time.sleep(1)  # torchrun stops every worker once one exits: let rank 0's line out first
    if hung and not joined:
        sys.stdout.flush(), sys.stderr.flush()
        os._exit(code)
    sys.exit(code)
