"""torchrun, ending as one process does.

    python -m parallel.launch --nproc_per_node 8 train.py --model small --dp-mode fsdp

torchrun's flags, rendezvous, restarts and workers (torch.distributed.run), nothing changed. Only
the end differs. After Ctrl-C or SIGTERM every worker stops after the same step and says where
(train.py); torchrun would then add its traceback of the signal and exit 1, and this ends with
the worker's status instead: 130 or 143. A worker that failed has printed its own line; the
status is that worker's (2 bad input, 3 a failed run), not torchrun's report and its 1.
"""
import sys

from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.run import parse_args, run


def main(argv=None):
    """Runs torchrun's launch with argv; returns the exit status one process would have."""
    try:
        run(parse_args(sys.argv[1:] if argv is None else argv))
    except SignalException as e:
        return 128 + e.sigval
    except ChildFailedError as e:  # once one worker fails, torchrun signals the others
        codes = [failure.exitcode for failure in e.failures.values()]
        own = [code for code in codes if code > 0]  # a worker's own status, not a signal's
        return own[0] if own else 128 - codes[0]  # < 0: a signal ended the worker
    return 0


if __name__ == "__main__":
    sys.exit(main())
