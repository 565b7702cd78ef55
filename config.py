"""The run's configuration, resolved once: train.py's command line and the launcher's environment become one frozen
Run (resolve), and with the data, the model it trains (model): every check, in one place, before a process group
forms or a file is written. Bad input is one UsageError or LayoutError line (exit status 2).

    run = resolve(argv)                 # flags, launcher, device, dtypes, layout, compile, schedule, saves
    model = model_for(run, data_folder) # the ModelConfig (flags, data vocabulary, --init-from), checked to fit
"""
import argparse
import hashlib
import math
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

import fp8
import model as M
from data.loader import read_meta
from parallel import ckpt, cp, pp, tp
from parallel.cp import MODES as CP_MODES
from parallel.mesh import LayoutError, infer_dp
from parallel.pp_schedule import SCHEDULES, SPLIT_BACKWARD
from saves.hf import init_from

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16,
          "fp8": torch.bfloat16}  # fp8: bf16 autocast, and the block matmuls in fp8 (fp8.py)
DP_MODES = ("ddp", "fsdp", "hsdp")
# Dense bf16 tensor-core peaks in TFLOP/s, matched against torch.cuda.get_device_name(); first match wins.
PEAK_TFLOPS = {  # dense bf16 tensor-core peak in TFLOP/s, by the full name torch.cuda.get_device_name() reports
    "NVIDIA H100 80GB HBM3": 989.4, "NVIDIA H100 PCIe": 756.0, "NVIDIA H100 NVL": 835.0,  # SXM, PCIe, NVL
    "NVIDIA H200": 989.4, "NVIDIA H200 NVL": 835.0, "NVIDIA GH200 480GB": 989.4, "NVIDIA H800": 989.4,
    "NVIDIA A100-SXM4-80GB": 312.0, "NVIDIA A100-SXM4-40GB": 312.0, "NVIDIA A100 80GB PCIe": 312.0,
    "NVIDIA A100-PCIE-40GB": 312.0, "NVIDIA L4": 121.0, "NVIDIA L40": 181.0, "NVIDIA L40S": 362.0,
    "NVIDIA A10G": 125.0, "NVIDIA GeForce RTX 4090": 165.2,
}


class UsageError(ValueError):
    """A bad command line: printed as one line, exit status 2."""


class OneLineParser(argparse.ArgumentParser):
    def error(self, message):
        raise UsageError(message.removeprefix("argument "))


def typed(name, parse, ok):
    """An argparse type: parse(text), refused unless ok(value); argparse names it in its message."""
    def check(text):
        value = parse(text)
        if not ok(value):
            raise ValueError
        return value
    check.__name__ = name
    return check


positive_int = typed("positive integer", int, lambda v: v >= 1)
seed_int = typed("integer in [0, 2^63)", int, lambda v: 0 <= v < 2 ** 63)
nonnegative_int = typed("non-negative integer", int, lambda v: v >= 0)
positive_float = typed("positive number", float, lambda v: math.isfinite(v) and v > 0)
nonnegative_float = typed("non-negative number", float, lambda v: math.isfinite(v) and v >= 0)
probability = typed("number in [0, 1)", float, lambda v: 0 <= v < 1)


def one_of(choices, what):
    """A type that accepts one of `choices` and otherwise says which exist."""
    def check(text):
        if text not in choices:
            raise argparse.ArgumentTypeError(f"unknown {what} {text!r}; choose from {', '.join(choices)}")
        return text
    return check


def recompute_policy(text):
    try:
        ckpt.parse(text)
    except LayoutError as e:
        raise argparse.ArgumentTypeError(str(e).removeprefix("--ckpt: ")) from None
    return text


def layer_split(text):
    """'3,5' -> (3, 5): layers per pipeline stage."""
    try:
        counts = tuple(int(s) for s in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated layer counts, got {text!r}") from None
    if min(counts) < 1:
        raise argparse.ArgumentTypeError(f"every stage needs at least one layer, got {text}")
    return counts


class Run(argparse.Namespace):
    """The run, resolved: every flag with its default made concrete, and what the launcher and the machine decide.
    Frozen: once resolve() returns it, nothing changes it. Beyond the flags (train.py --help):
      rank, world, local_rank, ranks_here   from torchrun's RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE (else one
                                            process)
      device, backend                       "cuda:<local rank>" and nccl, or "cpu" and gloo
      dtype, compile, tf32                  the defaults: bf16, compiled, TF32 for what stays fp32 on CUDA; fp32,
                                            eager, no TF32 on CPU (--dtype fp32 never uses TF32 unless --tf32)
      dp, micro_batches                     world / (tp·pp·cp) unless given; B / (b·dp), also the pipeline's M
      pp_schedule, cp_mode                  1f1b, ring unless given (given without --pp / --cp: refused)
      overlap                               not --no-overlap
      tp_ring                               --sp's collectives as ring hops under the matmuls (tp_ring.py): on NCCL,
                                            with overlap, bf16/fp16/fp32 and a schedule without the B/W split; on
                                            gloo the blocking collectives cost less (bench/vs_torch.py)"""

    def __setattr__(self, name, value):
        if vars(self).get("frozen"):
            raise AttributeError(f"the run is resolved; {name} cannot change")
        super().__setattr__(name, value)


def parse_args(argv=None, namespace=None):
    p = OneLineParser(description="Train a Llama-style GPT on any (dp x pp x cp x tp) layout.",
                      formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    a = p.add_argument
    a("--model", default="tiny", type=one_of(M.PRESETS, "preset"), help=f"preset: {', '.join(M.PRESETS)}")
    for name in ("n-layer", "d-model", "n-head", "n-kv-head", "ffn-dim", "vocab-size", "seq-len"):
        a(f"--{name}", type=positive_int, help="override the preset's field")
    a("--dropout", type=probability, default=0.0, help="residual dropout (off by default)")
    a("--data", help="folder of token shards (default: the pystdlib corpus, prepared on first use)")
    a("--global-batch", type=positive_int, default=32, help="sequences per optimizer step, all ranks together")
    a("--micro-batch", type=positive_int, default=8,
      help="sequences per forward per DP rank; accumulation = B / (b*dp)")
    a("--steps", type=positive_int, default=100, help="optimizer steps")
    a("--lr", type=nonnegative_float, default=3e-3, help="peak learning rate (0: measure, or check an import)")
    a("--min-lr", type=nonnegative_float, default=3e-4, help="learning rate at the end of the cosine decay")
    a("--warmup", type=nonnegative_int, default=20, help="linear warmup steps")
    a("--weight-decay", type=nonnegative_float, default=0.1)
    a("--grad-clip", type=nonnegative_float, default=1.0, help="clip the global gradient norm (0: off)")
    a("--seed", type=seed_int, default=1337, help="seeds the weights and the batches")
    a("--dtype", type=one_of(DTYPES, "dtype"),
      help="compute precision: fp32 | bf16 | fp16 (fp16 uses loss scaling) | fp8 (bf16, block matmuls in fp8); "
           "default bf16 on CUDA, fp32 on CPU")
    a("--tf32", action=argparse.BooleanOptionalAction,
      help="TF32 tensor cores for the matmuls that stay fp32 (default: on with bf16, fp16, fp8 on CUDA; off for fp32)")
    a("--dp", type=positive_int, help="data parallel degree (default: world / (tp*pp*cp))")
    a("--dp-mode", default="ddp", type=one_of(DP_MODES, "mode"), help=" | ".join(DP_MODES))
    a("--dp-shard", type=positive_int, help="HSDP shard-group size (ranks that shard one replica)")
    a("--reduce-dtype", type=one_of(("fp32", "bf16"), "dtype"),
      help="FSDP gradient reduce-scatter dtype: fp32 | bf16 (default fp32)")
    a("--accumulate", type=one_of(("sharded", "unsharded"), "mode"),
      help="FSDP/HSDP micro-batch gradients: sharded (a reduce-scatter per micro-batch, 4P/M bytes held; the "
           "default) | unsharded (summed locally, one reduce-scatter per step, 4P bytes held)")
    a("--fp8-all-gather", action="store_true", help="FSDP/HSDP all-gather the block weights in fp8 (--dtype fp8)")
    a("--tp", type=positive_int, default=1, help="tensor parallel degree")
    a("--sp", action="store_true", help="sequence parallel (with --tp)")
    a("--pp", type=positive_int, default=1, help="pipeline parallel degree")
    a("--pp-schedule", type=one_of(SCHEDULES, "schedule"), help=f"{' | '.join(SCHEDULES)} (default 1f1b)")
    a("--pp-virtual", type=positive_int, default=1, help="model chunks per pipeline rank (interleaved)")
    a("--pp-split", type=layer_split, help="explicit layers per stage, e.g. 3,5")
    a("--cp", type=positive_int, default=1, help="context parallel degree")
    a("--cp-mode", type=one_of(CP_MODES, "mode"), help=f"{' | '.join(CP_MODES)} (default ring)")
    a("--ckpt", default="none", type=recompute_policy,
      help="activation checkpointing, i.e. recompute activations in backward (not a save: see --save-every): "
           f"{ckpt.POLICIES}")
    a("--bucket-mb", type=nonnegative_float, default=25.0, help="DDP gradient bucket size in MB")
    a("--no-overlap", action="store_true",
      help="no communication overlap (ablation): dp gradient sync after backward, every tp collective blocking")
    a("--device", type=one_of(("cpu", "cuda"), "device"), help="cpu | cuda (default: cuda if available)")
    a("--compile", action=argparse.BooleanOptionalAction,
      help="torch.compile each transformer block (default: on for cuda, off for cpu)")
    a("--peak-tflops", type=positive_float, help="device peak for MFU (default: device table, or measured on CPU)")
    a("--timeout", type=positive_float, default=600.0,
      help="seconds a collective may wait, once the first steps are done (a hung rank then stops the job)")
    a("--startup-timeout", type=positive_float, default=3600.0,
      help="seconds a collective may wait during set-up, the first two steps and the first evaluation, which "
           "compile stage after stage")
    a("--out", help="run folder: saves, metrics, trace (default: runs/ and a name made of the flags that differ from "
      "their defaults, a new one for a fresh run, the newest of that name for --resume)")
    a("--save-every", type=nonnegative_int, default=0, help="save every N steps (0: only at the end)")
    a("--resume", nargs="?", const="latest", choices=["latest", "auto"],
      help="continue from the newest complete save in --out in any layout (error if none); "
           "--resume auto: start fresh if there is none (for torchrun --max-restarts)")
    a("--init-from", metavar="DIR", help="start from a Hugging Face Llama folder (config.json + safetensors) at step 0 "
      "with a fresh optimizer; the shape flags must match config.json")
    a("--keep", type=nonnegative_int, default=2, help="complete saves to keep (0: all)")
    a("--async-save", action="store_true", help="snapshot to CPU memory and write from a background thread")
    a("--eval-every", type=nonnegative_int, default=0, help="val loss every N steps (0: off)")
    a("--eval-batches", type=positive_int, default=4, help="global batches per evaluation")
    a("--log-every", type=nonnegative_int, default=10, help="print a console line every N steps (0: off)")
    a("--metrics", help="append one JSON line per step, and the run's summary at the end, to this file (rank 0; "
      "default OUT/metrics.jsonl)")
    a("--profile", action="store_true", help="write a torch.profiler Chrome trace of steps 3-5 to --out")
    args = p.parse_args(argv, namespace=namespace)
    check_args(args)
    return args


def check_args(args):
    """The checks that involve more than one flag, or the machine; each names the flag at fault."""
    for problem, flag, needs in (
            (args.sp and args.tp == 1, "--sp", "--tp > 1: it shards the tensor-parallel region along the sequence"),
            (args.dp_shard and args.dp_mode != "hsdp", "--dp-shard", "--dp-mode hsdp"),
            (args.reduce_dtype and args.dp_mode == "ddp", "--reduce-dtype", "--dp-mode fsdp or hsdp"),
            (args.accumulate and args.dp_mode == "ddp", "--accumulate", "--dp-mode fsdp or hsdp"),
            (args.fp8_all_gather and (args.dtype != "fp8" or args.dp_mode == "ddp"), "--fp8-all-gather",
             "--dtype fp8 and --dp-mode fsdp or hsdp"),
            ((args.pp_split or args.pp_virtual != 1 or args.pp_schedule) and args.pp == 1,
             "--pp-split/--pp-virtual/--pp-schedule", "--pp > 1"),
            (args.pp_virtual > 1 and args.pp_schedule != "interleaved", "--pp-virtual",
             "--pp-schedule interleaved"),
            (args.cp_mode and args.cp == 1, "--cp-mode", "--cp > 1")):
        if problem:  # a flag that would silently do nothing in this layout
            raise UsageError(f"{flag}: has no effect without {needs}")
    if args.dp_mode == "hsdp" and not args.dp_shard:
        raise UsageError("--dp-shard: hsdp needs the shard-group size")
    if args.device == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device: cuda requested but no GPU is visible")
    if args.dtype == "fp8" and args.pp_schedule in SPLIT_BACKWARD:
        raise UsageError("--pp-schedule: zb1 and zbv defer the weight gradients of plain matmuls; not with --dtype fp8")
    if args.dtype == "fp8" and fp8.missing():
        raise UsageError(f"--dtype: fp8 needs torch._scaled_mm and the float8 dtypes; {fp8.missing()}")


NOT_IN_NAME = {"out", "metrics", "resume", "log_every", "profile", "save_every", "keep", "async_save", "eval_every",
               "eval_batches", "timeout", "startup_timeout", "peak_tflops", "device"}  # they change no number trained


def given_flags(run):
    """{flag: value} of the flags this run sets to something other than their defaults, that change what it trains
    (a data folder or checkpoint by its name): the run's name, and what bench/compare.py tells runs apart by."""
    defaults = vars(parse_args([]))
    return {k.replace("_", "-"): Path(v).name if k in ("data", "init_from") else v
            for k, v in sorted(vars(run).items()) if k in defaults and k not in NOT_IN_NAME and v != defaults[k]}


def default_out(run, root=Path("runs")):
    """runs/NAME, NAME the model and the given flags (a hash past 120 characters). A fresh run takes the first of
    NAME, NAME-2, NAME-3, ... that holds no run (so back-to-back ablations never collide and nothing is lost);
    --resume the newest that exists (so a torchrun restart with --resume auto finds its own saves)."""
    flags = {k: v for k, v in given_flags(run).items() if k != "model"}
    name = "-".join([run.model] + [f"{k}={','.join(map(str, v)) if isinstance(v, tuple) else v}"
                                   for k, v in flags.items()]).replace("/", "_")
    if len(name) > 120:
        name = f"{name[:100]}-{hashlib.sha256(name.encode()).hexdigest()[:12]}"
    names = [root / name] + [root / f"{name}-{i}" for i in range(2, 10_000)]
    if run.resume:
        existing = [p for p in names[:next(i for i, p in enumerate(names) if not p.exists())]]
        return existing[-1] if existing else names[0]
    for path in names:
        if not path.exists() or not holds_a_run(path):
            return path
    raise UsageError(f"--out: {root / name} and 9,999 more of that name hold runs; choose --out")


def holds_a_run(path):
    return any(path.glob("step_*")) or (path / "attempts.json").exists()


def resolve(argv=None, environ=None):
    """The frozen Run of this process: the flags (checked), torchrun's environment, and the device's defaults."""
    environ = os.environ if environ is None else environ
    run = parse_args(argv, namespace=Run())
    run.flags = given_flags(run)
    if run.out is None:
        run.out = str(default_out(run))
    run.metrics = run.metrics or str(Path(run.out) / "metrics.jsonl")
    rank, world = int(environ.get("RANK", 0)), int(environ.get("WORLD_SIZE", 1))
    run.rank, run.world, run.local_rank = rank, world, int(environ.get("LOCAL_RANK", 0))
    run.ranks_here = int(environ.get("LOCAL_WORLD_SIZE", 1))
    cuda = (run.device or ("cuda" if torch.cuda.is_available() else "cpu")) == "cuda"
    run.device, run.backend = (f"cuda:{run.local_rank}", "nccl") if cuda else ("cpu", "gloo")
    run.dtype = run.dtype or ("bf16" if cuda else "fp32")
    run.compile = cuda if run.compile is None else run.compile
    run.tf32 = (cuda and run.dtype != "fp32") if run.tf32 is None else run.tf32
    if cuda and run.dtype == "fp8" and torch.cuda.get_device_capability(run.device) < (8, 9):
        raise UsageError(f"--dtype: fp8 needs FP8 tensor cores (compute capability 8.9+: Ada, Hopper); "
                         f"{torch.cuda.get_device_name(run.device)} is {torch.cuda.get_device_capability(run.device)}")
    run.dp = infer_dp(world, run.tp, run.pp, run.cp, run.dp)
    run.dp_shard = run.dp_shard if run.dp_mode == "hsdp" else None
    if run.dp_shard and run.dp % run.dp_shard:
        raise LayoutError("--dp-shard", f"dp_shard {run.dp_shard} does not divide dp {run.dp}")
    run.micro_batches = accumulation_steps(run.global_batch, run.micro_batch, run.dp)
    run.pp_schedule, run.cp_mode = run.pp_schedule or "1f1b", run.cp_mode or "ring"
    run.reduce_dtype, run.accumulate = run.reduce_dtype or "fp32", run.accumulate or "sharded"
    run.overlap = not run.no_overlap
    run.tp_ring = (run.sp and run.overlap and run.backend == "nccl" and run.dtype != "fp8"
                   and not (run.pp > 1 and run.pp_schedule in SPLIT_BACKWARD))
    check_writable(run.out, "--out", folder=True)
    if run.metrics:
        check_writable(run.metrics, "--metrics", folder=False)
    run.frozen = True
    return run


def check_writable(path, flag, folder):
    """path (a folder to be, or a file to be) can be created: it is not the other kind of thing, nothing on its way
    is a file, and the nearest existing folder takes a new file (probed, then removed: nothing is left)."""
    path = Path(path)
    if path.exists() and path.is_dir() != folder:
        raise UsageError(f"{flag}: {path} is a {'file' if folder else 'folder'}")
    parent = path if folder else path.parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        raise UsageError(f"{flag}: {parent} is a file, so {path} cannot be created")
    try:
        with tempfile.NamedTemporaryFile(dir=parent, prefix=".write_probe_"):
            pass
    except OSError as e:
        raise UsageError(f"{flag}: cannot write in {parent}: {e.strerror or e}") from None


def accumulation_steps(global_batch, micro_batch, dp):
    """Micro-batches per rank and step, M = B / (b·dp); the one place the batch sizes are checked together."""
    if global_batch % (micro_batch * dp):
        raise UsageError(f"--global-batch: {global_batch} is not divisible by micro-batch x dp = "
                         f"{micro_batch} x {dp}")
    return global_batch // (micro_batch * dp)


# ---------------------------------------------------------------- the model, with the data

@dataclass(frozen=True)
class Model:
    """What the run trains: the model config (flags, the data's vocabulary, --init-from's config.json), the Hugging
    Face weights to start from (None: the seeded init), and what a save records to be resumed: `config` must match on
    --resume (model, data, tokenizer, optimization), `layout` need not."""
    cfg: M.ModelConfig
    weights: object
    config: dict
    layout: dict


def model_for(run, data_folder):
    """The Model of a run on a prepared data folder, checked: the shape, every parallelism's constraints on it
    (tp.validate, cp.validate, pp.layer_counts), fp8's dimensions, and that it fits the device."""
    meta = read_meta(data_folder)
    cfg, weights = init_from(run.init_from, model_config(run, meta["vocab_size"]), run)  # config.json checked
    check_layout(cfg, run)
    check_fits(cfg, run)
    config = {"model": dict(cfg.__dict__), "data": data_identity(Path(data_folder) / "meta.json"),
              "train": {k: getattr(run, k) for k in ("global_batch", "lr", "min_lr", "warmup", "weight_decay",
                                                      "grad_clip", "seed", "dtype", "steps")},
              "tokenizer": meta["tokenizer"], **{k: meta[k] for k in ("tokenizer_file",) if k in meta}}
    layout = {"world": run.world, "dp": run.dp, "pp": run.pp, "cp": run.cp, "tp": run.tp, "dp_mode": run.dp_mode,
              "dp_shard": run.dp_shard or run.dp, "sp": run.sp, "pp_schedule": run.pp_schedule,
              "pp_virtual": run.pp_virtual, "pp_split": ",".join(map(str, run.pp_split)) if run.pp_split else None,
              "cp_mode": run.cp_mode}
    return Model(cfg, weights, config, layout)


def model_config(run, vocab_size):
    base = M.PRESETS[run.model]
    overrides = {f: getattr(run, f) for f in ("n_layer", "d_model", "n_head", "n_kv_head", "ffn_dim",
                                              "vocab_size", "seq_len") if getattr(run, f) is not None}
    fields = {**base.__dict__, "dropout": run.dropout, **overrides}
    if not fields["vocab_size"]:
        fields["vocab_size"] = vocab_size
    if fields["vocab_size"] < vocab_size:
        raise UsageError(f"--vocab-size: {fields['vocab_size']} is below the data's vocabulary of {vocab_size}")
    cfg = M.ModelConfig(**fields)
    problem = cfg.validate() or (run.dtype == "fp8" and fp8.misfit(cfg, run.tp, run.micro_batch * cfg.seq_len
                                                                   // run.cp))
    if problem:
        raise UsageError(f"{problem[0]}: {problem[1]}")
    return cfg


def check_layout(cfg, run):
    """Every parallelism's constraints on this model, through its own check, before anything is built."""
    if run.tp > 1:
        tp.validate(cfg, run.tp, run.cp, run.sp)
    if run.cp > 1:
        cp.validate(cfg, run.cp, run.tp, run.cp_mode)
    if run.pp > 1:
        pp.layer_counts(cfg, run.pp, run.pp_virtual, run.micro_batches, run.pp_split, run.pp_schedule)


MARGIN = 0.10  # of the device's memory, kept free: the allocator's fragmentation, NCCL's buffers, the CUDA context


def step_bytes(cfg, run):
    """{what: bytes} one rank holds at the peak of a step, an estimate from the shapes: the model state (fp32 weights,
    gradients, Adam's two moments: 16 bytes per parameter after sharding), the weights in use (FSDP's two gathered
    units, or autocast's cast of the stage's weights), the activations backward keeps (per layer and token in the
    compute dtype: the norms' inputs and outputs, q, k, v, attention's output, the MLP's gate, up and product; a
    checkpointed layer keeps its input, and one layer is remade at a time; a pipeline stage keeps up to P micro-
    batches' sets, GPipe M), the logits and their gradient, and the step's token ids. --accumulate unsharded keeps
    every unit's flat gradient all step, in the reduce dtype, unsharded."""
    e = 4 if run.dtype == "fp32" else 2
    d, f, params = cfg.d_model, cfg.ffn_dim, M.param_counts(cfg)[0]
    sh = run.tp if run.sp else 1  # the residual stream's split under sequence parallel
    shard = {"ddp": 1, "fsdp": run.dp * run.cp, "hsdp": (run.dp_shard or 1) * run.cp}[run.dp_mode]
    stage = params / (run.tp * run.pp)
    block = M.layer_param_count(cfg) / run.tp
    tokens = run.micro_batch * cfg.seq_len / run.cp
    layer = e * (4 * d / sh + (4 * d + 2 * d * cfg.n_kv_head / cfg.n_head + 3 * f) / run.tp) + 8 / sh  # per token
    layers = -(-cfg.n_layer // run.pp)
    kind = ckpt.parse(run.ckpt)[0]
    kept = layers * layer if kind in ("none", "selective") else layers * e * d / sh + layer  # remade one at a time
    if kind == "selective":
        kept -= layers * e * (2 * d / sh + f / run.tp)
    sets = 1 if run.pp == 1 else (run.micro_batches if run.pp_schedule == "gpipe" else min(run.pp, run.micro_batches))
    vocab = cfg.padded_vocab / run.tp
    summed = DTYPES[run.reduce_dtype].itemsize * stage if run.accumulate == "unsharded" else 0  # fsdp_accumulate
    return {"model state": 16 * stage / shard + summed,
            "weights in use": 2 * e * block if run.dp_mode != "ddp" else (e * stage if e < 4 else 0),
            "activations": sets * tokens * kept,
            "logits": 2 * e * tokens * vocab + 4 * min(tokens, 2 ** 25 / vocab) * vocab,
            "token ids": 16 * run.global_batch / run.dp * cfg.seq_len}


def device_memory(run):
    """(bytes one rank may use, what they are): the GPU's memory, or on CPU the memory available now over the ranks
    on this machine."""
    if run.backend == "nccl":
        return torch.cuda.get_device_properties(run.device).total_memory, torch.cuda.get_device_name(run.device)
    available = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
    return available / run.ranks_here, f"this machine's available RAM / {run.ranks_here} rank(s)"


def check_fits(cfg, run):
    """Refuses, before anything is built, a run whose step (step_bytes) would not fit in the device's memory less a
    margin, naming the largest part and the flag that moves it."""
    if cfg.vocab_size >= 2 ** 31:
        raise UsageError(f"--vocab-size: {cfg.vocab_size} is past 2^31")
    parts, (limit, where) = step_bytes(cfg, run), device_memory(run)
    need = sum(parts.values())
    if need > (1 - MARGIN) * limit:
        largest = max(parts, key=parts.get)
        flag = {"activations": "--micro-batch", "logits": "--micro-batch", "token ids": "--global-batch"}.get(largest,
                                                                                                            "--model")
        shown = ", ".join(f"{k} {v / 1e9:.3g}" for k, v in parts.items())
        raise UsageError(f"{flag}: a step needs about {need / 1e9:.3g} GB per rank ({shown}), more than "
                         f"{1 - MARGIN:.0%} of the {limit / 1e9:.3g} GB of {where}; shard the model (--dp-mode fsdp, "
                         f"--tp, --pp), checkpoint (--ckpt), or shrink --micro-batch")


def data_identity(meta_path):
    """What a resume compares to know it reads the same data: a hash of the data folder's meta.json."""
    return hashlib.sha256(Path(meta_path).read_bytes()).hexdigest()[:16]


# ---------------------------------------------------------------- the peak that MFU divides by

def peak_flops(run, cfg):
    """Per-device peak FLOP/s and where it came from: --peak-tflops, or the table by the GPU's full name. A CPU has no
    honest peak (a measured matmul rate moved 70x between runs on shared cores): MFU is shown only with
    --peak-tflops there."""
    if run.peak_tflops:
        return run.peak_tflops * 1e12, "--peak-tflops"
    if run.backend == "nccl":
        name = torch.cuda.get_device_name(run.device)
        if name in PEAK_TFLOPS:
            return PEAK_TFLOPS[name] * 1e12, f"{name} bf16 dense peak"
        return 0.0, f"{name} is not in the peak table; pass --peak-tflops"
    return 0.0, "no peak for a CPU: pass --peak-tflops for MFU"
