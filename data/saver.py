"""Writing a save: each rank its own pieces, rank 0 the index; sync, or async from a thread.

    saver = Saver(run_dir, mesh, device, keep, async_save, run_id)
    stall = saver.save(step, wrapper, opt, header)   # seconds training waited for it
    saver.wait()                                     # the save in flight, written and agreed on

The ranks write into RUN/.tmp_step_STEP_ID/ (the format: saves.py); rank 0 merges their indexes
into meta.json, writes `complete` and renames the folder to step_STEP, then prunes. Every rank
agrees on whether each write and the finalize worked: a failure on any rank (a full disk) stops
every rank alike with SaveFailed (exit 3), naming the newest save that verifies.
"""
import contextlib
import json
import os
import shutil
import threading
import time
import zlib
from pathlib import Path

import torch

from data import TrainingFailure
from data.files import fsync_dir, write_json
from data.integrity import FORMAT, piece_seed
from data.saves import ADAM, global_shape, last_good_save, prune, rng_state
from parallel.comm import all_reduce_max


def not_finite(wrapper, opt, group, device):
    """'' if every weight and Adam moment a save would write is finite on every rank of the group;
    else which ("the weights", "Adam's state"). Two flags all-reduced: a save is a sync point."""
    moments = [v for s in opt.state.values() for k, v in s.items() if k in ADAM]
    bad = []
    for what, tensors in (("the weights", list(wrapper.optim_params())), ("Adam's state", moments)):
        finite = torch.stack([torch.isfinite(t).all() for t in tensors]).all() if tensors else True
        if all_reduce_max(group, float(not finite), device):
            bad.append(what)
    return " and ".join(bad)


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
    """Writes this rank's bytes, if any, then its index: atomically, last, the sign it is done."""
    folder.mkdir(parents=True, exist_ok=True)
    name, index, pos = f"rank{rank:05d}.bin", [], 0
    with open(folder / name, "wb") if pieces else contextlib.nullcontext() as f:
        for piece, tensors in pieces:
            offsets, crcs, numel = {}, {}, piece.end - piece.start
            for kind, t in tensors.items():
                data = t.contiguous().view(torch.uint8).numpy()
                f.write(data.data)
                seed = piece_seed(piece.name, kind, piece.tp_shard, piece.offset, numel)
                offsets[kind], crcs[kind], pos = pos, zlib.crc32(data, seed), pos + data.nbytes
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
    """Rank 0, once every rank's index is there: merges them into meta.json, marks, publishes
    and prunes; returns the save. OSError if it cannot; None once `abort` is set (another rank
    failed)."""
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
    prune(run_dir, keep, header["config"])
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

    Sync: a barrier, then rank 0 finalizes. Async: a thread writes a CPU snapshot. A failed save
    raises SaveFailed on every rank, in save() (sync) or at the next save() or wait() (async)."""

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
        """Writes this rank's part; on rank 0 an async save's thread then finalizes."""
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
        """On every rank's training thread: agree whether each rank's write, then rank 0's
        finalize, worked (barriers too); on a failure, clean up and raise SaveFailed."""
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
    """A random id all ranks share, naming this attempt's temp folders (a barrier too)."""
    return int(all_reduce_max(mesh.world_group, int.from_bytes(os.urandom(3), "little"), device))
