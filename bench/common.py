"""What the bench scripts share: their command line, where results go, what hardware ran them, timing.

Every result file is a markdown table headed by the command that made it, the date and the hardware, so a number
in the README can be traced back and re-run (write_result); `ANSWER Lk: text` lines (answer) feed run_all's index.
"""
import datetime
import functools
import platform
import shlex
import statistics
import sys
import time
from contextlib import nullcontext
from pathlib import Path

import torch

import config
import model
import train
from config import DTYPES, OneLineParser, UsageError
from data.ending import exit_status
from data.metrics import PEAK_TFLOPS
from data.prepare import prepare
from data.text import usable_cores as cpu_cores
from parallel.materialize import init_weights

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "bench" / "results"
QUICK_MODEL = dict(n_layer=1, d_model=32, n_head=2, n_kv_head=1, ffn_dim=64)  # --quick: a one-layer GPT
ANSWER_PREFIX = "ANSWER "  # `ANSWER L3: text` on stdout is the headline answer of lab item L3


def has_cuda():
    return torch.cuda.is_available()


def default_device():
    return torch.device("cuda" if has_cuda() else "cpu")


def cpu_name():
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def hardware_line(backend=None):
    """One line naming the hardware: the GPUs if any, else the CPU, plus torch and the backend."""
    if has_cuda():
        n = torch.cuda.device_count()
        what = f"{n}x {torch.cuda.get_device_name(0)}"
        backend = backend or "nccl"
    else:
        what = f"{cpu_cores()}-core CPU ({cpu_name()}), no GPU"
        backend = backend or "gloo"
    return f"{what}, torch {torch.__version__}, {backend}"


def command_line(argv=None):
    """The command that reproduces this run, from the repository root (without --out): `python -m MODULE ARGS`."""
    spec = getattr(sys.modules["__main__"], "__spec__", None)  # None: run as a file, not with -m
    path = Path(sys.argv[0]).resolve()
    script = ["-m", spec.name.removesuffix(".__main__")] if spec else [
        str(path.relative_to(REPO) if path.is_relative_to(REPO) else path)]
    args = list(sys.argv[1:] if argv is None else argv)
    if "--out" in args[:-1]:  # where the tables go does not change them
        i = args.index("--out")
        del args[i:i + 2]
    args = [a for a in args if not a.startswith("--out=")]
    return shlex.join(["python", *script, *args])


def markdown_table(header, rows):
    def cell(v):
        if isinstance(v, float):
            return f"{v:.4g}"
        return str(v)
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def write_result(out_dir, name, title, header, rows, notes=(), command=None, backend=None, echo=True):
    """Writes out_dir/name.md: title, command, date, hardware, the table, then notes. Prints it too (echo)."""
    text = "\n".join([f"### {title}", "", f"Command: `{command or command_line()}`  ",
        f"Date: {datetime.date.today().isoformat()}  ", f"Hardware: {hardware_line(backend)}", "",
        markdown_table(header, rows), "", *[f"- {n}" for n in notes],]).rstrip() + "\n"
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.md").write_text(text)
    if echo:
        print(text, flush=True)
    return out / f"{name}.md"


def answer(item, text):
    """The headline answer of one lab item, one line on stdout (run_all.py puts it in INDEX.md)."""
    print(f"{ANSWER_PREFIX}{item}: {text}", flush=True)


def parser(doc, results=True):
    """A parser that refuses in one line (config.OneLineParser), described by doc's first line; results: with
    --quick and --out (the result files' folder)."""
    p = OneLineParser(description=doc.split("\n")[0])
    if results:
        p.add_argument("--quick", action="store_true", help="tiny sizes, for the smoke tests")
        p.add_argument("--out", default=str(RESULTS), help="folder for the result markdown files")
    return p


def command(main):
    """main(argv) as a command: a UsageError is one line, `error: ...`, on stderr and exit status 2; an output that
    cannot be written (`| head`, a full disk) one line and 3. In the module
    `python -m` runs it calls main at once and exits with its status, so main comes last there."""
    @functools.wraps(main)
    def run(argv=None):
        try:
            return exit_status(lambda: main(argv))
        except UsageError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
    if main.__module__ == "__main__":
        sys.exit(run())
    return run


def sync(device):
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def time_it(fn, device="cpu", min_s=0.2, min_reps=3, warmup=1):
    """Median seconds of one call of fn(), over at least min_reps calls and min_s seconds."""
    for _ in range(warmup):
        fn()
    sync(device)
    times, start = [], time.perf_counter()
    while len(times) < min_reps or time.perf_counter() - start < min_s:
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def matmul_tflops(n, dtype=torch.float32, device="cpu", m=None, k=None, min_s=0.3):
    """Achieved TFLOP/s of an (m x k) @ (k x n) matmul, counting the useful 2*m*n*k FLOPs."""
    m, k = m or n, k or n
    a = torch.randn(m, k, dtype=dtype, device=device)
    b = torch.randn(k, n, dtype=dtype, device=device)
    return 2 * m * n * k / time_it(lambda: a @ b, device, min_s=min_s) / 1e12


def measured_cpu_peak_tflops(dtype=torch.float32, threads=None, n=2048, min_s=1.0):
    """The CPU's attainable dense matmul rate with `threads` threads: a stand-in for a device peak
    (a CPU has no spec-sheet number train.py can look up). Measured, so noisy on a shared machine."""
    old = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        return matmul_tflops(n, dtype, "cpu", min_s=min_s)
    finally:
        torch.set_num_threads(old)


def gpu_peak_tflops():
    """The device table's dense bf16 peak of GPU 0 (data.metrics.PEAK_TFLOPS), or None."""
    if not has_cuda():
        return None
    name = torch.cuda.get_device_name(0)
    return PEAK_TFLOPS.get(name)


def median(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def pystdlib_folder():
    """The offline corpus train.py uses by default, prepared on first use."""
    folder = REPO / "data" / "pystdlib"
    if not (folder / "meta.json").exists():
        prepare("pystdlib", folder)
    return folder


def preset_config(preset="tiny", **overrides):
    """A preset's model.ModelConfig with overrides; one without a vocabulary gets the byte corpus's 257 (what
    train.py uses on the pystdlib data)."""
    fields = {**model.PRESETS[preset].__dict__, **overrides}
    fields["vocab_size"] = fields["vocab_size"] or 257
    return model.ModelConfig(**fields)


def build_gpt(preset="tiny", seed=1337, device="cpu", **overrides):
    """model.GPT of preset_config(preset, **overrides) with train.py's initial weights."""
    with torch.device("meta"):
        gpt = model.GPT(preset_config(preset, **overrides))
    return init_weights(gpt, seed, device)


def autocast(mode, device):
    return nullcontext() if mode == "fp32" else torch.autocast(device.type, dtype=DTYPES[mode])


class TrainStep:
    """One precision mode's model, AdamW and loss scaler, built and stepped by train.py itself: calling it is one
    optimizer step on a batch of len(x) sequences; forward_backward and update are the step's two halves."""

    def __init__(self, mode, device, preset="tiny", **overrides):
        flags = [f"--{k.replace('_', '-')}={v}" for k, v in overrides.items()]
        self.argv = ["--model", preset, "--dtype", mode, "--device", torch.device(device).type, "--no-compile",
                     "--lr", "3e-4", "--weight-decay", "0.1", "--grad-clip", "1.0", "--peak-tflops", "1",
                     "--out", str(RESULTS / ".unwritten")] + flags
        run = config.resolve(self.argv, environ={})
        cfg = train.model_config(run, overrides.get("vocab_size") or 257)
        self.trainer = train.prepare(run, cfg, train.start_distributed(run))
        self.model, self.opt, self.scaler = self.trainer.chunks[0], self.trainer.opt, self.trainer.scaler

    def batch(self, x):
        """The trainer's micro-batch follows the batch it is handed: one micro-batch of all its rows."""
        self.trainer.micro_batch = len(x)

    def forward_backward(self, x, y):
        self.batch(x)
        return train.forward_backward(self.trainer, x, y)

    def update(self):
        return train.optimizer_step(self.trainer, torch.zeros((), device=self.scaler.scale.device), 1.0)[0]

    def __call__(self, x, y):
        self.batch(x)
        return train.train_step(self.trainer, x, y, 3e-4, 1.0)[0]
