"""Sharded saves: every rank writes only what it owns (the layout of a save is in saves/__init__.py).

A piece is the run of elements [start, start + numel) of the flattened tp block `tp` = [dim, rank, world] of a
global tensor (of the whole tensor when tp is null): a DDP param, an FSDP shard segment. Adam's state maps like its
param. Every element has one writer: DDP replicas over dp x cp, HSDP replicas and tp-replicated norms are written
once, so a save is 12 bytes per parameter in all, whatever the layout.
Atomic: the ranks write into RUN/.tmp_step_STEP_ID/, rank 0 merges their indexes into meta.json, writes `complete`,
then renames the folder to step_STEP; resume ignores anything else and removes it. The newest --keep stay.
--async-save copies the pieces to CPU memory (the stall), then a thread writes them while training goes on; rank
0's thread waits for every rank's index file, then finalizes. No collective runs off the main thread.
"""
import json
import os
import random
import re
import shutil
import sys
import threading
import time
from contextlib import nullcontext
from pathlib import Path

import numpy as np
import torch

from parallel.comm import all_reduce_max
from saves.files import fsync_dir, write_json

SAVE = re.compile(r"step_(\d{7})$")
ADAM = ("exp_avg", "exp_avg_sq")


# ---------------------------------------------------------------- the run folder

def complete_saves(run_dir):
    """Complete saves in the run folder, oldest first."""
    run_dir = Path(run_dir)
    found = [p for p in run_dir.glob("step_*") if SAVE.match(p.name) and (p / "complete").exists()]
    return sorted(found, key=lambda p: p.name)


def remove_incomplete(run_dir):
    """Saves killed mid-write (.tmp_*), half-deleted ones (.del_*) and folders without `complete` (rank 0)."""
    for p in Path(run_dir).glob("*step_*"):
        if p.is_dir() and (p.name.startswith((".tmp_", ".del_")) or (SAVE.match(p.name) and
                                                                      not (p / "complete").exists())):
            shutil.rmtree(p, ignore_errors=True)


def _retire(path):
    """Deletes a save folder: renamed first, so that it is never seen half-deleted under its name."""
    trash = path.with_name(f".del_{path.name}_{os.getpid()}")
    try:
        os.replace(path, trash)
    except OSError:  # already gone (another process pruned it)
        return
    shutil.rmtree(trash, ignore_errors=True)


def prune(run_dir, keep):
    if keep > 0:
        for old in complete_saves(run_dir)[:-keep]:
            _retire(old)


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
        torch.cuda.set_rng_state(torch.frombuffer(bytearray.fromhex(state["cuda"]), dtype=torch.uint8))


# ---------------------------------------------------------------- writing

def global_shape(piece):
    shape = list(piece.shape)
    if piece.tp_shard is not None:
        dim, _, world = piece.tp_shard
        shape[dim] *= world
    return shape


def written_pieces(wrapper, opt, copy):
    """[(piece, {kind: 1-D CPU tensor})] for the pieces this rank writes; copy: snapshot them (async)."""
    out = []
    for piece in wrapper.owned_pieces():
        if not piece.writer:
            continue
        sources = {"param": piece.param, **({k: opt.state[piece.param][k] for k in ADAM} if opt.state else {})}
        out.append((piece, {kind: t.detach().reshape(-1)[piece.start:piece.end].to("cpu", copy=copy)
                            for kind, t in sources.items()}))
    return out


def write_rank(folder, rank, pieces, rank_info):
    """This rank's bytes (if it writes any), then, atomically and last, its index: the sign that it is done."""
    folder.mkdir(parents=True, exist_ok=True)
    name, index, pos = f"rank{rank:05d}.bin", [], 0
    with open(folder / name, "wb") if pieces else nullcontext() as f:
        for piece, tensors in pieces:
            offsets = {}
            for kind, t in tensors.items():
                f.write(t.contiguous().view(torch.uint8).numpy().data)
                offsets[kind], pos = pos, pos + t.numel() * t.element_size()
            index.append({"name": piece.name, "shape": global_shape(piece), "dtype": str(t.dtype).split(".")[1],
                          "tp": piece.tp_shard, "start": piece.offset, "numel": piece.end - piece.start,
                          "offsets": offsets})
        if pieces:
            f.flush()
            os.fsync(f.fileno())
    write_json(folder / f"rank{rank:05d}.json", {"file": name, "bytes": pos, "pieces": index, **rank_info})


def finalize(run_dir, folder, step, world, header, keep, wait_s):
    """Rank 0: once every rank's index is there, merge them into meta.json, mark complete, publish, prune."""
    indexes = [folder / f"rank{r:05d}.json" for r in range(world)]
    deadline = time.time() + wait_s
    while not all(p.exists() for p in indexes):
        if time.time() > deadline or not folder.exists():
            print(f"warning: save of step {step} abandoned: not every rank wrote to {folder}", file=sys.stderr)
            return None
        time.sleep(0.05)
    tensors, files, rng = {}, {}, {}
    for r, path in enumerate(indexes):
        info = json.loads(path.read_text())
        rng[r] = info["rng"]
        if info["bytes"]:
            files[info["file"]] = info["bytes"]
        for p in info["pieces"]:
            entry = tensors.setdefault(p["name"], {"shape": p["shape"], "dtype": p["dtype"], "pieces": []})
            entry["pieces"].append({"file": info["file"], **{k: p[k] for k in ("tp", "start", "numel", "offsets")}})
    write_json(folder / "meta.json", {**header, "rng": rng, "files": files, "tensors": tensors})
    for path in indexes:
        path.unlink()
    with open(folder / "complete", "w") as f:
        f.write(f"{step}\n")
        f.flush()
        os.fsync(f.fileno())
    final = run_dir / f"step_{step:07d}"
    if final.exists():  # saved again after resuming from an older save
        _retire(final)
    try:
        os.replace(folder, final)
    except OSError as e:  # another process published this step meanwhile (tests share a scratch folder)
        print(f"warning: could not publish {final}: {e}", file=sys.stderr)
        shutil.rmtree(folder, ignore_errors=True)
        return None
    fsync_dir(run_dir)
    prune(run_dir, keep)
    return final


class Saver:
    """save() writes this rank's pieces; synchronously (a barrier, then rank 0 finalizes), or with async_save
    from a background thread after a CPU snapshot. Returns the seconds training stalled for it."""

    def __init__(self, run_dir, mesh, device, keep=2, async_save=False, run_id=0):
        self.run_dir, self.mesh, self.device, self.keep = Path(run_dir), mesh, device, keep
        self.async_save, self.run_id, self.thread = async_save, run_id, None

    def save(self, step, wrapper, opt, header):
        t0 = time.perf_counter()
        self.wait()  # one save in flight at a time: its snapshot may not be overwritten
        pieces = written_pieces(wrapper, opt, copy=self.async_save)
        rank_info = {"rng": rng_state()}
        adam_steps = max((int(s["step"]) for s in opt.state.values()), default=0)  # < step if fp16 skipped some
        header = {**header, "step": step, "data_position": step, "world": self.mesh.world,
                  "optimizer": {"step": adam_steps, "kinds": ["param", *ADAM] if opt.state else ["param"]}}
        folder = self.run_dir / f".tmp_step_{step:07d}_{self.run_id:06x}"
        rank = self.mesh.global_rank
        if self.async_save:
            self.thread = threading.Thread(target=self._write, args=(folder, step, pieces, rank_info, header, 1800),
                                           daemon=True)
            self.thread.start()
        else:
            write_rank(folder, rank, pieces, rank_info)
            all_reduce_max(self.mesh.world_group, 0.0, self.device)  # a barrier: every rank's files are there
            if rank == 0:
                finalize(self.run_dir, folder, step, self.mesh.world, header, self.keep, wait_s=60)
        return time.perf_counter() - t0

    def _write(self, folder, step, pieces, rank_info, header, wait_s):
        try:
            write_rank(folder, self.mesh.global_rank, pieces, rank_info)
            if self.mesh.global_rank == 0:
                finalize(self.run_dir, folder, step, self.mesh.world, header, self.keep, wait_s)
        except Exception as e:  # noqa: BLE001 - a failed save must not kill training; the last good one stays
            print(f"warning: save of step {step} failed: {type(e).__name__}: {e}", file=sys.stderr)

    def wait(self):
        if self.thread is not None:
            self.thread.join()
            self.thread = None


def agree_on_run_id(mesh, device):
    """A random id all ranks share (names this attempt's temp folders). The all-reduce is also a barrier."""
    return int(all_reduce_max(mesh.world_group, int.from_bytes(os.urandom(3), "little"), device))
