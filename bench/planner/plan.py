"""The 4D layout planner: which dp x cp x pp x tp layout trains a model fastest on a given cluster?

    python -m bench.planner --model llama3-405b --gpus 16384 --seq-len 131072
    python -m bench.planner --model llama3-8b --gpus 64 --code ours --layout dp=8,tp=8,dp_mode=fsdp
    python -m bench.planner --model llama3-8b --gpus 64 --compare-fsdp-scope   # L15
    python -m bench.planner train.py --model llama3-8b --dp-mode fsdp --micro-batch 2 --global-batch 16 --world 8

Prints the top layouts by predicted MFU, each with its range over the uncertain factors, and where the winner's time
and memory go; --code reference (Llama 3's, Megatron-LM's implementation) or ours (parallel/*.py). Given the
command train.py --dry-run takes, it prices that command's layout and names the best in train.py's flags. The
formulas: bench/README.md, "The planner's formulas". `from bench.planner import plan` reaches the public names of
every module.
"""
import sys
import time
from dataclasses import replace
from pathlib import Path

from bench import common, dry_run
from bench.planner import command
from bench.planner.costs import collectives, comm_bytes, memory
from bench.planner.factors import FACTORS, load
from bench.planner.layout import CODES, GB, MEM_MARGIN, Cluster, Layout, Shape, invalid, parse_layout
from bench.planner.search import CKPTS, Plan, candidates, default_batch_tokens, evaluate, plan
from bench.planner.step_time import error_bars, members_per_node, rates, step_time
from config import UsageError, nonnegative_float, one_of, positive_float, probability, typed
from model import PRESETS, param_counts
from parallel.memory import MARGIN

__all__ = ["CKPTS", "CODES", "Cluster", "Layout", "Plan", "Shape", "bill", "candidates", "collectives", "comm_bytes",
           "default_batch_tokens", "error_bars", "evaluate", "invalid", "main", "memory", "parse_layout", "plan",
           "step_time"]

SHAPE = ("n_layer", "d_model", "n_head", "n_kv_head", "ffn_dim", "vocab_size")
LIMITS = {"n-layer": 2 ** 12, "d-model": 2 ** 17, "n-head": 2 ** 12, "n-kv-head": 2 ** 12, "ffn-dim": 2 ** 19,
          "vocab-size": 2 ** 22, "seq-len": 2 ** 22, "gpus": 2 ** 30, "gpus-per-node": 2 ** 10,
          "global-batch-tokens": 2 ** 36, "top": 2 ** 10}  # far past any published run; more is a typo, or a hang
FP8_PUBLISHED = 1.5  # the most fp8 gained over bf16 end to end in the published runs (torchtitan: 1.28-1.29x on
# Llama 3.1 8B; about 1.2-1.5x across its tables): a ranked fp8 layout beyond it says why


def up_to(limit):
    """An argparse type: an integer in [1, limit]."""
    return typed(f"integer in [1, {limit}]", int, lambda v: 1 <= v <= limit)


def bill(p, cl):
    """The layout, its MFU, and where its step time and memory go."""
    t, m = p.time, p.mem
    parts = ", ".join(f"{k} {v:.3g}" for k, v in t.items() if k not in ("total", "mfu", "hfu") and v > 0)
    mems = ", ".join(f"{k} {v / GB:.1f}" for k, v in m.items() if v > 0)
    fits = f"fits below {p.usable_gb:.1f}" if p.fits else f"DOES NOT FIT below {p.usable_gb:.1f}"
    return (f"{p.layout}\n  MFU {t['mfu']:.1%}  HFU {t['hfu']:.1%}  step {t['total']:.3g} s = {parts}\n"
            f"  memory {sum(m.values()) / GB:.1f} GB of {cl.hbm_gb:g} ({fits}): {mems}")


def bars_table(cfg, cl, plans, seq, batch, code, measured):
    """Rows: each plan's MFU at both ends of each factor (error_bars)."""
    bars = [error_bars(cfg, cl, p.layout, seq, batch, code, measured) for p in plans]
    names = list(bars[0]) if bars else []
    lines = [f"{'#':>2} {'MFU':>6}  " + "  ".join(f"{n:>11}" for n in names)]
    for i, (p, b) in enumerate(zip(plans, bars), 1):
        spans = "  ".join(f"{100 * b[n][0]:5.1f}-{100 * b[n][1]:<5.1f}" for n in names)
        lines.append(f"{i:>2} {p.mfu:6.1%}  {spans}".rstrip())
    return "\n".join(lines)


def fp8_notes(cfg, cl, plans, seq, batch, code):
    """Each fp8 plan's speed over the same layout in bf16, and why where it passes FP8_PUBLISHED."""
    lines = []
    for i, p in enumerate(plans, 1):
        bf16 = step_time(cfg, cl, replace(p.layout, fp8=False), seq, batch, code)
        gain = bf16["total"] / p.time["total"]
        lines.append(f"{i:>2} fp8 {gain:.2f}x the same layout in bf16")
        if gain > FP8_PUBLISHED:
            s = Shape(cfg, replace(p.layout, fp8=False), seq, batch, code)
            c = replace(cl, factors=cl.factors or FACTORS[code])
            share = rates(s, c)[0]["mm"] * s.t * s.M * cfg.n_layer / p.layout.pp / bf16["total"]
            lines.append(f"   beyond the {FP8_PUBLISHED}x published fp8 runs reached, because its bf16 step is "
                         f"{share:.0%} block matmuls, which fp8 runs {c.factors.fp8:g}x faster; published steps keep "
                         "more outside them (attention, communication, elementwise), and fp8 GEMMs may reach less "
                         "than twice bf16's rate (the fp8 factor's range)")
    return "\n".join(lines)


def spread_limit(cfg, cl, seq, batch):
    """Why no layout exists: the most GPUs a batch of `batch` sequences can be spread over, one line."""
    tp = max(t for t in (1, 2, 4, 8, 16, 32, 64) if t <= cl.gpus_per_node and cfg.n_head % t == 0)
    cp = max(1, 1 << max(0, (seq // 1024).bit_length() - 1))
    most = batch * tp * cfg.n_layer * cp
    return (f"no layout spreads the batch over {cl.gpus} GPUs: dp takes whole sequences (at most {batch}), tp at most "
            f"{tp}, pp {cfg.n_layer} (the layers), cp {cp} (1024 tokens each): at most {most:,} GPUs")


def print_layout(cfg, cl, lay, seq, batch, code, measured=()):
    """The bill of one layout, its MFU at both ends of each uncertain factor, and fp8's gain."""
    p = evaluate(cfg, cl, lay, seq, batch, checked=True, code=code)
    print(bill(p, cl))
    print("\nMFU at the pessimistic and optimistic end of each uncertain factor (factors.py), all together first:\n"
          + bars_table(cfg, cl, [p], seq, batch, code, measured))
    if lay.fp8:
        print(fp8_notes(cfg, cl, [p], seq, batch, code))


def plan_command(argv):
    """`python -m bench.planner train.py FLAGS --world N [--gpu G]`, the command --dry-run takes: the bill of its
    layout, its MFU range, and the planner's best layouts for the same model, batch and GPUs, as train.py's flags."""
    args, train_argv = dry_run.parse_args(argv)
    gpu = dry_run.GPUS[args.gpu]
    run = dry_run.resolve(train_argv, args.world, gpu, args.gpus_per_node or gpu.per_node)
    cfg, cl, lay = dry_run.model_config(run), command.cluster_of(run, gpu.name), command.layout_of(run)
    seq, batch = cfg.seq_len, run.global_batch
    why = invalid(cfg, cl, lay, seq, batch, "ours")
    if why:
        raise UsageError(f"the planner does not price this layout: {why}")
    total, non_emb = param_counts(cfg)
    print(f"{run.model}: {total / 1e9:.2f}B params ({non_emb / 1e9:.2f}B non-embedding), batch {batch} x {seq} "
          f"tokens; {cl.gpus} {args.gpu} GPUs, {cl.gpus_per_node}/node; code: ours (parallel/*.py)")
    print_layout(cfg, cl, lay, seq, batch, "ours")
    plans = plan(cfg, cl, seq, batch, 5, "ours", lay.fp8)
    print(f"\nthe planner's best layouts for {run.model}, a batch of {batch} and {cl.gpus} GPUs, as train.py's flags:")
    print(f"{'#':>2} {'MFU':>6} {'step s':>7} {'mem GB':>6}  flags")
    for i, p in enumerate(plans, 1):
        mem = sum(p.mem.values()) / GB
        print(f"{i:>2} {p.mfu:6.1%} {p.time['total']:7.3g} {mem:6.1f}  {command.flags_of(p.layout)}")
    return 0


@common.command
def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and Path(argv[0]).name == "train.py":
        return plan_command(argv[1:])
    ap = common.parser(__doc__, results=False)
    ap.add_argument("--model", default="llama3-8b", type=one_of(sorted(PRESETS), "preset"))
    for name in ("n-layer", "d-model", "n-head", "n-kv-head", "ffn-dim", "vocab-size"):
        ap.add_argument(f"--{name}", type=up_to(LIMITS[name]), help="override the preset (vocab: 50257 if it has none)")
    ap.add_argument("--gpus", type=up_to(LIMITS["gpus"]), default=8,
                    help="a whole number of nodes (or fewer than one node)")
    ap.add_argument("--gpus-per-node", type=up_to(LIMITS["gpus-per-node"]), default=8)
    ap.add_argument("--hbm-gb", type=positive_float, default=80.0, help="memory per GPU (H100: 80)")
    ap.add_argument("--peak-tflops", type=positive_float, default=989.0, help="dense bf16 peak (H100 SXM: 989)")
    ap.add_argument("--intra-gbs", type=positive_float, default=450.0, help="NVLink GB/s per direction per GPU")
    ap.add_argument("--inter-gbs", type=positive_float, default=50.0, help="network GB/s per GPU (400 Gb/s)")
    ap.add_argument("--hbm-tbs", type=positive_float, default=3.35, help="memory TB/s per GPU (H100 SXM: 3.35)")
    ap.add_argument("--lat-intra-us", type=positive_float, default=1.0, help="latency per ring step inside a node")
    ap.add_argument("--lat-inter-us", type=positive_float, default=5.0, help="latency per ring step across nodes")
    ap.add_argument("--backend", default="nccl", choices=("nccl", "gloo"), help="gloo: reduce-scatter = all-reduce")
    ap.add_argument("--dtype", default="bf16", choices=("bf16", "fp32", "fp8"),
                    help="compute dtype: fp32 (a CPU cluster), fp8 (the block matmuls at 2x the bf16 rate, FSDP "
                    "gathers their weights in fp8)")
    ap.add_argument("--measured", action="store_true", help="the rates were measured on this cluster at these sizes "
                    "(python -m bench.cluster): no H100 efficiency factors")
    ap.add_argument("--attn-tflops", type=positive_float, help="with --measured: the measured attention rate")
    ap.add_argument("--host-us", type=nonnegative_float, default=0.0,
                    help="host microseconds per dispatched op where the host is the device (a CPU cluster; "
                    "python -m bench.cluster measures it); 0: a GPU hides them")
    ap.add_argument("--seq-len", type=up_to(LIMITS["seq-len"]), help="default: the preset's")
    ap.add_argument("--global-batch-tokens", type=up_to(LIMITS["global-batch-tokens"]),
                    help="default: 0.5M-16M tokens by model size")
    ap.add_argument("--top", type=up_to(LIMITS["top"]), default=10)
    ap.add_argument("--layout", help="the bill of one layout, e.g. dp=64,tp=8,pp=16,dp_mode=fsdp,V=8")
    ap.add_argument("--code", default="reference", choices=CODES,
                    help="whose implementation: Llama 3's (reference, the calibration) or this repository's (ours)")
    ap.add_argument("--compare-fsdp-scope", action="store_true",
                    help="L15: the winner's mesh with its FSDP group inside one node (hsdp) vs across nodes")
    ap.add_argument("--factors", help="--code ours: the factors `python -m bench.gpu` measured (its JSON file)")
    ap.add_argument("--mem-margin", type=probability,
                    help="share of HBM a layout leaves free (allocator, NCCL buffers, CUDA context, model error); "
                    f"default: the reference's {MEM_MARGIN * 100:.0f}%%, ours {MARGIN * 100:.0f}%% (train.py's check)")
    args = ap.parse_args(argv)
    over = {k: getattr(args, k) for k in SHAPE if getattr(args, k)}
    cfg = replace(PRESETS[args.model], **over)
    cfg = cfg if cfg.vocab_size else replace(cfg, vocab_size=50257)  # the GPT-2 tokenizer of our data
    problem = cfg.validate() or (args.gpus > args.gpus_per_node and args.gpus % args.gpus_per_node and (
        "--gpus", f"{args.gpus} GPUs are not a whole number of {args.gpus_per_node}-GPU nodes"))
    if problem:
        raise UsageError(f"{problem[0]}: {problem[1]}")
    seq = args.seq_len or cfg.seq_len
    if args.measured and not args.attn_tflops:
        raise UsageError("--measured: needs --attn-tflops, the attention rate measured with the others")
    factors, measured = None, ()
    if args.factors and args.code != "ours":
        raise UsageError("--factors: measured factors describe this repository's code: add --code ours")
    if args.factors:
        try:
            factors, measured = load(args.factors)
        except ValueError as e:
            raise UsageError(f"--factors: {e}") from None
    cl = Cluster(args.gpus, args.gpus_per_node, args.hbm_gb, args.peak_tflops, args.intra_gbs, args.inter_gbs,
                 args.hbm_tbs, args.lat_intra_us, args.lat_inter_us, args.backend, 4 if args.dtype == "fp32" else 2,
                 args.measured, args.attn_tflops or 0.0, args.host_us, factors, args.mem_margin)
    batch = max(1, (args.global_batch_tokens or default_batch_tokens(cfg)) // seq)
    fp8, lay = args.dtype == "fp8", None
    if args.layout:  # refused before anything is printed: one line, exit 2
        try:
            lay = replace(parse_layout(args.layout), fp8=fp8) if fp8 else parse_layout(args.layout)
            why = invalid(cfg, cl, lay, seq, batch, args.code)
        except (ValueError, TypeError) as e:
            why = str(e)
        if why:
            raise UsageError(f"--layout: {why}")
    total, non_emb = param_counts(cfg)
    flags = " ".join(f"--{k.replace('_', '-')} {v}" for k, v in over.items())
    name = f"custom shape (from {args.model} with {flags})" if over else args.model
    print(f"{name}: {total / 1e9:.2f}B params ({non_emb / 1e9:.2f}B non-embedding), seq {seq}, batch "
          f"{batch} x {seq} = {batch * seq / 2**20:.1f}M tokens; {cl.gpus} GPUs, {cl.gpus_per_node}/node, "
          f"{cl.hbm_gb:g} GB, {cl.peak_tflops:g} TF, {cl.intra_gbs:g}/{cl.inter_gbs:g} GB/s intra/inter"
          + ("; code: ours (parallel/*.py)" if args.code == "ours" else ""))
    whose = (f"measured ({', '.join(measured)}: {args.factors})" if factors
             else "this code's" if args.code == "ours" else "the reference's")
    print(f"a layout fits below {cl.usable_gb(args.code):.4g} GB: {cl.hbm_gb:g} GB less a "
          f"{cl.margin_of(args.code):.0%} margin (allocator, NCCL buffers, CUDA context, the memory model's error); "
          f"efficiency factors: {whose} (factors.py)")
    if lay:
        print_layout(cfg, cl, lay, seq, batch, args.code, measured)
        return 0
    t0 = time.time()
    plans = plan(cfg, cl, seq, batch, args.top, args.code, fp8)
    if not plans:
        spreads = next(candidates(cfg, cl, seq, batch, code=args.code, fp8=fp8), None) is not None
        print("no layout fits in memory" if spreads else spread_limit(cfg, cl, seq, batch))
        return 1
    print(f"top {len(plans)} layouts by predicted MFU (searched in {time.time() - t0:.1f} s):")
    print(f"{'#':>2} {'MFU':>6} {'step s':>7} {'mem GB':>6}  layout")
    for i, p in enumerate(plans, 1):
        print(f"{i:>2} {p.mfu:6.1%} {p.time['total']:7.3g} {sum(p.mem.values()) / GB:6.1f}  {p.layout}")
    print("\nMFU at the pessimistic and optimistic end of each uncertain factor (factors.py), all together "
          "first:\n" + bars_table(cfg, cl, plans, seq, batch, args.code, measured))
    if fp8:
        print("\n" + fp8_notes(cfg, cl, plans, seq, batch, args.code))
    print("\nwhere the winner's time (s) and memory (GB) go:\n" + bill(plans[0], cl))
    if args.compare_fsdp_scope:
        lay = plans[0].layout
        local = members_per_node(cl.gpus_per_node, lay.tp, lay.cp, lay.pp, lay.dp, 1, "dp")
        print(f"\nL15, the same mesh with FSDP across nodes vs inside one node (shard={local}):")
        for alt in (replace(lay, dp_mode="fsdp", shard=0, dist_opt=False),
                    replace(lay, dp_mode="hsdp", shard=local, dist_opt=False)):
            why = invalid(cfg, cl, alt, seq, batch, args.code)
            print(f"{alt}: {why}" if why else bill(evaluate(cfg, cl, alt, seq, batch, code=args.code), cl))
    return 0
