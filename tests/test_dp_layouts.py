"""DDP, FSDP and HSDP against one process (layout equivalence; lab L5, L6, L8, L9, L14, L16).

Each layout is one set of gloo ranks that (1) runs the first step by hand, returning the averaged step-1
gradients, the data rows it read and the bytes its collectives sent, then (2) trains 10 steps through
train.main. The single-process reference runs once for the module.
"""
import json
from pathlib import Path

import numpy as np
import pytest

import config
import model
import train
from bench.ranks import run_ranks
from data.loader import TokenLoader
from data.metrics import read_metrics
from data.prepare import prepared_folder
from parallel.comm import global_grad_norm
from tests.counting import all_reduces_launched, fsdp_gathers
from tests.layouts import BASE, assert_same_losses
from tests.wrapper_state import full_grads


def _first_step_and_losses(rank, world, flags, out_dir):
    argv = BASE + ["--out", out_dir, "--metrics", f"{out_dir}/metrics.jsonl"] + flags
    args = config.resolve(argv)
    mesh = train.start_distributed(args)
    dp, n_micro = mesh.dp, args.accum_steps
    folder = prepared_folder(args.data, rank, world)
    cfg = train.model_config(args, json.loads((folder / "meta.json").read_text())["vocab_size"])
    loader = TokenLoader(folder, "train", cfg.seq_len, args.global_batch, args.seed, mesh.coord["dp"], dp,
                         prefetch=False)
    trainer = train.prepare(args, cfg, mesh)
    wrapper = trainer.wrapper
    x, y = loader.get(0)
    mesh.stats.reset()
    with fsdp_gathers() as all_gathers:
        train.forward_backward(trainer, x, y)
    launched_in_backward = all_reduces_launched(mesh) if args.dp_mode == "ddp" else None
    wrapper.finish_grad_sync()
    calls, sent, all_gathers = dict(mesh.stats.calls), dict(mesh.stats.bytes), dict(all_gathers)
    grads = full_grads(wrapper)
    norm = global_grad_norm(wrapper.grads_for_norm(), mesh.world_group).item()
    result = dict(  # numpy, not tensors: tensors cross processes as file descriptors that die with the rank
        grads={k: v.numpy() for k, v in grads.items()}, norm=norm, x=x.numpy(),
        rows=(loader.rows.start, loader.rows.stop), micro_batches=n_micro,
        calls=calls, bytes=sent, all_gathers=all_gathers,
        launched_in_backward=launched_in_backward, n_buckets=len(getattr(wrapper, "buckets", [])),
        params=model.param_counts(cfg)[0], dp=dp, shard=mesh.shard_group.size, n_layer=cfg.n_layer,
        edge_params=2 * cfg.padded_vocab * cfg.d_model + cfg.d_model)  # fsdp: embedding, norm + head
    result["losses"] = train.main(argv)
    return result


LAYOUTS = {  # name: (world, flags); BASE is global batch 8, micro-batch 4 -> accumulation 8 / (micro x dp)
    "ddp2-no-overlap": (2, ["--no-overlap"]),
    "ddp4-accum-tiny-buckets": (4, ["--micro-batch", "1", "--bucket-mb", "0.01", "--profile"]),
    "fsdp2": (2, ["--dp-mode", "fsdp", "--profile"]),
    "fsdp4-accum-no-overlap": (4, ["--dp-mode", "fsdp", "--micro-batch", "1", "--no-overlap"]),
    "hsdp2x2-accum": (4, ["--dp-mode", "hsdp", "--dp-shard", "2", "--micro-batch", "1"]),
    "fsdp2-accum-unsharded": (2, ["--dp-mode", "fsdp", "--micro-batch", "1", "--accumulate", "unsharded"]),
    "hsdp2x2-accum-unsharded": (4, ["--dp-mode", "hsdp", "--dp-shard", "2", "--micro-batch", "1",
                                    "--accumulate", "unsharded", "--no-overlap"]),
}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return run_ranks(_first_step_and_losses, 1, args=([], str(tmp_path_factory.mktemp("ref"))))[0]


def expected_bytes(mode, r, flags):
    """Bytes sent per rank in the first step, in ring terms (parallel/comm.py), fp32 everywhere."""
    P4, g, A = 4 * r["params"], r["dp"], r["micro_batches"]
    if mode == "ddp":
        return {"all_reduce": 2 * (g - 1) / g * P4}
    K, R = r["shard"] if mode == "hsdp" else g, g // r["shard"] if mode == "hsdp" else 1
    reduces = 1 if "unsharded" in flags else A  # unsharded accumulation reduces once per step
    # forward gathers every unit, backward the blocks (not the embedding, nor norm + head); every backward reduces
    out = {"all_gather": A * (K - 1) / K * (2 * P4 - 4 * r["edge_params"]),
           "reduce_scatter": reduces * (K - 1) / K * P4}
    if R > 1:
        out["all_reduce"] = 2 * (R - 1) / R * P4 / K
    return out


@pytest.mark.parametrize("name", LAYOUTS)
def test_dp_layout_matches_one_process(name, reference, tmp_path):
    world, flags = LAYOUTS[name]
    mode = name[:4].rstrip("0123456789")
    ranks = run_ranks(_first_step_and_losses, world, args=(flags, str(tmp_path)), timeout=150)
    r0 = ranks[0]

    # losses for 10 steps, and the step-1 averaged gradient (L8)
    assert_same_losses(r0["losses"], reference["losses"], rtol=1e-5)
    for key, g in reference["grads"].items():
        np.testing.assert_allclose(r0["grads"][key], g, rtol=1e-4, atol=1e-6, err_msg=key)
    assert r0["grads"].keys() == reference["grads"].keys()
    assert r0["norm"] == pytest.approx(reference["norm"], rel=1e-5)  # grads_for_norm counts each element once

    # sharded data (L5, L6): disjoint slices whose union, in order, is the one-process global batch
    rows = sorted(r["rows"] for r in ranks[::world // r0["dp"]])
    assert [a for a, _ in rows] == list(range(0, 8, 8 // r0["dp"])) and all(b - a == 8 // r0["dp"] for a, b in rows)
    np.testing.assert_array_equal(np.concatenate([r["x"] for r in ranks[::world // r0["dp"]]]), reference["x"])
    micro = config.parse_args(BASE + flags).micro_batch
    assert 8 == micro * r0["dp"] * r0["micro_batches"], "global = micro x dp x accumulation"

    # communication (L14): bytes per rank equal the ring-terms theory within 1%
    want = expected_bytes(mode, r0, flags)
    for r in ranks:
        assert set(r["bytes"]) == set(want)
        for kind, b in want.items():
            assert r["bytes"][kind] == pytest.approx(b, rel=0.01), kind
    if mode == "ddp":
        assert r0["calls"]["all_reduce"] == r0["n_buckets"]
        assert r0["launched_in_backward"] == (0 if "--no-overlap" in flags else r0["n_buckets"])
    else:
        units, A = r0["n_layer"] + 2, r0["micro_batches"]
        print(f"\n{name}: all-gathers forward {r0['all_gathers']['forward']}, backward "
              f"{r0['all_gathers']['backward']}, reduce-scatters {r0['calls']['reduce_scatter']} ({units} units, "
              f"{A} micro-batches)")
        assert r0["all_gathers"] == {"forward": A * units, "backward": A * r0["n_layer"]}
        assert r0["calls"]["reduce_scatter"] == (1 if "unsharded" in flags else A) * units
        assert r0["calls"]["all_gather"] == A * (units + r0["n_layer"])
    first_row = read_metrics(Path(tmp_path) / "metrics.jsonl")[0][0]
    assert first_row["comm_gb"] * 1e9 == pytest.approx(sum(want.values()), rel=0.01)

    # L9 / L16: the Chrome trace holds the collectives of the profiled steps
    if "--profile" in flags:
        trace = (Path(tmp_path) / "trace_rank0.json").read_text()
        for kind in ("all_reduce",) if mode == "ddp" else ("all_gather", "reduce_scatter"):
            assert kind in trace.replace("allreduce", "all_reduce").replace("allgather", "all_gather"), kind
