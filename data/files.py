"""Files and folders that are never half-written, read through a link, or blocked on.

The token shards, the saves, the run folder and the exports all write through these.

    atomic_write, write_json   readers see the old file or the whole new one, never a part
    read_bytes, read_json      a regular file's bytes; a FIFO or a device is refused, not waited on
    open_append                a folder's log, never appended through a link out of the folder
    check_own_file             a file a folder's owner writes: a regular file there, or missing
    lock_folder                one writer per folder: an flock on the folder, gone with its process
    make_folders, remove_created   a folder and its parents; on a failure, only those made here
    staged                     a folder built beside its place, swapped in whole when complete

How a command ends (one line, an exit status, Ctrl-C): ending.py.
"""
import errno
import fcntl
import json
import os
import re
import shutil
import stat
import tempfile
from contextlib import contextmanager
from pathlib import Path

from data import DataError, SaveError

KINDS = ((stat.S_ISDIR, "a folder"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"),
         (stat.S_ISCHR, "a device"), (stat.S_ISBLK, "a device"))


class NotAFile(OSError):
    """A path that is there but is not a regular file (strerror says what it is)."""


def kind_of(mode):
    return next((kind for test, kind in KINDS if test(mode)), "not a regular file")


def _open_regular(path, flags):
    """An fd of the regular file at path, checked before the open and after it (O_NONBLOCK:
    a FIFO put there meanwhile is refused too, never waited on)."""
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


def read_json(path, error, prefix=""):
    """The JSON in the regular file at path; else error("{prefix}cannot read {path}: why")."""
    try:
        return json.loads(read_text(path))
    except OSError as e:  # missing, a FIFO, unreadable
        raise error(f"{prefix}cannot read {path}: {e.strerror or e}") from None
    except ValueError as e:
        raise error(f"{prefix}cannot read {path}: {type(e).__name__}: {e}") from None


def check_own_file(path, folder):
    """None if path is missing or a regular file; else what is there, for one line: "a link to /x"
    (", outside FOLDER"), "a FIFO, not a regular file"."""
    path = Path(path)
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    if stat.S_ISLNK(st.st_mode):  # never written through another name, inside or out
        target, home = Path(os.path.realpath(path)), Path(os.path.realpath(folder))
        return f"a link to {target}" + (f", outside {folder}" * (not target.is_relative_to(home)))
    if not stat.S_ISREG(st.st_mode):
        return f"{kind_of(st.st_mode)}, not a regular file"
    return None


def open_append(path, folder=None):
    """path opened to append text, created if missing: a regular file, never through a link. Else
    OSError (NotAFile, strerror saying why)."""
    path = Path(path)
    problem = check_own_file(path, folder if folder is not None else path.parent)
    if problem:
        raise NotAFile(errno.EINVAL, problem, str(path))
    fd = _open_regular(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    return os.fdopen(fd, "a", encoding="utf-8")


def _exclusive(path, flags):
    """Opens a new file at path (never an existing one, never through a link)."""
    return os.open(path, flags | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o666)


@contextmanager
def atomic_write(path, mode="wb"):
    """Yields a file for a temporary sibling of `path`, renamed over it once its bytes are on disk.

    On any error `path` is untouched. A link at path is replaced, never written through."""
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
    """An fd of the folder at path (made if missing) holding an exclusive flock; None if another
    process holds it. The kernel drops it when the process dies; nothing in the folder is
    involved. A folder swapped away between the open and the lock is let go for the new one."""
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

    On an OSError those it made are removed first."""
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


def cannot_create(path, e):
    """Why make_folders(path) failed: the folder that refused a new entry, when it is one that
    exists (/proc, a read-only mount), else the name and the error."""
    made = Path(e.filename or path)
    if e.errno in (errno.ENOENT, errno.EACCES, errno.EPERM, errno.EROFS) and made.parent.is_dir():
        return f"cannot create {path}: nothing can be created in {made.parent} ({e.strerror})"
    return f"cannot create {made}: {e.strerror or e}"


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
        raise SaveError(f"{flag}: cannot create {path}: nothing can be created in {parent} "
                        f"({e.strerror or e})") from None


# ---------------------------------------------------------------- a folder built beside its place

HIDDEN_EXTRA = len("..4194304.tmp")  # what hidden folders add to out's name (pid: 7 digits at most)
TEMPORARY = re.compile(r"\.(.+?)(?:\.\d+)?\.tmp")  # .NAME.tmp, .NAME.PID.tmp: a file being written


def owned_by(prefix, extra=()):
    """owns(name): whether a file belongs to the data set of PREFIX: its shards
    PREFIX_{train,val}_NNNNNN.bin, meta.json, the `extra` names, or their temporary files."""
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
    """Whether folder is out, or a hidden folder staged() builds beside it (paths resolved)."""
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
    """Removes the `.NAME.PID.tmp` folders beside place of processes killed outright."""
    for folder in place.parent.glob(f".{place.name}.*.tmp") if place.parent.is_dir() else ():
        pid = re.fullmatch(rf"\.{re.escape(place.name)}\.(\d+)\.tmp", folder.name)
        if pid and int(pid.group(1)) not in (0, os.getpid()) and not running(int(pid.group(1))):
            shutil.rmtree(folder, ignore_errors=True)


def swap(tmp, place):
    """Puts the complete folder tmp at place; a folder there goes aside, then is removed."""
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
def staged(out, check, who="a preparation of it", instead="choose another --out"):
    """Yields an empty folder `.NAME.PID.tmp` beside out, which takes out's place when the block
    succeeds and is removed when it fails: out is then as it was.

    check() refuses an out not to be replaced: before out is locked, under the lock, and before
    the swap. A second writer meanwhile gets DataError naming `who` holds out, and what to do
    `instead`. A folder left by a process killed outright goes once no process of its PID runs
    on this machine (so two machines must not write one out at once). A link to a folder is
    built beside the folder it leads to."""
    check()
    place = Path(os.path.realpath(out))
    try:
        created = make_folders(place)  # out too: the lock is taken on the folder itself
    except OSError as e:
        raise DataError(cannot_create(place, e)) from None
    try:
        lock = lock_folder(place)
    except OSError as e:
        remove_created(created)
        raise DataError(f"cannot lock {place}: {e.strerror or e}") from None
    if lock is None:
        remove_created(created)
        raise DataError(f"{out} is being written by another process ({who}): "
                        f"wait for it to end, or {instead} (nothing was changed)")
    tmp = place.parent / f".{place.name}.{os.getpid()}.tmp"
    try:
        check()  # again, now that no other writer can change it
        remove_stale(place)
        shutil.rmtree(tmp, ignore_errors=True)  # this process's own, left by an earlier call
        tmp.mkdir()
        yield tmp
        fsync_dir(tmp)
        check()  # again: something may have been put there meanwhile
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
