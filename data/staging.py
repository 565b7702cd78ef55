"""Preparing a data set without losing one: build it in a hidden folder, swap it in when complete.

`staged(out, kind, owns)` checks that out is missing, empty, or holds only a `kind` set's files.
`owns(name)` is true for each of those, as for meta.json and text_train_000000.bin.
Anything else there (another set's shards, a file of yours, a folder) means out is not
the folder being written: DataError names it, and nothing changes. Then it locks out
(data.files.lock_folder, as training locks a run folder); a second preparation stops with
DataError. It yields an empty `.NAME.PID.tmp` beside out (NAME is out's name, PID this process).
On success that folder takes out's place: one rename if out is missing or empty. Otherwise
out goes to `.NAME.PID.old`, the new folder to NAME, and the old one is removed. On any failure
(an error, Ctrl-C, a SIGTERM that prepare.py raises) the new folder goes and out is as it was.
A run killed outright (SIGKILL, power loss) leaves its `.NAME.PID.tmp`. The next preparation
removes it once no process PID runs on this machine, so two machines must not prepare one out
at once. An out that is a symbolic link is built beside the folder it points to.

`carry(out, tmp, names)` hard-links (or copies) into the new folder the files a source reuses
(downloads). No file is written in place, so the previous set keeps its bytes until the swap.
"""
import os
import re
import shutil
from contextlib import contextmanager
from pathlib import Path

from data.files import fsync_dir, lock_folder, make_folders, remove_created, unlock_folder
from data.loader import DataError

HIDDEN_EXTRA = len("..4194304.tmp")  # what hidden folders add to out's name (pid: 7 digits at most)
TEMPORARY = re.compile(r"\.(.+?)(?:\.\d+)?\.tmp")  # .NAME.tmp, .NAME.PID.tmp: a file being written


def owned_by(prefix, extra=()):
    """owns(name): whether a file called name belongs to the data set of PREFIX.

    The set's files are its shards PREFIX_train_NNNNNN.bin and PREFIX_val_NNNNNN.bin, meta.json,
    the `extra` names, and the temporary files of any of them."""
    shard = re.compile(rf"{re.escape(prefix)}_(train|val)_\d{{6}}\.bin")

    def owns(name):
        temporary = TEMPORARY.fullmatch(name)
        name = temporary.group(1) if temporary else name
        return name == "meta.json" or name in extra or bool(shard.fullmatch(name))
    return owns


def check_replaceable(out, kind, owns):
    """DataError unless out is missing, empty, or holds only files of a previous `kind` data set."""
    out = Path(out)
    if not out.exists():
        return
    if not out.is_dir():
        raise DataError(f"{out} is a file, not a folder")
    foreign = sorted(p.name for p in out.iterdir() if p.is_dir() or not owns(p.name))
    if foreign:
        more = f" (and {len(foreign) - 1} more)" if len(foreign) > 1 else ""
        raise DataError(f"{out} holds {foreign[0]}{more}, which is not part of a {kind} data set: "
                        "choose another --out, or empty that one (nothing was changed)")


def is_preparation_folder(folder, out):
    """Whether folder is out, or a hidden folder a preparation of out builds beside it.

    Both paths are resolved first."""
    folder, out = Path(os.path.realpath(folder)), Path(os.path.realpath(out))
    return folder == out or (folder.parent == out.parent and
                             re.fullmatch(rf"\.{re.escape(out.name)}\.\d+\.(tmp|old)",
                                          folder.name) is not None)


def running(pid):
    """Whether a process with this id runs on this machine."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's
        return True
    return True


def remove_stale(place):
    """Removes the `.NAME.PID.tmp` folders beside place left by preparations killed outright."""
    for folder in place.parent.glob(f".{place.name}.*.tmp") if place.parent.is_dir() else ():
        pid = re.fullmatch(rf"\.{re.escape(place.name)}\.(\d+)\.tmp", folder.name)
        if pid and int(pid.group(1)) not in (0, os.getpid()) and not running(int(pid.group(1))):
            shutil.rmtree(folder, ignore_errors=True)


def swap(tmp, place):
    """Puts the complete folder tmp at place, where a previous data set may be."""
    try:
        os.rename(tmp, place)  # place missing, or an empty folder: one atomic step
    except OSError:
        if not place.is_dir():
            raise
        old = place.parent / f".{place.name}.{os.getpid()}.old"
        os.rename(place, old)
        try:
            os.rename(tmp, place)
        except BaseException:
            os.rename(old, place)
            raise
        shutil.rmtree(old, ignore_errors=True)
    fsync_dir(place.parent)


@contextmanager
def staged(out, kind, owns):
    """Yields an empty hidden folder beside out, to prepare a `kind` data set in.

    It is swapped in when the block succeeds, and removed when it fails. One preparation of out
    runs at a time: out is locked from its second check to the swap. DataError if another process
    holds it."""
    check_replaceable(out, kind, owns)
    place = Path(os.path.realpath(out))
    try:
        created = make_folders(place)  # out too: the lock is taken on the folder itself
    except OSError as e:
        raise DataError(f"cannot create {e.filename or place}: {e.strerror or e}") from None
    try:
        lock = lock_folder(place)
    except OSError as e:
        remove_created(created)
        raise DataError(f"cannot lock {place}: {e.strerror or e}") from None
    if lock is None:
        remove_created(created)
        raise DataError(f"{out} is being written by another process (a preparation of it): "
                        "wait for it to end, or choose another --out (nothing was changed)")
    tmp = place.parent / f".{place.name}.{os.getpid()}.tmp"
    try:
        check_replaceable(out, kind, owns)  # again, now that no other preparation can change it
        remove_stale(place)
        shutil.rmtree(tmp, ignore_errors=True)  # this process's own, left by an earlier call
        tmp.mkdir()
        yield tmp
        check_replaceable(out, kind, owns)  # again: something may have been put there meanwhile
        swap(tmp, place)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        remove_created(created)
        raise
    finally:
        unlock_folder(lock)


def carry(out, tmp, names):
    """Hard-links (or copies) into tmp those files `names` of the previous set in out that exist."""
    for name in names:
        source = Path(out) / name
        if source.is_file():
            try:
                os.link(source, tmp / name)
            except OSError:
                shutil.copy2(source, tmp / name)
