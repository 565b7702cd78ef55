"""Loading a save (write.py) into any layout: resuming is resharding.

For each piece this rank holds now (a Piece: a tp block of a global tensor, or a flat range of one),
and for the param and each Adam moment: if the save split that tensor over tp the same way, read exactly the
overlapping byte ranges of the saved pieces (a same-layout resume or a dp/fsdp/hsdp reshard reads each byte once);
otherwise assemble the full global tensor from its saved pieces, cut the new piece out, and drop it. So no rank
holds more than one full tensor beyond its own shard. Export and sampling read full tensors one at a time.
"""
import json
from pathlib import Path

import numpy as np
import torch

from saves import SaveError
from saves.write import complete_saves, global_shape, set_rng_state


class Saved:
    """One complete save on disk. tensor(name, kind) assembles a full global tensor from its pieces."""

    def __init__(self, path):
        self.path = Path(path)
        try:
            self.meta = json.loads((self.path / "meta.json").read_text())
            self.step, self.tensors = self.meta["step"], self.meta["tensors"]
        except (OSError, ValueError, KeyError) as e:
            raise SaveError(f"cannot read {self.path / 'meta.json'}: {type(e).__name__}: {e}") from None

    def _fill(self, out, p, kind, first=0):
        """Reads elements [first, first + out.numel()) of saved piece p into the 1-D tensor out."""
        with open(self.path / p["file"], "rb") as f:
            f.seek(p["offsets"][kind] + first * out.element_size())
            if f.readinto(out.view(torch.uint8).numpy()) != out.numel() * out.element_size():
                raise SaveError(f"{self.path / p['file']} is truncated")

    def validate(self):
        """Every file has the size the metadata says, and every tensor's pieces add up to it."""
        for name, size in self.meta["files"].items():
            path = self.path / name
            actual = path.stat().st_size if path.exists() else None
            if actual != size:
                raise SaveError(f"{path} is {'missing' if actual is None else 'truncated'}: "
                                      f"{actual or 0} of {size} bytes")
        for name, t in self.tensors.items():
            if sum(p["numel"] for p in t["pieces"]) != int(np.prod(t["shape"])):
                raise SaveError(f"{self.path}: the pieces of {name} do not cover its shape {t['shape']}")
        return self

    def tensor(self, name, kind="param"):
        """The full tensor, read piece by piece: each tp block is filled through one flat buffer."""
        info = self.tensors[name]
        dtype = getattr(torch, info["dtype"])
        full = torch.empty(info["shape"], dtype=dtype)
        blocks = {}
        for p in info["pieces"]:
            blocks.setdefault(tuple(p["tp"] or ()), []).append(p)
        for tp, pieces in blocks.items():
            block = full.chunk(tp[2], tp[0])[tp[1]] if tp else full
            flat = block.view(-1) if block.is_contiguous() else torch.empty(block.numel(), dtype=dtype)
            for p in pieces:
                self._fill(flat[p["start"]:p["start"] + p["numel"]], p, kind)
            if not block.is_contiguous():
                block.copy_(flat.view(block.shape))
        return full

    def read(self, piece, kind):
        """The piece's elements. Saved with the same tp split: read straight from the files (a resume in the same
        layout, or a dp/fsdp reshard, reads each byte once); else cut from the assembled full tensor."""
        info = self.tensors[piece.name]
        if info["shape"] != global_shape(piece):
            raise SaveError(f"{self.path}: {piece.name} has shape {info['shape']}, "
                                  f"this model has {global_shape(piece)}")
        split = piece.tp_shard and (piece.tp_shard[0], piece.tp_shard[2])  # (dim, world) or None
        if any((p["tp"] and (p["tp"][0], p["tp"][2])) != split for p in info["pieces"]):
            return cut(self.tensor(piece.name, kind), piece)
        start, n = piece.offset, piece.end - piece.start
        out = torch.empty(n, dtype=getattr(torch, info["dtype"]))
        for p in info["pieces"]:
            lo, hi = max(start, p["start"]), min(start + n, p["start"] + p["numel"])
            if hi > lo and (p["tp"] is None or p["tp"][1] == piece.tp_shard[1]):
                self._fill(out[lo - start:hi - start], p, kind, first=lo - p["start"])
        return out


def cut(full, piece):
    """This rank's piece of a full tensor: its tp block, then the flat range."""
    block = full
    if piece.tp_shard is not None:
        dim, rank, world = piece.tp_shard
        block = full.chunk(world, dim)[rank]
    return block.reshape(-1)[piece.offset:piece.offset + piece.end - piece.start]


@torch.no_grad()
def load(saved, wrapper, opt, rng_of_rank=None):
    """Fills this rank's params and Adam state from a save made in any layout, holding at most one full tensor
    at a time; rng_of_rank: whose RNG states to restore (same layout), or None."""
    kinds, adam = saved.meta["optimizer"]["kinds"], {}
    for piece in wrapper.owned_pieces():
        if piece.name not in saved.tensors:
            raise SaveError(f"{saved.path} has no tensor {piece.name}")
        for kind in kinds:
            target = piece.param if kind == "param" else adam.setdefault(piece.param, {}).setdefault(
                kind, torch.zeros_like(piece.param))  # FSDP padding keeps zero moments, as in training
            target.view(-1)[piece.start:piece.end].copy_(saved.read(piece, kind))
    if adam:
        state = opt.state_dict()
        indices = [i for group in state["param_groups"] for i in group["params"]]
        params = [p for group in opt.param_groups for p in group["params"]]
        step = torch.tensor(float(saved.meta["optimizer"]["step"]), dtype=torch.float32)
        state["state"] = {i: {"step": step.clone(), **adam[p]} for i, p in zip(indices, params)}
        opt.load_state_dict(state)
    if rng_of_rank is not None:
        set_rng_state(saved.meta["rng"][str(rng_of_rank)])


def check_config(saved, current, where=""):
    """Refuses to resume under a different model, data or optimization config; names the first difference."""
    def first_difference(a, b, prefix=""):
        for key in sorted(set(a) | set(b)):
            x, y = a.get(key), b.get(key)
            if isinstance(x, dict) and isinstance(y, dict):
                found = first_difference(x, y, f"{prefix}{key}.")
                if found:
                    return found
            elif x != y:
                return f"{prefix}{key}", x, y
        return None
    found = first_difference(saved, current)
    if found:
        key, x, y = found
        raise SaveError(f"{where}has {key}={x!r}, this run has {key}={y!r}")


def find_resume(run_dir, mode, config):
    """The validated save to resume from, or None (mode None: a fresh run; 'auto': fresh if there is none)."""
    if mode is None:
        return None
    found = complete_saves(run_dir)
    if not found:
        if mode == "auto":
            return None
        raise SaveError(f"--resume: no complete save in {run_dir} (use --resume auto to start fresh)")
    try:
        saved = Saved(found[-1]).validate()
        check_config(saved.meta["config"], config, where=f"{found[-1]} ")
    except SaveError as e:
        raise SaveError(f"--resume: {e}") from None
    return saved


# ---------------------------------------------------------------- export and sampling

class LazyTensor:
    """A saved global tensor, read when called: export holds one full tensor at a time."""

    def __init__(self, saved, name):
        self.saved, self.name = saved, name
        self.shape = torch.Size(saved.tensors[name]["shape"])
        self.dtype = getattr(torch, saved.tensors[name]["dtype"])

    def __call__(self):
        return self.saved.tensor(self.name)


def model_tensors(run_dir):
    """(run config, {global name: LazyTensor}) of the newest complete save in run_dir (or of that save)."""
    run_dir = Path(run_dir)
    path = run_dir if (run_dir / "complete").exists() else (complete_saves(run_dir) or [None])[-1]
    if path is None:
        raise SaveError(f"no complete save in {run_dir}")
    saved = Saved(path).validate()
    return saved.meta["config"], {name: LazyTensor(saved, name) for name in saved.tensors}
