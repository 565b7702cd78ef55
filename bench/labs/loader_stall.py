"""L11: does the data loader prefetch asynchronously, or does the device wait for input?

    python -m bench.labs.loader_stall

The tiny GPT (small, bf16, on a GPU) on pystdlib with TokenLoader, prefetch on and off; the stall is sum(wait_s) /
sum(step time). An injected read latency of about half and one and a half steps shows prefetch hiding a short read
completely and a long one partly, while without prefetch every read is a stall.
"""
import statistics
import time

import torch

from bench import common
from data.loader import TokenLoader


class SlowStorageLoader(TokenLoader):
    """TokenLoader whose every read first waits `latency_s`, like a slow disk or an on-the-fly tokenizer."""

    def __init__(self, *args, latency_s=0.0, **kwargs):
        self.latency_s = latency_s
        super().__init__(*args, **kwargs)

    def _load(self, step):
        time.sleep(self.latency_s)
        return super()._load(step)


def measure(train_step, device, rows, seq_len, steps, prefetch, latency_s):
    """(median wait s, median compute s, median step s, stall fraction) over `steps` steps after the first."""
    loader = SlowStorageLoader(common.pystdlib_folder(), "train", seq_len, rows, seed=1337, device=device,
                               prefetch=prefetch, latency_s=latency_s)
    waits, totals = [], []
    try:
        for step in range(steps + 1):
            t0 = time.perf_counter()
            x, y = loader.get(step)
            wait = loader.wait_s
            train_step(x, y)
            common.sync(device)
            if step:  # the first get() has nothing prefetched yet
                waits.append(wait)
                totals.append(time.perf_counter() - t0)
    finally:
        loader.close()
    computes = [t - w for t, w in zip(totals, waits)]
    return statistics.median(waits), statistics.median(computes), statistics.median(totals), sum(waits) / sum(totals)


@common.command
def main(argv=None):
    p = common.parser(__doc__)
    p.add_argument("--device", help="cpu | cuda (default: cuda if available)")
    p.add_argument("--steps", type=int, help="timed steps per row")
    args = p.parse_args(argv)
    device = torch.device(args.device or common.default_device())
    gpu = device.type == "cuda"
    if args.quick:
        preset, mode, rows, seq_len, steps = "tiny", "fp32", 2, 32, 2
    elif gpu:
        preset, mode, rows, seq_len, steps = "small", "bf16", 8, 1024, 20
    else:
        preset, mode, rows, seq_len, steps = "tiny", "fp32", 8, 256, 5
    steps = args.steps or steps
    train_step = common.TrainStep(mode, device, preset, **(common.QUICK_MODEL if args.quick else {}))
    warm = TokenLoader(common.pystdlib_folder(), "train", seq_len, rows, seed=1337, device=device, prefetch=False)
    x, y = warm.get(0)
    compute_s = common.time_it(lambda: train_step(x, y), device, min_s=0 if args.quick else 0.5, min_reps=3)
    latencies = [0.0] if args.quick else [0.0, 0.5 * compute_s, 1.5 * compute_s]
    table, stall = [], {}
    for latency in latencies:
        for prefetch in (False, True):
            wait, compute, total, frac = measure(train_step, device, rows, seq_len, steps, prefetch, latency)
            stall[(latency, prefetch)] = frac
            read = f"{latency * 1e3:.0f} injected" if latency else "0 (real read only)"
            table.append(["on" if prefetch else "off", read, f"{wait * 1e3:.2f}", f"{compute * 1e3:.1f}",
                          f"{total * 1e3:.1f}", f"{frac:.1%}"])
    cpu_only = "" if gpu else " (CPU only)"
    notes = [f"{preset} GPT, {mode}, {rows} x {seq_len} tokens per step (global batch, one process), full training "
             f"step; median over {steps} steps after the first; compute alone ~{compute_s * 1e3:.0f} ms per step.",
             "wait = TokenLoader.wait_s, the time get() blocked; compute = step - wait; stall = sum(wait) / "
             "sum(step time). With prefetch the expected wait is max(0, read - compute).",
             "Prefetch: a background thread reads step s+1 while step s trains (queue of one batch; on CUDA into "
             "pinned memory, copied with non_blocking=True). Injected latency is a sleep before each read, "
             "standing in for slow storage or on-the-fly tokenization."]
    if not gpu:
        notes.append("On a 2-core CPU the reader thread competes with the compute threads; on a GPU node the "
                     "step runs on the device and the read is fully hidden while read < step.")
    common.write_result(args.out, "L11_loader_stall", f"L11: time waiting for data, prefetch on vs off{cpu_only}",
                        ["prefetch", "read latency ms", "median wait ms", "median compute ms", "median step ms",
                         "stall"], table, notes)
    text = (f"real loader: stall {stall[(0.0, False)]:.2%} without prefetch, {stall[(0.0, True)]:.2%} with; ")
    if len(latencies) > 1:
        mid, high = latencies[1], latencies[2]
        text += (f"read = 0.5 step: {stall[(mid, False)]:.0%} -> {stall[(mid, True)]:.0%}; "
                 f"read = 1.5 step: {stall[(high, False)]:.0%} -> {stall[(high, True)]:.0%}")
    common.answer("L11", text.rstrip("; ") + f" ({device.type})")
