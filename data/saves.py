"""Saves of a run: what train.py writes to disk and reads back, in any layout.

    RUN/step_0000100/        one complete save (the step, 7 digits)
        meta.json            rank 0: format (3), step, config, layout, loss scaler, Adam's step
                             count, every rank's RNG states, and the size of every file. For every
                             global tensor: its shape, dtype and pieces. A piece names its file
                             (a plain name in this folder). For the param and each Adam moment
                             it holds a byte offset and the CRC-32 of those bytes, seeded with
                             what the piece is, so each piece checks on its own (integrity.py).
        rank00003.bin        rank 3's raw bytes: per piece it writes, the param, exp_avg, exp_avg_sq
        complete             written last (the step)
    RUN/attempts.json        one record per attempt of the run (run.py)
    RUN/metrics.jsonl, RUN/.lock   train.py's metrics; who holds the folder (run.py)

A piece is the run of elements [start, start + numel) of the flattened tp block
`tp` = [dim, rank, world] of a global tensor (or of the whole tensor when tp is null): a DDP
param or an FSDP shard segment, and Adam's state with it. Every element has one writer, so a
save is 12 bytes per parameter in any layout. saver.py writes a save, sync or async.

Loading takes each piece a rank now holds: from the overlapping byte ranges when the save split
that tensor over tp the same way (a same-layout resume or a dp/fsdp reshard reads each byte
once), else cut from the full tensor. Each piece read is checked against its CRC-32, and the
ranks agree on whether every read passed.
"""
import json
import math
import os
import random
import shutil
import warnings
import zlib
from pathlib import Path

import numpy as np
import torch

from data import DataError, SaveError, integrity
from data.files import open_regular, read_json
from data.integrity import (
    DTYPES,
    SAVE,
    check_meta,
    config_from_dict,
    corrupt,
    seed_of,
)
from data.tokenizer import get_tokenizer
from model import GPT
from parallel.comm import all_reduce_max

ADAM = ("exp_avg", "exp_avg_sq")


# ---------------------------------------------------------------- the run folder

def published(path):
    """A step_* folder that holds a save: `complete`, or the meta.json it was published with (a
    save whose marker was lost is still one: loading it checks every byte)."""
    return bool(SAVE.match(path.name)) and any((path / f).exists() for f in ("complete",
                                                                             "meta.json"))


def complete_saves(run_dir):
    """Complete saves in the run folder, oldest first."""
    return sorted((p for p in Path(run_dir).glob("step_*") if published(p)), key=lambda p: p.name)


def remove_incomplete(run_dir):
    """Rank 0 removes saves killed mid-write (.tmp_*), half-deleted (.del_*), or never published."""
    for p in Path(run_dir).glob("*step_*"):
        if p.is_symlink():
            continue  # a link: what it leads to is not this run's to delete
        if p.is_dir() and (p.name.startswith((".tmp_", ".del_"))
                           or (SAVE.match(p.name) and not published(p))):
            shutil.rmtree(p, ignore_errors=True)


def _retire(path):
    """Deletes a save folder, renamed first: never seen half-deleted under its name."""
    if path.is_symlink():
        return
    trash = path.with_name(f".del_{path.name}_{os.getpid()}")
    try:
        os.replace(path, trash)
    except OSError:  # already gone (another process pruned it)
        return
    shutil.rmtree(trash, ignore_errors=True)


def prune(run_dir, keep, config):
    """Deletes all but the newest `keep` saves, and only saves of this run: their meta.json records
    `config` (--steps aside). A folder only named like a save is never deleted."""
    if keep > 0:
        for old in complete_saves(run_dir)[:-keep]:
            if same_run(old, config):
                _retire(old)


def same_run(path, config):
    """Whether the save at path records config as its run's (--steps aside)."""
    def plain(c):
        return json.loads(json.dumps({**c, "train": {**c.get("train", {}), "steps": None}}))
    try:
        return plain(read_json(path / "meta.json", SaveError)["config"]) == plain(config)
    except (SaveError, KeyError, TypeError, AttributeError):
        return False


def last_good_save(run_dir, group=None, device="cpu"):
    """The newest complete save whose meta.json, sizes and checksums verify, or None.

    With `group` every rank of it calls this, reads a share of each save's files, and one
    all-reduce per save tried agrees on the answer."""
    rank, size = (group.rank, group.size) if group is not None else (0, 1)
    for path in reversed(complete_saves(run_dir)):
        bad = 0.0
        try:
            saved = Saved(path).validate()
            saved.verify(files=sorted(saved.meta["files"])[rank::size])
        except (OSError, ValueError, SaveError):
            bad = 1.0
        if (bad if group is None else all_reduce_max(group, bad, device)) == 0:
            return path
    return None


# ---------------------------------------------------------------- RNG states, as JSON

def rng_state():
    state = {"torch": torch.get_rng_state().numpy().tobytes().hex(), "python": random.getstate()}
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    state["numpy"] = [kind, keys.tolist(), pos, has_gauss, gauss]
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state().numpy().tobytes().hex()
    return state


def set_rng_state(state):
    torch.set_rng_state(torch.frombuffer(bytearray.fromhex(state["torch"]), dtype=torch.uint8))
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(torch.frombuffer(bytearray.fromhex(state["cuda"]),
                                                  dtype=torch.uint8))


def global_shape(piece):
    shape = list(piece.shape)
    if piece.tp_shard is not None:
        dim, _, world = piece.tp_shard
        shape[dim] *= world
    return shape


# ---------------------------------------------------------------- loading

# load() agrees on kind * SLOT + (file index, or rank) + 1: exact in the float32 all-reduce
SLOT = 1 << 20


class FileError(SaveError):
    """A saved file that does not read back as written: `name` is its name in the save."""

    def __init__(self, message, name, kind):
        super().__init__(message)
        self.name, self.kind = name, kind


class Saved:
    """One complete save on disk. tensor(name, kind) assembles a full global tensor from pieces."""

    def __init__(self, path, meta=None):
        self.path = Path(path)
        if meta is None:  # else a folder read as a save (hf.py), whose meta its reader checked
            meta = read_json(self.path / "meta.json", SaveError)
            check_meta(meta, self.path / "meta.json")
        self.meta = meta
        self.step, self.tensors = self.meta["step"], self.meta["tensors"]
        # verified: the pieces whose CRC-32 passed on this rank
        self.checked, self.verified = self.meta["format"] >= 2, set()

    def _fill(self, out, name, p, kind, first=0):
        """Reads elements [first, first + out.numel()) of saved piece p into 1-D out; a part of a
        piece is cut from the whole, read and checked against its CRC-32 once."""
        whole = first == 0 and out.numel() == p["numel"]
        key = (p["file"], p["offsets"][kind])
        if self.checked and not whole and key not in self.verified:
            piece = torch.empty(p["numel"], dtype=out.dtype)
            self._fill(piece, name, p, kind)
            out.copy_(piece[first:first + out.numel()])
            return
        try:
            with open_regular(self.path / p["file"]) as f:
                f.seek(p["offsets"][kind] + first * out.element_size())
                n = f.readinto(out.view(torch.uint8).numpy())
        except OSError as e:
            raise FileError(f"cannot read {self.path / p['file']}: {e.strerror or e}",
                            p["file"], 1) from None
        if n != out.numel() * out.element_size():
            raise FileError(f"{self.path / p['file']} is truncated", p["file"], 1)
        if self.checked and whole and key not in self.verified:
            crc = zlib.crc32(out.view(torch.uint8).numpy(), seed_of(self.meta, name, kind, p))
            if crc != p["crc32"][kind]:
                raise FileError(corrupt(self.path, p["file"]), p["file"], 0)
            self.verified.add(key)
        if not torch.isfinite(out).all():  # a save that cannot train, or a checkpoint
            raise FileError(f"{self.path / p['file']}: {name} holds values that are not finite",
                            p["file"], 0)

    def validate(self):
        """Each file has its recorded size and its pieces tile it; each tensor's pieces cover it."""
        integrity.check_files(self.path, self.meta)
        return self

    def verify(self, kinds=None, files=None):
        """Reads every piece of `kinds` in `files` (default: all) and checks its CRC-32."""
        integrity.verify(self.path, self.meta, files, kinds)
        return self

    def tensor(self, name, kind="param"):
        """The full tensor, read piece by piece: each tp block is filled through one flat buffer."""
        info = self.tensors[name]
        dtype = DTYPES[info["dtype"]]
        full = torch.zeros(info["shape"], dtype=dtype)  # rows no piece covers: hf.py's padding
        blocks = {}
        for p in info["pieces"]:
            blocks.setdefault(tuple(p["tp"] or ()), []).append(p)
        for tp, pieces in blocks.items():
            block = full.chunk(tp[2], tp[0])[tp[1]] if tp else full
            flat = (block.view(-1) if block.is_contiguous()
                    else torch.empty(block.numel(), dtype=dtype))
            for p in pieces:
                self._fill(flat[p["start"]:p["start"] + p["numel"]], name, p, kind)
            if not block.is_contiguous():
                block.copy_(flat.view(block.shape))
        return full

    def read(self, piece, kind):
        """The piece's elements: read from the files if saved with the same tp split, else cut
        from the full tensor."""
        info = self.tensors[piece.name]
        if info["shape"] != global_shape(piece):
            raise SaveError(f"{self.path}: {piece.name} has shape {info['shape']}, "
                            f"this model has {global_shape(piece)}")
        split = piece.tp_shard and (piece.tp_shard[0], piece.tp_shard[2])  # (dim, world), or None
        start, n = piece.offset, piece.end - piece.start
        if split and split[0] == 0 and all(p["tp"] is None for p in info["pieces"]):
            # a block of rows of a tensor saved whole: one stretch of its flat elements
            start += piece.tp_shard[1] * math.prod(info["shape"]) // split[1]
        elif any((p["tp"] and (p["tp"][0], p["tp"][2])) != split for p in info["pieces"]):
            return cut(self.tensor(piece.name, kind), piece)
        out = torch.zeros(n, dtype=DTYPES[info["dtype"]])
        for p in info["pieces"]:
            lo, hi = max(start, p["start"]), min(start + n, p["start"] + p["numel"])
            if hi > lo and (p["tp"] is None or p["tp"][1] == piece.tp_shard[1]):
                self._fill(out[lo - start:hi - start], piece.name, p, kind, first=lo - p["start"])
        return out


def cut(full, piece):
    """This rank's piece of a full tensor: its tp block, then the flat range."""
    block = full
    if piece.tp_shard is not None:
        dim, rank, world = piece.tp_shard
        block = full.chunk(world, dim)[rank]
    return block.reshape(-1)[piece.offset:piece.offset + piece.end - piece.start]


@torch.no_grad()
def load(saved, wrapper, opt, rng_of_rank=None, flag="--resume"):
    """Every rank fills its params and Adam state from a save made in any layout (rng_of_rank:
    whose RNG states to restore, or None), holding one full tensor at a time at most.

    One all-reduce agrees on whether every rank's reads passed, so a corrupt file found by one
    stops all with the same SaveError naming it."""
    pieces, mesh = wrapper.owned_pieces(), getattr(wrapper, "mesh", None)
    rank, names = mesh.global_rank if mesh else 0, sorted(saved.meta["files"])
    code, error = 0, None
    try:
        _load(saved, pieces, opt, rng_of_rank)
    except FileError as e:
        # a corrupt file outranks a short one
        error, code = e, (2 - e.kind) * SLOT + names.index(e.name) + 1
    except SaveError as e:
        error, code = e, min(rank, SLOT - 1) + 1
    agreed = code if mesh is None else int(all_reduce_max(mesh.world_group, code, next(
        (p.param.device for p in pieces), "cpu")))
    if not agreed:
        return
    kind, index = divmod(agreed - 1, SLOT)
    if agreed != code or error is None:
        error = (f"{saved.path} does not fit this model "
                 f"(rank {index}: a tensor's name or shape, or its RNG state)",
                 f"{saved.path / names[index]} is truncated or unreadable",
                 corrupt(saved.path, names[index]))[kind]
    raise SaveError(f"{flag}: {error}")


def _load(saved, pieces, opt, rng_of_rank):
    kinds, adam = saved.meta["optimizer"]["kinds"], {}
    for piece in pieces:
        if piece.name not in saved.tensors:
            raise SaveError(f"{saved.path} has no tensor {piece.name}")
        for kind in kinds:
            # FSDP padding keeps zero moments, as in training
            target = piece.param if kind == "param" else adam.setdefault(
                piece.param, {}).setdefault(kind, torch.zeros_like(piece.param))
            target.view(-1)[piece.start:piece.end].copy_(saved.read(piece, kind))
    if adam:
        state = opt.state_dict()
        indices = [i for group in state["param_groups"] for i in group["params"]]
        params = [p for group in opt.param_groups for p in group["params"]]
        step = torch.tensor(float(saved.meta["optimizer"]["step"]), dtype=torch.float32)
        state["state"] = {i: {"step": step.clone(), **adam[p]} for i, p in zip(indices, params)}
        opt.load_state_dict(state)
    if rng_of_rank is not None:
        where = saved.path / "meta.json"
        if str(rng_of_rank) not in saved.meta["rng"]:
            raise SaveError(f"{where} has no key 'rng.{rng_of_rank}'")
        try:
            set_rng_state(saved.meta["rng"][str(rng_of_rank)])
        except (KeyError, TypeError, ValueError, IndexError, RuntimeError) as e:
            raise SaveError(f"{where}: rng.{rng_of_rank} is not an RNG state "
                            f"({type(e).__name__}: {e})") from None


# ---------------------------------------------------------------- export and sampling

class LazyTensor:
    """A saved global tensor, read when called: export holds one full tensor at a time."""

    def __init__(self, saved, name):
        self.saved, self.name = saved, name
        self.shape = torch.Size(saved.tensors[name]["shape"])
        self.dtype = DTYPES[saved.tensors[name]["dtype"]]

    def __call__(self):
        return self.saved.tensor(self.name)


def check_layers(cfg, tensors, where):
    """SaveError unless cfg's n_layer is the number of layers the save holds tensors of: checked
    before a model of cfg is built, which for 10^6 layers takes hours even on the meta device."""
    held = {name.split(".")[1] for name in tensors
            if name.startswith("layers.") and name.count(".") >= 2}
    if cfg.n_layer != len(held):
        raise SaveError(f"{where}: its config's model has n_layer {cfg.n_layer}, "
                        f"the save holds tensors of {len(held)} layer{'s' * (len(held) != 1)}")


def model_shapes(cfg):
    """{name: shape} of the parameters of a model of cfg, in its order (tied: no lm_head)."""
    with torch.device("meta"), warnings.catch_warnings():  # shapes only; a zero-size one would warn
        warnings.simplefilter("ignore")
        return {name: p.shape for name, p in GPT(cfg).named_parameters()}


def check_tensors(cfg, tensors, where):
    """The tensors in the model's order (so every layout exports the same bytes); SaveError
    naming `where` unless they are cfg's model's."""
    shapes = model_shapes(cfg)
    for name, shape in shapes.items():
        if name not in tensors or tensors[name].shape != shape:
            found = f"shape {list(tensors[name].shape)}" if name in tensors else "no such tensor"
            raise SaveError(f"{where}: its config's model needs {name} of shape {list(shape)}, "
                            f"the save has {found}")
    extra = sorted(set(tensors) - set(shapes))
    if extra:
        raise SaveError(f"{where}: the save has {extra[0]}, "
                        "which its config's model has no place for")
    return {name: tensors[name] for name in shapes}


def read_model(run, verify=True):
    """(ModelConfig, tokenizer, {name: LazyTensor} in the model's order, save folder) of the
    newest complete save in `run`, or of `run` if it is one: what export and sampling read.

    SaveError names its meta.json unless it is a whole model of its config. With verify the
    params' CRC-32 is checked now, so sampling finds a bad file before anything runs. Else each
    LazyTensor checks its pieces as it is read: export makes one pass."""
    run = Path(run)
    path = run if (run / "complete").exists() else (complete_saves(run) or [None])[-1]
    if path is None:
        raise SaveError(f"no complete save in {run}")
    saved, where = Saved(path).validate(), path / "meta.json"
    if verify:
        saved.verify(kinds=["param"])
    config = saved.meta["config"]
    try:
        cfg = config_from_dict(config["model"])
        enc = get_tokenizer(config["tokenizer"], config.get("tokenizer_file"))
    except (TypeError, ValueError) as e:
        raise SaveError(f"{where}: {e}".replace("\n", " ")) from None
    except DataError as e:
        raise SaveError(f"{where}: the run's tokenizer: {e}") from None
    tensors = {name: LazyTensor(saved, name) for name in saved.tensors}
    check_layers(cfg, tensors, where)
    return cfg, enc, check_tensors(cfg, tensors, where), path
