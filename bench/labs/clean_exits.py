"""Every short job ends with exit 0, every rank: torchrun jobs of each layout family, again and again.

    python -m bench.labs.clean_exits --repeat 10 --parallel 2   # every family, two jobs at a time (load)
    python -m bench.labs.clean_exits --families ddp,fsdp,hsdp --repeat 20

A run that ended its last step can still abort (SIGABRT) if a rank tears its process group down while a peer is in a
collective, or a C++ thread is still joinable at exit: torchrun then calls the job failed. One line per job; exit 1
if any job failed or any rank aborted.
"""
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from bench import common
from bench.common import REPO
from config import UsageError, positive_int

PP = ["--pp", "2", "--global-batch", "8", "--micro-batch", "2"]
FAMILIES = {  # name: [(ranks, flags), ...]: the jobs of one run, in order (a resume follows its first job)
    "ddp": [(2, [])], "fsdp": [(2, ["--dp-mode", "fsdp"])],
    "hsdp": [(4, ["--dp-mode", "hsdp", "--dp-shard", "2"])],
    "tp": [(2, ["--tp", "2"])], "tp sp": [(2, ["--tp", "2", "--sp"])],
    "pp 1f1b": [(2, PP)], "pp gpipe": [(2, PP + ["--pp-schedule", "gpipe"])],
    "pp interleaved": [(2, PP + ["--pp-schedule", "interleaved", "--pp-virtual", "2"])],
    "pp zb1": [(2, PP + ["--pp-schedule", "zb1"])], "pp zbv": [(2, PP + ["--pp-schedule", "zbv"])],
    "cp ring": [(2, ["--cp", "2"])], "cp ulysses": [(2, ["--cp", "2", "--cp-mode", "ulysses"])],
    "cp allgather": [(2, ["--cp", "2", "--cp-mode", "allgather"])],
    "3d": [(8, ["--dp-mode", "fsdp", "--tp", "2", "--sp", "--pp", "2", "--micro-batch", "1"])],
    "fsdp saves": [(2, ["--dp-mode", "fsdp", "--save-every", "3"])],
    "tp pp async saves": [(4, ["--tp", "2", "--pp", "2", "--save-every", "3", "--async-save"])],
    "fsdp -> tp pp resume": [(4, ["--dp-mode", "fsdp", "--save-every", "5", "--steps", "5"]),
                             (4, ["--tp", "2", "--pp", "2", "--resume", "--steps", "10"])],
}
FLAGS = ["--model", "tiny", "--global-batch", "8", "--micro-batch", "2", "--seq-len", "32", "--device", "cpu",
         "--log-every", "0"]


def run(family, steps, out):
    """(exit status, seconds, ranks that aborted, the output's last line) of one family's jobs."""
    t0, code, aborted, last = time.perf_counter(), 0, 0, ""
    for ranks, flags in FAMILIES[family]:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(ranks),
               "train.py", *FLAGS, "--steps", str(steps), "--out", str(out), *flags]
        done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=900)
        text = done.stdout + done.stderr
        aborted += text.count("terminate called") + text.count("Signals.SIGABRT")
        last = (text.strip().splitlines() or [""])[-1][-120:]
        code = done.returncode
        if code:
            break
    return code, time.perf_counter() - t0, aborted, last


@common.command
def main(argv=None):
    p = common.parser(__doc__, results=False)
    p.add_argument("--repeat", type=positive_int, default=10, help="runs per family")
    p.add_argument("--steps", type=positive_int, default=10)
    p.add_argument("--parallel", type=positive_int, default=1, help="runs at a time: others' jobs load the machine")
    p.add_argument("--families", default=",".join(FAMILIES), help="comma-separated: " + ", ".join(FAMILIES))
    args = p.parse_args(argv)
    families = args.families.split(",")
    unknown = [f for f in families if f not in FAMILIES]
    if unknown:
        raise UsageError(f"--families: unknown {unknown}")
    jobs = [(f, i) for f in families for i in range(args.repeat)]
    counts = {f: [0, 0] for f in families}  # family: [clean, failed]
    with tempfile.TemporaryDirectory() as tmp, ThreadPoolExecutor(args.parallel) as pool:
        outs = {job: Path(tmp) / f"{job[0].replace(' ', '_')}_{job[1]}" for job in jobs}
        for (family, i), (code, seconds, aborted, last) in zip(jobs, pool.map(
                lambda job: run(job[0], args.steps, outs[job]), jobs)):
            clean = code == 0 and not aborted
            counts[family][not clean] += 1
            note = "" if clean else f": exit {code}, {aborted} aborted rank(s): {last}"
            print(f"{family} {i + 1}/{args.repeat}: exit {code} in {seconds:.1f} s{note}", flush=True)
    for family, (clean, failed) in counts.items():
        print(f"{family:22s} {clean} clean, {failed} failed")
    failed = sum(f for _, f in counts.values())
    print(f"{failed} of {len(jobs)} runs failed")
    return 1 if failed else 0
