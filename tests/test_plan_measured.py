"""The planner's validation (b) (issue 8): on small fp32 runs measured here on CPU, the planner with
code="ours" predicts the bytes every group sends (equal to the comm counters) and the peak memory per rank
(memory.step_bytes, train.py's own model: within MEMORY_BOUND of the bytes allocated).

Each layout builds the model the way train.py does, takes one warm-up step (so Adam's state exists), then
one measured step, both train.train_step: forward and backward of every microbatch, the gradient sync, the clip,
fused AdamW's update (no temporaries, on CPU as on GPU) and the wrapper's zero_grad. Measured:
- bytes: mesh.stats.log (parallel/comm.py, ring terms) summed per group; dp, dp_cp, shard and replicate are
  the planner's "dp"; the busiest rank of each group (pipeline stages differ);
- memory: the model state (the optimizer's params, Adam's two moments and the gradients kept between steps,
  ddp's buckets, by storage) plus the peak of the bytes held by tensors the step allocates (LiveBytes: every op's
  new storage until it is freed or resized, as the pipeline frees what it sent), on the fullest rank: CPU's
  analogue of torch.cuda.max_memory_allocated, without allocator caching or fragmentation (the model leaves
  those to its margin, memory.MARGIN).
One set of gloo ranks per world size runs its layouts back to back. Measured peaks repeat to within ~4% (gloo's
threads free a few buffers a little later or sooner).
"""
import traceback

import pytest
import torch

import config
import train
from bench.planner import plan
from bench.ranks import run_ranks
from parallel import memory
from parallel.mesh import infer_dp
from parallel.pp_schedule import chunks_per_rank
from tests.memory import LiveBytes, storage_bytes

MODEL = ["--n-layer", "2", "--d-model", "64", "--n-head", "4", "--n-kv-head", "2", "--ffn-dim", "128",
         "--vocab-size", "256", "--seq-len", "64"]
LONG, WIDE_VOCAB, SHORT = ["--seq-len", "256", "--vocab-size", "64"], ["--vocab-size", "2048"], ["--seq-len", "16"]
WIDE = ["--d-model", "256", "--n-head", "8", "--ffn-dim", "256"]
AXIS = {"tp": "tp", "cp": "cp", "pp": "pp", "dp": "dp", "dp_cp": "dp", "shard": "dp", "replicate": "dp"}
LAYOUTS = {  # name: (world, flags, micro-batch, microbatches per step); the global batch is micro * dp * that.
    # The model flags make the term a layout checks a large share of its memory: LONG sequences for the
    # activations, a WIDE_VOCAB for the loss's buffers, SHORT sequences (and WIDE layers) for the gradients,
    # their copies and fsdp's gathered units, a wide ffn for a block's backward.
    "ddp2": (2, [], 2, 2),
    "ddp2 long": (2, LONG, 2, 2),
    "ddp2 ckpt full": (2, LONG + ["--ckpt", "full"], 2, 2),
    "ddp2 short": (2, SHORT, 1, 1),
    "fsdp2": (2, ["--dp-mode", "fsdp"], 2, 2),
    "fsdp2 wide vocab": (2, WIDE_VOCAB + ["--dp-mode", "fsdp"], 4, 1),
    "fsdp2 short": (2, SHORT + ["--dp-mode", "fsdp"], 1, 1),
    "fsdp2 deep": (2, SHORT + WIDE + ["--n-layer", "6", "--dp-mode", "fsdp"], 1, 1),  # one unit's send in flight
    "tp2": (2, LONG + ["--tp", "2"], 2, 2),
    "tp2 sp": (2, LONG + ["--tp", "2", "--sp"], 2, 2),
    "tp2 sp ckpt selective": (2, ["--tp", "2", "--sp", "--ckpt", "selective"], 2, 2),
    "tp2 sp ckpt op": (2, LONG + ["--tp", "2", "--sp", "--ckpt", "op"], 2, 2),
    "fsdp2 long": (2, LONG + ["--dp-mode", "fsdp"], 2, 2),
    "fsdp2 long ckpt selective": (2, LONG + ["--dp-mode", "fsdp", "--ckpt", "selective"], 2, 2),
    "fsdp2 long ckpt op": (2, LONG + ["--dp-mode", "fsdp", "--ckpt", "op"], 2, 2),
    "tp4 sp": (4, LONG + ["--tp", "4", "--sp", "--n-kv-head", "4"], 2, 2),
    "pp2 1f1b": (2, LONG + ["--pp", "2"], 1, 4),
    "pp2 1f1b wide ffn": (2, LONG + ["--pp", "2", "--ffn-dim", "1024"], 1, 4),
    "pp2 gpipe": (2, ["--pp", "2", "--pp-schedule", "gpipe"], 1, 4),
    "pp2 zb1": (2, LONG + ["--pp", "2", "--pp-schedule", "zb1"], 1, 4),
    "pp2 zb1 ckpt selective": (2, LONG + ["--pp", "2", "--pp-schedule", "zb1", "--ckpt", "selective"], 1, 4),
    "pp2 zb1 wide vocab": (2, WIDE_VOCAB + ["--pp", "2", "--pp-schedule", "zb1"], 1, 4),
    "pp2 zbv": (2, LONG + ["--n-layer", "4", "--pp", "2", "--pp-schedule", "zbv"], 1, 4),
    "pp2 interleaved": (2, LONG + ["--n-layer", "4", "--pp", "2", "--pp-schedule", "interleaved",
                                   "--pp-virtual", "2"], 1, 4),
    "cp2 ring": (2, ["--cp", "2"], 2, 2),
    "cp2 ring ckpt full": (2, ["--cp", "2", "--ckpt", "full"], 2, 2),
    "cp2 allgather": (2, LONG + ["--cp", "2", "--cp-mode", "allgather"], 2, 2),
    "cp2 ulysses": (2, ["--cp", "2", "--cp-mode", "ulysses"], 2, 2),
    "hsdp 2x2": (4, ["--dp-mode", "hsdp", "--dp-shard", "2"], 2, 2),
    "hsdp x cp2": (4, ["--dp-mode", "hsdp", "--dp-shard", "1", "--cp", "2"], 2, 2),  # a shard group of cp ranks
    "tp2 x fsdp2": (4, LONG + ["--tp", "2", "--dp-mode", "fsdp"], 2, 2),
    "pp2 x dp2": (4, ["--pp", "2"], 1, 4),
    "pp2 x fsdp2": (4, SHORT + ["--pp", "2", "--dp-mode", "fsdp"], 1, 4),
    "pp2 x fsdp2 wide": (4, SHORT + WIDE + ["--pp", "2", "--dp-mode", "fsdp"], 1, 4),
    "pp2 x fsdp2 zb1": (4, SHORT + WIDE + ["--pp", "2", "--dp-mode", "fsdp", "--pp-schedule", "zb1"], 1, 4),
    "pp2 x fsdp2 unsharded": (4, SHORT + WIDE + ["--pp", "2", "--dp-mode", "fsdp", "--accumulate", "unsharded"], 1, 4),
    "fsdp2 unsharded": (2, ["--dp-mode", "fsdp", "--accumulate", "unsharded"], 2, 2),
    "cp2 x tp2 sp": (4, ["--cp", "2", "--tp", "2", "--sp"], 2, 2),
    "cp4 ulysses": (4, ["--cp", "4", "--cp-mode", "ulysses"], 2, 2),
}


def parse(world, flags, micro, accum, rank=0):
    """(train.py's resolved run, the model config, the planner's Layout and global batch) of one layout."""
    argv = MODEL + ["--micro-batch", str(micro), "--dtype", "fp32", "--device", "cpu", "--peak-tflops", "1"] + flags
    flat = config.parse_args(argv)  # a repeated flag: the last one counts
    dp = infer_dp(world, flat.tp, flat.pp, flat.cp, flat.dp)
    args = config.resolve(argv + ["--global-batch", str(micro * dp * accum)],
                          environ={"RANK": str(rank), "WORLD_SIZE": str(world)})
    cfg = train.model_config(args, args.vocab_size)
    lay = plan.Layout(dp=dp, tp=args.tp, pp=args.pp, cp=args.cp, dp_mode=args.dp_mode,
                      shard=(args.dp_shard or 0) * args.cp, micro=micro, ckpt=args.ckpt, schedule=args.pp_schedule,
                      V=chunks_per_rank(args.pp_schedule, args.pp_virtual), cp_mode=args.cp_mode, sp=args.sp,
                      overlap=args.overlap, accumulate=args.accumulate)
    return args, cfg, lay, args.global_batch




def measure(rank, world, flags, micro, accum):
    """{axis: bytes this rank sent in one step}, and its peak memory in bytes."""
    args, cfg, lay, batch = parse(world, flags, micro, accum, rank)
    mesh = train.start_distributed(args)
    run = train.prepare(args, cfg, mesh)
    wrapper, opt = run.wrapper, run.opt
    ids = torch.randint(0, cfg.vocab_size, (batch, cfg.seq_len + 1), generator=torch.Generator().manual_seed(0))
    rows = ids[mesh.coord["dp"] * micro * accum:(mesh.coord["dp"] + 1) * micro * accum]  # this dp rank's share
    x, y = rows[:, :-1].contiguous(), rows[:, 1:].contiguous()
    train.train_step(run, x, y, 1e-3, args.grad_clip)
    params = wrapper.optim_params()
    state = storage_bytes(params) + storage_bytes(v for s in opt.state.values() for v in s.values() if v.numel() > 1)
    state += storage_bytes(p.grad for p in params if p.grad is not None)  # gradients kept between steps (ddp's buckets)
    state += storage_bytes(u.summed for u in getattr(wrapper, "units", [])
                           if getattr(u, "summed", None) is not None)  # --accumulate unsharded
    mesh.stats.reset()
    with LiveBytes() as live:
        train.train_step(run, x, y, 1e-3, args.grad_clip)
    sent = dict.fromkeys(("tp", "cp", "pp", "dp"), 0.0)
    for _, group, nbytes in mesh.stats.log:
        sent[AXIS[group]] += nbytes
    return sent, state + live.peak


def _layouts_rank(rank, world, layouts):
    """Each layout's measurement; a layout that raises returns its traceback for its tests to report."""
    out = {}
    for name, (flags, micro, accum) in layouts.items():
        try:
            out[name] = measure(rank, world, flags, micro, accum)
        except Exception:  # noqa: BLE001 - reported by the tests of that layout
            out[name] = traceback.format_exc()
    return out


@pytest.fixture(scope="module")
def measured(request):
    """{name: (the most each group's busiest rank sent, the fullest rank's peak memory)}, for the layouts of the
    tests selected (-k runs only theirs)."""
    chosen = {item.callspec.params["name"] for item in request.session.items
              if item.module is request.module and hasattr(item, "callspec")}
    chosen |= {name.removesuffix(" ckpt selective") for name in chosen}  # and the run selective is compared with
    out = {}
    for world in sorted({w for w, *_ in LAYOUTS.values()}):
        layouts = {name: tuple(rest) for name, (w, *rest) in LAYOUTS.items() if w == world and name in chosen}
        if not layouts:
            continue
        per_rank = run_ranks(_layouts_rank, world, args=(layouts,), timeout=300)
        for name in layouts:
            failed = [r[name] for r in per_rank if isinstance(r[name], str)]
            if failed:
                out[name] = failed[0]
                continue
            sent = {axis: max(r[name][0][axis] for r in per_rank) for axis in ("tp", "cp", "pp", "dp")}
            out[name] = sent, max(r[name][1] for r in per_rank)
    return out


def result(measured, name):
    if isinstance(measured[name], str):
        pytest.fail(f"{name} failed to run:\n{measured[name]}")
    return measured[name]


def predicted(name):
    """The planner's bytes per axis and peak memory for one layout, fp32 on CPU."""
    world, flags, micro, accum = LAYOUTS[name]
    _, cfg, lay, batch = parse(world, flags, micro, accum)
    sent = plan.comm_bytes(cfg, lay, cfg.seq_len, batch, w_bytes=4, g_bytes=4, a_bytes=4, code="ours")
    mem = plan.memory(cfg, lay, cfg.seq_len, batch, overhead_gb=0, frag=0, w_bytes=0, a_bytes=4, code="ours")
    return sent, mem


@pytest.mark.parametrize("name", LAYOUTS)
def test_predicted_bytes_equal_the_comm_counters(name, measured):
    """Per group, all its collectives together, exactly (floating-point rounding aside)."""
    sent, _ = result(measured, name)
    want, _ = predicted(name)
    print(f"\n{name}: sent {sent}, predicted {want}")
    for axis in ("tp", "cp", "pp", "dp"):
        assert want[axis] == pytest.approx(sent[axis], rel=1e-6, abs=1e-6), (axis, sent, want)


MEMORY_BOUND = 0.12  # |predicted / measured - 1| of every layout (measured: -10.0% .. +9.6%)


@pytest.mark.parametrize("name", LAYOUTS)
def test_predicted_memory_within_the_bound(name, measured):
    """The planner's memory under --code ours is train.py's own model (memory.step_bytes), the one its pre-run
    check and --dry-run use: the same parts as for the run train.py resolves, within MEMORY_BOUND of its peak."""
    _, peak = result(measured, name)
    _, mem = predicted(name)
    args, cfg, _, _ = parse(*LAYOUTS[name])
    assert mem == pytest.approx(memory.step_bytes(cfg, args))
    parts = ", ".join(f"{k} {v / 1e6:.3f}" for k, v in mem.items() if v)
    print(f"\n{name}: measured {peak / 1e6:.3f} MB, predicted {sum(mem.values()) / 1e6:.3f} MB ({parts}), "
          f"{sum(mem.values()) / peak - 1:+.1%}")
    assert sum(mem.values()) == pytest.approx(peak, rel=MEMORY_BOUND)


@pytest.mark.parametrize("name", ["fsdp2 long ckpt selective"])
def test_selective_saves_what_the_planner_says(name, measured):
    """--ckpt selective's saving at the peak (the norms' and SwiGLU's outputs no matmul keeps), measured against the
    run without it, is the planner's."""
    (_, with_outputs), (_, selective) = result(measured, name.removesuffix(" ckpt selective")), result(measured, name)
    want = sum(predicted(name.removesuffix(" ckpt selective"))[1].values()) - sum(predicted(name)[1].values())
    print(f"\n{name}: saves {(with_outputs - selective) / 1e6:.3f} MB, predicted {want / 1e6:.3f} MB")
    assert want == pytest.approx(with_outputs - selective, rel=0.25)
