"""Token shards from your own text: `python -m data.prepare text PATH... --tokenizer NAME`.

Documents are the files corpus.py finds: a text file is one, a .jsonl file one per line (the
string field `text_key`). Each ends with the end-of-text token; empty ones are left out. Invalid
UTF-8 becomes U+FFFD, as errors="replace" does, and is counted. A document goes to val when a
hash of (seed, its file's name, its byte offset) falls below val_fraction.

The files are cut into units of about `unit_bytes`: a .jsonl range holds the lines that start in
it, a text range starts and ends at a cut (CUT), where every tiktoken pre-tokenizer ends a piece
anyway. Worker processes tokenize units, a few each in flight; the main process writes their
tokens in unit order into shards of `shard_tokens` (uint32 past 65535 ids, else uint16). So the
split and the shards are byte-identical for any number of workers, and the corpus is never in
memory. The set is built beside out_dir and swapped in when complete (files.staged).
"""
import hashlib
import itertools
import json
import multiprocessing
import os
import re
import sys
from collections import Counter, deque
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path

import numpy as np
from tqdm import tqdm

from data import DataError, TrainingFailure
from data.corpus import DEFAULT_GLOBS, describe_skipped, find_files
from data.ending import sigint_held, start_worker
from data.files import check_replaceable, owned_by, staged, write_json
from data.loader import HEADER_BYTES, fingerprint, shard_header
from data.tokenizer import TokenizerUnavailable, get_tokenizer

UNIT_BYTES = 1 << 20
# a cut: after a non-space ASCII character and its newline, before an ASCII letter or digit
CUT = re.compile(rb"[\x21-\x7e]\n[0-9A-Za-z]")
SURROGATE = re.compile("[\ud800-\udfff]")
PREFIX = "text"  # shards are text_train_000000.bin, text_val_000000.bin, ...
SMALLEST_WINDOW = 257  # the tiny model's sequence and the target after it


def plan_units(files, unit_bytes=UNIT_BYTES):
    """Units of work, about unit_bytes each, in corpus order: tuples of (file, start, end byte)."""
    unit, size = [], 0
    for i, (_, _, _, n) in enumerate(files):
        for start in range(0, max(n, 1), unit_bytes):
            end = min(start + unit_bytes, n)
            unit.append((i, start, end))
            size += end - start
            if size >= unit_bytes:
                yield tuple(unit)
                unit, size = [], 0
    if unit:
        yield tuple(unit)


def decode(data):
    """(text, invalid sequences replaced), as errors="replace" decodes: one U+FFFD each."""
    text = data.decode("utf-8", "replace")
    return text, text.count("\ufffd") - data.count(b"\xef\xbf\xbd")  # EF BF BD: a valid U+FFFD


def next_cut(f, pos, size):
    """The first cut at or after byte pos of the open file (0 and the file's end are cuts). Where no
    CUT comes before the next multiple of UNIT_BYTES, that multiple (moved on to a character's
    start) is one: a unit reads at most UNIT_BYTES past its start, however long the lines."""
    if pos <= 0 or pos >= size:
        return min(max(pos, 0), size)
    forced, base = min((pos // UNIT_BYTES + 1) * UNIT_BYTES, size), max(pos - 2, 0)
    f.seek(base)
    buf = f.read(forced - base + 4)  # through the forced cut, and a character that straddles it
    match = CUT.search(buf, 0, forced - base + 1)  # a cut at or before forced
    if match:
        return base + match.start() + 2
    while forced < size and 0x80 <= buf[forced - base] < 0xC0:  # a UTF-8 continuation byte
        forced += 1
    return forced


class Tokenizing:
    """One worker's job on a unit: read, tokenize and sort its documents into train and val."""

    def __init__(self, files, tokenizer, tokenizer_file, text_key, seed, val_fraction):
        self.enc = get_tokenizer(tokenizer, tokenizer_file)
        self.files, self.text_key, self.seed, self.val_fraction = (
            files, text_key, seed, val_fraction)

    def encode(self, text):
        if self.enc.name == "bytes":  # the same ids as the Encoding's, without its per-byte work
            return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.uint32)
        # "<|endoftext|>" inside the text is plain text
        return self.enc.encode_to_numpy(text, disallowed_special=())

    def is_val(self, name, offset):
        key = hashlib.blake2b(f"{self.seed}/{name}/{offset}".encode(), digest_size=8).digest()
        return int.from_bytes(key, "little") < self.val_fraction * 2 ** 64

    def __call__(self, unit):
        """-> (train tokens, val tokens, counts) of the unit, tokens as uint32 arrays."""
        out, counts = {"train": [], "val": []}, Counter()
        for i, start, end in unit:
            path, name, jsonl, size = self.files[i]
            try:
                with open(path, "rb") as f:
                    docs = (self.json_lines(f, path, start, end) if jsonl
                            else self.text_range(f, start, end, size))
                    for offset, text, last, replaced in docs:
                        split = "val" if self.is_val(name, offset) else "train"
                        out[split].append(self.encode(text))
                        if last:
                            out[split].append(np.array([self.enc.eot_token], dtype=np.uint32))
                            counts[f"{split}_docs"] += 1
                        counts["replaced"] += replaced
            except OSError as e:
                raise DataError(f"{path}: cannot read: {e.strerror or e}") from None
            counts["bytes"] += end - start
        arrays = [np.concatenate(out[s]) if out[s] else np.zeros(0, np.uint32)
                  for s in ("train", "val")]
        return arrays[0], arrays[1], counts

    def text_range(self, f, start, end, size):
        """(0, text, whether the document ends, replaced) between the cuts at start and at end."""
        first, last = next_cut(f, start, size), next_cut(f, end, size)
        if last > first:
            f.seek(first)
            text, replaced = decode(f.read(last - first))
            yield 0, text, last == size, replaced

    def json_lines(self, f, path, start, end):
        """(offset, text, True, invalid sequences replaced) per line starting in [start, end)."""
        f.seek(max(start - 1, 0))
        if start:  # the rest of a line that started before `start` is the previous unit's
            newline = f.read(end - start + 1).find(b"\n")  # never past this unit's bytes
            if newline < 0:
                return
            f.seek(start + newline)
        pos = f.tell()
        while pos < end and (line := f.readline()):
            offset, pos = pos, pos + len(line)
            text, replaced = decode(line)
            if not text.strip():
                continue
            try:
                doc = json.loads(text)
            except ValueError as e:
                raise DataError(f"{path}: the line at byte {offset} is not JSON ({e})") from None
            if not isinstance(doc, dict) or self.text_key not in doc:
                raise DataError(f"{path}: the line at byte {offset} has no {self.text_key!r} field "
                                "(choose another with --text-key)")
            text = doc[self.text_key]
            if not isinstance(text, str):
                raise DataError(f"{path}: the line at byte {offset}: {self.text_key!r} is a "
                                f"{type(text).__name__}, not a string")
            text, lone = SURROGATE.subn("\ufffd", text)  # JSON's escaped "\ud800" is no character
            if text:
                yield offset, text, True, replaced + lone


_job = None  # in a worker process: its Tokenizing, made once by the pool's initializer


def _start_worker(parent, *job_args):
    """A worker leaves Ctrl-C to the main process (it stops handing out work and waits) and dies
    with it, so a killed prepare leaves no worker holding the folder's lock."""
    global _job
    start_worker(parent)
    _job = Tokenizing(*job_args)


def _run_unit(unit):
    return _job(unit)


class WorkerLost(TrainingFailure):
    """A tokenizing worker was killed by a signal (the out-of-memory killer, say): exit 3."""


def usable_cores():
    """The cores this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def tokenized_units(units, job_args, workers):
    """The units' results, in order, from `workers` processes (this one when 1); WorkerLost."""
    if workers == 1:
        yield from map(Tokenizing(*job_args), units)
        return
    # fork: no re-import per worker
    method = "fork" if "fork" in multiprocessing.get_all_start_methods() else None
    pool = ProcessPoolExecutor(workers, multiprocessing.get_context(method), _start_worker,
                               (os.getpid(), *job_args))
    try:
        pending = deque()
        for unit in units:
            with sigint_held():  # a worker forked here starts up without a traceback
                pending.append(pool.submit(_run_unit, unit))
            if len(pending) >= 4 * workers:  # bounded: behind a slow unit, the rest never pile up
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()
    except BrokenProcessPool:
        raise WorkerLost("a tokenizing worker process died (killed by a signal: out of memory?); "
                         "nothing was written: run again, with fewer --workers if memory is short"
                         ) from None
    finally:
        pool.shutdown(cancel_futures=True)


class Shards:
    """One split's tokens, streamed into shards of exactly `size` tokens (the last one shorter).

    Each shard is written to a hidden file and renamed when complete."""

    def __init__(self, out_dir, split, size, dtype):
        self.out_dir, self.split, self.size, self.dtype = (
            Path(out_dir), split, size, np.dtype(dtype))
        self.done, self.file, self.tmp = {}, None, None

    def add(self, tokens):
        while len(tokens):
            if self.file is None:
                self.open()
            n = min(len(tokens), self.size - self.count)
            self.file.write(tokens[:n].astype(self.dtype).tobytes())
            self.count, self.top = self.count + n, max(self.top, int(tokens[:n].max()))
            tokens = tokens[n:]
            if self.count == self.size:
                self.close()

    def open(self):
        self.tmp = self.out_dir / f".{PREFIX}_{self.split}_{len(self.done):06d}.bin.tmp"
        self.file, self.count, self.top = open(self.tmp, "wb"), 0, -1
        self.file.write(bytes(HEADER_BYTES))  # the header, filled in when the shard is complete

    def finish(self):
        """Completes the last shard (an empty one if the split has no tokens)."""
        if self.file is None and not self.done:
            self.open()
        if self.file is not None:
            self.close()

    def close(self):
        self.file.seek(0)
        self.file.write(shard_header(self.dtype, self.count))
        self.file.flush()
        os.fsync(self.file.fileno())
        self.file.close()
        path = self.out_dir / self.tmp.name[1:-len(".tmp")]
        os.replace(self.tmp, path)
        self.done[path.name] = {"bytes": path.stat().st_size, "fingerprint": fingerprint(path),
                                "tokens": self.count, "max_token_id": self.top}
        self.file = None

    def abort(self):
        """Closes a shard left open (the folder it is in is about to be removed)."""
        if self.file is not None:
            self.file.close()
            self.file = None


def worker_count(asked, units):
    """`asked` workers (None: as many as useful), never more than the units or the cores.

    A note says so when that is fewer than asked."""
    cores = usable_cores()
    useful = min(units, cores)
    if asked is not None and asked > useful:
        print(f"note: {useful} worker{'s' * (useful != 1)}, not {asked}: "
              f"no more than the units of work ({units}) and the usable cores ({cores})",
              file=sys.stderr)
    return useful if asked is None else min(asked, useful)


def prepare_text(paths, out_dir, tokenizer="bytes", val_fraction=0.01, workers=1,
                 globs=DEFAULT_GLOBS, text_key="text", seed=1337, shard_tokens=100_000_000,
                 unit_bytes=UNIT_BYTES):
    """Tokenizes the documents under `paths` into out_dir; returns meta.json's content.

    `workers` processes tokenize (None: one per core). Bad input raises DataError (ValueError
    for an unknown tokenizer), a dead worker WorkerLost; either way out_dir is as it was."""
    try:
        enc = get_tokenizer(tokenizer)
    except TokenizerUnavailable as e:
        raise DataError(f"{e}; or --tokenizer bytes, which works offline") from None
    tokenizer_file = str(Path(tokenizer).resolve()) if enc.name.startswith("sha256:") else None
    files, skipped = find_files(paths, globs, out_dir)
    workers = worker_count(workers, sum(1 for _ in plan_units(files, unit_bytes)))
    dtype = np.uint32 if enc.n_vocab > 65535 else np.uint16
    job_args = (files, enc.name, tokenizer_file, text_key, seed, val_fraction)
    counts = Counter()
    with staged(out_dir, lambda: check_replaceable(out_dir, "text", owned_by(PREFIX))) as tmp:
        shards = {split: Shards(tmp, split, shard_tokens, dtype) for split in ("train", "val")}
        try:
            results = tokenized_units(plan_units(files, unit_bytes), job_args, workers)
            first = next(results)  # the workers start before the progress bar's thread
            with tqdm(total=sum(f[3] for f in files), unit="B", unit_scale=True, unit_divisor=1000,
                      desc=f"tokenizing ({workers} worker{'s' * (workers > 1)})") as bar:
                for train, val, unit_counts in itertools.chain([first], results):
                    shards["train"].add(train)
                    shards["val"].add(val)
                    counts.update(unit_counts)
                    bar.update(unit_counts["bytes"])
            if not counts["train_docs"] + counts["val_docs"]:
                raise DataError(f"empty corpus: the {len(files)} file(s) hold no document")
            if not counts["train_docs"]:
                raise DataError("every document fell in the val split; "
                                f"lower --val-fraction {val_fraction}")
            for split in shards.values():
                split.finish()
        finally:
            for split in shards.values():
                split.abort()
        done = {**shards["train"].done, **shards["val"].done}
        tokens = {split: sum(s["tokens"] for s in shards[split].done.values()) for split in shards}
        meta = {"tokenizer": enc.name,
                **({"tokenizer_file": tokenizer_file} if tokenizer_file else {}),
                "vocab_size": enc.n_vocab, "eot": enc.eot_token, "train_tokens": tokens["train"],
                "val_tokens": tokens["val"], "train_docs": counts["train_docs"],
                "val_docs": counts["val_docs"],
                "max_token_id": max(v["max_token_id"] for v in done.values()), "shards": done,
                "source": {"paths": [str(Path(p).resolve()) for p in paths], "files": len(files),
                           "bytes": sum(f[3] for f in files),
                           "invalid_utf8_replaced": counts["replaced"],
                           "val_fraction": val_fraction, "seed": seed, "text_key": text_key,
                           "globs": list(globs)}}
        write_json(tmp / "meta.json", meta, indent=2)
    if val_fraction and not counts["val_docs"]:
        print(f"warning: no document fell in the val split (--val-fraction {val_fraction})",
              file=sys.stderr)
    elif val_fraction and tokens["val"] <= SMALLEST_WINDOW:
        print(f"warning: the val split holds {tokens['val']:,} tokens, no window of the tiny "
              f"model's {SMALLEST_WINDOW - 1} and its target: a run that evaluates refuses it "
              "(raise --val-fraction, or give more text)", file=sys.stderr)
    if counts["replaced"]:
        print(f"warning: {counts['replaced']:,} invalid UTF-8 sequence(s) replaced by U+FFFD",
              file=sys.stderr)
    if skipped:
        print(f"note: {describe_skipped(skipped)}", file=sys.stderr)
    return meta

