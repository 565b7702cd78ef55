"""Our DDP, FSDP, TP and PP against torch's own, side by side (same model, world, data, seed; gloo CPU).

    python -m bench.vs_torch   # world 2, a 4-layer d=128 GPT, 10 timed steps each
    python -m bench.vs_torch --quick   # smoke test sizes
    python -m bench.vs_torch --pairs tp,tp-sp,pp-gpipe,pp-1f1b,pp-interleaved   # only the tp/pp peers

parallel.ddp.DDP against DistributedDataParallel, parallel.fsdp.FSDP against FSDP2's fully_shard (a unit per block
plus the root), fp32, no clipping; TP and PP in peers.py. The same initial weights and batches, so the losses agree
to float tolerance; ours and torch's alternate --rounds times, and the ratio is median step over median step.
"""
import statistics

import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

import model
from bench import common
from bench.ranks import run_ranks
from bench.vs_torch import peers
from parallel.ddp import DDP
from parallel.fsdp import FSDP
from parallel.materialize import init_weights, local_init
from parallel.mesh import Mesh

try:  # torch >= 2.6 exports it here; older torch keeps it under _composable
    from torch.distributed.fsdp import fully_shard
except ImportError:
    from torch.distributed._composable.fsdp import fully_shard


def build(impl, cfg, mesh, seed):
    """(module to call, optimizer params, our wrapper or None) for one implementation, from the same initial weights."""
    with torch.device("meta"):
        gpt = model.GPT(cfg)
    if impl == "ours-fsdp":
        wrapper = FSDP(nn.ModuleList([gpt]), mesh, mesh.dp_cp_group,
                       lambda name, p, flat=None, out=None: local_init(name, p, cfg, seed, flat, out), "cpu")
        return gpt, wrapper.optim_params(), wrapper
    init_weights(gpt, seed, "cpu")
    if impl == "ours-ddp":
        wrapper = DDP(nn.ModuleList([gpt]), mesh)
        return gpt, wrapper.optim_params(), wrapper
    if impl == "torch-ddp":
        ddp = nn.parallel.DistributedDataParallel(gpt)
        return ddp, list(ddp.parameters()), None
    device_mesh = init_device_mesh("cpu", (mesh.world,))
    for block in gpt.layers.values():
        fully_shard(block, mesh=device_mesh)
    fully_shard(gpt, mesh=device_mesh)
    return gpt, list(gpt.parameters()), None


def _run(rank, world, impl, cfg_fields, micro_batch, steps, warmup, seed):
    cfg = model.ModelConfig(**cfg_fields)
    mesh = Mesh(rank, world)
    torch.manual_seed(seed)
    net, params, wrapper = build(impl, cfg, mesh, seed)
    gen = torch.Generator().manual_seed(seed * 1000 + rank)
    return peers.timed_steps(net, params, wrapper, cfg, micro_batch, steps, warmup, gen)


PAIRS = {"ddp": ("ours-ddp", "torch-ddp"), "fsdp": ("ours-fsdp", "torch-fsdp2"), "tp": ("ours-tp", "torch-tp"),
         "tp-sp": ("ours-tp", "torch-tp"), "tp-sp-ring": ("ours-tp", "torch-tp"), "pp-gpipe": ("ours-pp", "torch-pp"),
         "pp-1f1b": ("ours-pp", "torch-pp"), "pp-interleaved": ("ours-pp", "torch-pp")}
PEER_QUICK = dict(n_layer=4, d_model=32, n_head=2, n_kv_head=2, ffn_dim=64, vocab_size=64, seq_len=16)


def launch(pair, impl, fields, args, seed=1337, warmup=2):
    """One run of one implementation on args.world ranks: a dict per rank (losses, times, cpu)."""
    if pair.startswith("tp"):
        fn, fn_args = peers.run_tp, (impl, fields, args.micro_batch, args.steps, warmup, seed, pair != "tp",
                                     pair == "tp-sp-ring")
    elif pair.startswith("pp"):
        fn, fn_args = peers.run_pp, (impl, pair[3:], fields, args.micro_batch, args.n_micro, args.steps, warmup, seed)
    else:
        fn, fn_args = _run, (impl, fields, args.micro_batch, args.steps, warmup, seed)
    return run_ranks(fn, args.world, args=fn_args, timeout=600)


def loss_match(ours, theirs):
    """(max |difference|, verdict) of two loss curves: bit-identical, within fp32 rtol 1e-5, or not."""
    diff = max(abs(a - b) for a, b in zip(ours, theirs))
    close = all(abs(a - b) <= 1e-5 * abs(b) for a, b in zip(ours, theirs))
    return diff, "bit-identical" if diff == 0 else "rtol 1e-5" if close else "NO"


@common.command
def main(argv=None):
    p = common.parser(__doc__)
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--rounds", type=int, default=2, help="alternating ours/torch runs per pair")
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--n-micro", type=int, default=4, help="micro-batches per step of the pipeline pairs")
    p.add_argument("--pairs", default=",".join(PAIRS), help=f"comma-separated, of {', '.join(PAIRS)}")
    args = p.parse_args(argv)
    fields = dict(n_layer=4, d_model=128, n_head=8, n_kv_head=4, ffn_dim=384, vocab_size=512, seq_len=128)
    peer_fields = fields
    if args.quick:
        fields, peer_fields = dict(common.QUICK_MODEL, vocab_size=64, seq_len=16), PEER_QUICK
        args.steps, args.rounds = 3, 1
    pairs = args.pairs.split(",")
    rows, answers = [], []
    for pair in pairs:
        (ours, theirs), cfg = PAIRS[pair], peer_fields if pair[:2] in ("tp", "pp") else fields
        results = {ours: [], theirs: []}
        for _ in range(args.rounds):
            for impl in (ours, theirs):
                results[impl].append(launch(pair, impl, cfg, args))
        # the step time of a run: the slowest rank's, per step; the median over all steps of all rounds
        step_s = {impl: statistics.median(max(ts) for rs in runs for ts in zip(*(r["times"] for r in rs)))
                  for impl, runs in results.items()}
        cpu_s = {impl: statistics.median(c for rs in runs for r in rs for c in r["cpu"])
                 for impl, runs in results.items()}
        at = -1 if pair.startswith("pp") else 0  # the last pipeline stage holds the loss
        diff, match = max(loss_match(ra[at]["losses"], rb[at]["losses"])
                          for ra, rb in zip(results[ours], results[theirs]))
        ratio = step_s[ours] / step_s[theirs]
        rows.append([pair, ours, theirs, f"{step_s[ours] * 1e3:.1f}", f"{step_s[theirs] * 1e3:.1f}", f"{ratio:.2f}",
                     f"{cpu_s[ours] * 1e3:.1f}", f"{cpu_s[theirs] * 1e3:.1f}", f"{cpu_s[ours] / cpu_s[theirs]:.2f}",
                     f"{diff:.1e}", match, "yes" if ratio <= 1.10 else "no"])
        answers.append(f"{pair}: {ours} {ratio:.2f}x {theirs} (losses {match})")
    n_params = model.param_counts(model.ModelConfig(**fields))[0]
    notes = [f"world {args.world} gloo ranks, 1 thread each; GPT {fields}, {n_params / 1e6:.2f}M params, micro-batch "
             f"{args.micro_batch}; {args.rounds} alternating runs x {args.steps} timed steps (after 2 warm-up)",
             f"tp and pp pairs: GPT {peer_fields}; tp ranks read one batch of {args.micro_batch}; pp steps run "
             f"{args.n_micro} micro-batches of {args.micro_batch} (interleaved: 2 virtual stages per rank)",
             "step = forward + backward + gradient sync + AdamW; ms = wall time of the slowest rank, median over "
             "steps; CPU ms = process CPU time per step per rank (all threads), median: less sensitive to other "
             "jobs on a shared host",
             "torch-fsdp2: fully_shard on each block, then on the root (embedding, norm, head), fp32",
             "torch-tp: parallelize_module, Colwise q/k/v/gate/up/lm_head, Rowwise o/down/embedding, loss_parallel; "
             "tp-sp adds SequenceParallel norms (bench/vs_torch/peers.py)",
             "torch-pp: pipelining.PipelineStage on our pp.split chunks, ScheduleGPipe/Schedule1F1B/"
             "ScheduleInterleaved1F1B, loss = our cross-entropy / M, scale_grads off",
             "losses: the loss curve of rank 0 (pp: of the last stage) compared step by step"]
    common.write_result(args.out, "vs_torch", "Our DDP/FSDP/TP/PP vs torch's (median step time)",
                        ["pair", "ours", "torch", "ours ms", "torch ms", "ratio", "ours CPU ms", "torch CPU ms",
                         "CPU ratio", "max loss diff", "losses match", "ratio <= 1.10"], rows, notes=notes)
    common.answer("L8", "; ".join(answers))
