"""The run's configuration: the command line of train.py, its validation, the model config it implies,
and the peak FLOP/s that MFU divides by. Every bad flag becomes one UsageError line (exit status 2)."""
import argparse
import hashlib
import math
import os
import tempfile
import time
from pathlib import Path

import torch

import fp8
import model as M
from parallel import ckpt
from parallel.cp import MODES as CP_MODES
from parallel.mesh import LayoutError, infer_dp
from parallel.pp_schedule import SCHEDULES

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


def parse_args(argv=None):
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
    a("--lr", type=positive_float, default=3e-3, help="peak learning rate")
    a("--min-lr", type=nonnegative_float, default=3e-4, help="learning rate at the end of the cosine decay")
    a("--warmup", type=nonnegative_int, default=20, help="linear warmup steps")
    a("--weight-decay", type=nonnegative_float, default=0.1)
    a("--grad-clip", type=nonnegative_float, default=1.0, help="clip the global gradient norm (0: off)")
    a("--seed", type=int, default=1337, help="seeds the weights and the batches")
    a("--dtype", type=one_of(DTYPES, "dtype"),
      help="compute precision: fp32 | bf16 | fp16 (fp16 uses loss scaling) | fp8 (bf16, block matmuls in fp8)")
    a("--dp", type=positive_int, help="data parallel degree (default: world / (tp*pp*cp))")
    a("--dp-mode", default="ddp", type=one_of(DP_MODES, "mode"), help=" | ".join(DP_MODES))
    a("--dp-shard", type=positive_int, help="HSDP shard-group size (ranks that shard one replica)")
    a("--reduce-dtype", default="fp32", type=one_of(("fp32", "bf16"), "dtype"),
      help="FSDP gradient reduce-scatter dtype: fp32 | bf16")
    a("--accumulate", default="sharded", type=one_of(("sharded", "unsharded"), "mode"),
      help="FSDP/HSDP micro-batch gradients: sharded (a reduce-scatter per micro-batch, 4P/M bytes held) | "
           "unsharded (summed locally, one reduce-scatter per step, 4P bytes held)")
    a("--fp8-all-gather", action="store_true", help="FSDP/HSDP all-gather the block weights in fp8 (--dtype fp8)")
    a("--tp", type=positive_int, default=1, help="tensor parallel degree")
    a("--sp", action="store_true", help="sequence parallel (with --tp)")
    a("--pp", type=positive_int, default=1, help="pipeline parallel degree")
    a("--pp-schedule", default="1f1b", type=one_of(SCHEDULES, "schedule"), help=" | ".join(SCHEDULES))
    a("--pp-virtual", type=positive_int, default=1, help="model chunks per pipeline rank (interleaved)")
    a("--pp-split", type=layer_split, help="explicit layers per stage, e.g. 3,5")
    a("--cp", type=positive_int, default=1, help="context parallel degree")
    a("--cp-mode", default="ring", type=one_of(CP_MODES, "mode"), help=" | ".join(CP_MODES))
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
    a("--out", default="out", help="run folder: saves, metrics, trace")
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
    a("--metrics", help="append one JSON line per step to this file (rank 0)")
    a("--profile", action="store_true", help="write a torch.profiler Chrome trace of steps 2-4 to --out")
    args = p.parse_args(argv)
    check_args(args)
    return args


def check_args(args):
    """The checks that involve more than one flag, or the machine; each names the flag at fault."""
    for problem, flag, needs in (
            (args.sp and args.tp == 1, "--sp", "--tp > 1: it shards the tensor-parallel region along the sequence"),
            (args.dp_shard and args.dp_mode != "hsdp", "--dp-shard", "--dp-mode hsdp"),
            (args.reduce_dtype != "fp32" and args.dp_mode == "ddp", "--reduce-dtype", "--dp-mode fsdp or hsdp"),
            (args.accumulate != "sharded" and args.dp_mode == "ddp", "--accumulate", "--dp-mode fsdp or hsdp"),
            (args.fp8_all_gather and (args.dtype != "fp8" or args.dp_mode == "ddp"), "--fp8-all-gather",
             "--dtype fp8 and --dp-mode fsdp or hsdp"),
            ((args.pp_split or args.pp_virtual != 1) and args.pp == 1, "--pp-split/--pp-virtual", "--pp > 1"),
            (args.pp_virtual > 1 and args.pp_schedule != "interleaved", "--pp-virtual",
             "--pp-schedule interleaved")):
        if problem:  # a flag that would silently do nothing in this layout
            raise UsageError(f"{flag}: has no effect without {needs}")
    if args.dp_mode == "hsdp" and not args.dp_shard:
        raise UsageError("--dp-shard: hsdp needs the shard-group size")
    if args.device == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device: cuda requested but no GPU is visible")
    if args.dtype == "fp8" and args.pp > 1 and args.pp_schedule in ("zb1", "zbv"):
        raise UsageError("--pp-schedule: zb1 and zbv defer the weight gradients of plain matmuls; not with --dtype fp8")
    if args.dtype == "fp8" and fp8.missing():
        raise UsageError(f"--dtype: fp8 needs torch._scaled_mm and the float8 dtypes; {fp8.missing()}")


def check_layout(args, world):
    """The layout from the flags and the world size alone, before any process group forms: every rank finds the
    same error and exits 2 on its own. Returns (dp, micro-batches per step)."""
    dp = infer_dp(world, args.tp, args.pp, args.cp, args.dp)
    if args.dp_shard and dp % args.dp_shard:
        raise LayoutError("--dp-shard", f"dp_shard {args.dp_shard} does not divide dp {dp}")
    return dp, accumulation_steps(args.global_batch, args.micro_batch, dp)


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


def check_fits(cfg, args, dp, device):
    """Refuses a run whose model state alone cannot fit on one device, before anything is built: parameters,
    gradients and Adam's two moments (16 bytes per parameter) split over tp·pp and, when sharded, over the
    data-parallel shard group, against the device's memory (on CPU, the machine's RAM over the ranks on it).
    Also one (tokens, d) activation of a micro-batch, and the step's token ids. Each is a lower bound of what the
    run needs, so a run that fits is never refused."""
    if cfg.vocab_size >= 2 ** 31:
        raise UsageError(f"--vocab-size: {cfg.vocab_size} is past 2^31")
    shards = args.tp * args.pp * {"ddp": 1, "fsdp": dp * args.cp, "hsdp": (args.dp_shard or 1) * args.cp}[args.dp_mode]
    state = 16 * M.param_counts(cfg)[0] / shards
    activation = 2 * args.micro_batch * cfg.seq_len * cfg.d_model / (args.cp * (args.tp if args.sp else 1))
    batch = 16 * args.global_batch / dp * cfg.seq_len + 8 * args.global_batch  # int64 inputs and targets, offsets
    if device.type == "cuda":
        limit, where = torch.cuda.get_device_properties(device).total_memory, torch.cuda.get_device_name(device)
    else:
        ranks_here = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
        limit = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / ranks_here
        where = f"this machine's RAM / {ranks_here} rank(s)"
    for what, need in (("model state (16 bytes per parameter after sharding)", state),
                       ("one micro-batch activation", activation), ("one step's token batch", batch)):
        if need > limit:
            raise UsageError(f"--model: {what} needs {need / 1e9:.4g} GB per rank, more than the {limit / 1e9:.4g} "
                             f"GB of {where}")


def data_identity(meta_path):
    """What a resume compares to know it reads the same data: a hash of the data folder's meta.json."""
    return hashlib.sha256(Path(meta_path).read_bytes()).hexdigest()[:16]


def device_defaults(args, device):
    """The fast path is the default on CUDA: bf16 autocast (TF32 for what stays fp32) and torch.compile. CPU: fp32,
    eager, so that every layout matches one process to float tolerance."""
    cuda = device.type == "cuda"
    if args.dtype is None:
        args.dtype = "bf16" if cuda else "fp32"
    if args.compile is None:
        args.compile = cuda
    if cuda and args.dtype == "fp8" and torch.cuda.get_device_capability(device) < (8, 9):
        raise UsageError(f"--dtype: fp8 needs FP8 tensor cores (compute capability 8.9+: Ada, Hopper); "
                         f"{torch.cuda.get_device_name(device)} is {torch.cuda.get_device_capability(device)}")
    if cuda:
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True


def accumulation_steps(global_batch, micro_batch, dp):
    """Micro-batches per rank and step, M = B / (b·dp); the one place the batch sizes are checked together."""
    if global_batch % (micro_batch * dp):
        raise UsageError(f"--global-batch: {global_batch} is not divisible by micro-batch x dp = "
                         f"{micro_batch} x {dp}")
    return global_batch // (micro_batch * dp)


def model_config(args, vocab_size):
    base = M.PRESETS[args.model]
    overrides = {f: getattr(args, f) for f in ("n_layer", "d_model", "n_head", "n_kv_head", "ffn_dim",
                                               "vocab_size", "seq_len") if getattr(args, f) is not None}
    fields = {**base.__dict__, "dropout": args.dropout, **overrides}
    if not fields["vocab_size"]:
        fields["vocab_size"] = vocab_size
    if fields["vocab_size"] < vocab_size:
        raise UsageError(f"--vocab-size: {fields['vocab_size']} is below the data's vocabulary of {vocab_size}")
    cfg = M.ModelConfig(**fields)
    problem = cfg.validate() or (args.dtype == "fp8" and fp8.misfit(cfg, args.tp, args.micro_batch * cfg.seq_len
                                                                    // args.cp))
    if problem:
        raise UsageError(f"{problem[0]}: {problem[1]}")
    return cfg


def peak_flops(args, device, cfg):
    """Per-device peak FLOP/s and where it came from: --peak-tflops, the table by the GPU's full name, or on CPU the
    best measured rate of this run's own largest matmul (forward and both backward shapes), on the threads the run
    uses, so that MFU stays at or below 100% on an idle machine."""
    if args.peak_tflops:
        return args.peak_tflops * 1e12, "--peak-tflops"
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        if name in PEAK_TFLOPS:
            return PEAK_TFLOPS[name] * 1e12, f"{name} bf16 dense peak"
        return 0.0, f"{name} is not in the peak table; pass --peak-tflops"
    m = min(args.micro_batch * cfg.seq_len, 8192)  # the token rows of one micro-batch's matmuls
    k, n = cfg.d_model, max(cfg.ffn_dim, cfg.padded_vocab)
    best = max(matmul_rate(a, b, DTYPES[args.dtype]) for a, b in (((m, k), (k, n)), ((m, n), (n, k)), ((k, m), (m, n))))
    return best, (f"best measured CPU {args.dtype} rate of this run's largest matmul, {m}x{k}x{n} and its backward "
                  f"shapes, on {torch.get_num_threads()} threads (no device table for CPU)")


def matmul_rate(shape_a, shape_b, dtype, trials=4, trial_s=0.05):
    """FLOP/s of a @ b, the best of a few short trials: other jobs on the cores only ever slow a trial down."""
    a, b = torch.randn(shape_a, dtype=dtype), torch.randn(shape_b, dtype=dtype)
    flops, rates = 2 * shape_a[0] * shape_a[1] * shape_b[1], []
    for _ in range(trials):
        n, t0 = 0, time.perf_counter()
        while n == 0 or time.perf_counter() - t0 < trial_s:
            a @ b
            n += 1
        rates.append(flops * n / (time.perf_counter() - t0))
    return max(rates)


def run_layout(args, mesh):
    """Recorded in each save: a resume in the same layout also restores every rank's RNG states."""
    return {"world": mesh.world, **mesh.sizes, "dp_mode": args.dp_mode, "dp_shard": mesh.dp_shard, "sp": args.sp,
            "pp_schedule": args.pp_schedule, "pp_virtual": args.pp_virtual,
            "pp_split": ",".join(map(str, args.pp_split)) if args.pp_split else None, "cp_mode": args.cp_mode}


def run_config(args, cfg, meta, data_id):
    """What must match on --resume: the model, the data (by the identity of its meta.json) and the optimization,
    not the layout."""
    train = {k: getattr(args, k) for k in ("global_batch", "lr", "min_lr", "warmup", "weight_decay", "grad_clip",
                                            "seed", "dtype", "steps")}
    return {"model": dict(cfg.__dict__), "train": train, "data": data_id, "tokenizer": meta["tokenizer"],
            **{k: meta[k] for k in ("tokenizer_file",) if k in meta}}  # a .tiktoken file's path, for sample.py
