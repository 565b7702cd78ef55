"""A process's children and whether they are gone, read from Linux's /proc."""
import time
from pathlib import Path


def children(pid):
    """The pids of pid's child processes."""
    found = []
    try:
        for task in Path(f"/proc/{pid}/task").iterdir():
            found += [int(p) for p in (task / "children").read_text().split()]
    except OSError:  # gone
        pass
    return found


def descendants(pid):
    """The pids of pid's children, their children, and so on."""
    found = children(pid)
    return found + [d for child in found for d in descendants(child)]


def alive(pid):
    """Running or sleeping: not gone, and not a zombie waiting to be reaped."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


def all_gone(pids, within_s):
    """Whether every pid is gone within within_s seconds."""
    deadline = time.monotonic() + within_s
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    return not any(alive(p) for p in pids)


def children_started(pid, count, within_s, deep=False):
    """pid's children (or all descendants, if deep) once there are count of them (fewer if within_s
    passes first)."""
    deadline = time.monotonic() + within_s
    while len(found := (descendants if deep else children)(pid)) < count and time.monotonic() < deadline:
        time.sleep(0.1)
    return found
