"""`make bench`: run every bench script that fits this machine, then index the lab checklist L1-L28.

    python bench/run_all.py                 # everything CPU-feasible, each script under a generous budget
    python bench/run_all.py --only precision.py --only collectives.py
    python bench/run_all.py --list          # the registry, without running anything

Each script runs in its own process group with --out set to the results folder (--results, default
bench/results); its output goes to logs/NAME.log there, and the lines `ANSWER Lk: text` it prints
(bench/common.answer) are the headline answers. INDEX.md lists L1-L28: the question, the scripts and
tests that answer it, and the latest measured answer (kept in answers.json across partial runs). Scripts
that need a GPU are skipped on a CPU machine with a message, the emulated cluster (bench/cluster.py) without root
(CAP_NET_ADMIN) likewise; a script that has not landed yet is reported as missing.

Budgets guard against hangs; they are not a pass mark. Each is generous (several times what the script
takes on an idle machine; --budget-scale stretches them all). A script still running at its budget is
"over budget": if it has written something by then (a table, an ANSWER line) it is stopped there and what
it wrote is kept; if not, it may run on to HANG_FACTOR times its budget (at most HARD_CEILING_S). Only a
crash (a nonzero exit) or a hang (still running at that limit: killed) fails the run, with exit status 1;
over-budget scripts are reported as such in INDEX.md and the run exits 0. --budget-min stops starting
scripts after that many minutes (and stops the one running then, if it has written something).
"""
import argparse
import datetime
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench import common  # noqa: E402
from bench.cluster_net import can_admin_net  # noqa: E402

QUESTIONS = {
    "L1": "dtype of params, inputs, accumulation, grads, optimizer state per precision mode",
    "L2": "throughput of fp32 vs bf16/fp16 autocast",
    "L3": "matmul utilization at tile-unaligned sizes (8192 vs 8191/8200)",
    "L4": "fp16 gradient underflow without loss scaling, fixed with it",
    "L5": "each DP rank gets different samples",
    "L6": "global batch = local batch x world x accumulation steps",
    "L7": "sum vs average of gradients: learning rate and loss normalization",
    "L8": "single-device gradient == DDP all-reduced gradient",
    "L9": "profiler trace: backward overlaps the gradient all-reduce",
    "L10": "bucket size vs number of collective calls and overlap",
    "L11": "does the loader prefetch, or does the device wait for input",
    "L12": "intra-node vs inter-node collective bandwidth",
    "L13": "FSDP: params, grads, optimizer state truly sharded per rank",
    "L14": "how many all-gathers in forward and in backward (FSDP)",
    "L15": "FSDP group inside one server vs across servers: throughput",
    "L16": "prefetch and reduce-scatter hidden under compute, on a timeline",
    "L17": "peak memory and step time with and without activation checkpointing",
    "L18": "segment length C sweep: memory vs recompute",
    "L19": "recomputed forward reproduces dropout exactly",
    "L20": "checkpointing every layer: effect on MFU and HFU",
    "L21": "useful FLOPs per step from architecture and global batch",
    "L22": "MFU from device peak and measured step time",
    "L23": "why HFU != MFU",
    "L24": "sweep parallel degrees and micro-batches: compare MFU",
    "L25": "which collective lets a local query see all keys and values under CP",
    "L26": "pipeline utilization of each schedule (gpipe, 1f1b, interleaved, zb1, zbv) vs theory",
    "L27": "why the TP MLP splits column-wise then row-wise",
    "L28": "which physical scope each of the TP/CP/PP/DP groups lands on",
}

# Items answered by tests or by the code itself: what the test asserts, shown once such a test exists.
TESTED = {
    "L5": ("tests/test_data.py, tests/test_ddp.py", "DP rank slices are disjoint and their union is the "
           "one-process global batch (a function of seed and step only)"),
    "L6": ("tests/test_ddp.py", "global batch = micro x dp x accumulation, asserted; train.py refuses any other"),
    "L7": ("tests/test_ddp.py, parallel/ddp.py", "gradients are averaged over dp x cp (sum, then divide: gloo has "
           "no AVG), so the loss is the mean over the global batch and the learning rate does not change with "
           "the world size; a sum would scale the gradient by dp x cp"),
    "L8": ("tests/test_ddp.py", "losses over 10 steps (rtol 1e-5) and step-1 gradients equal one process for "
           "ddp/fsdp/hsdp, worlds 2 and 4, with and without accumulation"),
    "L9": ("tests/test_ddp.py, train.py --profile", "the first bucket's all-reduce is launched before backward "
           "ends (hook order); the --profile Chrome trace shows it under backward compute"),
    "L13": ("tests/test_fsdp.py", "persistent param, grad and optimizer bytes per rank <= total/M + padding"),
    "L14": ("tests/test_fsdp.py", "bytes per rank per step = theory within 1% (ddp 2P, fsdp ~3P ring terms); "
            "all-gathers per forward and backward printed"),
    "L16": ("tests/test_fsdp.py, train.py --profile", "prefetch all-gather and reduce-scatter sit under compute "
            "in the --profile trace"),
    "L19": ("tests/test_ckpt.py", "with dropout > 0 the recomputed forward reproduces the same masks: gradients "
            "equal the no-checkpoint run"),
    "L25": ("tests/test_cp.py, parallel/cp.py", "ring: send/recv passes of K/V (cp-1 per layer in forward); "
            "ulysses: all-to-all from sequence shards to head shards; allgather: all-gather of K/V"),
    "L27": ("tests/test_tp.py, parallel/tp.py", "column-parallel gate/up then row-parallel down needs one "
            "all-reduce per MLP forward: Y = [X A_1 | X A_2] [B_1; B_2] = X A_1 B_1 + X A_2 B_2"),
    "L28": ("tests/test_4d.py, parallel/mesh.py", "Mesh.describe: tp innermost (one server), then cp, pp, dp "
            "outermost (across servers); train.py prints it at start"),
}


@dataclass
class Script:
    path: str                    # relative to the repository root
    items: list                  # lab items it answers
    budget_s: int                # over budget past this (stopped if it wrote something); hung at HANG_FACTOR x
    args: list = field(default_factory=list)
    gpu_only: bool = False
    net_admin: bool = False      # makes network namespaces (needs root or CAP_NET_ADMIN)
    name: str = ""               # log name (defaults to the file name)
    takes_out: bool = True       # accepts --out DIR (run_all passes its results folder)

    @property
    def label(self):
        return self.name or Path(self.path).stem


# One entry per script; colleagues' scripts run with their defaults. Budgets: several times an idle machine's time.
REGISTRY = [
    Script("bench/precision.py", ["L1", "L2", "L3", "L4"], 480),
    Script("bench/loader_stall.py", ["L11"], 240),
    Script("bench/collectives.py", ["L12"], 240),
    Script("bench/mfu_sweep.py", ["L20", "L21", "L22", "L23", "L24"], 600),
    Script("bench/plan.py", ["L24", "L28"], 120,
           ["--model", "llama3-405b", "--gpus", "16384", "--gpus-per-node", "8", "--seq-len", "131072"],
           takes_out=False),
    Script("bench/plan.py", ["L15"], 120, ["--model", "llama3-8b", "--gpus", "64", "--compare-fsdp-scope"],
           name="plan_fsdp_scope", takes_out=False),
    Script("bench/vs_torch.py", ["L8"], 300),
    Script("bench/dp_memory.py", ["L13", "L14"], 240),
    Script("bench/ddp_buckets.py", ["L9", "L10"], 240),
    Script("bench/ckpt_memory.py", ["L17", "L18", "L20"], 300),
    Script("bench/pp_bubble.py", ["L26"], 900),  # five schedules, M = 8 and 16
    # L12 and L15 across emulated nodes (network namespaces, shaped links); its answers replace the loopback ones
    Script("bench/cluster.py", ["L12", "L15"], 600, net_admin=True),
    Script("bench/ring_vs_sdpa.py", ["L25"], 240, gpu_only=True),  # the bf16 flash kernels
    Script("bench/gpu.py", ["L22"], 1080, gpu_only=True),  # one GPU: ours vs Hugging Face, kernels, ring (< 8 min)
    # GPU only: the small preset with and without full checkpointing (L20 on real hardware).
    Script("bench/mfu_sweep.py", ["L20", "L23"], 600, ["--model", "small", "--layout", "ckpt none=1:",
                                                       "--layout", "ckpt full=1:--ckpt full", "--micro-batches", "8",
                                                       "--name", "L20_ckpt_small_gpu"],
           gpu_only=True, name="mfu_sweep_ckpt_gpu"),
]

ANSWER_RE = re.compile(r"^" + re.escape(common.ANSWER_PREFIX) + r"(L\d+): (.*)$")
HANG_FACTOR = 3  # a script with nothing written yet may run this many budgets before it counts as hung
HARD_CEILING_S = 45 * 60  # and never longer than this
FAILED = ("failed", "hung")  # statuses that fail the run; "over budget" does not


def written(results, since=None):
    """{path: mtime} of the result files in the results folder (logs and the index aside); with `since`
    (an earlier call's answer), only the files new or changed since."""
    files = {}
    for path in Path(results).rglob("*"):
        rel = path.relative_to(results).parts
        if path.is_file() and rel[0] != "logs" and path.name not in ("INDEX.md", "answers.json"):
            files[path] = path.stat().st_mtime_ns
    return {p: t for p, t in files.items() if since is None or since.get(p) != t}


def run_script(script, results, budget_s, hang_s=None):
    """Runs one script in its own session; returns (status, seconds, {item: answer}). Past budget_s it is over
    budget: stopped there if it has written a result file or an ANSWER line, else left to run until hang_s
    (default HANG_FACTOR x budget_s, at most HARD_CEILING_S), where it is killed as hung."""
    hang_s = max(budget_s, min(HANG_FACTOR * budget_s, HARD_CEILING_S) if hang_s is None else hang_s)
    before = written(results)
    log_dir = Path(results) / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / f"{script.label}.log"
    cmd = [sys.executable, script.path, *script.args, *(["--out", str(results)] if script.takes_out else [])]
    answers = {}
    start = time.perf_counter()
    with open(log_path, "w") as log:
        log.write(f"$ {' '.join(cmd)}\n")
        log.flush()
        proc = subprocess.Popen(cmd, cwd=common.REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                start_new_session=True)

        def pump():
            for line in proc.stdout:
                log.write(line)
                log.flush()
                m = ANSWER_RE.match(line.strip())
                if m:
                    answers[m.group(1)] = m.group(2)
                    print(f"    {m.group(1)}: {m.group(2)}", flush=True)

        reader = threading.Thread(target=pump, daemon=True)
        reader.start()
        try:
            rc = proc.wait(timeout=budget_s)
        except subprocess.TimeoutExpired:
            rc = None
        if rc is None and (answers or written(results, before)):
            stop(proc)
            files = written(results, before)
            status = (f"over budget: stopped at its {budget_s:.0f} s budget; kept what it wrote "
                      f"({len(files)} file{'s' * (len(files) != 1)}, {len(answers)} answer{'s' * (len(answers) != 1)})")
        elif rc is None:
            try:
                rc = proc.wait(timeout=max(hang_s - (time.perf_counter() - start), 0))
            except subprocess.TimeoutExpired:
                stop(proc)
                status = f"hung: killed at {hang_s:.0f} s with nothing written (budget {budget_s:.0f} s)"
        if rc is not None:
            seconds = time.perf_counter() - start
            status = (f"failed (exit {rc})" if rc != 0 else
                      "ok" if seconds <= budget_s else f"over budget: finished (budget {budget_s:.0f} s)")
        reader.join(timeout=10)
    return status, time.perf_counter() - start, answers


def stop(proc):
    """Ends the script and everything it started (its own session): TERM, then KILL."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=10)
            return
        except subprocess.TimeoutExpired:
            continue


def mentions(item):
    """Test and bench files that name the item (e.g. 'L8') in their text."""
    pattern = re.compile(rf"\b{item}\b")
    found = []
    for folder in ("tests", "bench", "parallel"):
        for path in sorted((common.REPO / folder).glob("*.py")):
            if path.name in ("run_all.py", "common.py", "test_bench.py"):  # they name every item
                continue
            try:
                if pattern.search(path.read_text(errors="replace")):
                    found.append(f"{folder}/{path.name}")
            except OSError:
                pass
    return found


def write_index(results, answers, statuses):
    lines = ["# Lab checklist L1-L28: where each item is answered", "",
             f"Updated {datetime.date.today().isoformat()} by `python bench/run_all.py` on {common.hardware_line()}. "
             "Answers are the headline lines the scripts printed (`ANSWER Lk: ...`); the full tables are the "
             "other files in this folder, the raw output is in logs/.", "",
             "| item | question | answered by | answer |", "|---|---|---|---|"]
    for item, question in QUESTIONS.items():
        scripts = [s.path for s in REGISTRY if item in s.items and (common.REPO / s.path).exists()]
        scripts = list(dict.fromkeys(scripts))
        where = scripts + [m for m in mentions(item) if m not in scripts]
        if item in answers:
            a = answers[item]
            text = f"{a['text']} ({a['script']}, {a['date']})"
        elif item in TESTED and any(w.startswith("tests/") for w in where):
            text = f"asserted by tests: {TESTED[item][1]}"
        elif item in TESTED and any(w.startswith("parallel/") for w in where):
            text = f"documented in the code: {TESTED[item][1]}"
        elif item in TESTED:
            text = f"pending: expected in {TESTED[item][0]}, not on main yet"
        else:
            missing = [s.path for s in REGISTRY if item in s.items and not (common.REPO / s.path).exists()]
            logs = [f"logs/{s.label}.log" for s in REGISTRY
                    if item in s.items and (Path(results) / "logs" / f"{s.label}.log").exists()]
            if logs:
                text = f"ran, printed no headline: see {', '.join(logs)}"
            else:
                text = "not measured yet" + (f" ({', '.join(missing)} not on main)" if missing else
                                             " (run `make bench`)")
        lines.append(f"| {item} | {question} | {', '.join(where) or '-'} | {text.replace('|', chr(92) + '|')} |")
    if statuses:
        lines += ["", "## Last run", "", "| script | items | status | seconds |", "|---|---|---|---|"]
        lines += [f"| {s.path} {' '.join(s.args)} | {', '.join(s.items)} | {st} | {sec:.0f} |"
                  for s, st, sec in statuses]
    path = Path(results) / "INDEX.md"
    path.write_text("\n".join(lines) + "\n")
    return path


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--only", action="append", help="run only scripts whose file name or label matches (repeatable)")
    p.add_argument("--list", action="store_true", help="print the registry and exit")
    p.add_argument("--budget-min", type=float, default=29.0,
                   help="stop starting scripts after this many minutes (and the running one, if it wrote something)")
    p.add_argument("--results", default=str(common.RESULTS), help="results folder (INDEX.md, answers.json, logs/)")
    p.add_argument("--index-only", action="store_true", help="rebuild INDEX.md from answers.json, run nothing")
    p.add_argument("--budget-scale", type=float, default=1.0,
                   help="multiply every script's budget (a slow or shared machine); --budget-min still caps the run")
    args = p.parse_args(argv)
    gpu = common.has_cuda()
    if args.list:
        for s in REGISTRY:
            state = "present" if (common.REPO / s.path).exists() else "missing"
            print(f"{s.path:26s} {','.join(s.items):22s} {s.budget_s:4d} s  {'GPU only  ' if s.gpu_only else ''}"
                  f"{state}  {' '.join(s.args)}")
        return 0
    results = Path(args.results)
    results.mkdir(parents=True, exist_ok=True)
    answers_path = results / "answers.json"
    answers = json.loads(answers_path.read_text()) if answers_path.exists() else {}
    statuses, failed = [], False
    if not args.index_only:
        todo = [s for s in REGISTRY if not args.only or any(o in (s.path, Path(s.path).name, s.label)
                                                             for o in args.only)]
        deadline = time.perf_counter() + args.budget_min * 60
        print(f"run_all: {len(todo)} scripts on {common.hardware_line()}; results in {results}", flush=True)
        for i, s in enumerate(todo, 1):
            head = f"[{i}/{len(todo)}] {s.path} {' '.join(s.args)}".rstrip()
            if s.gpu_only and not gpu:
                print(f"{head}: SKIPPED, needs a GPU (none visible); answers {', '.join(s.items)} on a GPU node",
                      flush=True)
                statuses.append((s, "skipped: needs a GPU", 0.0))
                continue
            if s.net_admin and not can_admin_net():
                print(f"{head}: SKIPPED, needs root (CAP_NET_ADMIN) for network namespaces", flush=True)
                statuses.append((s, "skipped: needs root (CAP_NET_ADMIN)", 0.0))
                continue
            if not (common.REPO / s.path).exists():
                print(f"{head}: MISSING, not on main yet", flush=True)
                statuses.append((s, "missing: not on main yet", 0.0))
                continue
            left = deadline - time.perf_counter()
            if left < 30:
                print(f"{head}: SKIPPED, the {args.budget_min:g}-minute budget is spent", flush=True)
                statuses.append((s, "skipped: total budget spent", 0.0))
                continue
            budget = min(s.budget_s * args.budget_scale, left)
            hang = min(HANG_FACTOR * s.budget_s * args.budget_scale, HARD_CEILING_S)
            print(f"{head}: running (budget {budget:.0f} s, hung at {max(hang, budget):.0f} s; "
                  f"log {results / 'logs' / s.label}.log)", flush=True)
            status, seconds, got = run_script(s, results, budget, hang)
            print(f"{head}: {status} in {seconds:.0f} s", flush=True)
            failed |= status.startswith(FAILED)
            statuses.append((s, status, seconds))
            for item, text in got.items():
                answers[item] = {"text": text, "script": s.path, "date": datetime.date.today().isoformat()}
            answers_path.write_text(json.dumps(answers, indent=1, sort_keys=True) + "\n")
    index = write_index(results, answers, statuses)
    print(f"wrote {index}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
