"""Writing a file so that readers see the old file or the whole new one, never a part of it."""
import json
import os
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def atomic_write(path, mode="wb"):
    """Yields a file object for a temporary sibling of `path`, renamed over `path` only after the block succeeds
    and the bytes are on disk; on any error the temporary file is removed and `path` is untouched."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")  # unique per process: concurrent writers are safe
    try:
        with open(tmp, mode) as f:
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
