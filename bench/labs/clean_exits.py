"""Every short job ends with exit 0: torchrun jobs of each data-parallel mode, run again and again on gloo.

    python -m bench.labs.clean_exits --repeat 20   # ddp and fsdp on 2 ranks, hsdp (2 x 2) on 4; 10 steps each

A run that ended its last step can still abort (SIGABRT, "terminate called without an active exception") if a rank
tears down its process group while a peer is still in the last collective: torchrun then reports the job as failed.
train.py leaves together (a barrier after the last collective, the loader's thread joined, then the group destroyed);
this counts the exit statuses to show it. One line per job; exit 1 if any job failed.
"""
import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.common import REPO

MODES = {"ddp": (2, []), "fsdp": (2, ["--dp-mode", "fsdp"]), "hsdp": (4, ["--dp-mode", "hsdp", "--dp-shard", "2"])}
FLAGS = ["--model", "tiny", "--global-batch", "8", "--micro-batch", "2", "--seq-len", "32", "--device", "cpu",
         "--log-every", "0"]


def job(mode, steps, out):
    """(exit status, seconds, the output's last line) of one torchrun job."""
    world, flags = MODES[mode]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(world), "train.py",
           *FLAGS, "--steps", str(steps), "--out", str(out), *flags]
    t0 = time.perf_counter()
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
    last = (done.stdout + done.stderr).strip().splitlines()[-1:] or [""]
    return done.returncode, time.perf_counter() - t0, last[0][-120:]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeat", type=int, default=20, help="jobs per mode")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--modes", default=",".join(MODES), help="comma-separated: " + ", ".join(MODES))
    args = p.parse_args(argv)
    failed = 0
    with tempfile.TemporaryDirectory() as tmp:
        for mode in args.modes.split(","):
            for i in range(args.repeat):
                code, seconds, last = job(mode, args.steps, Path(tmp) / f"{mode}{i}")
                failed += code != 0
                print(f"{mode} {i + 1}/{args.repeat}: exit {code} in {seconds:.1f} s" + (f": {last}" if code else ""),
                      flush=True)
    print(f"{failed} of {args.repeat * len(args.modes.split(','))} jobs failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
