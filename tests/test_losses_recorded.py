"""Every layout family's first 20 losses, and a few layouts' val losses, are bit-identical to those
recorded in tests/golden/.

A refactor that moves code must not move a single bit of the numbers. The record was made before
the house was rearranged; regenerate it only for a change that is meant to alter the numerics:

    python -m tests.test_losses_recorded   # rewrites tests/golden/losses.json
"""
import json
import sys
from pathlib import Path

import pytest

import train
from bench.ranks import run_ranks
from data.metrics import read_metrics
from tests.layouts import BASE, train_losses

GOLDEN = Path(__file__).parent / "golden" / "losses.json"
VAL = Path(__file__).parent / "golden" / "val_losses.json"  # 10 steps, evaluated at 5 and 10
STEPS = ["--steps", "20"]
LAYOUTS = {
    "one process": (1, []),
    "ddp 2": (2, []),
    "fsdp 2": (2, ["--dp-mode", "fsdp"]),
    "hsdp 2x2": (4, ["--dp-mode", "hsdp", "--dp-shard", "2", "--micro-batch", "2"]),
    "fsdp 2 unsharded accumulation": (2, ["--dp-mode", "fsdp", "--micro-batch", "2",
                                          "--accumulate", "unsharded"]),
    "tp 2": (2, ["--tp", "2"]),
    "tp 2 sp": (2, ["--tp", "2", "--sp"]),
    "tp 2 sp ring": (2, ["--tp", "2", "--sp", "--sp-ring"]),
    "tp 2 sp no overlap": (2, ["--tp", "2", "--sp", "--no-overlap"]),
    "ckpt selective": (1, ["--ckpt", "selective"]),
    "fsdp 2 ckpt full": (2, ["--dp-mode", "fsdp", "--ckpt", "full"]),
    "pp 2 gpipe": (2, ["--pp", "2", "--pp-schedule", "gpipe", "--micro-batch", "2"]),
    "pp 2 1f1b": (2, ["--pp", "2", "--pp-schedule", "1f1b", "--micro-batch", "2"]),
    "pp 2 interleaved": (2, ["--pp", "2", "--pp-schedule", "interleaved", "--pp-virtual", "2",
                             "--micro-batch", "2"]),
    "pp 2 zb1": (2, ["--pp", "2", "--pp-schedule", "zb1", "--micro-batch", "2"]),
    "pp 2 zbv": (2, ["--pp", "2", "--pp-schedule", "zbv", "--micro-batch", "2"]),
    "cp 2 ring": (2, ["--cp", "2", "--cp-mode", "ring"]),
    "cp 2 ulysses": (2, ["--cp", "2", "--cp-mode", "ulysses"]),
    "cp 2 allgather": (2, ["--cp", "2", "--cp-mode", "allgather"]),
    "4d dp2 fsdp cp2 pp2 tp2": (16, ["--dp", "2", "--dp-mode", "fsdp", "--cp", "2", "--pp", "2",
                                     "--tp", "2", "--micro-batch", "2"]),
}


def losses_of(name):
    world, flags = LAYOUTS[name]
    return [float(x) for x in train_losses(world, STEPS + flags, timeout=600)]


@pytest.mark.parametrize("name", LAYOUTS)
def test_losses_are_bit_identical_to_the_record(name):
    recorded = [float.fromhex(h) for h in json.loads(GOLDEN.read_text())[name]]
    assert losses_of(name) == recorded


def _evaluating_rank(rank, world, argv):
    train.main(argv)


@pytest.mark.parametrize("name", ["one process", "fsdp 2", "tp 2 sp", "pp 2 1f1b", "cp 2 ring"])
def test_val_losses_are_bit_identical_to_the_record(name, tmp_path):
    world, flags = LAYOUTS[name]
    argv = BASE + ["--steps", "10", "--eval-every", "5", "--out", str(tmp_path / "run"), "--metrics",
                   str(tmp_path / "m.jsonl")] + flags
    run_ranks(_evaluating_rank, world, args=(argv,), timeout=600)
    got = [r["val_loss"] for r in read_metrics(tmp_path / "m.jsonl")[0] if "val_loss" in r]
    assert got == [float.fromhex(h) for h in json.loads(VAL.read_text())[name]]


if __name__ == "__main__":
    names = sys.argv[1:] or list(LAYOUTS)
    record = json.loads(GOLDEN.read_text()) if GOLDEN.exists() else {}
    for name in names:
        record[name] = [x.hex() for x in losses_of(name)]
        print(name, [float.fromhex(h) for h in record[name]][-1], flush=True)
        GOLDEN.write_text(json.dumps(record, indent=1) + "\n")
