"""The run's configuration: each flag declared once, as a field of Run, resolved once, checked once.

    run = resolve(argv)   # flags, launcher, device: one frozen Run

A field made with flag() is a command-line flag, its default, help and type there: the parser is
built from the fields. Bad input is one UsageError or LayoutError line (exit status 2).
"""
import argparse
import math
import os
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Optional

import torch

import model
from data import OneLineParser, UsageError  # noqa: F401  (every command's)
from data.files import check_writable
from data.run import default_out
from parallel import ckpt, fp8
from parallel.cp import MODES as CP_MODES
from parallel.mesh import LayoutError, infer_dp, launcher
from parallel.pp_schedule import SCHEDULES, SPLIT_BACKWARD

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16,
          "fp8": torch.bfloat16}  # fp8: bf16 autocast, and the block matmuls in fp8 (fp8.py)
DP_MODES = ("ddp", "fsdp", "hsdp")


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


def flag(default, help, type=None, group=None, name=True, **options):
    """A Run field that is a flag. name=False: it changes no number trained, so not the name."""
    help += "%(default).0s" * ("default" in help or default is None)  # argparse's said, or none
    return field(default=default, metadata=dict(help=help, type=type, group=group, name=name,
                                                options=options))


ON, YES_NO = dict(action="store_true"), dict(action=argparse.BooleanOptionalAction)


# ---------------------------------------------------------------- the flags, and the run

@dataclass(frozen=True)
class Run:
    """The run, resolved: every flag with its default made concrete (None: decided by resolve),
    and what the launcher and the machine decide. Frozen once resolve() returns."""
    model: str = flag("tiny", ", ".join(model.PRESETS), one_of(model.PRESETS, "preset"), "model")
    n_layer: Optional[int] = flag(None, "override the preset's field", positive_int)
    d_model: Optional[int] = flag(None, "override the preset's field", positive_int)
    n_head: Optional[int] = flag(None, "override the preset's field", positive_int)
    n_kv_head: Optional[int] = flag(None, "override the preset's field", positive_int)
    ffn_dim: Optional[int] = flag(None, "override the preset's field", positive_int)
    vocab_size: Optional[int] = flag(None, "override the preset's field", positive_int)
    seq_len: Optional[int] = flag(None, "override the preset's field", positive_int)
    dropout: float = flag(0.0, "residual dropout (off by default)", probability)
    data: Optional[str] = flag(None, "folder of token shards (default: the pystdlib corpus)",
                               group="data and batch")
    global_batch: int = flag(32, "sequences per optimizer step, all ranks", positive_int)
    micro_batch: int = flag(8, "sequences per forward per dp rank; M = B / (b*dp)", positive_int)
    steps: int = flag(100, "optimizer steps", positive_int, "optimization")
    lr: float = flag(3e-3, "peak learning rate (0: measure, or check an import)", nonnegative_float)
    min_lr: float = flag(3e-4, "learning rate at the end of the decay", nonnegative_float)
    warmup: int = flag(20, "linear warmup steps", nonnegative_int)
    schedule: str = flag("cosine", "after the warmup: cosine | wsd (stable, then --warmdown)",
                         one_of(("cosine", "wsd"), "schedule"))
    warmdown: Optional[int] = flag(None, "steps of wsd's final linear decay", positive_int)
    weight_decay: float = flag(0.1, "AdamW's decay of the matrices", nonnegative_float)
    grad_clip: float = flag(1.0, "clip the global gradient norm (0: off)", nonnegative_float)
    seed: int = flag(1337, "seeds the weights and the batches", seed_int)
    dtype: str = flag(None, "fp32 | bf16 | fp16 (loss scaling) | fp8 (block matmuls); default "
                      "bf16 on CUDA, fp32 on CPU", one_of(DTYPES, "dtype"), "precision")
    tf32: bool = flag(None, "TF32 for fp32 matmuls (default: on CUDA, not for fp32)", **YES_NO)
    reduce_dtype: str = flag(None, "FSDP's reduce-scatter: fp32 (default) | bf16",
                             one_of(("fp32", "bf16"), "dtype"))
    fp8_all_gather: bool = flag(False, "FSDP/HSDP gather in fp8", **ON)
    dp: int = flag(None, "data parallel degree (default: world / (tp*pp*cp))", positive_int,
                   "layout")
    dp_mode: str = flag("ddp", " | ".join(DP_MODES), one_of(DP_MODES, "mode"))
    dp_shard: Optional[int] = flag(None, "HSDP's ranks that shard one replica", positive_int)
    accumulate: str = flag(None, "FSDP/HSDP micro-batch gradients: sharded (default) | unsharded "
                           "(one reduce-scatter a step)", one_of(("sharded", "unsharded"), "mode"))
    tp: int = flag(1, "tensor parallel degree", positive_int)
    sp: bool = flag(False, "sequence parallel (with --tp)", **ON)
    sp_ring: bool = flag(False, "--sp's collectives as ring hops under the matmuls", **ON)
    pp: int = flag(1, "pipeline parallel degree", positive_int)
    pp_schedule: str = flag(None, f"{' | '.join(SCHEDULES)} (default 1f1b)",
                            one_of(SCHEDULES, "schedule"))
    pp_virtual: int = flag(1, "model chunks per pipeline rank (interleaved)", positive_int)
    pp_split: Optional[tuple] = flag(None, "explicit layers per stage, e.g. 3,5", layer_split)
    cp: int = flag(1, "context parallel degree", positive_int)
    cp_mode: str = flag(None, f"{' | '.join(CP_MODES)} (default ring)", one_of(CP_MODES, "mode"))
    ckpt: str = flag("none", f"activation checkpointing: {ckpt.POLICIES}", recompute_policy)
    bucket_mb: float = flag(25.0, "DDP gradient bucket size in MB", nonnegative_float)
    no_overlap: bool = flag(False, "ablation: no dp or tp communication overlap", **ON)
    device: str = flag(None, "cpu | cuda (default: cuda if available)",
                       one_of(("cpu", "cuda"), "device"), "device", name=False)
    compile: bool = flag(None, "torch.compile the blocks (default: on CUDA)", **YES_NO)
    peak_tflops: Optional[float] = flag(None, "MFU's peak (default: the device table)",
                                        positive_float, name=False)
    timeout: float = flag(600.0, "seconds a collective may wait after the first steps", seconds,
                          name=False)
    startup_timeout: float = flag(3600.0, "seconds it may wait before", seconds, name=False)
    out: str = flag(None, "run folder (default: runs/NAME, NAME from the flags given)",
                    group="outputs", name=False)
    save_every: int = flag(0, "save every N steps (0: only at the end)", nonnegative_int,
                           name=False)
    resume: Optional[str] = flag(None, "go on from --out's newest save, in any layout (error if "
                                 "none); auto: else start fresh", name=False, nargs="?",
                                 const="latest", choices=["latest", "auto"])
    init_from: Optional[str] = flag(None, "start from a Hugging Face Llama folder at step 0",
                                    metavar="DIR")
    keep: int = flag(2, "complete saves to keep (0: all)", nonnegative_int, name=False)
    async_save: bool = flag(False, "write saves from a background thread", name=False, **ON)
    eval_every: int = flag(0, "val loss every N steps (0: off)", nonnegative_int, name=False)
    eval_batches: int = flag(None, "global batches per evaluation (default 4)", positive_int,
                             name=False)
    eval_tokens: Optional[int] = flag(None, "evaluate on the first N tokens of the val split",
                                      positive_int, name=False)
    target_loss: Optional[float] = flag(None, "the summary says when val loss first reached it",
                                        positive_float, name=False)
    log_every: int = flag(10, "print a console line every N steps (0: off)", nonnegative_int,
                          name=False)
    metrics: str = flag(None, "a JSON line per step, then the summary (default OUT/metrics.jsonl)",
                        name=False)
    profile: bool = flag(False, "a Chrome trace of steps 3-5 into --out", name=False, **ON)
    # what resolve() derives: from the batch, the flags, and torchrun's environment
    accum_steps: int = None  # M = B / (b·dp): micro-batches per rank and step, the pipeline's M
    overlap: bool = None  # not --no-overlap
    backend: str = None  # nccl or gloo
    rank: int = 0  # RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE (else one process)
    world: int = 1
    local_rank: int = 0
    ranks_here: int = 1
    flags: dict = None  # the flags set to other than their defaults that change what is trained


FLAGS = [f for f in fields(Run) if "help" in f.metadata]


def parse_args(argv=None):
    """The argparse namespace of a command line, its flags checked together."""
    p = OneLineParser(description="Train a Llama-style GPT on any (dp x pp x cp x tp) layout.",
                      epilog="Before you launch, rehearse: add --dry-run --world N to the command "
                             "(train.py --dry-run --help).",
                      formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    group = p
    for f in FLAGS:
        meta, options = f.metadata, dict(f.metadata["options"], default=f.default)
        if meta["group"]:
            group = p.add_argument_group(meta["group"])
        if meta["type"]:
            options["type"] = meta["type"]
        group.add_argument(f"--{f.name.replace('_', '-')}", help=meta["help"], **options)
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
    wd, w, steps, wsd = args.warmdown, args.warmup, args.steps, args.schedule == "wsd"
    split = args.pp_schedule in SPLIT_BACKWARD
    for problem, message in [
        (args.dp_mode == "hsdp" and not args.dp_shard, "--dp-shard: hsdp needs its group's size"),
        (wsd and not wd, "--warmdown: --schedule wsd needs the length of its decay, in steps"),
        (wd and wd > steps, f"--warmdown: {wd} is more than --steps {steps}"),
        (wd and w + wd > steps, f"--warmdown: its {wd} steps overlap --warmup's {w} in {steps}"),
        (args.min_lr > args.lr, f"--min-lr: {args.min_lr:g} is above --lr {args.lr:g}"),
        (args.device == "cuda" and not torch.cuda.is_available(),
         "--device: cuda requested but no GPU is visible"),
        (args.dtype == "fp8" and split, "--pp-schedule: zb1 and zbv defer the weight gradients of "
         "plain matmuls; not with --dtype fp8"),
        (args.sp_ring and (args.dtype == "fp8" or split), "--sp-ring: not with --dtype fp8 or the "
         "zero-bubble schedules, which run tp's plain path"),
        (args.dtype == "fp8" and fp8.missing(),
         f"--dtype: fp8 needs torch._scaled_mm and the float8 dtypes; {fp8.missing()}")]:
        if problem:
            raise UsageError(message)


def resolve(argv=None, environ=None):
    """The frozen Run of this process: the flags (checked), torchrun's environment, the device."""
    environ = os.environ if environ is None else environ
    args = parse_args(argv)
    for flag, value, what in (("--out", args.out, "a folder"),
                              ("--metrics", args.metrics, "a file")):
        if value == "":
            raise UsageError(f"{flag}: an empty path: name {what}")
    rank, world, local_rank, ranks_here = launcher(environ)
    cuda = (args.device or ("cuda" if torch.cuda.is_available() else "cpu")) == "cuda"
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
    out = args.out or str(default_out(args.model, flags, args.resume, world))
    metrics = args.metrics or str(Path(out) / "metrics.jsonl")
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
        ranks_here=ranks_here, flags=flags)
    run = Run(**{**vars(args), **derived})
    check_writable(run.out, "--out", folder=True)
    check_writable(run.metrics, "--metrics", folder=False)
    return run


def given_flags(args):
    """{flag: value} of the flags set to other than their defaults that change what is trained (a
    data folder or checkpoint by its name): the run's name, and how compare.py tells runs apart."""
    named = {f.name: f.default for f in FLAGS if f.metadata["name"]}
    return {k.replace("_", "-"): Path(v).name if k in ("data", "init_from") else v
            for k, v in sorted(vars(args).items()) if k in named and v != named[k]}


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
