"""L12, L15 and the planner's step time, measured on an emulated cluster (net.py): one torchrun per node meeting at
node 0, three jobs of bench/cluster/worker.py (bench/README.md, "An emulated cluster"), then the planner's price of
each layout from the constants the ranks measured (report.py). Needs root (CAP_NET_ADMIN); without it, one line, exit 0.

    python -m bench.cluster   # 2 nodes x 2 ranks, 1 Gbit/s NICs: the whole table (< 6 min)
    python -m bench.cluster --gbit 0.5 --delay-ms 1 --rounds 3
"""
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench import common
from bench.cluster.net import Net, can_admin_net
from bench.cluster.report import JOBS, LAYOUTS, MODEL, OPS, report
from bench.ranks import free_port
from config import nonnegative_float, nonnegative_int, positive_float, positive_int

WORKER = ["-m", "bench.cluster.worker"]  # what torchrun starts in every node
SIZES = [16, 2 ** 16, 2 ** 20, 2 ** 22, 2 ** 24]


class Stop(Exception):
    """SIGTERM: unwind through every finally (the namespaces' teardown) like Ctrl-C does."""


def on_sigterm(signum, frame):
    raise Stop(f"signal {signum}")


def torchrun(net, nodes, per_node, argv, timeout, log_dir, env=None):
    """Starts `python -m torch.distributed.run ... argv` in each of the first `nodes` nodes, the launchers meeting at
    node 0 (c10d), and waits: at most `timeout` seconds, and once a node has failed, 15 more for the others. Kills
    what is left. Returns each node's exit code (None: killed); node K's output is in log_dir/nodeK.log."""
    port, rdzv_id = free_port(), f"job{time.monotonic_ns()}"
    env = {**os.environ, **(env or {}), "GLOO_SOCKET_IFNAME": "eth0", "MASTER_ADDR": net.addr(0),
           "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    procs = []
    for k in range(nodes):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(nodes), "--nproc-per-node",
               str(per_node), "--rdzv-backend", "c10d", "--rdzv-endpoint", f"{net.addr(0)}:{port}", "--rdzv-id",
               rdzv_id, "--rdzv-conf", f"is_host={int(k == 0)}", "--local-addr", net.addr(k), "--max-restarts", "0",
               *map(str, argv)]
        with open(Path(log_dir) / f"node{k}.log", "w") as log:
            procs.append(net.popen(k, cmd, env=env, cwd=common.REPO, stdout=log, stderr=subprocess.STDOUT,
                                   start_new_session=True))
    deadline = time.monotonic() + timeout
    try:
        while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
            if any(p.poll() not in (None, 0) for p in procs):  # one node failed: give the others a moment
                deadline = min(deadline, time.monotonic() + 15)
            time.sleep(0.2)
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
                p.returncode = None
    return [p.returncode for p in procs]


def run_worker(net, job, spec, args, tmp, log):
    """One job of bench/cluster/worker.py; rank 0's results, or RuntimeError with each node's exit code and output."""
    nodes, order = JOBS[job]
    spec_path, out_path = Path(tmp) / "spec.json", Path(tmp) / "out.json"
    spec_path.write_text(json.dumps({**spec, "order": order}))
    out_path.unlink(missing_ok=True)
    codes = torchrun(net, nodes, args.nodes * args.ranks // nodes, [*WORKER, "--spec", spec_path, "--out", out_path],
                     args.timeout, tmp)
    outputs = [(Path(tmp) / f"node{k}.log").read_text() for k in range(nodes)]
    log.write("".join(outputs))
    if any(c != 0 for c in codes) or not out_path.exists():
        tails = "\n".join(f"--- node {k} (exit {c}):\n{o[-3000:]}" for k, (c, o) in enumerate(zip(codes, outputs)))
        raise RuntimeError(f"job {job!r} failed (exit codes {codes}, None = killed at its time limit)\n{tails}")
    return json.loads(out_path.read_text())


def run_jobs(args, log):
    """{job: [rank 0's results of each round]}, the jobs alternating for --rounds rounds, and the shaping used."""
    results = {job: [] for job in JOBS}
    base = {"model": MODEL, "warmup": args.warmup, "steps": args.steps, "rounds": 1, "rate_rows": 128,
            "sizes": SIZES, "ops": list(OPS), "target_s": 0.1}
    with Net(args.nodes, args.gbit, args.delay_ms, args.nodes * args.ranks, rails=args.ranks) as net, \
            tempfile.TemporaryDirectory() as tmp:
        base.update(cgroups=str(net.cgroups) if net.cgroups else None, rails=args.ranks)
        print(f"cluster: {args.nodes} namespaces x {args.ranks} ranks, links {args.gbit:g} Gbit/s each way "
              f"({net.shaping}{'' if net.shaping == 'netem' else ': this kernel has no sch_netem, no delay added'})",
              flush=True)
        for rnd in range(args.rounds):
            for job in JOBS:
                layouts = {name: flags for name, (j, flags, _) in LAYOUTS.items() if j == job}
                tasks = ["collectives"] * (JOBS[job][1] == "node") + ["train"]
                t0, sent = time.perf_counter(), net.sent_bytes()
                res = run_worker(net, job, {**base, "layouts": layouts, "tasks": tasks}, args, tmp, log)
                res["link_bytes"] = [b - a for a, b in zip(sent, net.sent_bytes())]
                results[job].append(res)
                print(f"  round {rnd + 1}, {job}: {time.perf_counter() - t0:.0f} s", flush=True)
        return results, net.shaping, net.cpu_share


@common.command
def main(argv=None):
    ap = common.parser(__doc__)
    ap.add_argument("--nodes", type=int, default=2, choices=[2], help="emulated nodes (the layouts are for 2)")
    ap.add_argument("--ranks", type=int, default=2, choices=[2], help="ranks per node")
    ap.add_argument("--gbit", type=positive_float, default=1.0, help="each node's link, Gbit/s each way")
    ap.add_argument("--delay-ms", type=nonnegative_float, default=0.2, help="added delay each way (needs sch_netem)")
    ap.add_argument("--rounds", type=positive_int, default=2, help="times each job runs, the jobs alternating")
    ap.add_argument("--steps", type=positive_int, default=4, help="timed steps per layout per round")
    ap.add_argument("--warmup", type=nonnegative_int, default=2, help="untimed steps first")
    ap.add_argument("--timeout", type=positive_float, default=240, help="seconds one job may take")
    args = ap.parse_args(argv)
    if not can_admin_net():
        print("skipped: python -m bench.cluster needs root (CAP_NET_ADMIN) to make network namespaces")
        return 0
    signal.signal(signal.SIGTERM, on_sigterm)
    log_path = Path(args.out) / "logs" / "cluster_ranks.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "w") as log:
        results, shaping, cpu_share = run_jobs(args, log)
    (log_path.parent / "cluster.json").write_text(json.dumps(results))
    claims = report(results, args, shaping, cpu_share, Path(args.out))
    print("\n".join(f"{claim}: {'yes' if ok else 'NO'}" for claim, ok in claims.items()))
    return 0
