"""The emulated cluster (bench/cluster/): two network namespaces of two ranks each, one
torchrun per namespace meeting at node 0 (as root only). A dp 2 x tp 2 run across them logs the same losses as one
process, its gradient all-reduce really crosses the link between the nodes, and nothing the cluster made outlives
it, even when a rank dies. Without CAP_NET_ADMIN the bench says so in one line and exits 0."""
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from bench.cluster import measure as cluster
from bench.cluster.measure import torchrun
from bench.cluster.net import Net, can_admin_net, namespaces, sh
from data.metrics import read_metrics
from tests.layouts import BASE

needs_net_admin = pytest.mark.skipif(not can_admin_net(), reason="needs root (CAP_NET_ADMIN) for network namespaces")
REPO = Path(__file__).resolve().parent.parent
STEPS = ["--steps", "3", "--peak-tflops", "1"]


def losses(path):
    return [row["loss"] for row in read_metrics(path)[0]]


@pytest.mark.parametrize("flags", [["--gbit", "-1"], ["--rounds", "0"], ["--timeout", "-5"], ["--steps", "0"]])
def test_impossible_bench_settings_are_one_line_exit_2(flags, capsys):
    assert cluster.main(flags) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {flags[0]}: invalid") and err.count("\n") == 1, err


def test_without_net_admin_the_bench_skips_in_one_line(tmp_path):
    cmd = [sys.executable, "-m", "bench.cluster", "--out", str(tmp_path / "out")]
    if can_admin_net():  # root: run it without the capability
        if not shutil.which("capsh"):
            pytest.skip("root, and no capsh to drop CAP_NET_ADMIN with")
        cmd = ["capsh", "--drop=cap_net_admin", "--", "-c", " ".join(cmd)]
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["skipped: python -m bench.cluster needs root (CAP_NET_ADMIN) to make network "
                                        "namespaces"], done.stdout
    assert not (tmp_path / "out").exists()


@needs_net_admin
def test_dp2_tp2_across_two_nodes_equals_one_process(tmp_path):
    single = subprocess.run([sys.executable, "train.py", *BASE, *STEPS, "--out", str(tmp_path / "single"),
                             "--metrics", str(tmp_path / "single.jsonl")], cwd=REPO, capture_output=True, text=True,
                            timeout=120)  # first: it prepares the data if need be
    assert single.returncode == 0, single.stdout + single.stderr
    with Net(nodes=2) as net:
        prefix = net.prefix
        before = net.sent_bytes()
        codes = torchrun(net, 2, 2, ["train.py", *BASE, *STEPS, "--tp", "2", "--out", tmp_path / "run", "--metrics",
                                     tmp_path / "cluster.jsonl"], 150, tmp_path)
        crossed = [b - a for a, b in zip(before, net.sent_bytes())]
        logs = "".join((tmp_path / f"node{k}.log").read_text()[-4000:] for k in range(2))
        assert codes == [0, 0], logs
    assert not [n for n in namespaces() if n.startswith(prefix)]
    np.testing.assert_allclose(losses(tmp_path / "cluster.jsonl"), losses(tmp_path / "single.jsonl"), rtol=1e-5, atol=0)
    assert "mesh: world 4 = dp 2 x pp 1 x cp 1 x tp 2" in logs
    # dp spans the nodes: each step, each of a node's 2 ranks all-reduces its tp half of the fp32 gradients with its
    # dp peer in the other node, sending that half once (2 ranks: 2(g-1)/g = 1)
    n_params = 869_504  # the tiny model on the byte corpus
    assert min(crossed) > 0.9 * 3 * 2 * 4 * n_params / 2, crossed


def kill_a_rank(net, node, after_s, killed):
    """SIGKILLs one training process (not its launcher) in `node` once it has run for after_s seconds."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not killed:
        for pid in sh(["ip", "netns", "pids", net.names[node]], check=False).stdout.split():
            try:
                cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
                started = time.time() - os.stat(f"/proc/{pid}").st_mtime
            except OSError:
                continue
            if any(part.endswith(b"train.py") for part in cmd) and b"torch.distributed.run" not in cmd:
                if started >= after_s:
                    os.kill(int(pid), signal.SIGKILL)
                    killed.append(int(pid))
                    return
        time.sleep(0.2)


class RankFailed(Exception):
    pass


@needs_net_admin
def test_a_killed_rank_ends_the_run_and_leaves_no_namespace(tmp_path):
    """A rank of node 1 dies before it joins the process group: node 1's launcher fails; node 0's ranks would wait
    for it for minutes, so the launcher is stopped 15 s later; the error unwinds through the teardown."""
    t0, killed = time.monotonic(), []
    with pytest.raises(RankFailed):
        with Net(nodes=2, ranks=4) as net:
            prefix, cgroups = net.prefix, net.cgroups
            killer = threading.Thread(target=kill_a_rank, args=(net, 1, 0.5, killed))
            killer.start()
            run = ["train.py", *BASE, "--steps", "100000", "--peak-tflops", "1", "--tp", "2", "--out", tmp_path / "run"]
            codes = torchrun(net, 2, 2, run, 120, tmp_path)
            killer.join()
            if codes != [0, 0]:
                raise RankFailed(codes)
    assert killed, "no training process to kill"
    assert codes[1] not in (0, None) and codes[0] != 0, codes  # node 1 failed; node 0 failed or was stopped
    assert not [n for n in namespaces() if n.startswith(prefix)]
    assert cgroups is None or not cgroups.exists()  # the ranks' cpu caps went with them
    assert time.monotonic() - t0 < 60
