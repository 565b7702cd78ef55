"""The emulated cluster's tables: what it measured, and the planner's prediction from the constants the cluster
measured about itself (rates, links' bus bandwidth and latency), never from a step time.

    python -m bench.cluster.report [bench/results/logs/cluster.json]   # re-price a run's raw results, term by term
"""
import json
import math
import shlex
import statistics
from pathlib import Path

from bench import common
from bench.planner.layout import Cluster, parse_layout
from bench.planner.search import evaluate
from config import parse_args
from train import model_config

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
OPS = ("all_reduce", "all_gather", "reduce_scatter", "send_recv")
LINK_OPS = ("all_reduce",)  # a link's bus bandwidth and latency: its all-reduce's, as nccl-tests reports them
STEPS_PER_OP = {"all_reduce": lambda n: 2 * (n - 1).bit_length(), "all_gather": lambda n: n - 1,
                "send_recv": lambda n: 1}  # the planner's ring steps: 2 log2 n for an all-reduce


def constants(results):
    """The planner's constants, medians pooled over the whole run (other load changes by the minute): the ranks'
    rates, and per kind of link the bus bandwidth at the largest size and the latency per ring step at the smallest."""
    rates = [rate for rounds in results.values() for r in rounds for t in r["train"].values() for rate in t["rates"]]
    out = {"peak_tflops": statistics.median(r["matmul"] for r in rates) / 1e12,
           "attn_tflops": statistics.median(r["attention"] for r in rates) / 1e12,
           "hbm_tbs": statistics.median(r["memory"] for r in rates) / 1e12,
           "host_us": 1e6 / statistics.median(r.get("host", math.inf) for r in rates)}  # 0: an old log
    for kind, key in (("intra-node", "intra"), ("inter-node", "inter")):
        rows = [row for rounds in results.values() for r in rounds for row in r.get("collectives", [])
                if row["kind"] == kind and row["op"] in LINK_OPS]
        small, big = min(row["size"] for row in rows), max(row["size"] for row in rows)
        out[f"{key}_gbs"] = statistics.median(row["busbw"] for row in rows if row["size"] == big)
        out[f"lat_{key}_us"] = statistics.median(row["time_us"] / STEPS_PER_OP[row["op"]](row["n"])
                                                 for row in rows if row["size"] == small)
    return out


def workload(flags):
    """(model config, sequence length, global batch) of a layout's train.py flags."""
    args = parse_args(MODEL + flags)
    cfg = model_config(args, 0)
    return cfg, cfg.seq_len, args.global_batch


def planner(name, const, world, per_node):
    """(the planner's step-time bill for one layout, the planner command that prints it); const: its constants."""
    job, flags, layout = LAYOUTS[name]
    gpn = world if JOBS[job][0] == 1 else per_node
    cfg, seq, batch = workload(flags)
    cl = Cluster(world, gpn, 1000.0, backend="gloo", dtype_bytes=4, measured=True, **const)
    bill = evaluate(cfg, cl, parse_layout(layout), seq, batch, code="ours").time
    cmd = ["python", "-m", "bench.planner", "--code", "ours", *MODEL, "--global-batch-tokens", str(batch * seq),
           "--gpus", str(world), "--gpus-per-node", str(gpn),
           "--hbm-gb", "1000", "--backend", "gloo", "--dtype", "fp32", "--measured"]
    for k, v in const.items():
        cmd += [f"--{k.replace('_', '-')}", f"{v:.4g}"]
    return bill, shlex.join(cmd + ["--layout", layout])


def replan(results, ranks=2):
    """{layout: (measured step s, measured exposed comm s, the planner's bill)} of a run's raw results (cluster.json),
    the planner fed the constants the run measured."""
    const, meas, world = constants(results), measured(results), len(results["two nodes"][0]["nodes"])
    return {name: (meas[name][0], meas[name][1], planner(name, const, world, ranks)[0]) for name in LAYOUTS}


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


def link_peaks(results):
    """{(kind, op): peak busbw over sizes} of the two-node cluster's sweeps, the median over rounds."""
    sweeps = [r["collectives"] for r in results["two nodes"]]
    keys = {(row["kind"], row["op"]) for row in sweeps[0]}
    return {k: statistics.median(max(row["busbw"] for row in rows if (row["kind"], row["op"]) == k)
                                 for rows in sweeps) for k in keys}


def misranked(meas, preds):
    """Pairs the planner orders one way and every round measured the other way (their spreads do not overlap)."""
    return [(a, b) for a in meas for b in meas if preds[a] < preds[b] and meas[a][2][0] > meas[b][2][1]]


def report(results, args, shaping, cpu_share, out):
    """Writes out/cluster.md; prints the L12 and L15 answers. Returns {claim: holds}."""
    const, meas, world = constants(results), measured(results), args.nodes * args.ranks
    link = f"{args.gbit:g} Gbit/s each way" + (f", {args.delay_ms:g} ms delay" if shaping == "netem" else
                                               ", no added delay (this kernel has no sch_netem; tbf shapes the rate)")
    rows, preds, cmds = [], {}, []
    for name in LAYOUTS:
        bill, cmd = planner(name, const, world, args.ranks)
        step, wait, (lo, hi), sent = meas[name]
        preds[name] = bill["total"]
        rows.append([name, f"{step:.3f}", f"{lo:.3f}-{hi:.3f}", f"{wait:.3f}", f"{sent:.1f}", f"{bill['total']:.3f}",
                     f"{bill['total'] / step - 1:+.0%}", f"{sum(bill[k] for k in ('tp', 'cp', 'pp', 'dp')):.3f}"])
        cmds.append([name, f"`{torchrun_line(name, args)}`", f"`{cmd}`"])
    order_m, order_p = sorted(LAYOUTS, key=lambda n: meas[n][0]), sorted(LAYOUTS, key=lambda n: preds[n])
    names, step = list(LAYOUTS), {n: meas[n][0] for n in LAYOUTS}
    claims = {"FSDP across nodes is slower than FSDP inside a node": step[names[1]] > step[names[0]],
        "HSDP is faster than FSDP across nodes": step[names[2]] < step[names[1]],
        "tp across nodes is slower than tp inside a node": step[names[5]] > step[names[4]],
        "the planner lands within +-25% of every measured step": all(abs(preds[n] / step[n] - 1) <= 0.25
                                                                      for n in names),
        "the planner ranks the layouts as measured": order_m == order_p,
        "... but for pairs whose round spreads overlap (ties this run cannot order)": not misranked(meas, preds),}
    peak = link_peaks(results)
    l12 = [[op] + [f"{peak[(k, op)]:.3f}" for k in ("intra-node", "inter-node")]
           + [f"{peak[('intra-node', op)] / peak[('inter-node', op)]:.0f}x"] for op in OPS]
    caps = (f"each rank capped at {cpu_share:g} of a core (a cgroup: a rank is a device, and lends no one the "
            "cycles it spends waiting)" if cpu_share else "no cpu caps (no cgroup v1 cpu controller here)")
    notes = [f"The cluster: {args.nodes} network namespaces x {args.ranks} ranks on this {common.cpu_cores()}-core "
        f"machine, {caps}; one NIC per rank (local rank J of every node on rail J), each {link}; inside a node the "
        f"ranks talk over loopback. {args.rounds} rounds of the three jobs, alternating; {args.steps} timed steps per "
        f"layout per round after {args.warmup} warm-up steps; step = the slowest rank's, exposed comm = the most "
        "seconds a rank spent blocked in collectives (parallel/comm.py's wait_s); spread = the lowest and highest "
        "round median.",
        f"The planner's constants, measured by the ranks themselves, all ranks at once, medians over the run: the "
        f"rates sampled before every layout of every round, matmul {const['peak_tflops'] * 1e3:.1f} "
        f"GFLOP/s over a block's linears (its peak), causal attention fwd+bwd {const['attn_tflops'] * 1e3:.1f} "
        f"GFLOP/s, memory {const['hbm_tbs'] * 1e3:.1f} GB/s (a 16 MB add), host {const['host_us']:.1f} us per "
        "dispatched op (a chain of tiny multiplies, forward and backward); the links' from the sweeps of "
        f"every round: inside a node {const['intra_gbs']:.3f} GB/s and {const['lat_intra_us']:.0f} us per ring step, "
        f"across nodes {const['inter_gbs']:.3f} GB/s and {const['lat_inter_us']:.0f} us (all-reduce bus bandwidth of "
        "the largest messages, latency of the smallest). The latencies are mostly the scheduler's: a rank woken by "
        "a message waits for a core.", "Measured: " + " < ".join(order_m) + ". Predicted: " + " < ".join(order_p) + ".",
        *[f"{claim}: {'yes' if ok else 'NO'}" for claim, ok in claims.items()],]
    common.write_result(out, "cluster", "L12, L15 and the planner's step time on an emulated 2-node cluster",
                        ["layout", "step s", "spread s", "exposed comm s", "MB sent per rank", "planner s",
                         "planner vs measured", "planner comm s"], rows, notes)
    text = (out / "cluster.md").read_text().rstrip() + "\n\n" + "\n".join([
        "#### L12: peak bus bandwidth per rank, GB/s (bench/labs/collective_bandwidth.py's sweep, 16 B to 16 MB)", "",
        common.markdown_table(["collective", "inside a node", "across nodes", "ratio"], l12), "",
        f"Across nodes every rank has its own {args.gbit:g} Gbit/s NIC ({args.gbit / 8:.3f} GB/s). gloo's "
        "reduce-scatter takes as long as an all-reduce of its whole input (half the bus bandwidth), its all-gather "
        "reaches about half the all-reduce's.", "",
        "#### Commands", "", common.markdown_table(["layout", "measured (one launcher per node)", "predicted"], cmds),
        ""])
    (out / "cluster.md").write_text(text)
    ar, ag = ([peak[(k, op)] for k in ("intra-node", "inter-node")] for op in ("all_reduce", "all_gather"))
    common.answer("L12", f"emulated 2 nodes, {args.gbit:g} Gbit/s links: all-reduce busbw {ar[0]:.3f} GB/s inside a "
                         f"node vs {ar[1]:.3f} across nodes ({ar[0] / ar[1]:.0f}x), all-gather {ag[0]:.3f} vs "
                         f"{ag[1]:.3f} ({ag[0] / ag[1]:.0f}x) per rank (gloo; bench/results/cluster.md)")
    f1, f2, h = (meas[n] for n in names[:3])
    common.answer("L15", f"emulated 2 nodes: FSDP over 4 ranks {f1[0]:.3f} s/step inside one node vs {f2[0]:.3f} s "
                         f"across 2 nodes x 2 ({f2[0] / f1[0]:.2f}x; exposed comm {f1[1]:.3f} vs {f2[1]:.3f} s); "
                         f"HSDP with a node as shard group {h[0]:.3f} s (bench/results/cluster.md)")
    return claims


@common.command
def main(argv=None):
    p = common.parser(__doc__, results=False)
    p.add_argument("results", nargs="?", default="bench/results/logs/cluster.json", help="python -m bench.cluster's")
    for name, (step, wait, bill) in replan(json.loads(Path(p.parse_args(argv).results).read_text())).items():
        terms = " ".join(f"{k} {v:.3f}" for k, v in bill.items() if v and k not in ("total", "mfu", "hfu"))
        print(f"{name:30} measured {step:.3f} s (exposed comm {wait:.3f}), planner {bill['total']:.3f} s "
              f"({bill['total'] / step - 1:+.0%}): {terms}")
