"""`make bench`: run every bench script that fits this machine, then index the lab checklist L1-L28.

    python -m bench.run_all            # everything this machine can run: about 18 minutes on 2 quiet CPU cores
    python -m bench.run_all --quick    # every script at smoke-test sizes, into out/bench-quick: about 5 minutes
    python -m bench.run_all --only precision --only collective_bandwidth
    python -m bench.run_all --list     # the registry and each script's time, without running anything

Each script runs as `python -m MODULE --out RESULTS` in its own session, its output in logs/NAME.log; its `ANSWER Lk:`
lines go to answers.json and INDEX.md. A script gets BUDGET_FACTOR x its seconds (at least MIN_BUDGET_S); past it,
it is stopped if it wrote something (kept, "over budget"), else it may run to HANG_FACTOR budgets (at most
HARD_CEILING_S). Only a crash or a hang fails the run (exit 1). GPU-only scripts are skipped on a CPU, the emulated
cluster without root; --budget-min stops starting scripts after that many minutes.
"""
import datetime
import importlib.util
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from bench import common
from bench.cluster.net import can_admin_net
from config import UsageError, positive_float

QUESTIONS = {"L1": "dtype of params, inputs, accumulation, grads, optimizer state per precision mode",
    "L2": "throughput of fp32 vs bf16/fp16 autocast",
    "L3": "matmul utilization at tile-unaligned sizes (8192 vs 8191/8200)",
    "L4": "fp16 gradient underflow without loss scaling, fixed with it", "L5": "each DP rank gets different samples",
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
    "L18": "segment length C sweep: memory vs recompute", "L19": "recomputed forward reproduces dropout exactly",
    "L20": "checkpointing every layer: effect on MFU and HFU",
    "L21": "useful FLOPs per step from architecture and global batch",
    "L22": "MFU from device peak and measured step time", "L23": "why HFU != MFU",
    "L24": "sweep parallel degrees and micro-batches: compare MFU",
    "L25": "which collective lets a local query see all keys and values under CP",
    "L26": "pipeline utilization of each schedule (gpipe, 1f1b, interleaved, zb1, zbv) vs theory",
    "L27": "why the TP MLP splits column-wise then row-wise",
    "L28": "which physical scope each of the TP/CP/PP/DP groups lands on",}

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
    module: str                  # run as `python -m MODULE` from the repository root
    items: list                  # lab items it answers
    seconds: int                 # what it takes on a quiet 2-core machine, measured (a GPU script: its bound)
    args: list = field(default_factory=list)
    quick: tuple = None          # (args, seconds) of its smoke-test run for --quick (on CPU); None: not in --quick
    gpu_only: bool = False
    net_admin: bool = False      # makes network namespaces (needs root or CAP_NET_ADMIN)
    name: str = ""               # log name (defaults to the module's last part)
    takes_out: bool = True       # accepts --out DIR (run_all passes its results folder)

    @property
    def label(self):
        return self.name or self.module.rsplit(".", 1)[-1]

    @property
    def source(self):
        """The file or folder it runs, from the repository root, or None where this tree has no such module."""
        try:
            path = Path(importlib.util.find_spec(self.module).origin)
        except (ImportError, AttributeError, TypeError):  # no such module (find_spec None, or no origin)
            return None
        path = path.parent if path.name == "__init__.py" else path
        return shown(path) + "/" * path.is_dir()


QUICK = ["--quick"]
PLAN_405B = ["--model", "llama3-405b", "--gpus", "16384", "--gpus-per-node", "8", "--seq-len", "131072"]
PLAN_L15 = ["--model", "llama3-8b", "--gpus", "64", "--compare-fsdp-scope"]  # the planner takes seconds: --quick too
# One entry per script, with its defaults. seconds: measured on 2 CPU cores (bench/README.md); the GPU scripts' are
# their bounds (bench.gpu ends within 10 minutes), as none has run on a GPU yet.
REGISTRY = [
    Script("bench.labs.precision", ["L1", "L2", "L3", "L4"], 70, quick=(QUICK, 25)),
    Script("bench.labs.loader_stall", ["L11"], 20, quick=(QUICK, 15)),
    Script("bench.labs.collective_bandwidth", ["L12"], 30, quick=(QUICK + ["--target-s", "0.01"], 15)),
    Script("bench.labs.mfu_sweep", ["L20", "L21", "L22", "L23", "L24"], 170, quick=(QUICK, 20)),
    Script("bench.planner", ["L24", "L28"], 10, PLAN_405B, quick=(PLAN_405B, 10), name="plan", takes_out=False),
    Script("bench.planner", ["L15"], 10, PLAN_L15, quick=(PLAN_L15, 10), name="plan_fsdp_scope", takes_out=False),
    Script("bench.vs_torch", ["L8"], 90, quick=(QUICK, 30)),
    Script("bench.labs.dp_memory", ["L13", "L14"], 15, quick=(QUICK, 15)),
    Script("bench.labs.ddp_buckets", ["L9", "L10"], 45, quick=(QUICK, 20)),
    Script("bench.labs.ckpt_memory", ["L17", "L18", "L20"], 45, quick=(QUICK, 15)),
    Script("bench.labs.pp_bubble", ["L26"], 560, quick=(QUICK, 45)),  # five schedules, M = 8 and 16
    # L12 and L15 across emulated nodes (network namespaces, shaped links); its answers replace the loopback ones
    Script("bench.cluster", ["L12", "L15"], 240, net_admin=True),
    Script("bench.labs.ring_vs_sdpa", ["L25"], 60, gpu_only=True, quick=(["--cpu-smoke"], 15)),  # bf16 flash kernels
    # one GPU: ours vs Hugging Face, kernels, ring; --smoke runs every part of it on CPU
    Script("bench.gpu", ["L22"], 600, gpu_only=True, quick=(["--smoke"], 60)),
    # GPU only: the small preset with and without full checkpointing (L20 on real hardware).
    Script("bench.labs.mfu_sweep", ["L20", "L23"], 200, ["--model", "small", "--layout", "ckpt none=1:",
                                                          "--layout", "ckpt full=1:--ckpt full", "--micro-batches",
                                                          "8", "--name", "L20_ckpt_small_gpu"],
           gpu_only=True, name="mfu_sweep_ckpt_gpu"),
]

ANSWER_RE = re.compile(r"^" + re.escape(common.ANSWER_PREFIX) + r"(L\d+): (.*)$")
BUDGET_FACTOR = 3  # a script is over budget at this many times its seconds
MIN_BUDGET_S = 240  # and never sooner: on a loaded machine start-up alone (torch, the ranks) can take minutes
HANG_FACTOR = 3  # a script with nothing written yet may run this many budgets before it counts as hung
HARD_CEILING_S = 60 * 60  # and never longer than this
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


def shown(path):
    """A path as a person reads it: from the repository root where it lies inside it."""
    path = Path(path).resolve()
    return path.relative_to(common.REPO).as_posix() if path.is_relative_to(common.REPO) else str(path)


def run_script(script, argv, results, budget_s, hang_s=None):
    """Runs `python -m script.module *argv` in its own session; returns (status, seconds, {item: answer}, [files it
    wrote]). Past budget_s it is over budget: stopped there if it has written a result file or an ANSWER line, else
    left to run until hang_s (default HANG_FACTOR x budget_s, at most HARD_CEILING_S), where it is killed as hung."""
    hang_s = max(budget_s, min(HANG_FACTOR * budget_s, HARD_CEILING_S) if hang_s is None else hang_s)
    before = written(results)
    log_dir = Path(results) / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / f"{script.label}.log"
    out = ["--out", str(results)] if script.takes_out else []
    answers = {}
    start = time.perf_counter()
    with open(log_path, "w") as log:
        log.write(f"$ {shlex.join(['python', '-m', script.module, *argv, *out[:1], *map(shown, out[1:])])}\n")
        log.flush()
        proc = subprocess.Popen([sys.executable, "-m", script.module, *argv, *out], cwd=common.REPO,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)

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
    files = sorted(f.relative_to(results).as_posix() for f in written(results, before))
    return status, time.perf_counter() - start, answers, files


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
        for path in sorted((common.REPO / folder).rglob("*.py")):
            if path.name in ("run_all.py", "common.py", "test_bench.py"):  # they name every item
                continue
            try:
                if pattern.search(path.read_text(errors="replace")):
                    found.append(path.relative_to(common.REPO).as_posix())
            except OSError:
                pass
    return found


def write_index(results, answers, statuses):
    lines = ["# Lab checklist L1-L28: where each item is answered", "",
             f"Updated {datetime.date.today().isoformat()} by `python -m bench.run_all` on {common.hardware_line()}. "
             "Answers are the headline lines the scripts printed (`ANSWER Lk: ...`); the full tables are the "
             "other files in this folder, the raw output is in logs/.", "",
             "| item | question | answered by | answer |", "|---|---|---|---|"]
    sources = {s.module: s.source for s in REGISTRY}
    for item, question in QUESTIONS.items():
        scripts = list(dict.fromkeys(sources[s.module] for s in REGISTRY if item in s.items and sources[s.module]))
        folders = tuple(d for d in scripts if d.endswith("/"))  # a room's files are named by its folder
        where = scripts + [m for m in mentions(item) if m not in scripts and not m.startswith(folders)]
        if item in answers:
            a = answers[item]
            text = f"{a['text']} ({a['script']}, {a['date']})"
        elif item in TESTED and any(w.startswith("tests/") for w in where):
            text = f"asserted by tests: {TESTED[item][1]}"
        elif item in TESTED and any(w.startswith("parallel/") for w in where):
            text = f"documented in the code: {TESTED[item][1]}"
        elif item in TESTED:
            text = f"pending: expected in {TESTED[item][0]}, not in this tree"
        else:
            missing = [s.module for s in REGISTRY if item in s.items and not sources[s.module]]
            logs = [f"logs/{s.label}.log" for s in REGISTRY
                    if item in s.items and (Path(results) / "logs" / f"{s.label}.log").exists()]
            if logs:
                text = f"ran, printed no headline: see {', '.join(logs)}"
            else:
                text = "not measured yet" + (f" ({', '.join(missing)} not in this tree)" if missing else
                                             " (run `make bench`)")
        lines.append(f"| {item} | {question} | {', '.join(where) or '-'} | {text.replace('|', chr(92) + '|')} |")
    if statuses:
        lines += ["", "## Last run", "", "| command | items | status | seconds |", "|---|---|---|---|"]
        lines += [f"| python -m {s.module} {' '.join(argv)} | {', '.join(s.items)} | {st} | {sec:.0f} |"
                  for s, argv, st, sec in statuses]
    path = Path(results) / "INDEX.md"
    path.write_text("\n".join(lines) + "\n")
    return path


def minutes(seconds):
    return f"{seconds / 60:.0f} min" if seconds >= 90 else f"{seconds:.0f} s"


def selected(only):
    """The registry's scripts that --only names (by module, its last part or the log name), or UsageError naming
    the first name that matches none."""
    def names(s):
        return {s.module, s.module.rsplit(".", 1)[-1], s.label, f"{s.label}.py"}
    for o in only or []:
        if not any(o in names(s) for s in REGISTRY):
            raise UsageError(f"--only: no script is called {o!r} (python -m bench.run_all --list shows them)")
    return [s for s in REGISTRY if not only or any(o in names(s) for o in only)]


@common.command
def main(argv=None):
    p = common.parser(__doc__, results=False)
    p.add_argument("--only", action="append", help="run only the scripts of this name (repeatable; --list shows them)")
    p.add_argument("--list", action="store_true", help="print the registry and exit")
    p.add_argument("--quick", action="store_true",
                   help="every script's smoke-test run (on CPU), into out/bench-quick unless --results says where")
    p.add_argument("--budget-min", type=positive_float, default=29.0,
                   help="stop starting scripts after this many minutes (and the running one, if it wrote something)")
    p.add_argument("--results", help="results folder (INDEX.md, answers.json, logs/); default bench/results")
    p.add_argument("--index-only", action="store_true", help="rebuild INDEX.md from answers.json, run nothing")
    p.add_argument("--budget-scale", type=positive_float, default=1.0,
                   help="multiply every script's budget (a slow or shared machine); --budget-min still caps the run")
    args = p.parse_args(argv)
    todo = selected(args.only)
    gpu = common.has_cuda()
    if args.list:
        for s in REGISTRY:
            quick = f"--quick {s.quick[1]:3d} s" if s.quick else ""
            flags = ("GPU only " if s.gpu_only else "") + ("root " if s.net_admin else "") + ("missing" if not
                                                                                             s.source else "")
            print(f"{s.label:20s} {','.join(s.items):19s} {s.seconds:4d} s  {quick:13s}  {flags:9s} "
                  f"python -m {s.module} {' '.join(s.args)}".rstrip())
        return 0
    results = Path(args.results or (common.REPO / "out" / "bench-quick" if args.quick else common.RESULTS))
    results.mkdir(parents=True, exist_ok=True)
    answers_path = results / "answers.json"
    answers = json.loads(answers_path.read_text()) if answers_path.exists() else {}
    statuses, failed = [], False
    if not args.index_only:
        plan = []  # (script, its arguments, its seconds) of each script that will run, or the reason it will not
        for s in todo:
            if args.quick and not s.quick:
                continue
            argv_s, seconds = s.quick if args.quick else (s.args, s.seconds)
            why = ("needs a GPU (none visible); answers " + ", ".join(s.items) + " on a GPU node"
                   if s.gpu_only and not gpu and not args.quick else
                   "needs root (CAP_NET_ADMIN) for network namespaces" if s.net_admin and not can_admin_net() else
                   "missing: no such module in this tree" if not s.source else None)
            plan.append((s, argv_s, seconds, why))
        stated = sum(seconds for _, _, seconds, why in plan if why is None)
        deadline, t0 = time.perf_counter() + args.budget_min * 60, time.perf_counter()
        print(f"run_all{' --quick' if args.quick else ''}: {sum(why is None for *_, why in plan)} scripts, about "
              f"{minutes(stated)} on a quiet 2-core machine, on {common.hardware_line()}; tables into "
              f"{shown(results)}, output into {shown(results / 'logs')}", flush=True)
        for i, (s, argv_s, seconds, why) in enumerate(plan, 1):
            head = f"[{i}/{len(plan)}] {s.label}"
            if why is None and deadline - time.perf_counter() < 30:
                why = f"the {args.budget_min:g}-minute budget is spent"
            if why:
                print(f"{head}: SKIPPED, {why}", flush=True)
                statuses.append((s, argv_s, f"skipped: {why}", 0.0))
                continue
            full = max(BUDGET_FACTOR * seconds, MIN_BUDGET_S) * args.budget_scale
            budget = min(full, deadline - time.perf_counter())
            hang = min(HANG_FACTOR * full, HARD_CEILING_S)
            print(f"{head}: started, python -m {s.module} {' '.join(argv_s)}".rstrip()
                  + f" (usually {minutes(seconds)}, stopped at {budget:.0f} s)", flush=True)
            status, took, got, files = run_script(s, argv_s, results, budget, hang)
            where = ", ".join(files) if files else f"logs/{s.label}.log"
            print(f"{head}: {status} in {took:.0f} s -> {where}", flush=True)
            failed |= status.startswith(FAILED)
            statuses.append((s, argv_s, status, took))
            for item, text in got.items():
                answers[item] = {"text": text, "script": s.source, "date": datetime.date.today().isoformat()}
            answers_path.write_text(json.dumps(answers, indent=1, sort_keys=True) + "\n")
        ran = sum(took for *_, took in statuses)
        print(f"run_all: {len(statuses)} scripts in {minutes(time.perf_counter() - t0)} ({minutes(ran)} running, "
              f"stated {minutes(stated)}){'; FAILED' if failed else ''}", flush=True)
    index = write_index(results, answers, statuses)
    print(f"wrote {shown(index)}", flush=True)
    return 1 if failed else 0
