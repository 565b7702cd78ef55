"""Build token shards: python -m data.prepare NAME [--out DIR] [--shards N]

pystdlib     the running Python's standard library, byte tokens, offline (~13M tokens, seconds)
shakespeare  tiny-shakespeare (1.1 MB download), GPT-2 tokens, 90/10 train/val
fineweb10b   FineWeb10B already tokenized with GPT-2: the val shard + N train shards
             (~98.5M tokens, ~200 MB each; at most 103)
text         your own files, folders and .jsonl, with any tokenizer (text.py):
             python -m data.prepare text PATH... --tokenizer NAME [--out DIR]
                 [--val-fraction F] [--workers N] [--glob G] [--text-key K] [--seed S]
                 [--shard-tokens N]

The folder (default data/NAME/) gets NAME_train_000000.bin ... and NAME_val_000000.bin
(loader.py), then meta.json, last. It is built beside the folder and swapped in whole
(files.staged): a failure leaves the previous set as it was, and a folder holding anything but
a set of the same kind is refused untouched. Downloads are renamed only when complete and
valid; a re-prepare reuses them. Exit status 2 for bad flags (before anything is created) or
bad input, 3 for a dead tokenizing worker or a failed write (a full disk), 128 + the signal's
number for Ctrl-C, SIGTERM or SIGHUP. Run it as a module, from the repository.
"""
import argparse
import http.client
import json
import os
import sys
import sysconfig
import time
import urllib.request
from pathlib import Path

import numpy as np
import torch.distributed as dist
from tqdm import tqdm

try:
    from data import DataError, OneLineParser
except ImportError:  # run as a file, python data/prepare.py: the repository is not on the path
    print("error: run it as a module, from the repository root: python -m data.prepare ...",
          file=sys.stderr)
    sys.exit(2)
from data.corpus import DEFAULT_GLOBS
from data.ending import exit_status, run_command
from data.files import (
    HIDDEN_EXTRA,
    atomic_write,
    carry,
    check_replaceable,
    owned_by,
    staged,
    write_json,
)
from data.loader import check_vocab, fingerprint, max_token_id, read_shard, write_shard
from data.text import prepare_text
from data.tokenizer import get_tokenizer

SOURCES = ("pystdlib", "shakespeare", "fineweb10b")
# the start of each set's shard names
PREFIX = {"pystdlib": "pystdlib", "shakespeare": "shakespeare", "fineweb10b": "fineweb"}
SHAKESPEARE_URL = "https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare"
FINEWEB_URL = "https://huggingface.co/datasets/kjj0/fineweb10B-gpt2/resolve/main"
FINEWEB_TRAIN_SHARDS = 103
NAME_MAX = 255  # bytes in one name: the limit of ext4, xfs, btrfs, zfs and apfs alike


def download(url, dest, check=None):
    """Stream url to dest via a temporary file; `check(tmp)` may reject it before the rename."""
    try:
        with urllib.request.urlopen(url, timeout=60) as r, atomic_write(dest) as f:
            total = int(r.headers.get("Content-Length") or 0) or None
            with tqdm(total=total, unit="B", unit_scale=True, desc=dest.name) as bar:
                while chunk := r.read(1 << 20):
                    f.write(chunk)
                    bar.update(len(chunk))
            f.flush()
            if check is not None:
                check(Path(f.name))
    except (OSError, http.client.HTTPException, ValueError, DataError) as e:
        # URLError, HTTPError, timeouts, cut connections, a bad url, a bad shard:
        # one line naming the url
        raise DataError(f"download of {url} failed: {e}".replace("\n", " ")) from None


def prepared_folder(data, rank=0, world=1):
    """The folder a run reads: `data` (--data), which must be prepared, or the pystdlib corpus,
    which rank 0 prepares on first use (offline) while the others wait."""
    if data == "":
        raise DataError("--data: an empty path; "
                        "name a prepared data folder, or leave --data out for pystdlib")
    if data is not None:
        folder = Path(data)
        if not (folder / "meta.json").exists():
            raise DataError(f"--data: {folder} is not a prepared data folder (no meta.json); "
                            "run python -m data.prepare NAME")
        return folder
    folder = default_folder("pystdlib")
    if not (folder / "meta.json").exists():
        if rank == 0:
            prepare("pystdlib", folder)
        if world > 1:
            dist.barrier()
    return folder


def default_folder(name):
    """data/NAME, next to this file."""
    return Path(__file__).resolve().parent / name


def python_files(src_dir):
    """The .py files under src_dir, sorted, leaving out tests and installed packages."""
    src_dir = Path(src_dir)
    files = []
    for path in sorted(src_dir.rglob("*.py")):
        parts = path.relative_to(src_dir).parts
        if any(p.startswith("test") or p in ("idle_test", "site-packages", "dist-packages")
               for p in parts):
            continue
        files.append(path)
    return files


def write_meta(out_dir, enc_name, vocab_size, eot):
    """Writes meta.json, last: each shard's size, fingerprint and largest id (within the
    vocabulary, or DataError), and the tokens of each split."""
    counts, shards = {}, {}
    for split in ("train", "val"):
        counts[split] = 0
        for path in sorted(out_dir.glob(f"*_{split}_*.bin")):
            tokens = read_shard(path)
            top = max_token_id(tokens)
            check_vocab(path, top, vocab_size, f"the {enc_name} tokenizer")
            counts[split] += len(tokens)
            shards[path.name] = {"bytes": path.stat().st_size, "fingerprint": fingerprint(path),
                                 "max_token_id": top}
    meta = {"tokenizer": enc_name, "vocab_size": vocab_size, "eot": eot,
            "train_tokens": counts["train"], "val_tokens": counts["val"],
            "max_token_id": max((s["max_token_id"] for s in shards.values()), default=-1),
            "shards": shards}
    write_json(out_dir / "meta.json", meta, indent=2)


def prepare_pystdlib(out_dir, src_dir=None):
    enc = get_tokenizer("bytes")
    src_dir = Path(src_dir or sysconfig.get_paths()["stdlib"])
    files = python_files(src_dir)
    splits = {"train": [], "val": []}
    for i, path in enumerate(tqdm(files, desc="pystdlib", unit="file")):
        tokens = enc.encode_ordinary(path.read_text(encoding="utf-8", errors="replace"))
        tokens.append(enc.eot_token)  # every file ends with <|endoftext|>
        splits["val" if i % 100 == 0 else "train"].append(np.array(tokens, dtype=np.uint16))
    for split, parts in splits.items():
        if not parts:
            raise DataError(f"{src_dir}: too few .py files ({len(files)}) for a {split} split")
        write_shard(out_dir / f"pystdlib_{split}_000000.bin", np.concatenate(parts))
    write_meta(out_dir, enc.name, enc.n_vocab, enc.eot_token)


def prepare_shakespeare(out_dir, base_url=None, tokenizer=None):
    enc = tokenizer or get_tokenizer("gpt2")  # first, so a missing tokenizer fails fast
    text_path = out_dir / "input.txt"
    if not text_path.exists():
        download(f"{base_url or SHAKESPEARE_URL}/input.txt", text_path)
    tokens = np.array(enc.encode_ordinary(text_path.read_text(encoding="utf-8")), dtype=np.uint32)
    n_train = int(0.9 * len(tokens))
    write_shard(out_dir / "shakespeare_train_000000.bin", tokens[:n_train])
    write_shard(out_dir / "shakespeare_val_000000.bin", tokens[n_train:])
    write_meta(out_dir, enc.name, enc.n_vocab, enc.eot_token)


def prepare_fineweb(out_dir, shards, base_url=None):
    names = ["fineweb_val_000000.bin"]
    names += [f"fineweb_train_{i:06d}.bin" for i in range(1, shards + 1)]
    for name in names:
        try:
            read_shard(out_dir / name)
            continue  # already here and valid
        except DataError:
            pass
        download(f"{base_url or FINEWEB_URL}/{name}", out_dir / name, check=read_shard)
    write_meta(out_dir, "gpt2", 50257, 50256)


def writable_folder(path):
    """path, if this process can write or create it, its name leaving room for the hidden
    folder beside it (files.staged); else DataError naming it."""
    if str(path) == "":
        raise DataError("an empty path: name a folder")
    path = Path(path)
    too_long = [part for part in path.parts if len(part.encode()) > NAME_MAX]
    if too_long or len(path.name.encode()) + HIDDEN_EXTRA > NAME_MAX:
        part = (too_long or [path.name])[0]
        raise DataError(f"{path}: the name {part[:16]}... is too long for the file system "
                        f"({len(part.encode())} bytes; {NAME_MAX} at most, "
                        f"less {HIDDEN_EXTRA} for the hidden folder it is built in)")
    if path.exists() and not path.is_dir():
        raise DataError(f"{path} is a file, not a folder")
    parent = path
    while not parent.exists() and parent != parent.parent:  # the nearest folder that exists
        parent = parent.parent
    if not parent.is_dir():
        raise DataError(f"cannot create {path}: {parent} is a file, not a folder")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise DataError(f"cannot write {path}: {parent} is not writable" if parent == path else
                        f"cannot create {path}: {parent} is not writable")
    return path


def out_folder(text):
    """--out: a folder that can be written (checked before anything is created)."""
    try:
        return writable_folder(text)
    except DataError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def number_in(kind, fits, what):
    """An argparse type: kind(text) where fits(value), else "TEXT: must be WHAT"."""
    def check(text):
        try:
            value = kind(text)
        except ValueError:
            value = None
        if value is None or not fits(value):
            raise argparse.ArgumentTypeError(f"{text!r}: must be {what}")
        return value
    return check


def int_in(low, high):
    return number_in(int, lambda value: low <= value <= high, f"an integer in {low}..{high}")


shard_count = int_in(1, FINEWEB_TRAIN_SHARDS)  # --shards
fraction = number_in(float, lambda value: 0 <= value < 1, "a number in [0, 1)")  # --val-fraction


def prepare(name, out_dir=None, shards=1, base_url=None, src_dir=None, tokenizer=None):
    """Builds data set `name` into out_dir (default data/NAME); returns that folder.

    base_url replaces the download host and path up to the file name (tests: a local server),
    src_dir pystdlib's standard library, tokenizer shakespeare's GPT-2. Failures: DataError."""
    if name not in SOURCES:
        raise ValueError(f"unknown data set {name!r}; choose from {', '.join(SOURCES)}")
    if name == "fineweb10b" and not 1 <= shards <= FINEWEB_TRAIN_SHARDS:
        raise ValueError(f"--shards {shards}: must be 1..{FINEWEB_TRAIN_SHARDS}")
    if name == "shakespeare":
        # offline without a cache: fail before creating anything
        tokenizer = tokenizer or get_tokenizer("gpt2")
    out_dir = writable_folder(out_dir or default_folder(name))
    owns = owned_by(PREFIX[name], ("input.txt",) if name == "shakespeare" else ())
    with staged(out_dir, lambda: check_replaceable(out_dir, name, owns)) as tmp:
        if name == "pystdlib":
            prepare_pystdlib(tmp, src_dir)
        elif name == "shakespeare":
            carry(out_dir, tmp, ["input.txt"])
            prepare_shakespeare(tmp, base_url, tokenizer)
        else:
            previous = (sorted(p.name for p in out_dir.glob("fineweb_*.bin"))
                        if out_dir.is_dir() else [])
            carry(out_dir, tmp, [n for n in previous if owns(n)])
            prepare_fineweb(tmp, shards, base_url)
    return out_dir


def text_main(argv):
    """python -m data.prepare text PATH... : returns the exit status."""
    parser = OneLineParser(prog="prepare.py text",
                           description="Tokenize text files, folders and .jsonl into shards")
    a = parser.add_argument
    a("paths", nargs="+", metavar="PATH",
      help="text files (one document each), .jsonl files (one per line), folders")
    a("--tokenizer", default="bytes",
      help="bytes (offline), a tiktoken encoding (gpt2, cl100k_base, o200k_base: "
      "network once, or TIKTOKEN_CACHE_DIR), or a .tiktoken BPE file")
    a("--out", type=out_folder,
      help="output folder (default: data/NAME, NAME the first PATH's name)")
    a("--val-fraction", type=fraction, default=0.01,
      help="share of the documents in the val split (by hash)")
    a("--workers", type=int_in(1, 1024),
      help="tokenizing processes (default: one per core; never more than the "
      "cores or the MiB of text)")
    a("--glob", action="append",
      help=f"file names kept in folders (repeat it; default {' '.join(DEFAULT_GLOBS)})")
    a("--text-key", default="text", help="the field of each .jsonl object that holds the text")
    a("--seed", type=int, default=1337, help="seeds the val split")
    a("--shard-tokens", type=int_in(1, 2**31 - 1), default=100_000_000, help="tokens per shard")
    args, code = run_command(lambda: parser.parse_args(argv), "")
    if code:
        return code
    out = args.out or default_folder(Path(args.paths[0]).resolve().name or "text")
    t0 = time.time()
    work = lambda: prepare_text(args.paths, out, args.tokenizer, args.val_fraction, args.workers,
                                tuple(args.glob or DEFAULT_GLOBS), args.text_key, args.seed,
                                args.shard_tokens)
    meta, code = run_command(work, out)
    if code:
        return code
    print(f"{out}: {meta['train_docs']:,} train + {meta['val_docs']:,} val documents, "
          f"{meta['train_tokens']:,} + {meta['val_tokens']:,} tokens "
          f"({args.tokenizer}, vocab {meta['vocab_size']}) in {time.time() - t0:.1f}s")
    return 0


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["text"]:
        return text_main(argv[1:])
    parser = OneLineParser(description=__doc__.splitlines()[0])
    parser.add_argument("name", choices=SOURCES,
                        help="data set to build (or: text PATH..., see text --help)")
    parser.add_argument("--out", type=out_folder,
                        help="output folder (default: data/NAME next to this file)")
    parser.add_argument("--shards", type=shard_count, default=1,
                        help=f"fineweb10b: train shards, 1-{FINEWEB_TRAIN_SHARDS} (default 1)")
    parser.add_argument("--fallback", choices=SOURCES,
                        help="if NAME cannot be prepared (no network), prepare this "
                        "one instead and say why on stderr "
                        "(make train on a GPU node: fineweb10b, else pystdlib)")
    parser.add_argument("--print-folder", action="store_true",
                        help="stdout: only the prepared folder (for make)")
    args, code = run_command(lambda: parser.parse_args(argv), "")
    if code:
        return code
    t0, name = time.time(), args.name
    out_dir, code = run_command(lambda: prepare(name, args.out, args.shards),
                                args.out or default_folder(name), quiet=args.fallback is not None)
    if isinstance(out_dir, DataError):  # the network, or a download that did not check out
        name = args.fallback
        print(f"note: {args.name} could not be prepared ({out_dir}); "
              f"using the {name} corpus instead", file=sys.stderr)
        out_dir, code = run_command(lambda: prepare(name, None, args.shards), default_folder(name))
    if code:
        return code
    meta = json.loads((out_dir / "meta.json").read_text())
    summary = (f"{out_dir}: {meta['train_tokens']:,} train + {meta['val_tokens']:,} val tokens "
               f"({meta['tokenizer']}, vocab {meta['vocab_size']}) in {time.time() - t0:.1f}s")
    print(out_dir if args.print_folder else summary)
    if args.print_folder:
        print(summary, file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(exit_status(main))
