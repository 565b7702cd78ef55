"""How a command ends: one line and an exit status, and Ctrl-C or SIGTERM that leave nothing
half-done; for training, a stop every rank agrees on.

    run_command(work, out)                     # prepare, export: (result, 0) or (None, 2, 3, 130)
    exit_status(main)                          # an output that cannot be written (| head): 3
    start_worker, sigint_held                  # a pool's worker dies with its parent, leaves Ctrl-C
    with CtrlC() as ctrl_c:                    # train.py's loop
        train_step(..., ctrl_c.pressed)        # its signal: a vote on the norm's all-reduce
        stop = ctrl_c.agreed(votes, world)     # the same verdict on every rank
    run_or_exit(job)                           # 0, or one line and 2, 3, 130 or 143

A run's line is printed by the lowest rank of each node; under torchrun it also goes to the
worker's error file, which torchrun's report ends with.
"""
import ctypes
import errno
import gc
import json
import os
import signal
import sys
import threading
import time
from contextlib import contextmanager, suppress
from pathlib import Path

import torch.distributed as dist

from data import DataError, SaveError, TrainingFailure


class StopSignal(Exception):
    """SIGTERM or SIGHUP (args[0]), raised in the main thread as SIGINT raises KeyboardInterrupt."""


@contextmanager
def interruptible():
    """Within the block SIGTERM and SIGHUP raise StopSignal; then the old handlers are back."""
    def interrupt(signum, frame):
        raise StopSignal(signal.Signals(signum))
    previous = {sig: signal.signal(sig, interrupt) for sig in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


@contextmanager
def sigint_held():
    """Ctrl-C waits while workers start here: they inherit the mask (start_worker lifts it)."""
    held = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, held)


def start_worker(parent):
    """In a pool's worker: Ctrl-C is the parent's to handle (no traceback here); SIGTERM and
    SIGHUP end it as by default; it is killed when `parent`'s process ends, however it ends."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGHUP, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() != parent:  # it ended before the line above: no signal will come
        os._exit(1)


def os_error_line(e):
    """An OSError in a few words: what failed, on which file. A pipe whose reader is gone (stdout
    into `head`) is said so."""
    if isinstance(e, BrokenPipeError):
        return "the output's reader is gone (a closed pipe)"
    return f"{e.filename}: {e.strerror}" if e.filename else f"a write failed: {e.strerror or e}"


def print_error(line):
    """line on stderr, as `error: line`; nothing if stderr itself cannot be written."""
    with suppress(OSError):
        print(f"error: {line}", file=sys.stderr, flush=True)


def exit_status(main):
    """main()'s exit status. An OSError it leaves (stdout into `head`, or onto a full device) is
    one line and 3, not a traceback."""
    try:
        return main()
    except OSError as e:
        print_error(os_error_line(e))
        return 3


def run_command(work, out, quiet=False):
    """(work()'s result, 0), or (None, an exit status) after one line on stderr: 2 for bad input
    (DataError, SaveError, ValueError, a name too long), 3 for TrainingFailure or a failed write,
    128 + the signal's number for Ctrl-C, SIGTERM or SIGHUP. With quiet, a DataError is
    returned in the result's place, not printed: a fallback follows."""
    try:
        with interruptible():
            return work(), 0
    except (DataError, SaveError, ValueError) as e:
        code, message = 2, e
        if quiet and isinstance(e, DataError):
            return e, code
    except TrainingFailure as e:
        code, message = 3, e
    except BrokenPipeError as e:  # stdout into `head`: out is as it was, or complete
        code, message = 3, os_error_line(e)
    except OSError as e:  # a full disk, a file too large, a name too long: out is as it was
        code = 2 if e.errno == errno.ENAMETOOLONG else 3
        message = f"cannot write {out}: {e.strerror or e}; nothing was changed there"
    except (KeyboardInterrupt, StopSignal) as e:
        sig = e.args[0] if isinstance(e, StopSignal) else signal.SIGINT
        code, message = 128 + sig, f"interrupted by {sig.name}: nothing was written to {out}"
    print_error(message)
    return None, code


class Interrupted(Exception):
    """Ctrl-C or SIGTERM: one line saying where the run stopped, the newest save and how to go on
    (exit 128 + the signal: 130, 143)."""

    def __init__(self, line, sig=signal.SIGINT):
        super().__init__(line)
        self.exit_status = 128 + sig


class Hung(TrainingFailure):
    """A collective timed out: one line naming it (exit 3). The process leaves at once: tearing
    the process group down would wait on the peer that does not answer. `silent`: the ranks that
    gave no word (None: unknown)."""

    def __init__(self, line, silent=frozenset()):
        super().__init__(line)
        self.silent = silent


def speaks_for_its_node(error):
    """Whether this rank prints the error line: its node's lowest local rank, passing over the
    ranks a hang found silent (every rank speaks when that is unknown)."""
    local = int(os.environ.get("LOCAL_RANK", os.environ.get("RANK", 0)))
    silent = getattr(error, "silent", frozenset())
    if silent is None:
        return True
    first = int(os.environ.get("RANK", 0)) - local  # the node's first global rank
    return local == min(set(range(local + 1)) - {r - first for r in silent})


class CtrlC:
    """While the loop runs, Ctrl-C or SIGTERM (Slurm's time limit, scancel, timeout, kill) ends the
    step in progress (or the next: every rank stops after the same one), then stops the run;
    `pressed` is the signal. A second one stops it at once.
    (Raised at once, the first could land in a finalizer, where Python drops it.) Off the main
    thread, or for a signal ignored from the start, nothing changes."""
    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self):
        self.pressed, self.previous = None, {}

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            for sig in self.SIGNALS:
                if signal.getsignal(sig) is not signal.SIG_IGN:
                    self.previous[sig] = signal.signal(sig, self._press)
        return self

    def _press(self, signum, frame):
        if self.pressed:
            raise KeyboardInterrupt
        self.pressed = signal.Signals(signum)

    @property
    def stop_signal(self):
        """The signal that stopped the run (Ctrl-C's, unless SIGTERM came first)."""
        return self.pressed or signal.SIGINT

    def agreed(self, votes, world):
        """The signal every rank stops on after this step, or None: from the step's votes, the
        ranks sent Ctrl-C and SIGTERM summed over the world (train_step), so every rank stops on
        the same step; SIGTERM wins, and then the step is saved. One process needs no vote."""
        if world == 1:
            return self.pressed
        sigint, sigterm = votes
        return signal.SIGTERM if sigterm else signal.SIGINT if sigint else None

    def __exit__(self, *exc):
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)


def report_to_launcher(error):
    """Under torchrun the error line also goes to this worker's error file. torchrun's report then
    ends with it as the root cause."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if path:
        report = {"message": f"error: {error}", "timestamp": str(int(time.time()))}
        Path(path).write_text(json.dumps(report))


def run_or_exit(job):
    """job()'s result; or, if it fails as a run can, one line on stderr and its exit status: 2 bad
    input, 3 a run that failed after it started, 130 Ctrl-C, 143 SIGTERM (each error class's
    exit_status)."""
    joined = dist.is_initialized()  # a caller's process group (tests) outlives this run
    error = None
    try:
        with interruptible():  # SIGTERM, SIGHUP: one line too, not a silent end
            return job()
    except KeyboardInterrupt:
        code, error = 130, "interrupted before training started; nothing was written"
    except StopSignal as e:
        code, error = 128 + e.args[0], (f"stopped by {e.args[0].name} before training started; "
                                        "nothing was written")
    except OSError as e:  # stdout into `head`, or onto a full device
        code, error = 3, os_error_line(e)
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
    if speaks_for_its_node(error):  # one line per node
        print_error(error)
    elif int(os.environ.get("WORLD_SIZE", 1)) > 1:
        time.sleep(1)  # torchrun stops every worker once one exits: let rank 0's line out first
    if isinstance(error, Hung) and not joined:
        sys.stdout.flush(), sys.stderr.flush()
        os._exit(code)
    sys.exit(code)
