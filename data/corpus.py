"""Which files `prepare.py text PATH...` reads, and what it skips.

A PATH that is a file is read: a regular file or a link to one, never a FIFO or a device.
A folder is walked in sorted order, keeping its regular files whose name or relative path
matches a glob (default *.txt and *.jsonl). Each file is read once however often it is reached
(told apart by resolved path), and never the output folder or a folder built beside it.
What is skipped is counted by kind for one line at the end.
"""
import os
import stat
from collections import Counter
from fnmatch import fnmatchcase
from pathlib import Path

from data import DataError
from data.files import is_preparation_folder, kind_of

DEFAULT_GLOBS = ("*.txt", "*.jsonl")


def irregular(path):
    """None for a regular file or a link to one, else its kind ("a FIFO", "a device", ...).

    DataError names a path that cannot be stat'ed: a dangling link, or no permission."""
    try:
        mode = os.stat(path).st_mode
    except OSError as e:
        raise DataError(f"{path}: cannot read: {e.strerror or e}") from None
    return None if stat.S_ISREG(mode) else kind_of(mode)


def count_files(folder):
    return sum(len(names) for _, _, names in os.walk(folder))


def find_files(paths, globs=DEFAULT_GLOBS, out=None):
    """([(path, name, is_jsonl, size)] in a fixed order, Counter of the files skipped by kind).

    name, the path relative to its PATH, seeds the split. `out`, the output folder, is never read.
    DataError for a missing or irregular PATH, an unreadable file, or no file at all."""
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
                        skipped[kind.removeprefix("a ")] += 1
                    else:
                        keep(path, rel)
        elif root.exists() or root.is_symlink():
            if kind := irregular(root):
                raise DataError(f"{arg}: not a regular file ({kind}); name a file or a folder")
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
    """"skipped 5 files: 3 without an extension, 1 .csv, 1 .md": the most common kinds first."""
    kinds = sorted(skipped.items(), key=lambda item: (-item[1], item[0]))
    parts = [f"{n:,} {kind}" for kind, n in kinds[:kinds_named]]
    if len(kinds) > kinds_named:
        parts.append(f"{sum(n for _, n in kinds[kinds_named:]):,} "
                     f"of {len(kinds) - kinds_named} other kinds")
    total = sum(skipped.values())
    unmatched = any(kind.startswith(".") or kind == "without an extension" for kind in skipped)
    return (f"skipped {total:,} file{'s' * (total != 1)}: {', '.join(parts)}" +
            ("; --glob chooses the names read" if unmatched else ""))
