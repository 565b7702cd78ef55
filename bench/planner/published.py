"""Published runs, priced by the planner: torchtitan's rows, which set --code ours' efficiency, and Llama 3 405B's,
which check the reference, each under both codes with the MFU range of factors.py.

    python -m bench.planner.published   # the derivation of COMPUTE_OURS and its range, then every row

The derivation: bench/README.md, "The planner's formulas". To check the planner against another run, add its row.
"""
from dataclasses import replace

from bench import common
from bench.planner.factors import OURS, REFERENCE, vary
from bench.planner.layout import Cluster, Layout, Shape, parse_layout
from bench.planner.search import evaluate
from bench.planner.step_time import error_bars, rates, recomputed_share, shape_step_time
from model import PRESETS, flops_per_token

PEAK = 989.0  # H100 SXM dense bf16 TF/s, the peak torchtitan's and Llama 3's MFU divide by
LLAMA31_8B = PRESETS["llama3-8b"]  # Llama 3.1 8B's shape
SAC_SHARE = recomputed_share(LLAMA31_8B, "op")  # (k + o + up) / all of a block's matmuls
# torchtitan, benchmarks/llama3_h100_202412_torchtitan.md, Tables 1 and 3: (GPUs, tokens/s per GPU eager, compiled)
TORCHTITAN = [(8, 5762, 6667), (128, 5605, 6514)]
TITAN_LAYOUT = "dp_mode=fsdp,micro=2,ckpt=selective"
# Llama 3 paper, Table 4: (GPUs, seq, dp, tp, pp, cp, reported MFU)
LLAMA3 = [(8192, 8192, 64, 8, 16, 1, 0.43), (16384, 8192, 128, 8, 16, 1, 0.41), (16384, 131072, 8, 8, 16, 16, 0.38)]


def titan_run(gpus):
    """(cfg, cluster, layout, seq, batch) of torchtitan's Llama 3.1 8B row on `gpus` H100s."""
    cl = Cluster(gpus, 8, hbm_gb=96.0, peak_tflops=PEAK, hbm_tbs=2.4)
    return LLAMA31_8B, cl, parse_layout(f"dp={gpus},{TITAN_LAYOUT}"), 8192, 2 * gpus


def mfu_of(cfg, tps, seq):
    return tps * flops_per_token(cfg, seq) / (PEAK * 1e12)


def predicted(cfg, cl, lay, seq, batch, code, sac=False):
    """MFU --code `code` predicts; sac: with torchtitan's recompute of SAC_SHARE of the forward's block matmuls."""
    s = Shape(cfg, lay, seq, batch, code)
    t = shape_step_time(s, cl)
    if not sac:
        return t["mfu"]
    extra = SAC_SHARE / 3 * rates(s, cl)[0]["mm"] * s.t * s.M * cfg.n_layer / lay.pp
    return t["mfu"] * t["total"] / (t["total"] + extra)


def scale(gpus, compiled=True, sac=False):
    """The scale of the reference's compute rates at which --code ours predicts torchtitan's row (bench/README.md)."""
    cfg, cl, lay, seq, batch = titan_run(gpus)
    want = mfu_of(cfg, TORCHTITAN[[g for g, *_ in TORCHTITAN].index(gpus)][1 + compiled], seq)
    base = replace(OURS, mm=REFERENCE.mm, attn=REFERENCE.attn, elem=REFERENCE.elem)
    lo, hi = 0.2, 2.0
    for _ in range(60):
        k = (lo + hi) / 2
        got = predicted(cfg, replace(cl, factors=vary(base, "compute", k)), lay, seq, batch, "ours", sac)
        lo, hi = (k, hi) if got < want else (lo, k)
    return (lo + hi) / 2


def best(cfg, cl, seq, batch, mesh, code):
    """The best fitting variant of a published mesh (dp, tp, pp, cp) under FSDP, one sequence per microbatch: V,
    checkpointing, accumulation (ours) and the cp kernel are not published; None if none fits. Ours also tries
    1F1B: train.py splits 126 layers into 16 x V chunks for no V > 1 without an explicit --pp-split."""
    dp, tp, pp, cp = mesh
    found = None
    schedules = [("interleaved", V) for V in (2, 4, 8)] + [("1f1b", 1)] * (code == "ours")
    for schedule, V in schedules:
        for ckpt in ("none", "selective", "full"):
            for acc in ("sharded", "unsharded")[:1 + (code == "ours")]:
                for cp_mode in ("ring", "allgather") if cp > 1 else ("ring",):
                    lay = Layout(dp, tp, pp, cp, "fsdp", 0, 1, ckpt, schedule, V, cp_mode, accumulate=acc)
                    try:
                        p = evaluate(cfg, cl, lay, seq, batch, need_fit=True, code=code)
                    except ValueError:
                        continue
                    if p and (found is None or p.mfu > found.mfu):
                        found = p
    return found


@common.command
def main(argv=None):
    common.parser(__doc__, results=False).parse_args(argv)  # no flags but --help
    k = {name: scale(8, c, sac) for name, c, sac in (("compiled", True, False), ("eager", False, False),
                                                      ("compiled, recompute priced", True, True))}
    print("COMPUTE_OURS and its range, from torchtitan's Llama 3.1 8B on 8 H100s (factors.py holds them):")
    for name, v in k.items():
        print(f"  {name}: {v:.3f}")
    print(f"  (SAC_SHARE, the forward matmul FLOPs torchtitan's selective checkpointing recomputes: {SAC_SHARE:.3f})")
    print("\n| run | published MFU | reference (range) | ours (range) |\n|---|---|---|---|")
    for gpus, eager, compiled in TORCHTITAN:
        cfg, cl, lay, seq, batch = titan_run(gpus)
        cells = []
        for code in ("reference", "ours"):
            b = error_bars(cfg, cl, lay, seq, batch, code)["all"]
            cells.append(f"{predicted(cfg, cl, lay, seq, batch, code):.1%} ({b[0]:.1%}-{b[1]:.1%})")
        print(f"| torchtitan Llama 3.1 8B, {gpus} H100, FSDP, `--layout dp={gpus},{TITAN_LAYOUT}` | "
              f"{mfu_of(cfg, compiled, seq):.1%} compiled, {mfu_of(cfg, eager, seq):.1%} eager | {' | '.join(cells)} |")
    cfg = PRESETS["llama3-405b"]
    for gpus, seq, dp, tp, pp, cp, reported in LLAMA3:
        cl, batch, cells = Cluster(gpus), 2**24 // seq, []
        for code in ("reference", "ours"):
            p = best(cfg, cl, seq, batch, (dp, tp, pp, cp), code)
            b = error_bars(cfg, cl, p.layout, seq, batch, code)["all"] if p else None
            cells.append(f"{p.mfu:.1%} ({b[0]:.1%}-{b[1]:.1%}), {sum(p.mem.values()) / 1e9:.1f} GB, `{p.layout}`"
                         if p else "does not fit")
        print(f"| Llama 3 405B, {gpus} H100, seq {seq}, TP{tp} CP{cp} PP{pp} DP{dp} | {reported:.0%} | "
              f"{' | '.join(cells)} |")
    return 0
