"""parallel/mesh.py: the rank order (tp innermost, dp outermost), the groups, HSDP's split, describe() (L28)."""
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from bench.ranks import run_ranks
from parallel.mesh import LayoutError, Mesh, infer_dp

REPO = Path(__file__).resolve().parent.parent
PLACEMENT = ["-m", "bench.labs.placement"]  # run from the repository root


def groups(mesh, name):
    return dict(mesh.partitions())[name]


def test_tp_is_innermost_and_dp_outermost():
    mesh = Mesh(0, 16, pp=2, cp=2, tp=2)
    assert mesh.dp == 2
    assert groups(mesh, "tp")[0] == [0, 1]
    assert groups(mesh, "cp")[0] == [0, 2]
    assert groups(mesh, "pp")[0] == [0, 4]
    assert groups(mesh, "dp")[0] == [0, 8]
    for r in range(16):
        assert mesh.rank_of(**mesh.coords(r)) == r


def test_every_axis_partitions_the_world():
    mesh = Mesh(0, 24, dp=None, pp=3, cp=2, tp=2, dp_shard=1)
    for name, members in mesh.partitions():
        flat = sorted(r for g in members for r in g)
        assert flat == list(range(24)), name


def test_dp_cp_group_and_hsdp_split():
    mesh = Mesh(0, 16, cp=2, tp=2, dp_shard=2)  # dp 4 = 2 replicas x 2 shards
    assert groups(mesh, "dp_cp")[0] == [0, 2, 4, 6, 8, 10, 12, 14]
    # a shard group: dp_shard x cp consecutive members of dp_cp; replicas every (dp_shard x cp)-th
    assert groups(mesh, "shard")[0] == [0, 2, 4, 6]
    assert groups(mesh, "replicate")[0] == [0, 8]


def test_describe_names_the_physical_scope_of_each_group():
    text = Mesh(0, 64, pp=2, cp=2, tp=8).describe(gpus_per_node=8)
    lines = {line.split()[0]: line for line in text.splitlines()[1:]}
    assert "inside one server" in lines["tp"]
    assert "across 2 servers" in lines["cp"] and "across 2 servers" in lines["dp"]
    assert "world 64 = dp 2 x pp 2 x cp 2 x tp 8" in text
    assert "e.g. ranks 0, 1, 2, 3, ..., 14, 15" in Mesh(0, 16, tp=16).describe()  # was [0, 1, 2, 3, '...', 14, 15]


def test_describe_on_cpu_speaks_of_processes_not_gpus():
    text = Mesh(0, 4, tp=2).describe(gpus_per_node=2, on_gpus=False)
    assert "2 processes per machine" in text and "inside one machine" in text and "GPU" not in text


@pytest.mark.parametrize("kwargs, flag", [
    ({"world": 4, "dp": 3}, "--dp"),
    ({"world": 6, "tp": 4}, "--tp"),
    ({"world": 1, "pp": 2}, "--pp"),
    ({"world": 4, "cp": 3}, "--cp"),
    ({"world": 4, "tp": 0}, "--tp"),
])
def test_impossible_layouts_name_their_flag(kwargs, flag):
    with pytest.raises(LayoutError) as err:
        infer_dp(**kwargs)
    assert err.value.flag == flag


def test_dp_shard_must_divide_dp():
    with pytest.raises(LayoutError, match="--dp-shard"):
        Mesh(0, 4, dp_shard=3)


def test_command_line_describe_and_its_error():
    ok = subprocess.run([sys.executable, *PLACEMENT, "--world", "16", "--tp", "8"], cwd=REPO,
                        capture_output=True, text=True)
    assert ok.returncode == 0 and "tp        size    8" in ok.stdout
    bad = subprocess.run([sys.executable, *PLACEMENT, "--world", "6", "--tp", "4"], cwd=REPO,
                         capture_output=True, text=True)
    assert bad.returncode == 2 and bad.stderr.startswith("error: --tp")


FAKE_16K = """
import json, sys, time
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore
from parallel.mesh import Mesh
rank = int(sys.argv[1])
dist.init_process_group("fake", rank=rank, world_size=16384, store=FakeStore())
t0 = time.perf_counter()
mesh = Mesh(rank, 16384, dp=8, pp=16, cp=16, tp=8)
print(json.dumps([time.perf_counter() - t0, mesh.coord, [mesh.tp_group.ranks, mesh.cp_group.ranks,
                                                      mesh.pp_group.ranks, mesh.dp_group.ranks]]))
"""


@pytest.mark.parametrize("rank", [0, 5000, 16383])
def test_llama3_405b_mesh_of_16384_ranks_sets_up_in_seconds(rank):
    """Llama 3 405B's mesh, TP8 x CP16 x PP16 x DP8, on torch's fake process-group backend: every rank creates every
    group (6,400 of them), in time linear in the world size (it was quadratic: 65 s at 2,048 ranks)."""
    out = subprocess.run([sys.executable, "-c", FAKE_16K, str(rank)], capture_output=True, text=True, timeout=300,
                         cwd=Path(__file__).resolve().parent.parent)
    assert out.returncode == 0, out.stderr
    seconds, coord, groups = json.loads(out.stdout)
    assert seconds < 20, seconds
    dp, pp, cp, tp = rank // 2048, rank // 128 % 16, rank // 8 % 16, rank % 8
    assert coord == dict(dp=dp, pp=pp, cp=cp, tp=tp)
    assert groups == [[rank - tp + i for i in range(8)],  # tp: 8 consecutive ranks
                      [rank - 8 * cp + 8 * i for i in range(16)],  # cp: stride tp
                      [rank - 128 * pp + 128 * i for i in range(16)],  # pp: stride cp·tp
                      [rank % 2048 + 2048 * i for i in range(8)]]  # dp: stride pp·cp·tp


def _timeout_rank(rank, world, tighten):
    """Rank 1 reaches the all-reduce 4 s late; under a 60 s timeout rank 0 waits for it, under 1 s it gives up."""
    mesh = Mesh(rank, world, timeout_s=60)
    if tighten:
        mesh.set_timeout(1.0)
    if rank == 1:
        time.sleep(4)
    try:
        mesh.world_group.all_reduce(torch.zeros(1))
        return "done"
    except RuntimeError:
        return "timed out"


@pytest.mark.parametrize("tighten", [False, True])
def test_set_timeout_changes_how_long_a_collective_waits(tighten):
    """train.py runs set-up and the first steps under --startup-timeout, then tightens to --timeout."""
    assert run_ranks(_timeout_rank, 2, args=(tighten,), timeout=120)[0] == ("timed out" if tighten else "done")
