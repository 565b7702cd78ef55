"""What a save must be before it is trusted: meta.json's keys, types and bounds, plain file
names, file sizes, checksums, and a save that agrees with itself.

Checksums (format 3): each piece's param and Adam moments carry the zlib.crc32 of their bytes,
started from the CRC-32 of what the bytes are (piece_seed), so another piece's intact bytes are
refused too. Format 2's cover the bytes alone; format 1 saves load with the other checks only.
Every piece read is checked once per rank; export checks the params as it streams them,
sampling before it builds the model. CRC-32 guards against disk and copy damage, not forgery.
A save agrees with itself: its folder's name and its `complete` say the step meta.json says;
Adam has taken no more steps than training; the loss scale is a finite positive fp32 number,
1 without fp16's scaler. The model config it records is whole, typed and valid (config_from_dict).
"""
import json
import math
import re
import zlib
from dataclasses import fields
from pathlib import Path

import torch

from data import SaveError
from data.files import open_regular, read_text
from model import ModelConfig, is_number

FORMAT = 3  # what saver.py writes
FORMATS = (1, 2, 3)  # what saves.py reads
SAVE = re.compile(r"step_(\d{7})$")  # a save's folder
MAX_STEP = 2 ** 53  # steps are exact in a float64 (the LR schedule's)
MAX_SCALE = float(torch.finfo(torch.float32).max)  # the loss scale is an fp32 tensor
KINDS = ("param", "exp_avg", "exp_avg_sq")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
          "float64": torch.float64}
CHUNK = 64 << 20  # bytes read at a time when verifying whole files

TOP = {"format": int, "step": int, "config": dict, "layout": dict, "scaler": dict,
       "optimizer": dict, "rng": dict, "files": dict, "tensors": dict}
JSON_NAMES = {int: "an integer", dict: "an object", list: "a list", str: "a string"}


def piece_seed(name, kind, tp, start, numel):
    """The CRC-32 a piece's checksum starts from (format 3): what its bytes are."""
    return zlib.crc32(json.dumps([name, kind, list(tp) if tp else None, start, numel]).encode())


def seed_of(meta, name, kind, p):
    """piece_seed of saved piece p of tensor `name`, or 0 before format 3."""
    return (piece_seed(name, kind, p["tp"], p["start"], p["numel"])
            if meta["format"] >= 3 else 0)


def corrupt(path, name):
    return f"{path / name} is corrupt: its bytes do not match their CRC-32 in meta.json"


def plain_name(name, where):
    """A file a save names must be a plain name inside the save folder: no path, no '..'."""
    if not isinstance(name, str) or name in ("", ".", "..") or any(c in name for c in "/\\\0"):
        raise SaveError(f"{where} names the file {name!r}: not a plain file name inside the save")
    return name


def _int(x, lo=0, hi=None):
    return isinstance(x, int) and not isinstance(x, bool) and x >= lo and (hi is None or x < hi)


def _has(obj, keys, where, prefix, kind=dict):
    """obj is a `kind`, and an object holds every key; else SaveError names the key and file."""
    if not isinstance(obj, kind) or isinstance(obj, bool):
        raise SaveError(f"{where}: {prefix.rstrip('.') or 'the file'} is not {JSON_NAMES[kind]}")
    for key in keys:
        if key not in obj:
            raise SaveError(f"{where} has no key {prefix + key!r}")


def _bad(where, what):
    raise SaveError(f"{where}: {what}")


def check_meta(meta, where):
    """SaveError naming the first key loading reads that is missing, of a wrong type or out of
    bounds."""
    _has(meta, TOP, where, "")
    for key, kind in TOP.items():
        _has(meta[key], (), where, key + ".", kind)
    if meta["format"] not in FORMATS:
        _bad(where, f"format {meta['format']} is not one this code reads "
                    f"({', '.join(map(str, FORMATS))})")
    _has(meta["config"], ("model", "tokenizer"), where, "config.")
    _has(meta["config"]["model"], (), where, "config.model.")
    _has(meta["scaler"], ("scale", "clean_steps"), where, "scaler.")
    _has(meta["optimizer"], ("step", "kinds"), where, "optimizer.")
    _has(meta["optimizer"]["kinds"], (), where, "optimizer.kinds.", list)
    kinds = meta["optimizer"]["kinds"]
    if kinds not in (["param"], list(KINDS)):
        _bad(where, f"optimizer.kinds is {kinds}, not ['param'] or {list(KINDS)}")
    if not (_int(meta["step"]) and _int(meta["optimizer"]["step"])
            and _int(meta["scaler"]["clean_steps"])
            and isinstance(meta["scaler"]["scale"], (int, float))
            and not isinstance(meta["scaler"]["scale"], bool)):
        _bad(where, "step, optimizer.step or the scaler's state is not a number >= 0")
    _check_agrees(meta, where)
    for rank, state in meta["rng"].items():
        _has(state, (), where, f"rng.{rank}.")
    for name, size in meta["files"].items():
        plain_name(name, where)
        if not _int(size):
            _bad(where, f"files.{name} is not a size in bytes")
    for name, t in meta["tensors"].items():
        _check_tensor(t, kinds, meta, where, f"tensors.{name}.")


def _check_agrees(meta, where):
    """The save says one thing: the step of its folder, its `complete`, its meta.json."""
    step, adam, scaler = meta["step"], meta["optimizer"]["step"], meta["scaler"]
    if step >= MAX_STEP or adam > step or scaler["clean_steps"] > step:
        _bad(where, f"optimizer.step {adam} or scaler.clean_steps {scaler['clean_steps']} "
                    f"is past step {step} (Adam takes at most one step per training step)"
                    if step < MAX_STEP else f"step {step} is absurd")
    if meta.get("data_position", step) != step:
        _bad(where, f"data_position {meta['data_position']!r} is not step {step}")
    scale, dtype = scaler["scale"], meta["config"].get("train", {}).get("dtype")
    if (not (math.isfinite(scale) and 0 < scale <= MAX_SCALE)
            or (dtype not in (None, "fp16") and scale != 1)):
        _bad(where, f"scaler.scale is {scale!r}; a loss scale is a finite fp32 number > 0, "
                    f"and 1 without fp16's loss scaler (this save's dtype is {dtype})")
    folder = Path(where).parent
    named = SAVE.match(folder.name)
    if named and int(named.group(1)) != step:
        _bad(where, f"step is {step}, but its folder is {folder.name}: "
                    "the folder holds another step's save")
    try:
        done = read_text(folder / "complete").strip() if named else ""
    except (OSError, UnicodeDecodeError):
        done = ""
    if done.isdigit() and int(done) != step:
        _bad(where, f"step is {step}, but {folder / 'complete'} says {done}: "
                    "the save contradicts itself")


def _check_tensor(t, kinds, meta, where, prefix):
    _has(t, ("shape", "dtype", "pieces"), where, prefix)
    _has(t["shape"], (), where, prefix + "shape.", list)
    _has(t["pieces"], (), where, prefix + "pieces.", list)
    if (not all(_int(n) for n in t["shape"]) or not isinstance(t["dtype"], str)
            or t["dtype"] not in DTYPES):
        _bad(where, f"{prefix}shape {t['shape']} or dtype {t['dtype']!r} is not a tensor's")
    keys = ("file", "tp", "start", "numel", "offsets") + (("crc32",) if meta["format"] >= 2 else ())
    fields = {"offsets": (None, "a byte offset"), "crc32": (1 << 32, "a CRC-32")}
    total = math.prod(t["shape"])
    for i, p in enumerate(t["pieces"]):
        at = f"{prefix}pieces[{i}]."
        _has(p, keys, where, at)
        if plain_name(p["file"], where) not in meta["files"]:
            _bad(where, f"{at}file {p['file']!r} is not one of its files")
        numel = total
        if p["tp"] is not None:
            tp = p["tp"]
            if not (isinstance(tp, list) and len(tp) == 3 and all(_int(x) for x in tp)
                    and tp[0] < len(t["shape"]) and tp[2] >= 1 and tp[1] < tp[2]
                    and t["shape"][tp[0]] % tp[2] == 0):
                _bad(where, f"{at}tp {tp} is not a [dim, rank, world] block of shape {t['shape']}")
            numel //= tp[2]
        if not (_int(p["start"]) and _int(p["numel"]) and p["start"] + p["numel"] <= numel):
            _bad(where, f"{at}start {p['start']} and numel {p['numel']} "
                        f"do not fit its block of {numel} elements")
        for field in keys[4:]:
            hi, what = fields[field]
            _has(p[field], kinds, where, at + field + ".")
            if not all(_int(p[field][k], 0, hi) for k in kinds):
                _bad(where, f"{at}{field} holds a value that is not {what}")


def _spans(meta, files=None, kinds=None):
    """(file, offset, bytes, tensor name, kind, piece) of each saved buffer of `kinds` in `files`
    (default: all)."""
    for name, t in meta["tensors"].items():
        for p in t["pieces"]:
            if files is None or p["file"] in files:
                for kind in kinds or meta["optimizer"]["kinds"]:
                    n = p["numel"] * DTYPES[t["dtype"]].itemsize
                    yield p["file"], p["offsets"][kind], n, name, kind, p


def check_files(path, meta):
    """Every file has the size meta.json records, and its pieces tile it, so every byte is under
    one checksum; every tensor's pieces tile each of its tp blocks: every element has one source."""
    where = path / "meta.json"
    for name, size in meta["files"].items():
        file = path / name
        actual = file.stat().st_size if file.is_file() else None
        if actual is None:
            raise SaveError(f"{file} is missing: 0 of {size} bytes")
        if actual < size:
            raise SaveError(f"{file} is truncated: {actual} of {size} bytes")
        if actual > size:
            raise SaveError(f"{file} is too long: {actual} bytes, meta.json records {size}")
    for name, t in meta["tensors"].items():
        blocks = {}
        for p in t["pieces"]:
            blocks.setdefault(tuple(p["tp"] or ()), []).append((p["start"], p["numel"]))
        worlds = {tp[2] if tp else 1 for tp in blocks}
        dims = {tp[0] for tp in blocks if tp}
        if (len(worlds) != 1 or len(dims) > 1 or len(blocks) != worlds.pop()
                or (dims and () in blocks)):
            _bad(where, f"the pieces of {name} do not split it into whole tp blocks")
        for tp, ranges in blocks.items():
            if _gap(ranges, math.prod(t["shape"]) // (tp[2] if tp else 1)) is not None:
                _bad(where, f"the pieces of {name} do not cover its shape {t['shape']} once")
    spans = {name: [] for name in meta["files"]}
    for file, offset, n, *_ in _spans(meta):
        spans[file].append((offset, n))
    for name, ranges in spans.items():
        at = _gap(ranges, meta["files"][name])
        if at is not None:
            _bad(where, f"the pieces in {name} overlap or leave bytes unaccounted for, "
                        f"at byte {at}")


def _gap(ranges, total):
    """None if the (start, length) ranges tile [0, total) exactly; else where they first do not."""
    end = 0
    for start, n in sorted(ranges):
        if start != end:
            return min(start, end)
        end += n
    return None if end == total else end


def verify(path, meta, files=None, kinds=None):
    """Reads `files` (default: all) for `kinds` (default: all saved); checks every piece's CRC-32.

    SaveError names the first file that fails. A format 1 save has nothing to check."""
    if meta["format"] < 2:
        return
    spans = {}
    for file, offset, n, name, kind, p in _spans(meta, files, kinds):
        seed = seed_of(meta, name, kind, p)
        dtype = DTYPES[meta["tensors"][name]["dtype"]]
        spans.setdefault(file, []).append((offset, n, p["crc32"][kind], seed, dtype))
    for name in sorted(spans):
        try:
            with open_regular(path / name) as f:
                for offset, n, expected, seed, dtype in sorted(spans[name]):
                    f.seek(offset)
                    crc, left, finite = seed, n, True
                    while left:
                        block = f.read(min(left, CHUNK))
                        if not block:
                            raise SaveError(f"{path / name} is truncated")
                        crc, left = zlib.crc32(block, crc), left - len(block)
                        whole = len(block) - len(block) % dtype.itemsize  # a short read: whole ones
                        values = torch.frombuffer(bytearray(block[:whole]), dtype=dtype)
                        finite = finite and bool(values.isfinite().all()) if whole else finite
                    if crc != expected:
                        raise SaveError(corrupt(path, name))
                    if not finite:  # intact bytes, but not a save that can train
                        raise SaveError(f"{path / name} holds values that are not finite")
        except OSError as e:
            raise SaveError(f"cannot read {path / name}: {e.strerror or e}") from None


# ---------------------------------------------------------------- the model a save recorded

OPTIONAL_FIELDS = ("rope_scaling", "tie_embeddings")  # added later: absent in older saves (None)
INTEGER_FIELDS = ("n_layer", "d_model", "n_head", "n_kv_head", "ffn_dim", "vocab_size", "seq_len")


def field_type_problem(name, value):
    """What a saved model field must be, if `value` is not that; else None."""
    if name in INTEGER_FIELDS:
        return None if is_number(value, integer=True) else "an integer"
    if name == "rope_scaling":
        return None if value is None or isinstance(value, dict) else "an object or null"
    if name == "tie_embeddings":
        return None if value is None or isinstance(value, bool) else "true, false or null"
    return None if is_number(value) else "a number"


def config_from_dict(d):
    """The ModelConfig a save recorded (its config's "model"). Else ValueError, naming the field.

    Every field must be there, with its type, and the whole must pass validate(). A missing shape
    field is never filled with a default: that would build another model than the one saved.
    Only OPTIONAL_FIELDS may be absent."""
    if not isinstance(d, dict):
        raise ValueError(f"the model config is not an object: {d!r}")
    names = [f.name for f in fields(ModelConfig)]
    unknown = sorted(set(d) - set(names))
    if unknown:
        raise ValueError(f"model.{unknown[0]} is not a field of this code's model")
    for name in names:
        if name not in d and name not in OPTIONAL_FIELDS:
            raise ValueError(f"model.{name} is missing")
        problem = field_type_problem(name, d.get(name))
        if problem:
            raise ValueError(f"model.{name} must be {problem}, got {d.get(name)!r}")
    cfg = ModelConfig(**d)
    problem = cfg.validate()
    if problem:
        raise ValueError(f"model.{problem[0].lstrip('-').replace('-', '_')}: {problem[1]}")
    return cfg
