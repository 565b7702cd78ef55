"""--dry-run: the command a user would launch, rehearsed on a CPU at full scale, one rank per pipeline stage.

    python train.py --model llama3-405b --tp 8 --pp 16 --dp-mode fsdp --micro-batch 1 \
        --global-batch 2048 --dry-run --world 16384 --gpu h100

Each rank (a process per CPU core, or --jobs) joins torch's `fake` process group at the full world size and runs the
real config.resolve, train.prepare and two train.train_step on fake CUDA tensors (shapes, no data). Per rank it
proves the step fits the GPU (live CUDA storages in parts, beside memory.stage_bytes), touches no CPU tensor, reads
nothing back to the host, that every collective obeys NCCL's rules, and what each group sends. It cannot see
compiled graphs, kernels' speed, numerics, the order of collectives across ranks, or CUDA context, NCCL buffers and
fragmentation (memory.MARGIN stands for them).
"""
import ctypes
import hashlib
import multiprocessing
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
import weakref
from collections import Counter, defaultdict
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from contextlib import ExitStack, contextmanager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.testing._internal.distributed.fake_pg import FakeStore
from torch.utils._mode_utils import no_dispatch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import config
import model
import train
from bench.planner.command import SPECS, expected_mfu
from config import UsageError
from data.ending import StopSignal, exit_status, interruptible, sigint_held, start_worker
from data.loader import DataError, read_meta
from data.metrics import PEAK_TFLOPS
from data.text import usable_cores
from parallel import fp8, fsdp, memory
from parallel.comm import Group
from parallel.memory import StorageMode
from parallel.mesh import LayoutError, Mesh

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
_ATEN = torch.ops.aten
_DEVICE = torch.ops.prim.device.default  # C++ asks it of fake tensors more often than any op
STEPS = 2  # the first step creates Adam's state; the second is every later one
MATMULS = (_ATEN.mm.default, _ATEN.addmm.default, _ATEN.bmm.default, _ATEN.baddbmm.default)


@dataclass(frozen=True)
class GPU:
    name: str  # as torch.cuda.get_device_name reports it (config.PEAK_TFLOPS's key)
    memory: int  # bytes: torch.cuda.get_device_properties(...).total_memory on such a GPU
    capability: tuple
    per_node: int = 8


def gpu_named(name, capability):
    """A GPU of torch's `name`, its memory as torch reports it (command.SPECS)."""
    return GPU(name, SPECS[name][0] * 2 ** 20, capability)


GPUS = {"h100": gpu_named("NVIDIA H100 80GB HBM3", (9, 0)),
        "h200": gpu_named("NVIDIA H200", (9, 0)),
        "a100": gpu_named("NVIDIA A100-SXM4-80GB", (8, 0)),
        "a100-40gb": gpu_named("NVIDIA A100-SXM4-40GB", (8, 0))}
PARTS = ("weights", "gradients", "optimizer state", "weights in use", "activations", "logits", "token ids")


# ---------------------------------------------------------------- the command line

def parse_args(argv):
    """(the dry run's options, train.py's own flags) of one command line."""
    p = config.OneLineParser(prog="train.py --dry-run", description="Rehearse the train.py command "
                             "given with these flags on fake GPUs, one rank per pipeline stage.")
    p.add_argument("--dry-run", action="store_true", help="with train.py's flags (train.py --help)")
    p.add_argument("--world", type=config.positive_int, required=True, help="GPUs to rehearse")
    p.add_argument("--gpu", default="h100", type=config.one_of(GPUS, "GPU"), help=", ".join(GPUS))
    p.add_argument("--gpus-per-node", type=config.positive_int, help="default: 8")
    p.add_argument("--jobs", type=config.positive_int,
                   help="stages rehearsed at once, a process each (default: one per CPU core)")
    args, rest = p.parse_known_args(argv)
    for flag in ("--device", "--compile"):
        if flag in rest:
            raise UsageError(f"{flag}: the dry run rehearses the CUDA path, eagerly; drop {flag}")
    return args, rest + ["--no-compile"]


def main(argv=None):
    """train.py --dry-run: the command rehearsed with train.py's prepare and train_step. Exit 0; 2 for bad flags or a
    rank that does not fit (naming the flag to change); 3 when the step breaks a rule a GPU run would fail on."""
    try:
        argv = sys.argv[1:] if argv is None else argv
        args, train_argv = parse_args(argv)
        gpu = GPUS[args.gpu]
        t0 = time.perf_counter()
        per_node = args.gpus_per_node or gpu.per_node
        jobs = args.jobs or usable_cores()
        with interruptible():
            reports = rehearse(train_argv, args.world, gpu, per_node, show=True, jobs=jobs)
    except (UsageError, LayoutError, DataError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except (KeyboardInterrupt, StopSignal) as e:
        sig = e.args[0] if isinstance(e, StopSignal) else signal.SIGINT
        print(f"error: the rehearsal was stopped by {sig.name}", file=sys.stderr)
        return 128 + sig
    except BrokenProcessPool:
        print(f"error: --jobs: a rehearsing process died (out of memory?); {jobs} ran at once", file=sys.stderr)
        return 3
    print(f"rehearsed {len(reports)} rank(s), one per pipeline stage, of {args.world} {args.gpu} "
          f"GPUs in {time.perf_counter() - t0:.1f} s")
    broken = next((r for r in reports if r.failure or r.violations), None)
    if broken:
        what = broken.failure or broken.violations[0]
        print(f"error: rank {broken.rank}: {what}", file=sys.stderr)
        return 3
    worst = max(reports, key=lambda r: r.peak / r.usable)
    if worst.peak > worst.usable:
        print(f"error: {worst.flag_to_change()}: rank {worst.rank} (pp stage {worst.coord['pp']}) "
              f"peaks at {worst.peak / 1e9:.1f} GB, more than {1 - memory.MARGIN:.0%} of the "
              f"{gpu.memory / 1e9:.1f} GB of an {args.gpu}", file=sys.stderr)
        return 2
    print(speed(reports[0].run, gpu, argv))
    return 0


def speed(run, gpu, argv):
    """How fast the rehearsed command would run: the planner's range for its model, layout and GPU
    (bench/planner, --code ours), as MFU, tokens/s a GPU and seconds a step; and the planner's
    command for where the time goes."""
    cfg = model_config(run)
    mfu = expected_mfu(run, cfg, gpu.name)
    if mfu is None:
        return "speed: the planner has no figures for this GPU or layout"
    per_gpu = [m * PEAK_TFLOPS[gpu.name] * 1e12 / model.flops_per_token(cfg) for m in mfu]
    step = [run.global_batch * cfg.seq_len / (run.world * t) for t in reversed(per_gpu)]
    return (f"speed, as the planner predicts it: MFU {mfu[0]:.1%}-{mfu[1]:.1%}, "
            f"{per_gpu[0]:,.0f}-{per_gpu[1]:,.0f} tokens/s a GPU, {step[0]:.2f}-{step[1]:.2f} s a step\n"
            f"where its time goes, and the best layouts: python -m bench.planner train.py {shlex.join(argv)}")


# ---------------------------------------------------------------- one rank per stage

@dataclass
class Report:
    """What one rank's rehearsal found."""
    rank: int
    device: str
    gpu: GPU
    run: object  # the resolved config.Run
    coord: dict = field(default_factory=dict)
    peak: int = 0  # bytes: the most live CUDA storage at once over the steps
    parts: dict = field(default_factory=dict)  # {part: bytes} at that moment
    expected: dict = field(default_factory=dict)  # memory.stage_bytes: the memory model's parts
    steps: list = field(default_factory=list)  # per step {(group, kind): [calls, bytes]} (comm.py)
    launches: list = field(default_factory=list)  # per step Counter {c10d op: launches}, p2p each
    violations: list = field(default_factory=list)  # the rules a GPU run would break, and where
    failure: str = ""  # what stopped the rehearsal, and where
    seconds: float = 0.0

    @property
    def usable(self):
        return (1 - memory.MARGIN) * self.gpu.memory

    def describe(self):
        c = self.coord
        head = (f"rank {self.rank} (dp {c.get('dp')}, pp {c.get('pp')}, cp {c.get('cp')}, "
                f"tp {c.get('tp')}) on {self.device}, rehearsed in {self.seconds:.1f} s")
        if self.failure:
            return f"{head}\n  FAILED: {self.failure}"
        estimate = sum(self.expected.values())
        lines = [head, f"  peak {self.peak / 1e9:.3g} GB ("
                 + ", ".join(f"{k} {v / 1e9:.3g}" for k, v in self.parts.items() if v) + ")",
                 f"  {'fits' if self.peak <= self.usable else 'does NOT fit'} in "
                 f"{1 - memory.MARGIN:.0%} of the {self.gpu.memory / 1e9:.1f} GB of an "
                 f"{self.gpu.name}; the memory model (memory.stage_bytes) says "
                 f"{estimate / 1e9:.3g} GB ({estimate / self.peak - 1:+.0%})"
                 + ("; train.py's memory check refuses to start above that 90%" if estimate > self.usable else ""),
                 f"  per step: {sum(self.launches[-1].values())} collective launches ("
                 + ", ".join(f"{op} {n}" for op, n in self.launches[-1].most_common()) + ")"]
        for (group, kind), (calls, nbytes) in sorted(self.steps[-1].items()):
            lines.append(f"    {group:10s} {kind:15s} {calls:6d} calls {nbytes / 1e9:10.3f} GB")
        return "\n".join(lines + [f"  BROKEN: {v}" for v in self.violations])

    def flag_to_change(self):
        largest = max(self.parts, key=self.parts.get)
        if largest == "activations":
            return "--ckpt" if self.run.ckpt == "none" else "--micro-batch"
        if largest in ("logits", "token ids"):
            return "--micro-batch"
        return "--dp-mode" if self.run.dp_mode == "ddp" else "--tp"


def rehearse(train_argv, world, gpu, per_node=8, stages=None, at=None, show=False, jobs=1):
    """[Report] of one rank per pipeline stage (or per stage in `stages`): the stage's rank 0, or
    its rank at coordinates `at` ({"dp": ..., "cp": ..., "tp": ...}). `jobs` ranks at once, each
    in a process of its own (a rank is one thread's work; they share nothing)."""
    layout = resolve(train_argv, world, gpu, per_node)  # the flags, checked before any rank
    mesh = Mesh(0, world, dp=layout.dp, pp=layout.pp, cp=layout.cp, tp=layout.tp, dp_shard=layout.dp_shard)
    ranks = [mesh.rank_of(pp=s, **(at or {})) for s in (range(layout.pp) if stages is None else stages)]
    jobs = min(jobs, len(ranks))
    if show:
        print(mesh.describe(per_node), flush=True)
        print(f"rehearsing {len(ranks)} rank(s), {jobs} at a time", flush=True)
    reports = []
    with ExitStack() as stack:
        if jobs == 1:
            stack.enter_context(FakeGPUs(gpu, per_node))
            done = (rehearse_rank(train_argv, r, world, per_node, gpu) for r in ranks)
        else:
            pool = ProcessPoolExecutor(jobs, multiprocessing.get_context("spawn"), start_worker,
                                       (os.getpid(),))
            stack.callback(pool.shutdown, cancel_futures=True)
            stack.push(stop_workers)
            task = [(train_argv, r, world, per_node, gpu) for r in ranks]
            with sigint_held():  # the workers start here: Ctrl-C is this process's to handle
                done = pool.map(rehearse_in_process, *zip(*task))
        for report in done:  # in stage order, each as soon as it and those before it are done
            reports.append(report)
            if show:
                print(report.describe(), flush=True)
    return reports


def stop_workers(kind, error, trace):
    """Stopped (Ctrl-C, SIGTERM): the workers go now, not after the ranks they are on."""
    if kind is not None:
        for worker in multiprocessing.active_children():
            worker.kill()


def resolve(train_argv, world, gpu, per_node=8):
    """Rank 0's config.Run of train.py's flags at this world size, on these GPUs: checked as the
    launch would check them."""
    env = {"RANK": "0", "WORLD_SIZE": str(world), "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": str(per_node)}
    with FakeGPUs(gpu, per_node):
        return config.resolve(train_argv, environ=env)


def rehearse_in_process(train_argv, rank, world, per_node, gpu):
    """rehearse_rank in a worker process."""
    torch.set_num_threads(1)  # fake tensors hold no data: nothing to compute on more threads
    with FakeGPUs(gpu, per_node):
        return rehearse_rank(train_argv, rank, world, per_node, gpu)


def rehearse_rank(train_argv, rank, world, per_node, gpu, watch=None):
    """One rank's Report (inside FakeGPUs). watch: a dispatch mode also entered for each step,
    reset() before it (bench.vs_peers counts FLOPs with one)."""
    env = {"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank % per_node),
           "LOCAL_WORLD_SIZE": str(per_node)}
    t0 = time.perf_counter()
    with FakeWorld(rank, world):
        run = config.resolve(train_argv, environ=env)
        cfg = model_config(run)
        pp_rank = rank // (run.tp * run.cp) % run.pp
        report = Report(rank, run.device, gpu, run, expected=memory.stage_bytes(cfg, run, pp_rank))
        try:
            rehearse_steps(run, cfg, report, watch)
        except Exception as e:  # noqa: BLE001 - what stopped it, and where, is the report
            first = str(e).strip().splitlines()[0] if str(e).strip() else ""
            report.failure = f"{type(e).__name__}: {first} ({where(e)})"
    report.seconds = time.perf_counter() - t0
    return report


def model_config(run):
    """The model train.py would build: the vocabulary of --data, else --vocab-size or the
    preset's; checked against the layout."""
    vocab = run.vocab_size or model.PRESETS[run.model].vocab_size
    vocab = read_meta(run.data)["vocab_size"] if run.data else vocab
    if not vocab:
        raise UsageError(f"--vocab-size: {run.model} takes its vocabulary from the data; "
                         "give --data or --vocab-size")
    cfg = train.model_config(run, vocab)
    train.check_layout(cfg, run)
    return cfg


def rehearse_steps(run, cfg, report, watch=None):
    """train.prepare, then STEPS of train.train_step on random tokens, on fake CUDA."""
    with FakeCUDA(), Ledger() as ledger, no_initial_values():
        mesh = train.start_distributed(run)
        for group in vars(mesh).values():  # the fake backend stands in for NCCL: means are AVG
            if isinstance(group, Group):
                group.native_mean = True
        report.coord = mesh.coord
        trainer = train.prepare(run, cfg, mesh)
        ledger.know(trainer, cfg, run)
        rules = Rules(torch.device(run.device), run.dtype)
        for step in range(STEPS):
            with ledger.labelled("token ids"):
                rows = (run.global_batch // run.dp, cfg.seq_len)
                x = torch.randint(0, cfg.vocab_size, rows, device=run.device)
                y = torch.randint(0, cfg.vocab_size, x.shape, device=run.device)
            mesh.stats.reset()
            if watch is not None:
                watch.reset()
            with rules, watch or nullcontext():
                lr = train.lr_at(step, run.lr, run.min_lr, run.warmup, run.steps, run.warmdown)
                train.train_step(trainer, x, y, lr, run.grad_clip)
            ledger.step_done(trainer)
            report.steps.append(per_group(mesh.stats))
            report.launches.append(rules.launches)
            del x, y
        report.peak, report.parts, report.violations = ledger.peak, ledger.parts(), rules.violations


@contextmanager
def no_initial_values():
    """train.build draws no initial values: fake tensors hold none, and drawing them tile by tile
    on the CPU (parallel/materialize.local_init) would take most of the rehearsal."""
    draw = train.local_init
    train.local_init = lambda name, param, cfg, seed, flat=None, out=None: out
    try:
        yield
    finally:
        train.local_init = draw


def per_group(stats):
    """{(group, kind): [calls, bytes]} of one step's counters."""
    out = defaultdict(lambda: [0, 0.0])
    for kind, group, nbytes in stats.log:
        out[(group, kind)][0] += 1
        out[(group, kind)][1] += nbytes
    return dict(out)


def where(error=None):
    """The innermost line of this repository's code (outside this file) on the stack, or in the error's traceback."""
    if error is None:
        frames = traceback.extract_stack()
    else:
        frames = traceback.extract_tb(error.__traceback__)
    ours = [f for f in frames if f.filename.startswith(str(REPO)) and "site-packages" not in f.filename
            and Path(f.filename).name not in ("dry_run.py", "_contextlib.py")]
    f = (ours or frames)[-1]
    return f"{Path(f.filename).relative_to(REPO) if ours else f.filename}:{f.lineno} in {f.name}"


# ---------------------------------------------------------------- the machine, pretended

@contextmanager
def FakeWorld(rank, world):
    """This process as rank `rank` of `world` on torch's fake process group: every collective returns at once."""
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        yield
    finally:
        dist.destroy_process_group()


class FakeCUDA(FakeTensorMode):
    """FakeTensorMode that never touches a real GPU and leaves the meta device alone: train.py builds the model on
    meta tensors, which Module.to_empty replaces by fake ones (torch refuses to swap fake meta ones in place)."""
    avoid_device_init = True

    def __init__(self):
        super().__init__(allow_non_fake_inputs=True)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is _DEVICE:  # the fake tensor's property answers it
            return args[0].device
        if args and isinstance(args[0], FakeTensor):  # most ops: at once
            return super().__torch_dispatch__(func, types, args, kwargs)
        tensors = list(tensors_in((args, kwargs)))
        device = torch.device(kwargs["device"]) if kwargs.get("device") is not None else None
        on_meta = all(t.is_meta and not isinstance(t, FakeTensor) for t in tensors) and (
            device.type == "meta" if device is not None else bool(tensors))
        if on_meta:
            with no_dispatch():
                return func(*args, **kwargs)
        return super().__torch_dispatch__(func, types, args, kwargs)


def shim():
    """dry_run_gpu.cpp, which answers the autograd engine's questions to CUDA, built against this
    torch by the C++ compiler once into the temporary folder (3-5 s of g++), then loaded."""
    source, torch_dir = HERE / "dry_run_gpu.cpp", Path(torch.__file__).parent
    key = source.read_bytes() + str(torch_dir).encode() + torch.__version__.encode()
    key = hashlib.sha256(key).hexdigest()
    built = Path(tempfile.gettempdir()) / f"dry_run_gpu-{key[:16]}.so"
    if not built.exists():
        compiler = shutil.which("c++") or shutil.which("g++")
        if compiler is None:
            raise UsageError("--dry-run: builds dry_run_gpu.cpp with a C++ compiler (c++ or g++); "
                             "none is on PATH")
        partial = built.with_suffix(f".{os.getpid()}.tmp")
        include, lib = torch_dir / "include", torch_dir / "lib"
        abi = int(torch.compiled_with_cxx11_abi())
        subprocess.run([compiler, "-O1", "-std=c++20", "-shared", "-fPIC", str(source),
                        "-o", str(partial), f"-D_GLIBCXX_USE_CXX11_ABI={abi}", f"-I{include}",
                        f"-I{include / 'torch' / 'csrc' / 'api' / 'include'}", f"-L{lib}",
                        f"-Wl,-rpath,{lib}", "-lc10", "-ltorch_cpu"], check=True, capture_output=True)
        os.replace(partial, built)  # whole or not at all, whoever builds it at the same time
    return ctypes.CDLL(str(built))


@contextmanager
def FakeGPUs(gpu, count):
    """For the block: `count` GPUs of kind `gpu` per node, as torch.cuda describes them; autograd on this thread, asking
    dry_run_gpu.cpp's device guard and hooks; attention routed to the kernel a GPU would run."""
    lib = shim()
    props = SimpleNamespace(name=gpu.name, total_memory=gpu.memory, major=gpu.capability[0],
                            minor=gpu.capability[1], multi_processor_count=132)
    answers = {"is_available": lambda: True, "device_count": lambda: count,
               "current_device": lambda: 0, "set_device": lambda device: None,
               "get_device_name": lambda device=None: gpu.name,
               "get_device_capability": lambda device=None: gpu.capability,
               "get_device_properties": lambda device=None: props,
               "is_bf16_supported": lambda *a, **k: True, "synchronize": lambda device=None: None}
    saved = {name: getattr(torch.cuda, name) for name in answers}
    sdpa = F.scaled_dot_product_attention
    lib.dry_run_gpu_install(count)
    try:
        for name, answer in answers.items():
            setattr(torch.cuda, name, answer)
        F.scaled_dot_product_attention = fused_attention
        with torch.autograd.set_multithreading_enabled(False):
            yield
    finally:
        F.scaled_dot_product_attention = sdpa
        for name, original in saved.items():
            setattr(torch.cuda, name, original)
        lib.dry_run_gpu_remove()


def fused_attention(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    """F.scaled_dot_product_attention as CUDA runs it for this model: FlashAttention in fp16 and
    bf16 (grouped K, V as they are), the memory-efficient kernel in fp32; their fake kernels return
    and save what theirs do (no (T x T) scores). SDPA's own choice asks the device, not there."""
    if attn_mask is not None or q.shape[-1] > 256 or q.shape[-1] % 8:
        raise NotImplementedError("the dry run rehearses attention without a mask, head_dim <= 256 "
                                  "a multiple of 8")
    if q.dtype in (torch.float16, torch.bfloat16):
        return _ATEN._scaled_dot_product_flash_attention(q, k, v, dropout_p, is_causal, scale=scale)[0]
    if k.shape[1] != q.shape[1]:
        raise NotImplementedError("fp32 attention on CUDA takes as many K, V heads as query heads")
    return _ATEN._scaled_dot_product_efficient_attention(q, k, v, None, False, dropout_p, is_causal, scale=scale)[0]


# ---------------------------------------------------------------- memory: the live CUDA storages

GATHERS = (fsdp.Unit.start_gather.__code__, fp8.FP8Gather.__call__.__code__)  # FSDP's gathers


class Ledger(StorageMode):
    """Every CUDA storage an op creates until it is freed (or resized); `peak` the most alive at once, in parts: what
    the trainer keeps between steps by holder, the rest by shape and when it was made (a parameter's shape: weights
    in use in forward, a gradient in backward; a 1-D buffer of FSDP's gather: weights in use; the vocab: logits)."""

    def __init__(self):
        super().__init__()
        self.live, self.now, self.peak, self.at_peak, self.serial = {}, 0, 0, {}, 0
        self.label, self.held, self.shapes, self.units, self.vocab = None, {}, set(), set(), None

    @contextmanager
    def labelled(self, part):
        self.label = part
        try:
            yield
        finally:
            self.label = None

    def know(self, trainer, cfg, run):
        """What tells the parts apart, once the model is built."""
        units = getattr(trainer.wrapper, "units", [])
        self.shapes = {tuple(p.shape) for c in trainer.chunks for p in c.parameters()}
        self.shapes |= {tuple(slot[3].shape) for u in units for slot in u.slots}
        self.units = {u.padded for u in units}
        self.vocab = cfg.padded_vocab // run.tp
        self.step_done(trainer)

    def step_done(self, trainer):
        """Notes {storage: (serial, part)} of what the trainer keeps between steps."""
        w, units = trainer.wrapper, getattr(trainer.wrapper, "units", [])
        params = [p for c in trainer.chunks for p in c.parameters()]
        self.hold({"weights": list(w.optim_params()) + params,
                   "gradients": [p.grad for p in w.optim_params()] + [u.grad for u in units]
                   + [getattr(u, "summed", None) for u in units] + [b.buffer for b in getattr(w, "buckets", [])],
                   "optimizer state": [v for s in trainer.opt.state.values() for v in s.values()]})

    def hold(self, kept):
        """Notes the storages of {part: [tensors]} as held between steps."""
        self.held = {}
        for part, tensors in kept.items():
            for t in tensors:
                if isinstance(t, torch.Tensor) and t.untyped_storage()._cdata in self.live:
                    key = t.untyped_storage()._cdata
                    self.held[key] = (self.live[key][2], part)

    def parts(self):
        out = dict.fromkeys(PARTS, 0)
        for key, (n, hint, serial) in self.at_peak.items():
            held = self.held.get(key)
            out[held[1] if held and held[0] == serial else hint] += n
        return out

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is _DEVICE:  # as Rules answers it
            return args[0].device
        out = func(*args, **(kwargs or {}))
        for t in tensors_in(out):
            if t.device.type == "cuda":
                storage = t.untyped_storage()
                if storage._cdata not in self.live:
                    self.add(storage, t)
        return out

    def add(self, storage, t):
        n, key = storage.nbytes(), storage._cdata
        self.serial += 1
        self.live[key] = (n, self.hint(t), self.serial)
        weakref.finalize(storage, self.free, key)
        self.grew(n)

    def hint(self, t):
        """The part of a new storage, unless it is kept between steps."""
        if self.label:
            return self.label
        if t.dim() >= 2 and t.shape[-1] == self.vocab:
            return "logits"
        if t.dim() == 1 and t.numel() in self.units and in_gather():
            return "weights in use"
        if tuple(t.shape) in self.shapes:
            return "gradients" if torch._C._current_graph_task_id() != -1 else "weights in use"
        return "activations"

    def grew(self, n):
        self.now += n
        if self.now > self.peak:
            self.peak, self.at_peak = self.now, dict(self.live)

    def free(self, key):
        self.now -= self.live.pop(key)[0]

    def resized(self, storage, before):
        entry = self.live.get(storage._cdata)
        if entry is not None:
            self.live[storage._cdata] = (storage.nbytes(), *entry[1:])
            self.grew(storage.nbytes() - before)


def in_gather():
    frame = sys._getframe(2)
    while frame is not None and frame.f_code not in GATHERS:
        frame = frame.f_back
    return frame is not None


# ---------------------------------------------------------------- the rules a GPU run lives by

class Rules(TorchDispatchMode):
    """During a step: no op touches a CPU tensor (0-dim scalars aside) or reads a value back to the
    host (aten._local_scalar_dense: .item(), bool() and float() of a tensor), every collective
    passes the checks NCCL makes on its tensors, and under --dtype bf16, fp16 or fp8 no matmul
    runs in fp32 (the policy: every matmul in the compute dtype, the loss's none). Counts the
    collectives launched, p2p ops each."""

    def __init__(self, device, dtype="fp32"):
        super().__init__()
        self.device, self.violations, self.launches, self.seen = device, [], Counter(), set()
        self.low_precision = dtype != "fp32"

    def __enter__(self):
        self.launches = Counter()
        return super().__enter__()

    def broke(self, rule):
        message = f"{rule} at {where()}"
        if message not in self.seen:
            self.seen.add(message)
            self.violations.append(message)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is _DEVICE:  # a fake tensor's device property answers it, without the modes below
            return args[0].device
        if func is torch.ops.aten._local_scalar_dense.default:
            self.broke("a host read (.item(), bool() or float() of a tensor)")
        if on_cpu((args, kwargs)):
            self.broke(f"{func} on a CPU tensor")
        if self.low_precision and func in MATMULS and any(
                t.dtype == torch.float32 for t in tensors_in(args)):
            self.broke(f"an fp32 matmul ({func._opname}) in a low-precision step")
        if func.namespace == "c10d" and func._opname != "barrier":
            self.launches[func._opname] += 1
            self.check_collective(func._opname, args)
        out = func(*args, **kwargs)
        if on_cpu(out):
            self.broke(f"{func} made a CPU tensor")
        return out

    def check_collective(self, name, args):
        tensors = list(tensors_in(args))
        for t in tensors:
            if t.device != self.device:
                self.broke(f"c10d.{name} on {t.device}, not this rank's {self.device}")
            if t.layout != torch.strided:
                self.broke(f"c10d.{name} on a {t.layout} tensor (NCCL: dense tensors)")
            if not t.is_contiguous():
                self.broke(f"c10d.{name} on a non-contiguous tensor {tuple(t.shape)}, strides "
                           f"{t.stride()}")
        if len({t.dtype for t in tensors}) > 1:
            self.broke(f"c10d.{name} mixes {', '.join(sorted(str(t.dtype) for t in tensors))}")
        size = group_size(args)
        if name in ("_allgather_base_", "_reduce_scatter_base_"):
            whole, part = (args[0], args[1]) if name == "_allgather_base_" else (args[1], args[0])
            if whole.numel() != part.numel() * size:
                self.broke(f"c10d.{name}: {whole.numel()} elements are not {size} x {part.numel()}")
        if name == "alltoall_base_":
            out, inp, out_splits, in_splits = args[0], args[1], args[3], args[4]
            if out_splits or in_splits or inp.shape[0] % size or out.shape != inp.shape:
                self.broke(f"c10d.{name}: {tuple(inp.shape)} does not split evenly over {size} "
                           "ranks")


def on_cpu(tree):
    """Whether a CPU tensor of more than 0 dimensions (a scalar is fine) is in the tree."""
    return any(t.device.type == "cpu" and t.dim() > 0 for t in tensors_in(tree))


def tensors_in(tree):
    """The tensors in an op's arguments or results."""
    return [t for t in tree_leaves(tree) if isinstance(t, torch.Tensor)]


def group_size(args):
    """The size of the process group among a c10d op's arguments."""
    for a in args:
        if isinstance(a, torch.ScriptObject):
            return dist.ProcessGroup.unbox(a).size()
    return dist.get_world_size()


if __name__ == "__main__":
    sys.exit(exit_status(main))
