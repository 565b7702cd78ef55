"""Files and folders that are never half-written, read through a link, or blocked on.

The token shards, the saves and the run folder all write through these.

    atomic_write, write_json   readers see the old file or the whole new one, never a part
    read_bytes, read_text      a regular file's bytes; a FIFO or a device is refused, not waited on
    open_append                a folder's log, never appended through a link out of the folder
    check_own_file             a file a folder's owner writes: a regular file there, or missing
    lock_folder                one writer per folder: an flock on the folder, gone with its process
    make_folders, remove_created   a folder and its parents; on a failure, only those made here
    interruptible              SIGTERM and SIGHUP raise Interrupted; a half-written folder goes
"""
import errno
import fcntl
import json
import os
import signal
import stat
import tempfile
from contextlib import contextmanager
from pathlib import Path

from data import SaveError

KINDS = ((stat.S_ISDIR, "a folder"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"),
         (stat.S_ISCHR, "a device"), (stat.S_ISBLK, "a device"))


class NotAFile(OSError):
    """A path that is there but is not a regular file (strerror says what it is)."""


def kind_of(mode):
    return next((kind for test, kind in KINDS if test(mode)), "not a regular file")


def _open_regular(path, flags):
    """An fd of the regular file at path, created if flags say so.

    What is there is checked before the open and after it. With O_NONBLOCK,
    a FIFO put there meanwhile is refused too, never waited on."""
    try:
        _check_regular(os.stat(path).st_mode, path)
    except FileNotFoundError:
        pass
    fd = os.open(path, flags | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        _check_regular(os.fstat(fd).st_mode, path)
    except NotAFile:
        os.close(fd)
        raise
    os.set_blocking(fd, True)
    return fd


def _check_regular(mode, path):
    if not stat.S_ISREG(mode):
        raise NotAFile(errno.EINVAL, f"{kind_of(mode)}, not a regular file", str(path))


def read_bytes(path):
    """The bytes of the regular file at path; else OSError (NotAFile for a FIFO, folder, device)."""
    with os.fdopen(_open_regular(path, os.O_RDONLY), "rb") as f:
        return f.read()


def read_text(path):
    return read_bytes(path).decode("utf-8")


def open_regular(path):
    """The regular file at path, open for binary reads (a FIFO there is refused, not waited on)."""
    return os.fdopen(_open_regular(path, os.O_RDONLY), "rb")


def check_own_file(path, folder):
    """What is wrong with a file the owner of `folder` writes, for one line; None if nothing.

    None means path is missing, or a regular file whose real path lies in folder. Otherwise it says
    what is there: "a link to /x, outside FOLDER", or "a FIFO, not a regular file"."""
    path = Path(path)
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    if stat.S_ISLNK(st.st_mode):
        target, home = Path(os.path.realpath(path)), Path(os.path.realpath(folder))
        if not target.is_relative_to(home):
            return f"a link to {target}, outside {folder}"
        try:
            st = os.stat(path)
        except FileNotFoundError:
            return None  # a dangling link inside the folder: writing replaces it
    if not stat.S_ISREG(st.st_mode):
        return f"{kind_of(st.st_mode)}, not a regular file"
    return None


def open_append(path, folder=None):
    """path opened to append text, created if missing; it must be a regular file.

    Within `folder` (a run folder) it is never opened through a link that leads out of it.
    Otherwise OSError (NotAFile, strerror saying why); the caller names the flag."""
    path = Path(path)
    if folder is not None and Path(os.path.abspath(path)).is_relative_to(os.path.abspath(folder)):
        problem = check_own_file(path, folder)
        if problem:
            raise NotAFile(errno.EINVAL, problem, str(path))
    fd = _open_regular(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    return os.fdopen(fd, "a", encoding="utf-8")


def _exclusive(path, flags):
    """Opens a new file at path (never an existing one, never through a link)."""
    return os.open(path, flags | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o666)


@contextmanager
def atomic_write(path, mode="wb"):
    """Yields a file for a temporary sibling of `path`, renamed over `path` once the block succeeds.

    The rename comes after the bytes are on disk. On any error the temporary file is removed
    and `path` is untouched. The rename replaces a link at path, never writes through it."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")  # per process: writers never collide
    tmp.unlink(missing_ok=True)  # this process's own leftover (a pid reused after a kill)
    try:
        with open(tmp, mode, opener=_exclusive) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def write_json(path, obj, indent=None):
    with atomic_write(path, "w") as f:
        json.dump(obj, f, indent=indent)


def fsync_dir(path):
    """Makes a rename inside the folder durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def lock_folder(path):
    """An fd of the folder at path holding an exclusive flock; None if another process holds it.

    The folder and its parents are created if missing. The lock is on the folder itself,
    not on a file in it that could be deleted. The kernel drops it when the process dies,
    so nothing stale is left. A folder renamed away between the open and the lock is let go
    (a writer swapped in a new one); the one now at path is locked instead."""
    path = Path(path)
    for _ in range(100):
        path.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return None
        here, now = os.fstat(fd), os.stat(path)
        if (here.st_dev, here.st_ino) == (now.st_dev, now.st_ino):
            return fd
        os.close(fd)
    raise OSError(errno.EAGAIN, "the folder keeps being replaced", str(path))


def make_folders(folder):
    """Creates folder and its missing parents; returns those made here, the outermost first.

    If one cannot be made, those it made are removed and the OSError is raised."""
    folder, created = Path(folder), []
    for p in [p for p in (folder, *folder.parents) if not p.exists()][::-1]:
        try:
            p.mkdir()
            created.append(p)
        except FileExistsError:  # another process made it meanwhile: not this one's to remove
            pass
        except OSError:
            remove_created(created)
            raise
    return created


def remove_created(created):
    """Removes the folders make_folders created, innermost first, while they are empty."""
    for folder in reversed(created):
        try:
            folder.rmdir()
        except OSError:
            break


def unlock_folder(fd):
    if fd is not None:
        os.close(fd)


class Interrupted(Exception):
    """SIGTERM or SIGHUP (args[0]), raised in the main thread as SIGINT raises KeyboardInterrupt.

    A command writing a folder then removes its unfinished work on the way out."""


@contextmanager
def interruptible():
    """Within the block SIGTERM and SIGHUP raise Interrupted; then the old handlers are back."""
    def interrupt(signum, frame):
        raise Interrupted(signal.Signals(signum))
    previous = {sig: signal.signal(sig, interrupt) for sig in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def check_writable(path, flag, folder):
    """path (a folder, or a file, to be) can be created: it is not the other kind, nothing on its
    way is a file, and the nearest existing folder takes a new file (probed, then removed)."""
    path = Path(path)
    try:
        if path.exists() and path.is_dir() != folder:
            raise SaveError(f"{flag}: {path} is a {'file' if folder else 'folder'}")
        parent = path if folder else path.parent
        while not parent.exists():
            parent = parent.parent
    except OSError as e:  # a name too long for the file system
        raise SaveError(f"{flag}: {path}: {e.strerror or e}") from None
    if not parent.is_dir():
        raise SaveError(f"{flag}: {parent} is a file, so {path} cannot be created")
    try:
        with tempfile.NamedTemporaryFile(dir=parent, prefix=".write_probe_"):
            pass
    except OSError as e:
        raise SaveError(f"{flag}: cannot write in {parent}: {e.strerror or e}") from None
