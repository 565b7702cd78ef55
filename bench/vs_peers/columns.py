"""The columns of bench.vs_peers: each counted in a process of its own, and their table."""
import multiprocessing
import os
import sys
import time

import torch

from bench.dry_run import PARTS, FakeCUDA, FakeGPUs, FakeWorld, Ledger, rehearse_rank
from bench.vs_peers import fsdp2, titan
from bench.vs_peers.count import Count
from data.ending import start_worker

COLUMNS = {"ours": None, "fsdp2": fsdp2, "torchtitan": titan}
STEPS = 2  # the first makes Adam's state; the peak is the second's
# torch FSDP2's own frames: what they allocate is gathered weights or gradients being reduced
FSDP2_GATHER = ("foreach_all_gather", "foreach_all_gather_copy_out", "init_unsharded_param")
FSDP2_REDUCE = ("foreach_reduce",)


def local(t):
    """A DTensor's local shard, else the tensor."""
    return getattr(t, "_local_tensor", t)


class PeerLedger(Ledger):
    """The rehearsal's ledger, told a peer's model and optimizers instead of our trainer."""

    def know_peer(self, peer):
        self.shapes = {tuple(p.shape) for m in peer.model for p in m.parameters()}
        self.vocab = peer.vocab
        self.peer_done(peer)

    def peer_done(self, peer):
        params = [p for m in peer.model for p in m.parameters()]
        self.hold({"weights": [local(p) for p in params],
                   "gradients": [local(p.grad) for p in params if p.grad is not None],
                   "optimizer state": [local(v) for opt in peer.optimizers
                                       for s in opt.state.values() for v in s.values()]})

    def hint(self, t):
        """Ledger's, after what torch's FSDP2 makes in its all-gathers and reduce-scatters."""
        if self.label or (t.dim() >= 2 and t.shape[-1] == self.vocab):
            return super().hint(t)
        frames = callers()
        if any(name in frames for name in FSDP2_GATHER):
            return "weights in use"
        if any(name in frames for name in FSDP2_REDUCE):
            return "gradients"
        return super().hint(t)


def callers():
    """The function names on the stack."""
    frame, names = sys._getframe(2), set()
    while frame is not None:
        names.add(frame.f_code.co_name)
        frame = frame.f_back
    return names


def column(name, layout, gpu):
    """{peak, parts, flops, launches, collectives, seconds} of one column (in a worker process),
    or {"error": why}."""
    torch.set_num_threads(1)
    t0, count = time.perf_counter(), Count()
    with FakeGPUs(gpu, gpu.per_node):
        if name == "ours":
            report = rehearse_rank(layout.train_argv(), 0, layout.world, gpu.per_node, gpu, count)
            if report.failure:
                return {"error": report.failure}
            peak, parts = report.peak, report.parts
        else:
            peak, parts = peer_step(COLUMNS[name], layout, count)
    return {"peak": peak, "parts": parts, **count.summary(), "seconds": time.perf_counter() - t0}


def peer_step(module, layout, count):
    """(peak bytes, parts) of a peer's STEPS steps, counting the last."""
    with FakeWorld(0, layout.world), FakeCUDA(), PeerLedger() as ledger:
        peer = module.build(layout, 0, layout.world)
        ledger.know_peer(peer)
        rows = (layout.micro_batch * layout.micro_batches, layout.seq_len)
        for _ in range(STEPS):
            ledger.peak, ledger.at_peak = ledger.now, dict(ledger.live)  # the last step's peak:
            # DTensor's first step makes global-shape tensors on fake CUDA, cached for the next
            with ledger.labelled("token ids"):
                x = torch.randint(0, 128_000, rows, device="cuda")
                y = torch.randint(0, 128_000, rows, device="cuda")
            count.reset()
            with count:
                peer.step(x, y)
            ledger.peer_done(peer)
            del x, y
        return ledger.peak, ledger.parts()


def measure(layout, gpu, names):
    """{column: its counts}, each column in a process of its own (fake worlds do not mix)."""
    out = {}
    ctx = multiprocessing.get_context("spawn")
    for name in names:
        why = COLUMNS[name].available() if COLUMNS[name] else None
        if why:
            out[name] = {"error": why}
            continue
        with ctx.Pool(1, start_worker, (os.getpid(),)) as pool:
            try:
                out[name] = pool.apply(column, (name, layout, gpu))
            except Exception as e:  # noqa: BLE001 - a peer that cannot run is its column's line
                out[name] = {"error": f"{type(e).__name__}: {str(e).strip().splitlines()[0]}"}
        print(f"  {name}: {describe(out[name])}", file=sys.stderr, flush=True)
    return out


def describe(c):
    if "error" in c:
        return c["error"]
    return f"peak {c['peak'] / 1e9:.1f} GB, counted in {c['seconds']:.0f} s"


def table(layout, columns):
    """The side-by-side table, in GB, TFLOP, launches and collectives per group."""
    ran = {k: c for k, c in columns.items() if "error" not in c}
    head = f"{'per GPU, one step':34s}" + "".join(f"{k:>14s}" for k in ran)
    lines = [f"{layout.name}: {layout.model}, world {layout.world} (fsdp {layout.dp_shard}, tp "
             f"{layout.tp}, pp {layout.pp}), {layout.micro_batch} x {layout.seq_len} tokens, --ckpt "
             f"{layout.ckpt}; counted on fake tensors, not measured on a GPU", head]

    def row(label, values, fmt="{:14.1f}"):
        lines.append(f"{label:34s}" + "".join(fmt.format(v) for v in values))
    row("peak GB", [c["peak"] / 1e9 for c in ran.values()])
    for part in PARTS:
        row(f"  {part}", [c["parts"].get(part, 0) / 1e9 for c in ran.values()])
    for p in ("forward", "backward", "recomputed"):
        row(f"TFLOP {p}", [c["flops"][p] / 1e12 for c in ran.values()])
    row("kernel launches", [c["launches"] for c in ran.values()], "{:14d}")
    groups = sorted({(g, op) for c in ran.values() for g, ops in c["collectives"].items()
                     for op in ops})
    for g, op in groups:
        calls = [c["collectives"].get(g, {}).get(op, [0, 0]) for c in ran.values()]
        lines.append(f"{g + ' ' + op:34s}" + "".join(f"{n:5d} x {b / 1e9:6.2f}GB" for n, b in calls))
    lines += [f"{k}: {c['error']}" for k, c in columns.items() if "error" in c]
    return "\n".join(lines)


def as_json(layout, columns):
    out = {"layout": layout.name, "ckpt": layout.ckpt, "counted_on": "fake tensors"}
    for k, c in columns.items():
        out[k] = c if "error" in c else {"peak_gb": c["peak"] / 1e9, **{
            "parts_gb": {p: v / 1e9 for p, v in c["parts"].items()}},
            **{key: c[key] for key in ("flops", "attention_flops", "launches", "collectives",
                                       "seconds")}}
    return out
