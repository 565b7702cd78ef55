"""parallel/comm.py's wait_s, the seconds a rank spends blocked in collectives (bench/cluster's exposed
communication): a blocking call that waits for a late peer counts it; an async collective counts its launch (gloo's
reduce-scatter does much of its work there) and the part of the wait its caller's own work did not cover."""
import time

import pytest
import torch
import torch.distributed as dist

from bench.ranks import run_ranks
from parallel.mesh import Mesh

LATE_S = 0.4


def _rank_one_waits_for_rank_zero(rank, world):
    """wait_s of rank 1 when rank 0 comes LATE_S late to: a blocking all-reduce; an async one with 2 LATE_S of work
    between launch and wait (all hidden); one with LATE_S / 4 of work (3/4 of the lateness exposed)."""
    mesh = Mesh(rank, world)
    group, t, out = mesh.dp_group, torch.ones(4), []
    for work_s in (None, 2 * LATE_S, LATE_S / 4):
        dist.barrier()  # both start together (not counted)
        mesh.stats.reset()
        if rank == 0:
            time.sleep(LATE_S)
        if work_s is None:
            group.all_reduce(t)
        else:
            pending = group.all_reduce(t, async_op=True)
            time.sleep(work_s if rank == 1 else 0.0)
            pending.wait()
        out.append(mesh.stats.wait_s)
    return out


def _launch(rank, world):
    """(wait_s right after an async reduce-scatter's launch, the launch's own seconds)."""
    mesh = Mesh(rank, world)
    inp, out = torch.ones(4 << 20), torch.empty(2 << 20)
    t0 = time.perf_counter()
    pending = mesh.dp_group.reduce_scatter(out, inp, async_op=True)
    launch = time.perf_counter() - t0
    counted = mesh.stats.wait_s
    pending.wait()
    return counted, launch


def test_wait_s_counts_an_async_launch():
    for counted, launch in run_ranks(_launch, 2):
        assert counted == pytest.approx(launch, rel=0.2, abs=2e-3)


def test_wait_s_counts_the_time_blocked_in_collectives():
    late, on_time = run_ranks(_rank_one_waits_for_rank_zero, 2)
    blocking, hidden, exposed = on_time
    assert blocking > 0.8 * LATE_S, on_time
    assert hidden < 0.2 * LATE_S, on_time
    assert 0.5 * LATE_S < exposed < LATE_S, on_time
    assert max(late) < 0.2 * LATE_S, late  # the late rank finds its peer waiting
