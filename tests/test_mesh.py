"""parallel/mesh.py: the rank order (tp innermost, dp outermost), the groups, HSDP's split, describe() (L28)."""
import subprocess
import sys
from pathlib import Path

import pytest

from parallel.mesh import LayoutError, Mesh, infer_dp

PLACEMENT = Path(__file__).resolve().parent.parent / "bench" / "placement.py"


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
    ok = subprocess.run([sys.executable, str(PLACEMENT), "--world", "16", "--tp", "8"],
                        capture_output=True, text=True)
    assert ok.returncode == 0 and "tp        size    8" in ok.stdout
    bad = subprocess.run([sys.executable, str(PLACEMENT), "--world", "6", "--tp", "4"],
                         capture_output=True, text=True)
    assert bad.returncode == 2 and bad.stderr.startswith("error: --tp")
