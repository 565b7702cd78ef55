"""Sharded saves: every rank writes only what it owns. The layout of a save: saves/__init__.py.

A piece is the run of elements [start, start + numel) of the flattened tp block
`tp` = [dim, rank, world] of a global tensor, or of the whole tensor when tp is null.
It is a DDP param or an FSDP shard segment. Adam's state maps like its param.
Every element has one writer: DDP replicas over dp x cp, HSDP replicas and tp-replicated norms
are written once. So a save is 12 bytes per parameter in all, whatever the layout.
Each buffer's CRC-32 is taken as it is written (integrity.py).

Atomic. The ranks write into RUN/.tmp_step_STEP_ID/. Rank 0 merges their indexes into meta.json,
writes `complete`, then renames the folder to step_STEP. Resume ignores anything else and
removes it. The newest --keep saves stay.
--async-save copies the pieces to CPU memory (the stall); then a thread writes them while
training goes on. Rank 0's thread waits for every rank's index file, then finalizes.
No collective runs off the main thread.

A save that fails stops every rank alike: a full disk, an OSError on any rank in its own write
or in rank 0's finalize. The ranks agree by an all-reduce of a failure code, after the writes
and after rank 0's finalize. For an async save that is on the training thread, at the next
save() or wait(). Rank 0 removes the temp folder. Every rank raises SaveFailed (exit 3), naming
the newest save that verifies; the failed save never touched it.
"""
import contextlib
import json
import os
import random
import shutil
import threading
import time
from pathlib import Path

import numpy as np
import torch

from data.files import fsync_dir, read_text, write_json
from parallel.comm import all_reduce_max
from saves import SaveError, TrainingFailure
from saves.integrity import FORMAT, SAVE, check_files, check_meta, crc32, piece_seed, verify

ADAM = ("exp_avg", "exp_avg_sq")


# ---------------------------------------------------------------- the run folder

def complete_saves(run_dir):
    """Complete saves in the run folder, oldest first."""
    run_dir = Path(run_dir)
    found = [p for p in run_dir.glob("step_*")
             if SAVE.match(p.name) and (p / "complete").exists()]
    return sorted(found, key=lambda p: p.name)


def remove_incomplete(run_dir):
    """Removes saves killed mid-write (.tmp_*), half-deleted (.del_*), or without `complete`.

    Rank 0 calls it."""
    for p in Path(run_dir).glob("*step_*"):
        if p.is_symlink():
            continue  # a link: what it leads to is not this run's to delete
        if p.is_dir() and (p.name.startswith((".tmp_", ".del_"))
                           or (SAVE.match(p.name) and not (p / "complete").exists())):
            shutil.rmtree(p, ignore_errors=True)


def _retire(path):
    """Deletes a save folder. It is renamed first, so it is never seen half-deleted under its name.

    A link is left alone: what it leads to is not this run's to delete."""
    if path.is_symlink():
        return
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


def last_good_save(run_dir, group=None, device="cpu"):
    """The newest complete save whose meta.json, sizes and checksums verify, or None.

    A failed run names it to go back to. With `group`, every rank of it calls this and reads
    a share of each save's files: usually the cost of one rank's part of one save.
    One all-reduce per save tried agrees on the answer."""
    rank, size = (group.rank, group.size) if group is not None else (0, 1)
    for path in reversed(complete_saves(run_dir)):
        bad = 0.0
        try:
            meta = json.loads(read_text(path / "meta.json"))
            check_meta(meta, path / "meta.json")
            check_files(path, meta)
            verify(path, meta, files=sorted(meta["files"])[rank::size])
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


# ---------------------------------------------------------------- writing

def global_shape(piece):
    shape = list(piece.shape)
    if piece.tp_shard is not None:
        dim, _, world = piece.tp_shard
        shape[dim] *= world
    return shape


def written_pieces(wrapper, opt, copy):
    """[(piece, {kind: 1-D CPU tensor})] for the pieces this rank writes; copy snapshots (async)."""
    out = []
    for piece in wrapper.owned_pieces():
        if not piece.writer:
            continue
        sources = {"param": piece.param,
                   **({k: opt.state[piece.param][k] for k in ADAM} if opt.state else {})}
        out.append((piece, {kind: t.detach().reshape(-1)[piece.start:piece.end].to("cpu",
                                                                                  copy=copy)
                            for kind, t in sources.items()}))
    return out


def write_rank(folder, rank, pieces, rank_info):
    """Writes this rank's bytes, if any, then its index: atomically and last, the sign it is done.

    Each buffer's CRC-32 starts from what the buffer is (piece_seed)."""
    folder.mkdir(parents=True, exist_ok=True)
    name, index, pos = f"rank{rank:05d}.bin", [], 0
    with open(folder / name, "wb") if pieces else contextlib.nullcontext() as f:
        for piece, tensors in pieces:
            offsets, crcs, numel = {}, {}, piece.end - piece.start
            for kind, t in tensors.items():
                data = t.contiguous().view(torch.uint8).numpy()
                f.write(data.data)
                seed = piece_seed(piece.name, kind, piece.tp_shard, piece.offset, numel)
                offsets[kind], crcs[kind], pos = pos, crc32(data, seed), pos + data.nbytes
            index.append({"name": piece.name, "shape": global_shape(piece),
                          "dtype": str(t.dtype).split(".")[1],
                          "tp": piece.tp_shard, "start": piece.offset, "numel": numel,
                          "offsets": offsets, "crc32": crcs})
        if pieces:
            f.flush()
            os.fsync(f.fileno())
    write_json(folder / f"rank{rank:05d}.json",
               {"file": name, "bytes": pos, "pieces": index, **rank_info})


def finalize(run_dir, folder, step, world, header, keep, wait_s, abort=None):
    """Rank 0, once every rank's index is there: merge them into meta.json, mark, publish, prune.

    Returns the published folder. OSError if it cannot: a full disk, or an index missing after
    wait_s. Once `abort` is set (another rank's part failed) it publishes nothing: None."""
    indexes = [folder / f"rank{r:05d}.json" for r in range(world)]
    deadline = time.time() + wait_s
    while not all(p.exists() for p in indexes):
        if abort is not None and abort.is_set():
            return None
        if time.time() > deadline or not folder.exists():
            raise TimeoutError(f"not every rank's part reached {folder} within {wait_s} s")
        time.sleep(0.05)
    tensors, files, rng = {}, {}, {}
    for r, path in enumerate(indexes):
        info = json.loads(path.read_text())
        rng[r] = info["rng"]
        if info["bytes"]:
            files[info["file"]] = info["bytes"]
        for p in info["pieces"]:
            entry = tensors.setdefault(p["name"],
                                       {"shape": p["shape"], "dtype": p["dtype"], "pieces": []})
            entry["pieces"].append({"file": info["file"],
                                    **{k: p[k] for k in ("tp", "start", "numel", "offsets",
                                                         "crc32")}})
    write_json(folder / "meta.json", {**header, "rng": rng, "files": files, "tensors": tensors})
    for path in indexes:
        path.unlink()
    with open(folder / "complete", "w") as f:
        f.write(f"{step}\n")
        f.flush()
        os.fsync(f.fileno())
    final = run_dir / f"step_{step:07d}"
    old = final.with_name(f".del_{final.name}_{os.getpid()}")
    # saved again after resuming from an older save: the old one goes once the new one is in
    if final.exists():
        os.replace(final, old)
    try:
        os.replace(folder, final)
    except OSError:
        if old.exists():
            os.replace(old, final)
        raise
    # published: nothing below may fail the save (prune never raises)
    shutil.rmtree(old, ignore_errors=True)
    with contextlib.suppress(OSError):  # the rename is done; an fsync error only weakens durability
        fsync_dir(run_dir)
    prune(run_dir, keep)
    return final


class SaveFailed(TrainingFailure):
    """A save that could not be written (a full disk). Each rank raises it; its temp folder goes."""

    def __init__(self, step, reason, good):
        super().__init__(f"the save of step {step} failed ({reason}) and was removed; "
                         + (f"the last good save, {good}, is intact" if good
                            else "there is no earlier save"))
        self.step, self.reason, self.good = step, reason, good


class Job:
    """One save in flight: its folder, this rank's outcome (the writer's), rank 0's finalize's."""

    def __init__(self, folder, step):
        self.folder, self.step, self.thread = folder, step, None
        self.written, self.abort = threading.Event(), threading.Event()
        self.error = self.final_error = self.finish = None


ERRNO_SLOT = 1 << 16  # failure code errno * ERRNO_SLOT + rank + 1: exact in a float32 all-reduce


class Saver:
    """save() writes this rank's pieces and returns the seconds training stalled for it.

    It is synchronous (a barrier, then rank 0 finalizes), or with async_save a background thread
    writes a CPU snapshot. A failed save raises SaveFailed on every rank: in save() itself (sync),
    or at the next save() or wait() (async)."""

    def __init__(self, run_dir, mesh, device, keep=2, async_save=False, run_id=0):
        self.run_dir, self.mesh, self.device, self.keep = Path(run_dir), mesh, device, keep
        self.async_save, self.run_id, self.job = async_save, run_id, None

    def save(self, step, wrapper, opt, header):
        t0 = time.perf_counter()
        self.wait()  # one save in flight at a time: its snapshot may not be overwritten
        pieces = written_pieces(wrapper, opt, copy=self.async_save)
        rank_info = {"rng": rng_state()}
        # below step if fp16 skipped some
        adam_steps = max((int(s["step"]) for s in opt.state.values()), default=0)
        header = {**header, "format": FORMAT, "step": step, "data_position": step,
                  "world": self.mesh.world,
                  "optimizer": {"step": adam_steps,
                                "kinds": ["param", *ADAM] if opt.state else ["param"]}}
        job = Job(self.run_dir / f".tmp_step_{step:07d}_{self.run_id:06x}", step)
        job.finish = lambda abort=None: finalize(self.run_dir, job.folder, step, self.mesh.world,
                                                 header, self.keep,
                                                 1800 if self.async_save else 60, abort)
        if self.async_save:
            self.job, job.thread = job, threading.Thread(target=self._write,
                                                         args=(job, pieces, rank_info),
                                                         daemon=True)
            job.thread.start()
        else:
            self._write(job, pieces, rank_info)
            self._settle(job)
        return time.perf_counter() - t0

    def _write(self, job, pieces, rank_info):
        """Writes this rank's part.

        On rank 0 an async save's thread then waits for every index, and finalizes."""
        try:
            write_rank(job.folder, self.mesh.global_rank, pieces, rank_info)
        except Exception as e:  # noqa: BLE001 - reported on every rank's training thread (_settle)
            job.error = e
        job.written.set()
        if self.async_save and job.error is None and self.mesh.global_rank == 0:
            try:
                job.finish(job.abort)
            except Exception as e:  # noqa: BLE001 - as above
                job.final_error = e

    def wait(self):
        """Waits for the save in flight; raises SaveFailed on every rank if it failed on any."""
        job, self.job = self.job, None
        if job is not None:
            self._settle(job)

    def _settle(self, job):
        """On every rank's training thread: agree whether each rank's write worked (a barrier too).

        Then rank 0 finalizes (sync), or its thread is waited for (async). The ranks agree on that
        too, and clean up on a failure."""
        rank = self.mesh.global_rank
        job.written.wait()
        own = job.error
        agreed = self._agree(own)
        if agreed:
            job.abort.set()
        elif rank == 0 and not self.async_save:
            try:
                job.finish()
            except Exception as e:  # noqa: BLE001 - agreed on below
                job.final_error = e
        if job.thread is not None:
            job.thread.join()
        if not agreed:
            own = job.final_error
            agreed = self._agree(own)
        if not agreed:
            return
        if rank == 0:
            shutil.rmtree(job.folder, ignore_errors=True)
        good = last_good_save(self.run_dir, self.mesh.world_group, self.device)
        if own is not None and not isinstance(own, OSError):
            # a bug, not the disk: its traceback, on this rank, after every rank's collectives
            raise own
        raise SaveFailed(job.step, self._reason(agreed, own), good)

    def _code(self, error):
        """0 for no error, else errno * ERRNO_SLOT + rank + 1; the all-reduce's max names a rank."""
        if error is None:
            return 0
        number = getattr(error, "errno", None)
        number = number if isinstance(number, int) and 0 < number < 256 else 0
        return number * ERRNO_SLOT + min(self.mesh.global_rank, ERRNO_SLOT - 1) + 1

    def _agree(self, error):
        """The largest failure code over all ranks (0: every rank succeeded)."""
        return int(all_reduce_max(self.mesh.world_group, self._code(error), self.device))

    def _reason(self, agreed, own):
        """What failed, in words: this rank's error if it was agreed on, else the rank and errno."""
        number, rank = divmod(agreed - 1, ERRNO_SLOT)
        where = f"rank {rank}: " if self.mesh.world > 1 else ""
        if own is not None and agreed == self._code(own):
            text = own.strerror if isinstance(own, OSError) and own.strerror else str(own)
            return where + (text or type(own).__name__)
        return where + (os.strerror(number) if number else "its write failed")


def agree_on_run_id(mesh, device):
    """A random id all ranks share; it names this attempt's temp folders.

    The all-reduce is also a barrier."""
    return int(all_reduce_max(mesh.world_group, int.from_bytes(os.urandom(3), "little"), device))
