"""L17, L18, L20: peak activation memory and step time under each activation-checkpointing policy.

    python -m bench.labs.ckpt_memory           # 16 layers, b=4, T=256, fp32, on CPU (or the GPU if present)
    python -m bench.labs.ckpt_memory --quick   # 4 layers, for the smoke test

One deep, thin model (activations dominate), one forward + backward per measurement. Memory: on CPU glibc's in-use
bytes (mallinfo2) read after every aten op, on a GPU torch.cuda's allocated bytes, both less what was held before the
step. Step time: median forward + backward without the watcher (on CPU: process CPU time, one thread). L18 sweeps
the segment length C of segment:C (segment:1 = full, segment:ceil(sqrt N) = sqrt).
"""
import ctypes
import datetime
import math
import statistics
import time
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import model
from bench import common
from parallel import ckpt
from parallel.materialize import init_weights

POLICIES = ["none", "every:2", "sqrt", "full", "selective"]


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                     "fsmblks", "uordblks", "fordblks", "keepcost")]


def heap_reader(device):
    """A function returning the bytes currently allocated for tensors on `device`, or None if unknown."""
    if device.type == "cuda":
        return lambda: torch.cuda.memory_allocated(device)
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallinfo2.restype = _MallInfo2
    except (OSError, AttributeError):
        return None

    def in_use():
        info = libc.mallinfo2()
        return info.uordblks + info.hblkhd
    return in_use


class PeakWatcher(TorchDispatchMode):
    """Reads the allocated bytes after every op; `peak` is the maximum above the value at entry."""

    def __init__(self, read):
        super().__init__()
        self.read, self.base, self.peak = read, read(), 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.peak = max(self.peak, self.read() - self.base)
        return out

    def now(self):
        return self.read() - self.base


def build(cfg, policy, device):
    with torch.device("meta"):
        gpt = model.GPT(cfg)
    ckpt.apply(gpt, policy)
    return init_weights(gpt, 1337, device)


def measure_memory(cfg, policy, x, y, device, read):
    """(the model, bytes kept after forward, peak bytes of forward + backward), above the pre-step value."""
    gpt = build(cfg, policy, device)
    gpt(x, y).backward()  # allocates the grads, so they are part of the baseline
    for p in gpt.parameters():
        p.grad.zero_()
    if read is None:
        return gpt, None, None
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    with PeakWatcher(read) as watcher:
        loss = gpt(x, y)
        kept = watcher.now()
        loss.backward()
    return gpt, kept, watcher.peak


def step_seconds(fn, device):
    """Seconds of one call: CPU time of this process on CPU (one intra-op thread, so it is the compute time,
    whatever else the shared machine runs), wall time on a GPU."""
    if device.type == "cuda":
        return common.time_it(fn, device, min_s=0, min_reps=1, warmup=0)
    t0 = time.process_time()
    fn()
    return time.process_time() - t0


def cpu_peak_flops(n=1024, reps=5):
    """The best 1-thread fp32 matmul rate, in CPU time: the stand-in for a device peak on CPU."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b
    return max(2 * n ** 3 / max(step_seconds(lambda: a @ b, torch.device("cpu")), 1e-9) for _ in range(reps))


def measure(cfg, policies, x, y, device, read, peak_flops, rounds):
    """One row per policy. Step times: the median over `rounds` rounds that time every policy once each, so
    that a shared machine's slow moments hit all policies alike."""
    rows, models = [], []
    for policy in policies:
        gpt, kept, peak = measure_memory(cfg, policy, x, y, device, read)
        models.append(gpt)
        keys = [str(i) for i in range(cfg.n_layer)]
        rows.append(dict(policy=policy, kept=kept, peak=peak, recomputed=ckpt.recomputed_layers(cfg, policy),
                         stored=sum(checkpointed for _, checkpointed in ckpt.segments(keys, policy)), times=[]))
    for _ in range(rounds):
        for row, gpt in zip(rows, models):
            row["times"].append(step_seconds(lambda gpt=gpt: gpt(x, y).backward(), device))
    tokens = x.numel()
    for row in rows:
        row["step_s"] = statistics.median(row["times"])
        row["mfu"] = model.flops_per_token(cfg) * tokens / row["step_s"] / peak_flops
        row["hfu"] = (model.flops_per_token(cfg, recomputed_layers=row["recomputed"]) * tokens
                      / row["step_s"] / peak_flops)
    return rows


def mb(v):
    return "n/a" if v is None else f"{v / 2 ** 20:.1f}"


@common.command
def main(argv=None):
    p = common.parser(__doc__)
    p.add_argument("--n-layer", type=int, default=16)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--device", default=None, help="cpu | cuda (default: cuda if available)")
    p.add_argument("--rounds", type=int, default=5, help="timed steps per policy (median)")
    args = p.parse_args(argv)
    if args.quick:
        args.n_layer, args.batch, args.seq_len, args.rounds = 4, 2, 64, 3
    device = torch.device(args.device) if args.device else common.default_device()
    torch.set_num_threads(1)
    cfg = model.ModelConfig(**{**model.PRESETS["tiny"].__dict__, "n_layer": args.n_layer, "seq_len": args.seq_len,
                               "vocab_size": 257})
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, cfg.vocab_size, (args.batch, cfg.seq_len + 1), generator=gen).to(device)
    x, y = ids[:, :-1], ids[:, 1:]
    read = heap_reader(device)
    if device.type == "cuda":
        peak_flops, peak_src = (common.gpu_peak_tflops() or 0) * 1e12, "device table, bf16 dense"
    else:
        peak_flops, peak_src = cpu_peak_flops(), "best of 5 1-thread fp32 1024^3 matmuls, in CPU time"

    n, c = cfg.n_layer, math.ceil(math.sqrt(cfg.n_layer))
    sweep = sorted({1, 2, c, max(1, n // 2), n})
    extra = [f"segment:{C}" for C in sweep if C not in (1, c)]  # segment:1 is full, segment:c is sqrt
    measured = {r["policy"]: r for r in measure(cfg, POLICIES + extra, x, y, device, read, peak_flops, args.rounds)}
    rows = [measured[policy] for policy in POLICIES]
    seg_rows = [measured["full" if C == 1 else "sqrt" if C == c else f"segment:{C}"] for C in sweep]

    base = rows[0]
    step = "step CPU-s" if device.type == "cpu" else "step s"
    header = ["policy", "boundaries stored", "kept after fwd MB", "peak MB", "peak vs none",
              step, "step vs none", "recomputed layers", "MFU", "HFU"]
    table = [[r["policy"], r["stored"], mb(r["kept"]), mb(r["peak"]),
              "n/a" if r["peak"] is None else f"{r['peak'] / base['peak']:.2f}",
              f"{r['step_s']:.3f}", f"{r['step_s'] / base['step_s']:.2f}", f"{r['recomputed']:.2f}",
              f"{r['mfu']:.1%}", f"{r['hfu']:.1%}"] for r in rows]
    seg_header = ["C", "segments ceil(N/C)", "N/C + C", "kept after fwd MB", "peak MB", step, "recomputed layers"]
    seg_table = [[C, r["stored"], f"{n / C + C:.1f}", mb(r["kept"]), mb(r["peak"]), f"{r['step_s']:.3f}",
                  f"{r['recomputed']:.2f}"] for C, r in zip(sweep, seg_rows)]
    boundary = 4 * args.batch * cfg.seq_len * cfg.d_model  # one fp32 (b, T, d) hidden state
    kept = {r["policy"]: r["kept"] or 0 for r in rows}
    per_block = (kept["none"] - kept["full"]) / n + boundary  # full keeps only each block's input
    memory_how = ("CUDA allocated bytes" if device.type == "cuda" else
                  "glibc mallinfo2 in-use bytes after every aten op" if read else "unavailable (no glibc)")
    text = "\n".join([
        f"### L17/L20: activation checkpointing policies, {n} layers, d={cfg.d_model}, ffn={cfg.ffn_dim}, "
        f"batch {args.batch} x T={cfg.seq_len}, fp32", "", f"Command: `{common.command_line(argv)}`  ",
        f"Date: {datetime.date.today().isoformat()}  ", f"Hardware: {common.hardware_line()}, 1 intra-op thread", "",
        common.markdown_table(header, table), "",
        f"### L18: segment length C (segment:C), N = {n}: memory O(N/C + C) against one extra forward", "",
        common.markdown_table(seg_header, seg_table), "",
        f"- Memory: {memory_how}, above the value before the step (weights, grads, batch). \"kept after fwd\" is "
        "held by the autograd graph between forward and backward; \"peak\" includes backward's working set.",
        f"- MFU/HFU: FLOPs of model.flops_per_token (PaLM; HFU adds the recomputed layers) per step time, peak "
        f"{peak_flops / 1e12:.3g} TFLOP/s ({peak_src}). HFU/MFU = 1 + recomputed x layer share; MFU falls with "
        "recompute because the useful work is the same and the step is longer.",
        "- every:K checkpoints the blocks whose index is a multiple of K; sqrt = segment:ceil(sqrt N); selective "
        "checkpoints nothing but lets no matmul keep a norm's or SwiGLU's output, remade in backward from what the "
        "norm and SwiGLU keep anyway (no matmul FLOPs repeated, so HFU = MFU; a norm read by q, k and v is remade "
        "three times).",
        "- recomputed layers < checkpointed blocks: torch's checkpoint stops recomputing a segment once backward "
        "has every saved tensor back, so each segment's last down_proj is not repeated.",
        f"- Why C=1 beats C=sqrt(N) here: O(N/C + C) counts a stored boundary and a recomputed block's internals "
        f"alike. Measured, a block keeps {mb(per_block)} MB for backward against its {mb(boundary)} MB input "
        f"(ratio {per_block / boundary:.0f}), so N/C·s + C·A is least at C = sqrt(N·s/A) = "
        f"{math.sqrt(n * boundary / per_block):.2f}: the sqrt rule holds when blocks are as cheap as boundaries.",
        "- The memory columns are exact and repeat to the byte; step times still vary a few percent.",]) + "\n"
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "ckpt_memory.md").write_text(text)
    print(text, flush=True)

    by = {r["policy"]: r for r in rows}
    if by["none"]["peak"] is not None:
        common.answer("L17", f"peak activation memory none {mb(by['none']['peak'])} MB -> sqrt "
                      f"{mb(by['sqrt']['peak'])} MB -> full {mb(by['full']['peak'])} MB; step time x"
                      f"{by['full']['step_s'] / by['none']['step_s']:.2f} with full")
        best = min(zip(sweep, seg_rows), key=lambda cr: cr[1]["peak"])
        common.answer("L18", f"segment length C in {sweep}: peak {', '.join(mb(r['peak']) for r in seg_rows)} MB; "
                      f"least at C={best[0]}; recompute is one forward for every C; a block keeps "
                      f"{per_block / boundary:.0f}x its input, so the O(N/C + C) optimum moves from sqrt(N) to "
                      f"sqrt(N/{per_block / boundary:.0f})")
    common.answer("L20", f"full checkpointing: MFU {by['full']['mfu']:.1%} vs {by['none']['mfu']:.1%} without, "
                  f"HFU {by['full']['hfu']:.1%} (HFU/MFU = {by['full']['hfu'] / by['full']['mfu']:.2f})")
    return rows, seg_rows
