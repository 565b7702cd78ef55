"""bench.vs_peers: one step of ours beside torch's FSDP2 and torchtitan's, counted on fake H100s.

The suite runs where torchtitan is not installed: that column says so in one line and the others print. One count
is checked against the model's own FLOP formula, and the transformers column (requirements-dev.txt) runs once.
"""
import contextlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker

import model
from bench.dry_run import GPUS, FakeCUDA, FakeGPUs, FakeWorld
from bench.ranks import run_ranks
from bench.vs_peers import LAYOUTS, fsdp2
from bench.vs_peers.columns import PeerLedger
from parallel import ckpt

REPO = Path(__file__).resolve().parent.parent
TOKENS = 2 * 8192


def vs_peers(*argv, timeout=600):
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # no torchtitan folder on it
    return subprocess.run([sys.executable, "-m", "bench.vs_peers", *argv], cwd=REPO, capture_output=True, text=True,
                          timeout=timeout, env=env)


@pytest.fixture(scope="module")
def counted(tmp_path_factory):
    out = tmp_path_factory.mktemp("vs_peers") / "8b.json"
    done = vs_peers("--layout", "8b-fsdp8", "--ckpt", "op", "--columns", "ours,fsdp2,torchtitan", "--json", str(out))
    return done, json.loads(out.read_text()) if out.exists() else None


def test_list_names_every_layout_with_the_command_of_ours():
    done = vs_peers("--list")
    assert done.returncode == 0, done.stderr
    for name in ("8b-fsdp8", "8b-fsdp128", "70b-fsdp32-tp8", "405b-fsdp8-tp8-pp8"):
        assert name in done.stdout
    assert "--model llama3-8b --dp-mode fsdp --micro-batch 2 --seq-len 8192" in done.stdout


def test_a_column_that_cannot_run_is_one_line_and_the_others_print(counted):
    done, counts = counted
    assert done.returncode == 0, done.stderr
    missing = [line for line in done.stdout.splitlines() if line.startswith("torchtitan:")]
    if counts["torchtitan"].get("error"):  # not installed here (CI): one line, the table without it
        assert len(missing) == 1 and "make vs-peers" in missing[0], done.stdout
    assert "counted on fake tensors, not measured on a GPU" in done.stdout
    assert {"ours", "fsdp2"} <= {k for k, c in counts.items() if isinstance(c, dict) and "peak_gb" in c}


def test_the_counts_are_the_models_flops_and_ours_is_the_leanest(counted):
    """Forward FLOPs are model.flops_per_token's third (6N + 12LdT a token: forward a third), recomputed ones
    parallel.ckpt.recomputed_layers('op')'s, in both columns (the same policy); ours holds less than FSDP2 on
    transformers' Llama."""
    _, counts = counted
    cfg = model.PRESETS["llama3-8b"]
    forward = model.flops_per_token(cfg) * TOKENS / 3
    redo = ckpt.recomputed_layers(cfg, "op") * model.layer_flops_per_token(cfg) * TOKENS
    for name in ("ours", "fsdp2"):
        flops = counts[name]["flops"]
        assert flops["forward"] == pytest.approx(forward, rel=0.01), name
        assert flops["backward"] == pytest.approx(2 * forward, rel=0.06), name
        assert flops["recomputed"] == pytest.approx(redo, rel=0.02), name
    assert counts["ours"]["peak_gb"] < counts["fsdp2"]["peak_gb"]
    gathers = counts["ours"]["collectives"]["8 ranks"]["_allgather_base"]
    assert gathers[0] == 2 * cfg.n_layer + 2  # forward: every unit; backward: the blocks (the head stays)


def _both_counters(rank, world):
    """(the rehearsal's ledger, torch's FSDPMemTracker): step 2's peak of the FSDP2 column at 8B FSDP 8."""
    with FakeGPUs(GPUS["h100"], 8), FakeWorld(0, 8), FakeCUDA(), PeerLedger() as ledger:
        peer = fsdp2.build(LAYOUTS["8b-fsdp8"], 0, 8)
        ledger.know_peer(peer)
        for step in range(2):  # the tracker on step 2 only: step 1's DTensor shapes are global (fake tensors)
            ledger.peak, ledger.at_peak = ledger.now, dict(ledger.live)
            x, y = (torch.randint(0, 128_000, (2, 8192), device="cuda") for _ in range(2))
            tracker = FSDPMemTracker(peer.model[0], peer.optimizers[0])
            with tracker if step else contextlib.nullcontext():
                peer.step(x, y)
            ledger.peer_done(peer)
        peaks = tracker.get_tracker_snapshot("peak")
        return ledger.peak, max(p["Total"] for device, p in peaks.items() if str(device).startswith("cuda"))


def test_one_counter_agrees_with_torchs_memtracker():
    """Every column's peak is the rehearsal's ledger of live CUDA storages; torch's FSDPMemTracker, on the FSDP2
    column, counts the same step within 1% (measured: 73.69 GB both)."""
    ours, torchs = run_ranks(_both_counters, 1, init=False, timeout=600)[0]
    assert ours == pytest.approx(torchs, rel=0.01)
