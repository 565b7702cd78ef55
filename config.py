"""The run's configuration, resolved once, before a process group forms or a file is written.

    run = resolve(argv)                  # flags, launcher, device: one frozen Run
    spec = model_for(run, data_folder)   # the model it trains, checked against every constraint

Bad input is one UsageError or LayoutError line (exit status 2).
"""
import argparse
import hashlib
import math
import os
import tempfile
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Optional

import torch

import model
from data.hf import init_from
from data.loader import data_identity, read_meta
from data.run import holds_a_run
from parallel import ckpt, cp, fp8, memory, pp, tp
from parallel.cp import MODES as CP_MODES
from parallel.mesh import LayoutError, infer_dp
from parallel.pp_schedule import SCHEDULES, SPLIT_BACKWARD

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16,
          "fp8": torch.bfloat16}  # fp8: bf16 autocast, and the block matmuls in fp8 (fp8.py)
DP_MODES = ("ddp", "fsdp", "hsdp")


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
seconds = typed("number of seconds in [0.001, 10^6]", float,
                lambda v: math.isfinite(v) and 1e-3 <= v <= 1e6)  # the process group's ms, in range


def one_of(choices, what):
    """A type that accepts one of `choices` and otherwise says which exist."""
    def check(text):
        if text not in choices:
            raise argparse.ArgumentTypeError(f"unknown {what} {text!r}; "
                                             f"choose from {', '.join(choices)}")
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
        message = f"expected comma-separated layer counts, got {text!r}"
        raise argparse.ArgumentTypeError(message) from None
    if min(counts) < 1:
        raise argparse.ArgumentTypeError(f"every stage needs at least one layer, got {text}")
    return counts


# ---------------------------------------------------------------- the flags

def parse_args(argv=None):
    p = OneLineParser(description="Train a Llama-style GPT on any (dp x pp x cp x tp) layout.",
                      epilog="Before you launch, rehearse: add --dry-run --world N to the command "
                             "(train.py --dry-run --help).",
                      formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    g = p.add_argument_group("model").add_argument
    g("--model", default="tiny", type=one_of(model.PRESETS, "preset"),
      help=f"preset: {', '.join(model.PRESETS)}")
    for name in ("n-layer", "d-model", "n-head", "n-kv-head", "ffn-dim", "vocab-size", "seq-len"):
        g(f"--{name}", type=positive_int, help="override the preset's field")
    g("--dropout", type=probability, default=0.0, help="residual dropout (off by default)")

    g = p.add_argument_group("data and batch").add_argument
    g("--data", help="folder of token shards (default: the pystdlib corpus, prepared on first use)")
    g("--global-batch", type=positive_int, default=32,
      help="sequences per optimizer step, all ranks")
    g("--micro-batch", type=positive_int, default=8,
      help="sequences per forward per dp rank; accumulation steps M = B / (b*dp)")

    g = p.add_argument_group("optimization").add_argument
    g("--steps", type=positive_int, default=100, help="optimizer steps")
    g("--lr", type=nonnegative_float, default=3e-3,
      help="peak learning rate (0: measure, or check an import)")
    g("--min-lr", type=nonnegative_float, default=3e-4,
      help="learning rate at the end of the cosine")
    g("--warmup", type=nonnegative_int, default=20, help="linear warmup steps")
    g("--schedule", default="cosine", type=one_of(("cosine", "wsd"), "schedule"),
      help="after the warmup: cosine to --min-lr | wsd (warmup-stable-decay: --lr until the last "
           "--warmdown steps, then linear to --min-lr)")
    g("--warmdown", type=positive_int, help="steps of wsd's linear decay at the end of the run")
    g("--weight-decay", type=nonnegative_float, default=0.1)
    g("--grad-clip", type=nonnegative_float, default=1.0,
      help="clip the global gradient norm (0: off)")
    g("--seed", type=seed_int, default=1337, help="seeds the weights and the batches")

    g = p.add_argument_group("precision").add_argument
    g("--dtype", type=one_of(DTYPES, "dtype"),
      help="compute precision: fp32 | bf16 | fp16 (loss scaling) | fp8 (bf16, block matmuls "
           "in fp8); "
           "default bf16 on CUDA, fp32 on CPU")
    g("--tf32", action=argparse.BooleanOptionalAction,
      help="TF32 for matmuls that stay fp32 (default: on with bf16, fp16, fp8 on CUDA; off for "
           "fp32)")
    g("--reduce-dtype", type=one_of(("fp32", "bf16"), "dtype"),
      help="FSDP gradient reduce-scatter dtype: fp32 | bf16 (default fp32)")
    g("--fp8-all-gather", action="store_true",
      help="FSDP/HSDP gather block weights in fp8 (--dtype fp8)")

    g = p.add_argument_group("layout").add_argument
    g("--dp", type=positive_int, help="data parallel degree (default: world / (tp*pp*cp))")
    g("--dp-mode", default="ddp", type=one_of(DP_MODES, "mode"), help=" | ".join(DP_MODES))
    g("--dp-shard", type=positive_int, help="HSDP shard-group size (ranks that shard one replica)")
    g("--accumulate", type=one_of(("sharded", "unsharded"), "mode"),
      help="FSDP/HSDP micro-batch gradients: sharded (a reduce-scatter per micro-batch; the "
           "default) | "
           "unsharded (summed locally, one reduce-scatter per step, 4P bytes more)")
    g("--tp", type=positive_int, default=1, help="tensor parallel degree")
    g("--sp", action="store_true", help="sequence parallel (with --tp)")
    g("--sp-ring", action="store_true",
      help="--sp's collectives as ring hops under the matmuls (tp_ring.py; not yet measured on "
           "GPUs)")
    g("--pp", type=positive_int, default=1, help="pipeline parallel degree")
    g("--pp-schedule", type=one_of(SCHEDULES, "schedule"),
      help=f"{' | '.join(SCHEDULES)} (default 1f1b)")
    g("--pp-virtual", type=positive_int, default=1,
      help="model chunks per pipeline rank (interleaved)")
    g("--pp-split", type=layer_split, help="explicit layers per stage, e.g. 3,5")
    g("--cp", type=positive_int, default=1, help="context parallel degree")
    g("--cp-mode", type=one_of(CP_MODES, "mode"), help=f"{' | '.join(CP_MODES)} (default ring)")
    g("--ckpt", default="none", type=recompute_policy,
      help=f"activation checkpointing: recompute activations in backward: {ckpt.POLICIES}")
    g("--bucket-mb", type=nonnegative_float, default=25.0, help="DDP gradient bucket size in MB")
    g("--no-overlap", action="store_true",
      help="no communication overlap (ablation): dp gradient sync after backward, tp collectives "
           "blocking")

    g = p.add_argument_group("device").add_argument
    g("--device", type=one_of(("cpu", "cuda"), "device"),
      help="cpu | cuda (default: cuda if available)")
    g("--compile", action=argparse.BooleanOptionalAction,
      help="torch.compile each transformer block (default: on for cuda, off for cpu)")
    g("--peak-tflops", type=positive_float, help="device peak for MFU (default: the device table)")
    g("--timeout", type=seconds, default=600.0,
      help="seconds a collective may wait once the first steps are done (a hung rank stops the "
           "job)")
    g("--startup-timeout", type=seconds, default=3600.0,
      help="seconds a collective may wait during set-up, the first two steps and the first "
           "evaluation")

    g = p.add_argument_group("outputs").add_argument
    g("--out",
      help="run folder: saves, metrics, trace (default: runs/ and a name made of the flags that "
      "differ from their defaults; a new one for a fresh run, the newest of that name for "
      "--resume)")
    g("--save-every", type=nonnegative_int, default=0,
      help="save every N steps (0: only at the end)")
    g("--resume", nargs="?", const="latest", choices=["latest", "auto"],
      help="continue from the newest complete save in --out, in any layout (error if none); "
           "--resume auto: start fresh if there is none (for torchrun --max-restarts)")
    g("--init-from", metavar="DIR",
      help="start from a Hugging Face Llama folder (config.json + safetensors) "
      "at step 0 with a fresh optimizer; the shape flags must match config.json")
    g("--keep", type=nonnegative_int, default=2, help="complete saves to keep (0: all)")
    g("--async-save", action="store_true",
      help="snapshot to CPU memory, write from a background thread")
    g("--eval-every", type=nonnegative_int, default=0, help="val loss every N steps (0: off)")
    g("--eval-batches", type=positive_int, help="global batches per evaluation (default 4)")
    g("--eval-tokens", type=positive_int,
      help="evaluate on exactly the first N tokens of the val split, the same slice every time "
           "(N a multiple of global-batch x seq-len)")
    g("--target-loss", type=positive_float,
      help="the summary names the step, tokens and time at which the val loss first reached it")
    g("--log-every", type=nonnegative_int, default=10,
      help="print a console line every N steps (0: off)")
    g("--metrics",
      help="append a JSON line per step, and the run's summary at the end, to this file "
      "(rank 0; default OUT/metrics.jsonl)")
    g("--profile", action="store_true",
      help="write a torch.profiler Chrome trace of steps 3-5 to --out")
    args = p.parse_args(argv)
    check_args(args)
    return args


def check_args(args):
    """The checks that involve more than one flag, or the machine; each names the flag at fault."""
    for problem, flag, needs in (
            (args.sp and args.tp == 1, "--sp",
             "--tp > 1: it shards the tensor-parallel region along the sequence"),
            (args.sp_ring and not args.sp, "--sp-ring", "--sp"),
            (args.sp_ring and args.no_overlap, "--sp-ring",
             "communication overlap (drop --no-overlap)"),
            (args.dp_shard and args.dp_mode != "hsdp", "--dp-shard", "--dp-mode hsdp"),
            (args.reduce_dtype and args.dp_mode == "ddp", "--reduce-dtype",
             "--dp-mode fsdp or hsdp"),
            (args.accumulate and args.dp_mode == "ddp", "--accumulate", "--dp-mode fsdp or hsdp"),
            (args.fp8_all_gather and (args.dtype != "fp8" or args.dp_mode == "ddp"),
             "--fp8-all-gather", "--dtype fp8 and --dp-mode fsdp or hsdp"),
            ((args.pp_split or args.pp_virtual != 1 or args.pp_schedule) and args.pp == 1,
             "--pp-split/--pp-virtual/--pp-schedule", "--pp > 1"),
            (args.pp_virtual > 1 and args.pp_schedule != "interleaved", "--pp-virtual",
             "--pp-schedule interleaved"),
            (args.cp_mode and args.cp == 1, "--cp-mode", "--cp > 1"),
            (args.warmdown and args.schedule != "wsd", "--warmdown", "--schedule wsd"),
            (args.target_loss and not args.eval_every, "--target-loss", "--eval-every"),
            (args.eval_tokens and not args.eval_every, "--eval-tokens", "--eval-every"),
            (args.eval_tokens and args.eval_batches, "--eval-batches",
             "random windows (--eval-tokens sets the batches)")):
        if problem:  # a flag that would silently do nothing in this layout
            raise UsageError(f"{flag}: has no effect without {needs}")
    if args.dp_mode == "hsdp" and not args.dp_shard:
        raise UsageError("--dp-shard: hsdp needs the shard-group size")
    if args.schedule == "wsd" and not args.warmdown:
        raise UsageError("--warmdown: --schedule wsd needs the length of its decay, in steps")
    if args.warmdown and args.warmdown > args.steps:
        raise UsageError(f"--warmdown: {args.warmdown} is more than --steps {args.steps}")
    if args.device == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device: cuda requested but no GPU is visible")
    if args.dtype == "fp8" and args.pp_schedule in SPLIT_BACKWARD:
        raise UsageError("--pp-schedule: zb1 and zbv defer the weight gradients of plain matmuls; "
                         "not with --dtype fp8")
    if args.sp_ring and (args.dtype == "fp8" or args.pp_schedule in SPLIT_BACKWARD):
        raise UsageError("--sp-ring: not with --dtype fp8 or the zero-bubble schedules, which run "
                         "tp's plain path")
    if args.dtype == "fp8" and fp8.missing():
        raise UsageError("--dtype: fp8 needs torch._scaled_mm and the float8 dtypes; "
                         f"{fp8.missing()}")


# ---------------------------------------------------------------- the run

@dataclass(frozen=True)
class Run:
    """The run, resolved: every flag with its default made concrete, and what the launcher and the
    machine decide. Frozen: nothing changes it once resolve() returns."""
    # the model (None: the preset's)
    model: str
    n_layer: Optional[int]
    d_model: Optional[int]
    n_head: Optional[int]
    n_kv_head: Optional[int]
    ffn_dim: Optional[int]
    vocab_size: Optional[int]
    seq_len: Optional[int]
    dropout: float
    # data and batch
    data: Optional[str]
    global_batch: int  # B: sequences per step
    micro_batch: int  # b: sequences per forward on one dp rank
    accum_steps: int  # M = B / (b·dp): micro-batches per rank and step, the pipeline's M
    # optimization
    steps: int
    lr: float
    min_lr: float
    warmup: int
    schedule: str  # cosine | wsd
    warmdown: Optional[int]  # wsd: the steps of the final linear decay
    weight_decay: float
    grad_clip: float
    seed: int
    # precision
    dtype: str  # bf16 on CUDA, fp32 on CPU unless given
    tf32: bool  # on CUDA for bf16, fp16 and fp8 unless given; never for fp32 unless given
    reduce_dtype: str
    fp8_all_gather: bool
    # layout
    dp: int  # world / (tp·pp·cp) unless given
    dp_mode: str
    dp_shard: Optional[int]  # hsdp only
    accumulate: str
    tp: int
    sp: bool
    sp_ring: bool
    pp: int
    pp_schedule: str  # 1f1b unless given
    pp_virtual: int
    pp_split: Optional[tuple]
    cp: int
    cp_mode: str  # ring unless given
    ckpt: str
    bucket_mb: float
    overlap: bool  # not --no-overlap
    # device
    device: str  # "cuda:<local rank>" or "cpu"
    backend: str  # nccl or gloo
    compile: bool  # on CUDA unless given
    peak_tflops: Optional[float]
    timeout: float
    startup_timeout: float
    # outputs
    out: str
    save_every: int
    resume: Optional[str]
    init_from: Optional[str]
    keep: int
    async_save: bool
    eval_every: int
    eval_batches: int  # 4 unless given, or --eval-tokens / (B·T)
    eval_tokens: Optional[int]
    target_loss: Optional[float]
    log_every: int
    metrics: str
    profile: bool
    # the launcher: torchrun's RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE (else one process)
    rank: int
    world: int
    local_rank: int
    ranks_here: int
    # the flags that differ from their defaults and change what is trained: the run's name
    flags: dict


def resolve(argv=None, environ=None):
    """The frozen Run of this process: the flags (checked), torchrun's environment, the device."""
    environ = os.environ if environ is None else environ
    args = parse_args(argv)
    for flag, value, what in (("--out", args.out, "a folder"),
                              ("--metrics", args.metrics, "a file")):
        if value == "":
            raise UsageError(f"{flag}: an empty path: name {what}")
    rank, world = int(environ.get("RANK", 0)), int(environ.get("WORLD_SIZE", 1))
    cuda = (args.device or ("cuda" if torch.cuda.is_available() else "cpu")) == "cuda"
    local_rank = int(environ.get("LOCAL_RANK", 0))
    dtype = args.dtype or ("bf16" if cuda else "fp32")
    if cuda and dtype == "fp8" and torch.cuda.get_device_capability(local_rank) < (8, 9):
        raise UsageError("--dtype: fp8 needs FP8 tensor cores (compute capability 8.9+: Ada, "
                         "Hopper); "
                         f"{torch.cuda.get_device_name(local_rank)} is "
                         f"{torch.cuda.get_device_capability(local_rank)}")
    dp = infer_dp(world, args.tp, args.pp, args.cp, args.dp)
    dp_shard = args.dp_shard if args.dp_mode == "hsdp" else None
    if dp_shard and dp % dp_shard:
        raise LayoutError("--dp-shard", f"dp_shard {dp_shard} does not divide dp {dp}")
    flags = given_flags(args)
    out = args.out or str(default_out(args.model, flags, args.resume))
    metrics = args.metrics or str(Path(out) / "metrics.jsonl")
    given = {k: v for k, v in vars(args).items() if k in {f.name for f in fields(Run)}}
    derived = dict(
        accum_steps=accumulation_steps(args.global_batch, args.micro_batch, dp),
        eval_batches=eval_batches(args),
        dtype=dtype, tf32=(cuda and dtype != "fp32") if args.tf32 is None else args.tf32,
        reduce_dtype=args.reduce_dtype or "fp32", dp=dp, dp_shard=dp_shard,
        accumulate=args.accumulate or "sharded", pp_schedule=args.pp_schedule or "1f1b",
        cp_mode=args.cp_mode or "ring", overlap=not args.no_overlap,
        device=f"cuda:{local_rank}" if cuda else "cpu", backend="nccl" if cuda else "gloo",
        compile=cuda if args.compile is None else args.compile, out=out, metrics=metrics,
        rank=rank, world=world, local_rank=local_rank,
        ranks_here=int(environ.get("LOCAL_WORLD_SIZE", 1)), flags=flags)
    run = Run(**{**given, **derived})
    check_writable(run.out, "--out", folder=True)
    check_writable(run.metrics, "--metrics", folder=False)
    return run


NOT_IN_NAME = {"out", "metrics", "resume", "log_every", "profile", "save_every", "keep",
               "async_save", "eval_every", "eval_batches", "eval_tokens", "target_loss", "timeout",
               "startup_timeout", "peak_tflops", "device"}  # they change no number trained


def given_flags(args):
    """{flag: value} of the flags set to other than their defaults that change what is trained (a
    data folder or checkpoint by its name): the run's name, and how compare.py tells runs apart."""
    defaults = vars(parse_args([]))
    return {k.replace("_", "-"): Path(v).name if k in ("data", "init_from") else v
            for k, v in sorted(vars(args).items()) if k not in NOT_IN_NAME and v != defaults[k]}


def default_out(preset, flags, resume, root=Path("runs")):
    """runs/NAME: the preset and the given flags (hashed past 120 characters). A fresh run takes the
    first of NAME, NAME-2, NAME-3, ... that holds no run; --resume the newest that exists."""
    shown = [f"{k}={','.join(map(str, v)) if isinstance(v, tuple) else v}" for k, v in flags.items()
             if k != "model"]
    name = "-".join([preset] + shown).replace("/", "_")
    if len(name) > 120:
        name = f"{name[:100]}-{hashlib.sha256(name.encode()).hexdigest()[:12]}"
    names = [root / name] + [root / f"{name}-{i}" for i in range(2, 10_000)]
    if resume:
        existing = names[:next(i for i, p in enumerate(names) if not p.exists())]
        return existing[-1] if existing else names[0]
    for path in names:
        if not path.exists() or not holds_a_run(path):
            return path
    raise UsageError(f"--out: {root / name} and 9,999 more of that name hold runs; choose --out")


def check_writable(path, flag, folder):
    """path (a folder, or a file, to be) can be created: it is not the other kind, nothing on its
    way is a file, and the nearest existing folder takes a new file (probed, then removed)."""
    path = Path(path)
    try:
        if path.exists() and path.is_dir() != folder:
            raise UsageError(f"{flag}: {path} is a {'file' if folder else 'folder'}")
        parent = path if folder else path.parent
        while not parent.exists():
            parent = parent.parent
    except OSError as e:  # a name too long for the file system
        raise UsageError(f"{flag}: {path}: {e.strerror or e}") from None
    if not parent.is_dir():
        raise UsageError(f"{flag}: {parent} is a file, so {path} cannot be created")
    try:
        with tempfile.NamedTemporaryFile(dir=parent, prefix=".write_probe_"):
            pass
    except OSError as e:
        raise UsageError(f"{flag}: cannot write in {parent}: {e.strerror or e}") from None


def eval_batches(args):
    """Global batches per evaluation: --eval-batches (4), or --eval-tokens / (B·T), checked."""
    if not args.eval_tokens:
        return args.eval_batches or 4
    per_batch = args.global_batch * (args.seq_len or model.PRESETS[args.model].seq_len)
    if args.eval_tokens % per_batch:
        raise UsageError(f"--eval-tokens: {args.eval_tokens:,} is not a multiple of global-batch x "
                         f"seq-len = {per_batch:,}")
    return args.eval_tokens // per_batch


def accumulation_steps(global_batch, micro_batch, dp):
    """M = B / (b·dp); the one place the batch sizes are checked together."""
    if global_batch % (micro_batch * dp):
        raise UsageError(f"--global-batch: {global_batch} is not divisible by micro-batch x dp = "
                         f"{micro_batch} x {dp}")
    return global_batch // (micro_batch * dp)


# ---------------------------------------------------------------- the model, with the data

@dataclass(frozen=True)
class Model:
    """What the run trains: the config (flags, the data's vocabulary, --init-from's config.json) and
    the Hugging Face weights to start from (None: the seeded init). A save records `config`, which
    must match on --resume (model, data, tokenizer, optimization), and `layout`, which need not."""
    cfg: model.ModelConfig
    weights: object
    config: dict
    layout: dict


def model_for(run, data_folder):
    """The Model of a run on a prepared data folder, checked: the shape, every parallelism's
    constraints on it, fp8's dimensions, and that a step fits the device."""
    meta = read_meta(data_folder)
    cfg, weights = init_from(run.init_from, model_config(run, meta["vocab_size"]), run)
    check_layout(cfg, run)
    check_fits(cfg, run)
    train = ("global_batch", "lr", "min_lr", "warmup", "weight_decay", "grad_clip", "seed", "dtype",
             "steps")
    config = {"model": dict(cfg.__dict__), "data": data_identity(data_folder),
              "train": {**{k: getattr(run, k) for k in train},  # cosine: as before wsd existed
                        **({"warmdown": run.warmdown} if run.schedule == "wsd" else {})},
              "tokenizer": meta["tokenizer"],
              **{k: meta[k] for k in ("tokenizer_file",) if k in meta}}
    layout = {"world": run.world, "dp": run.dp, "pp": run.pp, "cp": run.cp, "tp": run.tp,
              "dp_mode": run.dp_mode, "dp_shard": run.dp_shard or run.dp, "sp": run.sp,
              "pp_schedule": run.pp_schedule, "pp_virtual": run.pp_virtual,
              "pp_split": ",".join(map(str, run.pp_split)) if run.pp_split else None,
              "cp_mode": run.cp_mode}
    return Model(cfg, weights, config, layout)


def model_config(run, vocab_size):
    """The ModelConfig of the preset, the shape flags and the data's vocabulary, checked."""
    base = model.PRESETS[run.model]
    names = ("n_layer", "d_model", "n_head", "n_kv_head", "ffn_dim", "vocab_size", "seq_len")
    overrides = {f: getattr(run, f) for f in names if getattr(run, f) is not None}
    values = {**base.__dict__, "dropout": run.dropout, **overrides}
    if not values["vocab_size"]:
        values["vocab_size"] = vocab_size
    if values["vocab_size"] < vocab_size:
        raise UsageError(f"--vocab-size: {values['vocab_size']} is below the data's vocabulary of "
                         f"{vocab_size}")
    cfg = model.ModelConfig(**values)
    tokens = run.micro_batch * cfg.seq_len // run.cp
    problem = cfg.validate() or (run.dtype == "fp8" and fp8.misfit(cfg, run.tp, tokens))
    if problem:
        raise UsageError(f"{problem[0]}: {problem[1]}")
    return cfg


def check_layout(cfg, run):
    """Every parallelism's constraints on this model, through its own check."""
    if run.tp > 1:
        tp.validate(cfg, run.tp, run.cp, run.sp)
    if run.cp > 1:
        cp.validate(cfg, run.cp, run.tp, run.cp_mode)
    if run.pp > 1:
        pp.layer_counts(cfg, run.pp, run.pp_virtual, run.accum_steps, run.pp_split, run.pp_schedule)


def check_fits(cfg, run):
    """Refuses a run whose step would not fit the device's memory less the margin, naming the
    largest part and the flag that moves it."""
    if cfg.vocab_size >= 2 ** 31:
        raise UsageError(f"--vocab-size: {cfg.vocab_size} is past 2^31")
    parts, (limit, where) = memory.step_bytes(cfg, run), memory.device_memory(run)
    need = sum(parts.values())
    if need > (1 - memory.MARGIN) * limit:
        largest = max(parts, key=parts.get)
        flag = {"activations": "--micro-batch", "logits": "--micro-batch",
                "token ids": "--global-batch"}.get(largest, "--model")
        shown = ", ".join(f"{k} {v / 1e9:.3g}" for k, v in parts.items())
        raise UsageError(f"{flag}: a step needs about {need / 1e9:.3g} GB per rank ({shown}), more "
                         f"than {1 - memory.MARGIN:.0%} of the {limit / 1e9:.3g} GB of {where}; "
                         "shard the model (--dp-mode fsdp, --tp, --pp), checkpoint (--ckpt), or "
                         "shrink --micro-batch")


