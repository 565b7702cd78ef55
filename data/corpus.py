"""Which files `prepare.py text PATH...` reads, and what it skips.

A PATH that is a file is read. It must be a regular file or a link to one:
a FIFO or a device would block or never end. A PATH that is a folder is walked in sorted order.
Its regular files are kept when their name, or path relative to PATH, matches a glob
(default *.txt and *.jsonl). Each file is read once, however often it is reached:
named twice, inside a folder also named, or through a symbolic link.
Files are told apart by their resolved path; the first place to reach one names it.
The output folder and the hidden folders a preparation builds beside it (staging.py)
are never read, even inside a PATH. Everything skipped is counted by kind for one line at the end:
its extension, "without an extension", "FIFO", "in the output folder", "already read".
"""
import os
import stat
from collections import Counter
from fnmatch import fnmatchcase
from pathlib import Path

from data.loader import DataError
from data.staging import is_preparation_folder

DEFAULT_GLOBS = ("*.txt", "*.jsonl")
OTHER_KINDS = ((stat.S_ISFIFO, "FIFO"), (stat.S_ISSOCK, "socket"),
               (stat.S_ISCHR, "device"), (stat.S_ISBLK, "device"))


def irregular(path):
    """None for a regular file or a link to one, else its kind ("FIFO", "socket", "device", ...).

    DataError names a path that cannot be read: a dangling link, or no permission.
    It never opens the file."""
    try:
        mode = os.stat(path).st_mode
    except OSError as e:
        raise DataError(f"{path}: cannot read: {e.strerror or e}") from None
    if stat.S_ISREG(mode):
        return None
    return next((kind for test, kind in OTHER_KINDS if test(mode)), "special file")


def count_files(folder):
    return sum(len(names) for _, _, names in os.walk(folder))


def find_files(paths, globs=DEFAULT_GLOBS, out=None):
    """([(path, name, is_jsonl, size)] in a fixed order, Counter of the files skipped by kind).

    name is the path relative to its PATH argument; it seeds the split. `out` is the output folder,
    never read. DataError for a missing path, a named file that is not regular or cannot be read,
    or no file at all."""
    found, skipped, seen = [], Counter(), set()

    def keep(path, name):
        real = os.path.realpath(path)
        if real in seen:
            skipped["already read"] += 1
        else:
            seen.add(real)
            found.append((path, name))

    for arg in paths:
        if str(arg) == "":
            raise DataError("an empty PATH: name a file or a folder")
        root = Path(arg)
        if root.is_dir() and out is not None and is_preparation_folder(root, out):
            skipped["in the output folder"] += count_files(root)
        elif root.is_dir():
            for folder, subfolders, names in os.walk(root):
                for sub in [s for s in subfolders
                            if out is not None and is_preparation_folder(Path(folder, s), out)]:
                    skipped["in the output folder"] += count_files(Path(folder, sub))
                    subfolders.remove(sub)
                subfolders.sort()
                for name in sorted(names):
                    path = Path(folder) / name
                    rel = path.relative_to(root).as_posix()
                    if not any(fnmatchcase(name, g) or fnmatchcase(rel, g) for g in globs):
                        skipped[path.suffix or "without an extension"] += 1
                    elif kind := irregular(path):
                        skipped[kind] += 1
                    else:
                        keep(path, rel)
        elif root.exists() or root.is_symlink():
            if kind := irregular(root):
                raise DataError(f"{arg}: not a regular file (a {kind}); name a file or a folder")
            keep(root, root.name)
        else:
            raise DataError(f"{arg}: no such file or folder")
    if not found:
        note = f" ({describe_skipped(skipped)})" if skipped else ""
        raise DataError(f"empty corpus: no file in {', '.join(map(str, paths))} "
                        f"matches {', '.join(globs)}{note}")
    files = []
    for path, name in found:
        try:
            with open(path, "rb") as f:
                size = os.fstat(f.fileno()).st_size
        except OSError as e:
            raise DataError(f"{path}: cannot read: {e.strerror or e}") from None
        files.append((str(path), name, path.suffix == ".jsonl", size))
    return files, skipped


def describe_skipped(skipped, kinds_named=6):
    """"skipped 5 files: 3 without an extension, 1 .csv, 1 .md".

    The most common kinds come first; the rest are summed."""
    kinds = sorted(skipped.items(), key=lambda item: (-item[1], item[0]))
    parts = [f"{n:,} {kind}" for kind, n in kinds[:kinds_named]]
    if len(kinds) > kinds_named:
        parts.append(f"{sum(n for _, n in kinds[kinds_named:]):,} "
                     f"of {len(kinds) - kinds_named} other kinds")
    total = sum(skipped.values())
    unmatched = any(kind.startswith(".") or kind == "without an extension" for kind in skipped)
    return (f"skipped {total:,} file{'s' * (total != 1)}: {', '.join(parts)}" +
            ("; --glob chooses the names read" if unmatched else ""))
