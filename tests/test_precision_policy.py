"""One precision policy in every layout (parallel/__init__.py): under bf16 the embedding's output, every norm's output,
every block's input and output (the residual stream, and so what tp, sp, pp and cp carry) are bf16 in one process,
ddp, fsdp, hsdp, tp, tp + sp, pp and cp alike, and each layout's bf16 losses stay within bf16 rounding of one
process's. (FSDP gathered every weight in bf16 while the other layouts kept an fp32 residual stream, so a resume into
another dp mode changed the numerics.)"""
import numpy as np
import pytest
import torch

import config
import model
import train
from bench.ranks import run_ranks
from data.loader import TokenLoader
from data.prepare import prepared_folder
from tests.jobs import Failed, run_jobs
from tests.layouts import BASE

BF16 = BASE + ["--dtype", "bf16", "--seq-len", "32", "--global-batch", "4", "--micro-batch", "2", "--peak-tflops", "1",
               "--out", "unwritten"]
LAYOUTS = {"one process": (1, []), "ddp 2": (2, []), "fsdp 2": (2, ["--dp-mode", "fsdp"]),
           "hsdp 2x2": (4, ["--dp-mode", "hsdp", "--dp-shard", "2", "--micro-batch", "1"]), "tp 2": (2, ["--tp", "2"]),
           "tp 2 sp": (2, ["--tp", "2", "--sp"]), "pp 2": (2, ["--pp", "2", "--micro-batch", "1"]),
           "cp 2": (2, ["--cp", "2"])}
STEPS = 3


def _dtypes_and_losses(rank, world, flags):
    """({point: dtypes seen}, the global loss of each step) of a few bf16 steps of train.py's own step."""
    run = config.resolve(BF16 + flags)
    mesh = train.start_distributed(run)
    folder = prepared_folder(run.data, rank, world)
    cfg = train.model_config(run, 257)
    trainer = train.prepare(run, cfg, mesh)
    seen = {}

    def record(point):
        def hook(module, inputs, output):
            for where, t in (("in", inputs[0] if inputs else None), ("out", output)):
                if isinstance(t, torch.Tensor) and t.is_floating_point():
                    seen.setdefault(f"{point} {where}" if point == "block" else point, set()).add(str(t.dtype))
        return hook
    for chunk in trainer.chunks:
        for name, module in chunk.named_modules():
            if name.endswith("embed_tokens"):
                module.register_forward_hook(lambda m, i, o: seen.setdefault("embedding", set()).add(str(o.dtype)))
            elif isinstance(module, model.Block):
                module.register_forward_hook(record("block"))
            elif isinstance(module, model.RMSNorm):
                module.register_forward_hook(record("norm"))
    loader = TokenLoader(folder, "train", cfg.seq_len, run.global_batch, run.seed, mesh.coord["dp"], mesh.dp,
                         prefetch=False)
    losses = []
    for step in range(STEPS):
        x, y = loader.get(step)
        loss, _ = train.train_step(trainer, x, y, run.lr, run.grad_clip)
        losses.append(train.replica_mean(loss, mesh).item())
    return {k: sorted(v) for k, v in seen.items()}, losses


@pytest.fixture(scope="module")
def runs():
    out = {}
    for world in sorted({w for w, _ in LAYOUTS.values()}):
        jobs = [(name, _dtypes_and_losses, (flags,)) for name, (w, flags) in LAYOUTS.items() if w == world]
        results = run_ranks(run_jobs, world, args=(jobs,), timeout=600)
        for name, _, _ in jobs:
            for rank, r in enumerate(results):
                if isinstance(r[name], Failed):
                    pytest.fail(f"{name}, rank {rank}:\n{r[name]}")
            out[name] = [r[name] for r in results]
    return out


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_every_layout_carries_the_same_dtypes(runs, layout):
    """Every point any rank of the layout saw is bf16: the embedding's rows, the norms' outputs (a tp norm hands its
    readers their matmuls' outputs instead), the blocks' inputs and outputs."""
    seen = {}
    for dtypes, _ in runs[layout]:
        for point, names in dtypes.items():
            seen.setdefault(point, set()).update(names)
    assert seen.get("block in") == seen.get("block out") == {"torch.bfloat16"}, seen
    assert all(names == {"torch.bfloat16"} for names in seen.values()), seen


@pytest.mark.parametrize("layout", [name for name in LAYOUTS if name != "one process"])
def test_every_layout_trains_within_bf16_rounding_of_one_process(runs, layout):
    np.testing.assert_allclose(runs[layout][0][1], runs["one process"][0][1], rtol=2 ** -7)
