"""Run a function on N gloo ranks on CPU, the way torchrun would start them: `run_ranks(fn, world=4, args=(...))`
calls fn(rank, world, *args) in each process and returns every rank's value. It re-raises the first failing rank's
traceback, reports a rank that dies without one, and kills everything after `timeout` seconds instead of hanging.
"""
import multiprocessing as mp
import os
import queue
import socket
import time
import traceback

import torch
import torch.distributed as dist

_CTX = mp.get_context("forkserver")  # it imports torch once: a rank starts in well under a second
_CTX.set_forkserver_preload(["torch", "torch.distributed", "torch._dynamo", "model", "train"])


class RankError(RuntimeError):
    pass


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _child(fn, rank, world, port, args, results, init):
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    try:
        torch.set_num_threads(1)
        if init and world > 1:
            dist.init_process_group("gloo", rank=rank, world_size=world)
        results.put((rank, "ok", fn(rank, world, *args)))
    except BaseException as e:  # SystemExit too: a rank that exits is a failure to report
        results.put((rank, "error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
    finally:
        try:
            if dist.is_initialized():
                dist.destroy_process_group()
        except Exception:
            pass


def run_ranks(fn, world, args=(), timeout=120, init=True):
    """fn must be importable (a module-level function). Returns [result of rank 0, rank 1, ...]."""
    results = _CTX.Queue()
    port = free_port()
    procs = [_CTX.Process(target=_child, args=(fn, r, world, port, args, results, init), daemon=True)
             for r in range(world)]
    for p in procs:
        p.start()
    out, deadline = {}, time.monotonic() + timeout
    try:
        while len(out) < world:
            try:
                rank, status, value = results.get(timeout=0.5)
            except queue.Empty:
                missing = sorted(set(range(world)) - set(out))
                dead = [(r, procs[r].exitcode) for r in missing if procs[r].exitcode not in (None, 0)]
                if dead:  # e.g. killed, or it could not even import its function: no traceback will come
                    raise RankError(f"rank {dead[0][0]} died with exit code {dead[0][1]} before reporting") from None
                if time.monotonic() > deadline:
                    raise RankError(f"timeout after {timeout}s waiting for ranks {missing}") from None
                continue
            if status == "error":
                raise RankError(f"rank {rank} failed:\n{value}")
            out[rank] = value
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
    return [out[r] for r in range(world)]
