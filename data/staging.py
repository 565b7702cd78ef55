"""Preparing a data set without losing one: the new set is built in a hidden folder beside its destination and
swapped in only when complete.

`staged(out, kind, owns)` first checks `out`: it must be missing, empty, or hold only the files of a data set of the
same kind (`owns(name)` is true for each, as for meta.json and text_train_000000.bin). Anything else there (another
data set's shards, a file of yours, a folder) means it is not the folder being written: DataError names it before
anything is created or changed. One preparation of out at a time: it locks out (data.files.lock_folder, the lock
training takes on a run folder), and a second one started meanwhile stops with DataError, changing nothing. It then
yields an empty folder `.NAME.PID.tmp` beside out (NAME out's name, PID
this process's id). When the block succeeds, that folder takes out's place: one rename when out is missing or
empty; otherwise out is renamed to `.NAME.PID.old`, the new folder to NAME, and the old one is removed. When the
block fails in any way (an error, Ctrl-C, a SIGTERM that prepare.py turns into an exception), the new folder is
removed and out is as it was. A run killed outright (SIGKILL, power loss) leaves its `.NAME.PID.tmp`: the next
preparation of the same out removes it once no process PID runs on this machine (so two machines must not prepare
one out at the same time). An out that is a symbolic link is built beside the folder it points to.

`carry(out, tmp, names)` gives the new folder the files of the previous set that a source reuses (downloads) as
hard links (copies where the file system has none): nothing is written into a file in place (every file is written
under a temporary name and renamed), so the previous set keeps its bytes until the swap.
"""
import os
import re
import shutil
from contextlib import contextmanager
from pathlib import Path

from data.files import fsync_dir, lock_folder, make_folders, remove_created, unlock_folder
from data.loader import DataError

HIDDEN_EXTRA = len("..4194304.tmp")  # what the hidden folders' names add to out's (a pid has at most 7 digits)
TEMPORARY = re.compile(r"\.(.+?)(?:\.\d+)?\.tmp")  # .NAME.tmp, .NAME.PID.tmp: a file being written


def owned_by(prefix, extra=()):
    """owns(name): whether a file called name belongs to a data set whose shards are PREFIX_train_NNNNNN.bin and
    PREFIX_val_NNNNNN.bin: those, meta.json, the `extra` names, and the temporary files of any of them."""
    shard = re.compile(rf"{re.escape(prefix)}_(train|val)_\d{{6}}\.bin")

    def owns(name):
        temporary = TEMPORARY.fullmatch(name)
        name = temporary.group(1) if temporary else name
        return name == "meta.json" or name in extra or bool(shard.fullmatch(name))
    return owns


def check_replaceable(out, kind, owns):
    """DataError unless out is missing, empty, or holds only files that owns() (a previous `kind` data set)."""
    out = Path(out)
    if not out.exists():
        return
    if not out.is_dir():
        raise DataError(f"{out} is a file, not a folder")
    foreign = sorted(p.name for p in out.iterdir() if p.is_dir() or not owns(p.name))
    if foreign:
        more = f" (and {len(foreign) - 1} more)" if len(foreign) > 1 else ""
        raise DataError(f"{out} holds {foreign[0]}{more}, which is not part of a {kind} data set: choose another "
                        "--out, or empty that one (nothing was changed)")


def is_preparation_folder(folder, out):
    """Whether folder is out or one of the hidden folders a preparation of out builds beside it (both resolved)."""
    folder, out = Path(os.path.realpath(folder)), Path(os.path.realpath(out))
    return folder == out or (folder.parent == out.parent and
                             re.fullmatch(rf"\.{re.escape(out.name)}\.\d+\.(tmp|old)", folder.name) is not None)


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
    """Yields an empty hidden folder beside out to prepare a `kind` data set in, swapped in when the block
    succeeds and removed when it fails. One preparation of out at a time: out is locked (DataError if another
    process holds it) from its second check to the swap."""
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
        raise DataError(f"{out} is being written by another process (a preparation of it): wait for it to end, "
                        "or choose another --out (nothing was changed)")
    tmp = place.parent / f".{place.name}.{os.getpid()}.tmp"
    try:
        check_replaceable(out, kind, owns)  # again, now that no other preparation can change it
        remove_stale(place)
        shutil.rmtree(tmp, ignore_errors=True)  # this process's own, from an earlier call that could not remove it
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
    """Hard-links (or copies) the files `names` of the previous set in out, those that exist, into tmp."""
    for name in names:
        source = Path(out) / name
        if source.is_file():
            try:
                os.link(source, tmp / name)
            except OSError:
                shutil.copy2(source, tmp / name)
