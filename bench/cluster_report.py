"""bench/cluster.py's tables: what the emulated cluster measured, and the planner's prediction from its constants.

The planner (bench/plan.py --code ours --measured) gets only what the cluster measured about itself, never a step
time: the rank's matmul rate over a block's linears (its peak), its attention and memory rates, and per kind of
link (inside a node: loopback; across nodes: the shaped link, shared by the node's ranks) the bus bandwidth of the
largest messages and the latency per ring step of the smallest, each the median over all-reduce, all-gather and
send/recv (gloo's reduce-scatter is an all-reduce in disguise: the planner's --backend gloo).
"""
import shlex
import statistics

from bench import common
from bench.plan_layout import Cluster, parse_layout
from bench.plan_search import evaluate
from config import model_config, parse_args

MODEL = ["--model", "tiny", "--n-layer", "4", "--d-model", "256", "--n-head", "8", "--n-kv-head", "4",
         "--ffn-dim", "768", "--vocab-size", "256", "--seq-len", "128"]
DP = ["--global-batch", "4", "--micro-batch", "1"]  # 128 tokens per rank: FSDP's traffic outweighs its compute
TP = ["--global-batch", "32", "--micro-batch", "8", "--tp", "2"]  # 2048 tokens per dp rank: tp sends 6x what dp does
JOBS = {"one node": (1, "node"), "two nodes": (2, "node"), "tp across": (2, "interleaved")}  # nodes, rank order
LAYOUTS = {  # name: (job, train.py flags, the planner's --layout)
    "fsdp, 1 node x 4": ("one node", DP + ["--dp-mode", "fsdp"], "dp=4,dp_mode=fsdp,micro=1"),
    "fsdp, 2 nodes x 2": ("two nodes", DP + ["--dp-mode", "fsdp"], "dp=4,dp_mode=fsdp,micro=1"),
    "hsdp (shard = a node), 2 x 2": ("two nodes", DP + ["--dp-mode", "hsdp", "--dp-shard", "2"],
                                     "dp=4,dp_mode=hsdp,shard=2,micro=1"),
    "ddp, 2 x 2": ("two nodes", DP, "dp=4,micro=1"),
    "dp2 x tp2, tp inside a node": ("two nodes", TP, "dp=2,tp=2,micro=8,sp=0"),
    "dp2 x tp2, tp across nodes": ("tp across", TP, "dp=2,tp=2,micro=8,sp=0,order=interleaved"),
}
LINK_OPS = ("all_reduce", "all_gather", "send_recv")
STEPS_PER_OP = {"all_reduce": lambda n: 2 * (n - 1).bit_length(), "all_gather": lambda n: n - 1,
                "send_recv": lambda n: 1}  # the planner's ring steps: 2 log2 n for an all-reduce (plan_comm.py)


def constants(results):
    """{job: the planner's constants}, each cluster's own, measured in its job's first round: the one-node cluster's
    (4 ranks on loopback; it has no link) and the two-node cluster's, on which the interleaved job runs too."""
    def of(res):
        rate, rows, out = res["rate"], res["collectives"], {}
        for kind, key in (("intra-node", "intra"), ("inter-node", "inter")):
            mine = [r for r in rows if r["kind"] == kind and r["op"] in LINK_OPS]
            if mine:
                small, big = min(r["size"] for r in mine), max(r["size"] for r in mine)
                out[f"{key}_gbs"] = statistics.median(r["busbw"] for r in mine if r["size"] == big)
                out[f"lat_{key}_us"] = statistics.median(r["time_us"] / STEPS_PER_OP[r["op"]](r["n"])
                                                         for r in mine if r["size"] == small)
        return {"peak_tflops": rate["matmul"] / 1e12, "attn_tflops": rate["attention"] / 1e12,
                "hbm_tbs": rate["memory"] / 1e12, **out}

    two = of(results["two nodes"][0])
    return {"one node": {**two, **of(results["one node"][0])}, "two nodes": two, "tp across": two}


def workload(flags):
    """(model config, sequence length, global batch) of a layout's train.py flags."""
    args = parse_args(MODEL + flags)
    cfg = model_config(args, 0)
    return cfg, cfg.seq_len, args.global_batch


def planner(name, consts, world, per_node):
    """(the planner's step-time bill for one layout, the plan.py command that prints it)."""
    job, flags, layout = LAYOUTS[name]
    const = consts[job]
    gpn = world if JOBS[job][0] == 1 else per_node
    cfg, seq, batch = workload(flags)
    cl = Cluster(world, gpn, 1000.0, backend="gloo", dtype_bytes=4, measured=True, **const)
    bill = evaluate(cfg, cl, parse_layout(layout), seq, batch, code="ours").time
    cmd = ["python", "bench/plan.py", "--code", "ours", *MODEL, "--global-batch-tokens", str(batch * seq),
           "--gpus", str(world), "--gpus-per-node", str(gpn),
           "--hbm-gb", "1000", "--backend", "gloo", "--dtype", "fp32", "--measured"]
    for k, v in const.items():
        cmd += [f"--{k.replace('_', '-')}", f"{v:.4g}"]
    return bill, shlex.join(cmd + ["--layout", layout])


def measured(results):
    """{layout: (median step s, median exposed comm s, spread of the round medians, MB sent per rank)}."""
    out = {}
    for name, (job, _, _) in LAYOUTS.items():
        rounds = [r["train"][name] for r in results[job]]
        steps = [s for r in rounds for s in r["steps"]]
        per_round = [statistics.median(s[0] for s in r["steps"]) for r in rounds]
        out[name] = (statistics.median(s[0] for s in steps), statistics.median(s[1] for s in steps),
                     (min(per_round), max(per_round)), rounds[0]["sent"] / 1e6)
    return out


def torchrun_line(name, args):
    job, flags, _ = LAYOUTS[name]
    nodes = JOBS[job][0]
    per_node = args.nodes * args.ranks // nodes
    return (f"torchrun --nnodes {nodes} --nproc-per-node {per_node} train.py "
            + shlex.join(MODEL + flags + ["--dtype", "fp32"])
            + (" (ranks interleaved over the nodes)" if JOBS[job][1] == "interleaved" else ""))


def report(results, args, shaping, out):
    """Writes out/cluster.md; prints the L12 and L15 answers. Returns {claim: holds}."""
    two = results["two nodes"][0]
    consts, meas, world = constants(results), measured(results), args.nodes * args.ranks
    const = consts["two nodes"]
    rate = two["rate"]
    link = f"{args.gbit:g} Gbit/s each way" + (f", {args.delay_ms:g} ms delay" if shaping == "netem" else
                                               ", no added delay (this kernel has no sch_netem; tbf shapes the rate)")
    rows, preds = [], {}
    for name in LAYOUTS:
        bill, cmd = planner(name, consts, world, args.ranks)
        step, wait, (lo, hi), sent = meas[name]
        comm = sum(bill[k] for k in ("tp", "cp", "pp", "dp"))
        preds[name] = bill["total"]
        rows.append([name, f"{step:.3f}", f"{lo:.3f}-{hi:.3f}", f"{wait:.3f}", f"{sent:.1f}", f"{bill['total']:.3f}",
                     f"{bill['total'] / step - 1:+.0%}", f"{comm:.3f}"])
    order_m = sorted(LAYOUTS, key=lambda n: meas[n][0])
    order_p = sorted(LAYOUTS, key=lambda n: preds[n])
    errors = [abs(preds[n] / meas[n][0] - 1) for n in LAYOUTS]
    names = list(LAYOUTS)
    step = {n: meas[n][0] for n in LAYOUTS}
    claims = {
        "FSDP across nodes is slower than FSDP inside a node": step[names[1]] > step[names[0]],
        "HSDP is faster than FSDP across nodes": step[names[2]] < step[names[1]],
        "tp across nodes is slower than tp inside a node": step[names[5]] > step[names[4]],
        "the planner lands within +-25% of every measured step": max(errors) <= 0.25,
        "the planner ranks the layouts as measured": order_m == order_p,
    }
    peak = {}
    for r in two["collectives"]:
        key = (r["kind"], r["op"])
        peak[key] = max(peak.get(key, 0.0), r["busbw"])
    l12 = [[op] + [f"{peak[(k, op)]:.3f}" for k in ("intra-node", "inter-node")]
           + [f"{peak[('intra-node', op)] / peak[('inter-node', op)]:.1f}x"] for op in ("all_reduce", "all_gather",
                                                                                       "reduce_scatter", "send_recv")]
    notes = [
        f"The cluster: {args.nodes} network namespaces x {args.ranks} ranks on this one machine, each node's link "
        f"{link}, shared by its {args.ranks} ranks; inside a node the ranks talk over loopback. "
        f"{args.rounds} rounds of the three jobs, alternating; {args.steps} timed steps per layout per round after "
        f"{args.warmup} warm-up steps; step = the slowest rank's, exposed comm = the most seconds a rank spent blocked "
        "in collectives (parallel/comm.py's wait_s); spread = the lowest and highest round median.",
        f"Rank rates, measured with all {world} ranks at once (median rank): matmul {rate['matmul'] / 1e9:.1f} GFLOP/s "
        f"over a block's linears at {rate['rows']} rows (the planner's peak), causal attention fwd+bwd "
        f"{rate['attention'] / 1e9:.1f} GFLOP/s, memory {rate['memory'] / 1e9:.2f} GB/s. Links (median of "
        f"all-reduce, all-gather, send/recv): inside a node {const['intra_gbs']:.3f} GB/s and "
        f"{const['lat_intra_us']:.0f} us per ring step, across nodes {const['inter_gbs']:.4f} GB/s per rank and "
        f"{const['lat_inter_us']:.0f} us. The latencies are mostly the scheduler's: {world} ranks share "
        f"{common.cpu_cores()} cores, and a rank woken by its message waits for one.",
        "Measured: " + " < ".join(order_m) + ". Predicted: " + " < ".join(order_p) + ".",
        *[f"{claim}: {'yes' if ok else 'NO'}" for claim, ok in claims.items()],
    ]
    common.write_result(out, "cluster", "L12, L15 and the planner's step time on an emulated 2-node cluster",
                        ["layout", "step s", "spread s", "exposed comm s", "MB sent per rank", "planner s",
                         "planner vs measured", "planner comm s"], rows, notes)
    cmds = [[n, f"`{torchrun_line(n, args)}`", f"`{planner(n, consts, world, args.ranks)[1]}`"] for n in LAYOUTS]
    text = (out / "cluster.md").read_text().rstrip() + "\n\n" + "\n".join([
        "#### L12: peak bus bandwidth per rank (GB/s; bench/collectives.py's sweep, 16 B to 16 MB)", "",
        common.markdown_table(["collective", "inside a node", "across nodes", "ratio"], l12), "",
        "Across nodes both ranks of a node send at once, so each gets half the link. gloo's reduce-scatter takes as "
        "long as an all-reduce of its whole input: half the all-reduce's bus bandwidth.", "",
        "#### Commands", "", common.markdown_table(["layout", "measured (one launcher per node)", "predicted"], cmds),
        ""])
    (out / "cluster.md").write_text(text)
    ar = [peak[(k, "all_reduce")] for k in ("intra-node", "inter-node")]
    ag = [peak[(k, "all_gather")] for k in ("intra-node", "inter-node")]
    common.answer("L12", f"emulated 2 nodes, {link.split(',')[0]} links: all-reduce busbw {ar[0]:.3f} GB/s inside a "
                         f"node vs {ar[1]:.3f} across nodes ({ar[0] / ar[1]:.0f}x), all-gather {ag[0]:.3f} vs "
                         f"{ag[1]:.3f} ({ag[0] / ag[1]:.0f}x) per rank (gloo, bench/results/cluster.md)")
    f1, f2, h = (meas[n] for n in names[:3])
    common.answer("L15", f"emulated 2 nodes: FSDP over 4 ranks {f1[0]:.3f} s/step inside one node vs {f2[0]:.3f} s "
                         f"across 2 nodes x 2 ({f2[0] / f1[0]:.2f}x; exposed comm {f1[1]:.3f} vs {f2[1]:.3f} s); "
                         f"HSDP with a node as shard group {h[0]:.3f} s (bench/results/cluster.md)")
    return claims

