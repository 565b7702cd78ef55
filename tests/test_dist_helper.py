"""The N-rank runner itself: results in rank order, a failing rank's traceback, a dead rank at once, a timeout
instead of a hang."""
import os
import time

import pytest
import torch
import torch.distributed as dist

from bench.ranks import RankError, run_ranks


def _sum_of_ranks(rank, world):
    t = torch.tensor([float(rank)])
    dist.all_reduce(t)
    return rank, t.item()


def _rank_one_raises(rank, world):
    if rank == 1:
        raise ValueError("rank one is broken on purpose")
    return rank


def _rank_zero_hangs(rank, world):
    if rank == 0:
        time.sleep(60)
    return rank


def _rank_one_dies(rank, world):
    if rank == 1:
        os._exit(7)  # no exception, no traceback: as a SIGKILL or a failed import would leave it
    time.sleep(60)
    return rank


def test_results_come_back_in_rank_order_over_a_real_process_group():
    assert run_ranks(_sum_of_ranks, 4) == [(r, 6.0) for r in range(4)]


def test_a_raising_rank_is_reraised_with_its_traceback():
    with pytest.raises(RankError, match="rank 1 failed") as err:
        run_ranks(_rank_one_raises, 2)
    assert "rank one is broken on purpose" in str(err.value)
    assert "_rank_one_raises" in str(err.value)  # the child's traceback, not just the message


def test_a_hanging_rank_times_out():
    t0 = time.time()
    with pytest.raises(RankError, match=r"timeout after 3s waiting for ranks \[0\]"):
        run_ranks(_rank_zero_hangs, 2, timeout=3, init=False)
    assert time.time() - t0 < 20


def test_a_dead_rank_is_reported_at_once_not_at_the_timeout():
    t0 = time.time()
    with pytest.raises(RankError, match="rank 1 died with exit code 7"):
        run_ranks(_rank_one_dies, 2, timeout=60, init=False)
    assert time.time() - t0 < 20
