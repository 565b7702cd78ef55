"""Loading a save (write.py) into any layout: resuming is resharding.

Take each piece this rank now holds (a Piece: a tp block of a global tensor, or a flat range
of one), for the param and each Adam moment. If the save split that tensor over tp the same way,
read exactly the overlapping byte ranges of the saved pieces. So a same-layout resume, or a
dp/fsdp/hsdp reshard, reads each byte once. Otherwise assemble the full global tensor from its
saved pieces, cut the new piece out, and drop it. No rank holds more than one full tensor beyond
its own shard. Export and sampling read full tensors one at a time.

Nothing is trusted unchecked (integrity.py): meta.json's keys and file names when a save is
opened, the file sizes in validate(), and the CRC-32 of every piece as it is read. A resume
agrees over all ranks on whether every rank's reads passed. So all of them stop alike,
with the same one line naming the file.
"""
import json
from pathlib import Path

import torch

from data.files import open_regular, read_text
from parallel.comm import all_reduce_max
from saves import SaveError
from saves.integrity import DTYPES, check_files, check_meta, corrupt, crc32, seed_of
from saves.integrity import verify as verify_files
from saves.write import complete_saves, global_shape, set_rng_state

# load() agrees on kind * SLOT + (file index, or rank) + 1: exact in the float32 all-reduce
SLOT = 1 << 20


class FileError(SaveError):
    """A saved file that does not read back as written: `name` is its name in the save."""

    def __init__(self, message, name, kind):
        super().__init__(message)
        self.name, self.kind = name, kind


class Saved:
    """One complete save on disk. tensor(name, kind) assembles a full global tensor from pieces."""

    def __init__(self, path):
        self.path = Path(path)
        where = self.path / "meta.json"
        try:
            self.meta = json.loads(read_text(where))
        except OSError as e:  # missing, a FIFO, unreadable
            raise SaveError(f"cannot read {where}: {e.strerror or e}") from None
        except ValueError as e:
            raise SaveError(f"cannot read {where}: {type(e).__name__}: {e}") from None
        check_meta(self.meta, where)
        self.step, self.tensors = self.meta["step"], self.meta["tensors"]
        # verified: the pieces whose CRC-32 passed on this rank
        self.checked, self.verified = self.meta["format"] >= 2, set()

    def _fill(self, out, name, p, kind, first=0):
        """Reads elements [first, first + out.numel()) of saved piece p of `name` into 1-D out.

        A whole piece is checked against its CRC-32. A part of one is cut from the whole piece,
        which is read and checked once."""
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
            if crc32(out, seed_of(self.meta, name, kind, p)) != p["crc32"][kind]:
                raise FileError(corrupt(self.path, p["file"]), p["file"], 0)
            self.verified.add(key)

    def validate(self):
        """Each file has its recorded size and its pieces tile it; each tensor's pieces cover it."""
        check_files(self.path, self.meta)
        return self

    def verify(self, kinds=None):
        """Reads every piece of `kinds` (default: all) and checks its CRC-32.

        This comes before trusting a save wholesale."""
        verify_files(self.path, self.meta, kinds=kinds)
        return self

    def tensor(self, name, kind="param"):
        """The full tensor, read piece by piece: each tp block is filled through one flat buffer."""
        info = self.tensors[name]
        dtype = DTYPES[info["dtype"]]
        full = torch.empty(info["shape"], dtype=dtype)
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
        """The piece's elements.

        Saved with the same tp split, they are read straight from the files: a resume in the same
        layout, or a dp/fsdp reshard, reads each byte once. Else they are cut from the assembled
        full tensor."""
        info = self.tensors[piece.name]
        if info["shape"] != global_shape(piece):
            raise SaveError(f"{self.path}: {piece.name} has shape {info['shape']}, "
                                  f"this model has {global_shape(piece)}")
        split = piece.tp_shard and (piece.tp_shard[0], piece.tp_shard[2])  # (dim, world), or None
        if any((p["tp"] and (p["tp"][0], p["tp"][2])) != split for p in info["pieces"]):
            return cut(self.tensor(piece.name, kind), piece)
        start, n = piece.offset, piece.end - piece.start
        out = torch.empty(n, dtype=DTYPES[info["dtype"]])
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
    """Fills this rank's params and Adam state from a save made in any layout.

    It holds at most one full tensor at a time. rng_of_rank is whose RNG states to restore
    (same layout), or None. Every rank calls it. Then one all-reduce over wrapper.mesh agrees on
    whether every rank's reads passed. So a corrupt file found by one rank stops all of them with
    the same SaveError naming the file, on rank 0 too. `saved` may be anything with a Saved's path,
    meta["files"], meta["optimizer"]["kinds"], tensors and read(), as hf.py's reader has."""
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


def resume(saved, wrapper, opt, scaler, layout, rank):
    """Loads a save made in any layout into this one; returns the step to continue from.

    Without a save that step is 0."""
    if saved is None:
        return 0
    same_layout = saved.meta["layout"] == layout  # else resharding: a rank's RNG has no counterpart
    load(saved, wrapper, opt, rng_of_rank=rank if same_layout else None)
    scaler.load_state_dict(saved.meta["scaler"])
    if rank == 0:
        print(f"resumed from {saved.path} "
              f"(step {saved.step}{'' if same_layout else ', resharded'})", flush=True)
    return saved.step


def check_config(saved, current, where=""):
    """Refuses to resume under another model, data or optimization config; names the change."""
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
    """SaveError unless the config's n_layer is the number of layers the save holds tensors of.

    It runs before a model of the config is built: building one of 10^6 layers,
    even on the meta device, would run for hours."""
    held = {name.split(".")[1] for name in tensors
            if name.startswith("layers.") and name.count(".") >= 2}
    if cfg.n_layer != len(held):
        raise SaveError(f"{where}: its config's model has n_layer {cfg.n_layer}, "
                        f"the save holds tensors of {len(held)} layer{'s' * (len(held) != 1)}")


def model_tensors(run_dir, verify=True):
    """(run config, {global name: LazyTensor}) of run_dir's newest complete save, or of that save.

    With verify the params' CRC-32 is checked now, so sampling finds a bad file before anything
    runs. Else each LazyTensor checks its pieces as it reads them: export makes one pass."""
    run_dir = Path(run_dir)
    path = (run_dir if (run_dir / "complete").exists()
            else (complete_saves(run_dir) or [None])[-1])
    if path is None:
        raise SaveError(f"no complete save in {run_dir}")
    saved = Saved(path).validate()
    if verify:
        saved.verify(kinds=["param"])
    return saved.meta["config"], {name: LazyTensor(saved, name) for name in saved.tensors}
