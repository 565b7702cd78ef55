"""Token shards on disk, and a loader whose global batch depends only on (seed, split, step).

A shard is llm.c's, so downloaded FineWeb shards are read as they are: a header of 256
little-endian int32 [magic, version=1, token count, 0...], then the tokens, uint16 for
magic 20240520 or uint32 for magic 20240801.

The global batch of step s is `global_batch` windows of seq_len+1 tokens at offsets drawn by
np.random.default_rng([seed, s]) over all windows inside one shard. DP rank r takes rows
[r*B/dp, (r+1)*B/dp): every layout sees the one-process batch, and a resume needs no replay.
A background thread prepares step s+1 while step s trains.

meta.json (written last) holds `tokenizer` and `vocab_size`, and may record each shard's size,
fingerprint (a CRC-32 of 16 blocks of 4 KiB spread over it) and largest id: the shards must be
those it records. Each shard's largest id is taken as it opens, and must lie below vocab_size.
"""
import hashlib
import json
import queue
import threading
import time
import zlib
from pathlib import Path

import numpy as np
import torch

from data import DataError
from data.files import atomic_write, open_regular, read_bytes

HEADER_INTS = 256
HEADER_BYTES = HEADER_INTS * 4
VERSION = 1
MAGIC_DTYPE = {20240520: np.dtype("<u2"), 20240801: np.dtype("<u4")}
FINGERPRINT_BLOCKS, FINGERPRINT_BYTES = 16, 4096


def shard_header(dtype, count):
    """The header of a shard of `count` tokens of `dtype`."""
    header = np.zeros(HEADER_INTS, dtype="<i4")
    header[:3] = next(m for m, d in MAGIC_DTYPE.items() if d == dtype), VERSION, count
    return header.tobytes()


def write_shard(path, tokens):
    """Write tokens as an llm.c shard (uint16 if they fit, else uint32), atomically."""
    tokens = np.asarray(tokens)
    if tokens.size and (tokens.min() < 0 or tokens.max() >= 2**32):
        raise ValueError(f"{path}: token ids must lie in [0, 2**32)")
    dtype = MAGIC_DTYPE[20240520 if tokens.size == 0 or tokens.max() < 2**16 else 20240801]
    with atomic_write(path) as f:
        f.write(shard_header(dtype, tokens.size))
        f.write(tokens.astype(dtype).tobytes())


def read_shard(path):
    """Validate an llm.c shard and return its tokens as a read-only memmap."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"{path}: missing")
    size = path.stat().st_size
    if size < HEADER_BYTES:
        raise DataError(f"{path}: truncated: expected at least {HEADER_BYTES} bytes got {size}")
    magic, version, count = (int(v) for v in np.fromfile(path, dtype="<i4", count=3))
    if magic not in MAGIC_DTYPE:
        raise DataError(f"{path}: bad magic {magic} (expected 20240520 or 20240801)")
    if version != VERSION:
        raise DataError(f"{path}: unsupported version {version} (expected {VERSION})")
    dtype = MAGIC_DTYPE[magic]
    expected = HEADER_BYTES + count * dtype.itemsize
    if size != expected:
        what = "truncated" if size < expected else "too long"
        raise DataError(f"{path}: {what}: expected {expected} bytes got {size}")
    if count == 0:
        return np.zeros(0, dtype=dtype)  # np.memmap cannot map zero bytes
    return np.memmap(path, dtype=dtype, mode="r", offset=HEADER_BYTES, shape=(count,))


def read_meta(folder):
    """The folder's meta.json: a tokenizer's name, a positive vocab_size, any max_token_id
    below it; else DataError naming the file."""
    folder = Path(folder)
    if not folder.is_dir():
        raise DataError(f"data folder {folder} not found; run python -m data.prepare {folder.name}")
    path = folder / "meta.json"
    if not path.is_file():
        raise DataError(f"{path} missing (preparation unfinished?); "
                        f"run python -m data.prepare {folder.name}")
    try:
        meta = json.loads(read_bytes(path).decode("utf-8"))
    except (OSError, UnicodeDecodeError) as e:
        raise DataError(f"{path}: unreadable: {e}".replace("\n", " ")) from None
    except ValueError as e:
        raise DataError(f"{path}: not valid JSON ({e}); "
                        f"rerun python -m data.prepare {folder.name}") from None
    if not isinstance(meta, dict):
        raise DataError(f"{path}: expected a JSON object, got {type(meta).__name__}")
    for key in ("tokenizer", "vocab_size"):
        if key not in meta:
            raise DataError(f"{path}: {key} missing; rerun python -m data.prepare {folder.name}")
    if not isinstance(meta["tokenizer"], str) or not meta["tokenizer"]:
        raise DataError(f"{path}: tokenizer must be a tokenizer's name, got {meta['tokenizer']!r}")
    vocab = meta["vocab_size"]
    if not is_int(vocab) or vocab < 1:
        raise DataError(f"{path}: vocab_size must be a positive integer, got {vocab!r}")
    top = meta.get("max_token_id", -1)
    if not is_int(top) or top >= vocab:
        raise DataError(f"{path}: max_token_id {top!r} is not an integer below vocab_size {vocab}")
    return meta


def is_int(value):
    return isinstance(value, int) and not isinstance(value, bool)


def max_token_id(tokens):
    """The largest id in a shard's tokens (-1 if empty): one vectorized pass."""
    return int(tokens.max()) if len(tokens) else -1


def recorded_max(meta, path):
    """The largest id meta.json records for the shard at path, or None."""
    shards = meta.get("shards")
    record = shards.get(Path(path).name) if isinstance(shards, dict) else None
    return record.get("max_token_id") if isinstance(record, dict) else None


def fingerprint(path):
    """The CRC-32 (8 hex digits) of FINGERPRINT_BLOCKS blocks spread from first byte to last."""
    size = Path(path).stat().st_size
    crc = zlib.crc32(size.to_bytes(8, "little"))
    with open_regular(path) as f:
        last = max(size - FINGERPRINT_BYTES, 0)
        for k in range(FINGERPRINT_BLOCKS):
            f.seek(last * k // (FINGERPRINT_BLOCKS - 1))
            crc = zlib.crc32(f.read(FINGERPRINT_BYTES), crc)
    return f"{crc:08x}"


def shard_paths(folder, split="*"):
    return sorted(Path(folder).glob(f"*_{split}_*.bin"))


def check_shards(folder, meta, paths, split="*"):
    """DataError unless the shards `paths` (of `split`) are those meta.json records, each of
    its recorded size and fingerprint. A meta.json without `shards` records none."""
    shards, where = meta.get("shards"), Path(folder) / "meta.json"
    if not isinstance(shards, dict):
        return
    for path in paths:
        record = shards.get(path.name)
        if not isinstance(record, dict):
            raise DataError(f"{path}: not a shard {where} records "
                            "(a file put there after it was prepared?); "
                            f"remove it, or prepare the folder again")
        size = path.stat().st_size
        if record.get("bytes", size) != size:
            raise DataError(f"{path}: {size} bytes, {where} records {record['bytes']}: "
                            "the shard changed after it was prepared; prepare the folder again")
        if "fingerprint" in record and record["fingerprint"] != fingerprint(path):
            raise DataError(f"{path}: its bytes are not the ones {where} records "
                            f"(fingerprint {fingerprint(path)}, recorded {record['fingerprint']}): "
                            "the shard was replaced; prepare the folder again")
    names = {p.name for p in paths}
    missing = sorted(n for n in shards if n not in names and Path(n).match(f"*_{split}_*.bin"))
    if missing:
        raise DataError(f"{Path(folder) / missing[0]}: recorded in {where}, but missing")


def data_identity(folder):
    """What a resume compares: the hash of meta.json (16 hex digits), the shards held to it.

    Where it records none, each shard's name, size and fingerprint are hashed with it."""
    folder = Path(folder)
    meta, paths = read_meta(folder), shard_paths(folder)
    check_shards(folder, meta, paths)
    digest = hashlib.sha256(read_bytes(folder / "meta.json"))
    if not isinstance(meta.get("shards"), dict):
        for path in paths:
            digest.update(f"\0{path.name}\0{path.stat().st_size}\0{fingerprint(path)}".encode())
    return digest.hexdigest()[:16]


def check_vocab(path, top, vocab_size, where, recorded=None):
    """DataError naming the shard if its largest id `top` is outside the vocabulary; also
    naming what meta.json `recorded` where it differs (the shard changed since)."""
    if top >= vocab_size:
        changed = (f"; it records {recorded} for this shard"
                   if recorded is not None and recorded != top else "")
        raise DataError(f"{path}: token id {top} is outside the vocabulary "
                        f"(vocab_size {vocab_size} in {where}{changed})")


class TokenLoader:
    """fixed_tokens N: step s is instead the s-th run of global_batch consecutive windows from
    the split's start, window j the tokens [j·T, j·T + T] (T = seq_len): N tokens in N/(B·T) steps,
    the same slice every time (a validation set as the speedrun's). steps: how many a pass takes;
    their windows may not outnumber the split's tokens."""

    def __init__(self, data_dir, split, seq_len, global_batch, seed,
                 dp_rank=0, dp_size=1, device="cpu", prefetch=True, fixed_tokens=None, steps=None):
        if global_batch % dp_size:
            raise ValueError(f"--global-batch {global_batch} is not divisible by the "
                             f"data-parallel size {dp_size}")
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank {dp_rank} outside [0, {dp_size})")
        data_dir = Path(data_dir)
        self.meta = read_meta(data_dir)
        paths = shard_paths(data_dir, split)
        if not paths:
            raise DataError(f"no {split} shards (*_{split}_*.bin) in {data_dir}")
        self.shards = [read_shard(p) for p in paths]
        self.max_token_id = -1  # largest id in this split's shards: vocab_size must exceed it
        for path, tokens in zip(paths, self.shards):
            top = max_token_id(tokens)
            check_vocab(path, top, self.meta["vocab_size"], data_dir / "meta.json",
                        recorded_max(self.meta, path))
            self.max_token_id = max(self.max_token_id, top)
        check_shards(data_dir, self.meta, paths, split)
        # Window starts per shard: a window of seq_len+1 tokens must end inside its shard.
        self.starts = np.array([max(len(s) - seq_len, 0) for s in self.shards], dtype=np.int64)
        self.cum_starts = np.cumsum(self.starts)
        if self.cum_starts[-1] == 0:
            raise DataError(f"{split} shards in {data_dir} hold no window of "
                            f"seq_len+1 = {seq_len + 1} tokens")
        self.seq_len, self.global_batch, self.seed = seq_len, global_batch, seed
        self.fixed_tokens = fixed_tokens
        if fixed_tokens is not None and fixed_tokens + 1 > len(self.shards[0]):
            raise DataError(f"--eval-tokens: {fixed_tokens:,} tokens (and one more, the last "
                            f"target) are more than {paths[0]} holds ({len(self.shards[0]):,})")
        held = sum(map(len, self.shards))
        if steps is not None and steps * global_batch > held:  # a cost bounded by the split
            raise DataError(f"--eval-batches: {steps:,} batches of {global_batch} windows are more "
                            f"windows than the {split} split has tokens ({held:,}); evaluate fewer")
        rows_per_rank = global_batch // dp_size
        self.rows = slice(dp_rank * rows_per_rank, (dp_rank + 1) * rows_per_rank)  # global rows
        self.device = torch.device(device)
        self.wait_s = 0.0  # seconds the last get() blocked: the input stall
        self._pending = None  # the step the thread is preparing, if any
        self._thread = None
        if prefetch:
            self._requests, self._results = queue.Queue(), queue.Queue(maxsize=1)
            cuda_index = (None if self.device.type != "cuda"
                          else torch.cuda.current_device() if self.device.index is None
                          else self.device.index)
            self._thread = threading.Thread(target=self._worker, args=(cuda_index,), daemon=True)
            self._thread.start()

    def _windows(self, step, rows):
        """Token windows (len(rows), seq_len+1) as int64 for the given rows of the global batch."""
        if self.fixed_tokens is not None:  # consecutive windows of the first shard
            first = step * self.global_batch + np.arange(self.global_batch)[rows]
            T = self.seq_len
            return np.stack([self.shards[0][j * T:j * T + T + 1] for j in first]).astype(np.int64)
        rng = np.random.default_rng([self.seed, step])
        idx = rng.integers(0, self.cum_starts[-1], size=self.global_batch)  # every rank draws all
        idx = idx[rows]
        shard = np.searchsorted(self.cum_starts, idx, side="right")  # which shard holds window idx
        offset = idx - (self.cum_starts[shard] - self.starts[shard])
        out = np.empty((len(idx), self.seq_len + 1), dtype=np.int64)
        for i, (k, o) in enumerate(zip(shard, offset)):
            out[i] = self.shards[k][o:o + self.seq_len + 1]
        return out

    def global_rows(self, step):
        """The whole global batch of `step`, (global_batch, seq_len+1) int64 numpy (for tests)."""
        return self._windows(step, slice(None))

    def _load(self, step):
        """This rank's (x, y) on the CPU, pinned when headed for CUDA."""
        w = self._windows(step, self.rows)
        x = torch.from_numpy(np.ascontiguousarray(w[:, :-1]))  # (B/dp, T)
        y = torch.from_numpy(np.ascontiguousarray(w[:, 1:]))  # (B/dp, T) next tokens
        if self.device.type == "cuda":
            x, y = x.pin_memory(), y.pin_memory()
        return x, y

    def _worker(self, cuda_index):
        if cuda_index is not None:
            torch.cuda.set_device(cuda_index)  # else pinning would create a context on GPU 0
        while (step := self._requests.get()) is not None:
            try:
                self._results.put((step, self._load(step), None))
            except BaseException as e:  # noqa: BLE001 - get() raises it in the caller
                self._results.put((step, None, e))

    def get(self, step):
        """This rank's (x, y) of `step`: int64 (global_batch // dp_size, seq_len) on the device."""
        t0 = time.perf_counter()
        batch = None
        if self._pending is not None:  # wait for the one in flight; use it if it is this step
            ready, batch, error = self._results.get()
            self._pending = None
            if error is not None:
                raise error
            if ready != step:
                batch = None
        if batch is None:
            batch = self._load(step)
        if self._thread is not None:
            self._pending = step + 1
            self._requests.put(step + 1)
        x, y = (t.to(self.device, non_blocking=True) for t in batch)
        self.wait_s = time.perf_counter() - t0
        return x, y

    def close(self):
        """Stop the prefetch thread; get() keeps working, synchronously."""
        if self._thread is not None:
            self._requests.put(None)
            self._thread.join(timeout=10)
            self._thread, self._pending = None, None
