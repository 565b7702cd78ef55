"""The run's configuration: the command line of train.py, its validation, the model config it implies,
and the peak FLOP/s that MFU divides by. Every bad flag becomes one UsageError line (exit status 2)."""
import argparse
import time

import torch

import model as M

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# Dense bf16 tensor-core peaks in TFLOP/s, matched against torch.cuda.get_device_name(); first match wins.
PEAK_TFLOPS = [("H100 PCIe", 756.0), ("H100", 989.4), ("H200", 989.4), ("H800", 989.4), ("GH200", 989.4),
               ("A100", 312.0), ("A800", 312.0), ("L40S", 362.0), ("A10G", 125.0), ("L4", 121.0),
               ("RTX 4090", 165.2), ("V100", 125.0)]


class UsageError(ValueError):
    """A bad command line: printed as one line, exit status 2."""


class OneLineParser(argparse.ArgumentParser):
    def error(self, message):
        raise UsageError(message)


def parse_args(argv=None):
    p = OneLineParser(description="Train a Llama-style GPT on any (dp x pp x cp x tp) layout.",
                      formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    a = p.add_argument
    a("--model", default="tiny", help=f"preset: {', '.join(M.PRESETS)}")
    for name in ("n-layer", "d-model", "n-head", "n-kv-head", "ffn-dim", "vocab-size", "seq-len"):
        a(f"--{name}", type=int, help="override the preset's field")
    a("--dropout", type=float, default=0.0, help="residual dropout (off by default)")
    a("--data", help="folder of token shards (default: the pystdlib corpus, prepared on first use)")
    a("--global-batch", type=int, default=32, help="sequences per optimizer step, all ranks together")
    a("--micro-batch", type=int, default=8, help="sequences per forward per DP rank; accumulation = B / (b*dp)")
    a("--steps", type=int, default=100, help="optimizer steps")
    a("--lr", type=float, default=3e-3, help="peak learning rate")
    a("--min-lr", type=float, default=3e-4, help="learning rate at the end of the cosine decay")
    a("--warmup", type=int, default=20, help="linear warmup steps")
    a("--weight-decay", type=float, default=0.1)
    a("--grad-clip", type=float, default=1.0, help="clip the global gradient norm (0: off)")
    a("--seed", type=int, default=1337, help="seeds the weights and the batches")
    a("--dtype", default="fp32", help="compute precision: fp32 | bf16 | fp16 (fp16 uses loss scaling)")
    a("--dp", type=int, help="data parallel degree (default: world / (tp*pp*cp))")
    a("--dp-mode", default="ddp", help="ddp | fsdp | hsdp")
    a("--dp-shard", type=int, help="HSDP shard-group size (ranks that shard one replica)")
    a("--reduce-dtype", default="fp32", help="FSDP gradient reduce-scatter dtype: fp32 | bf16")
    a("--tp", type=int, default=1, help="tensor parallel degree")
    a("--sp", action="store_true", help="sequence parallel (with --tp)")
    a("--pp", type=int, default=1, help="pipeline parallel degree")
    a("--pp-schedule", default="1f1b", help="gpipe | 1f1b | interleaved")
    a("--pp-virtual", type=int, default=1, help="model chunks per pipeline rank (interleaved)")
    a("--pp-split", help="explicit layers per stage, e.g. 3,5")
    a("--cp", type=int, default=1, help="context parallel degree")
    a("--cp-mode", default="ring", help="ring | ulysses | allgather")
    a("--ckpt", default="none", help="activation checkpointing: none | full | every:K | segment:C | sqrt | selective")
    a("--bucket-mb", type=float, default=25.0, help="DDP gradient bucket size in MB")
    a("--no-overlap", action="store_true", help="sync gradients after backward instead of during it")
    a("--device", help="cpu | cuda (default: cuda if available)")
    a("--compile", action="store_true", help="torch.compile each transformer block")
    a("--peak-tflops", type=float, help="device peak for MFU (default: device table, or measured on CPU)")
    a("--out", default="out", help="run folder: checkpoints, trace")
    a("--save-every", type=int, default=0, help="checkpoint every N steps (0: only at the end)")
    a("--resume", nargs="?", const="latest", choices=["latest", "auto"],
      help="continue from the newest complete save in --out in any layout (error if none); "
           "--resume auto: start fresh if there is none (for torchrun --max-restarts)")
    a("--keep", type=int, default=2, help="complete saves to keep (0: all)")
    a("--async-save", action="store_true", help="snapshot to CPU memory and write from a background thread")
    a("--eval-every", type=int, default=0, help="val loss every N steps (0: off)")
    a("--eval-batches", type=int, default=4, help="global batches per evaluation")
    a("--log-every", type=int, default=10, help="print a console line every N steps (0: off)")
    a("--metrics", help="append one JSON line per step to this file (rank 0)")
    a("--profile", action="store_true", help="write a torch.profiler Chrome trace of steps 2-4 to --out")
    return p.parse_args(argv)


def check_args(args):
    """Flag checks that need no data, model or process group."""
    if args.model not in M.PRESETS:
        raise UsageError(f"--model: unknown preset {args.model!r}; choose from {', '.join(M.PRESETS)}")
    if args.dtype not in DTYPES:
        raise UsageError(f"--dtype: unknown dtype {args.dtype!r}; choose fp32, bf16 or fp16")
    for flag in ("steps", "global_batch", "micro_batch", "eval_batches"):
        if getattr(args, flag) < (0 if flag == "steps" else 1):
            raise UsageError(f"--{flag.replace('_', '-')}: must be positive, got {getattr(args, flag)}")
    if args.keep < 0:
        raise UsageError(f"--keep: must be >= 0, got {args.keep}")
    if args.dp_mode not in ("ddp", "fsdp", "hsdp"):
        raise UsageError(f"--dp-mode: unknown mode {args.dp_mode!r}; choose ddp, fsdp or hsdp")
    if args.dp_mode == "hsdp" and not args.dp_shard:
        raise UsageError("--dp-shard: hsdp needs the shard-group size")
    if args.reduce_dtype not in ("fp32", "bf16"):
        raise UsageError(f"--reduce-dtype: unknown dtype {args.reduce_dtype!r}; choose fp32 or bf16")
    for problem, flag, needs in (
            (args.sp and args.tp == 1, "--sp", "--tp > 1: it shards the tensor-parallel region along the sequence"),
            (args.dp_shard and args.dp_mode != "hsdp", "--dp-shard", "--dp-mode hsdp"),
            (args.reduce_dtype != "fp32" and args.dp_mode == "ddp", "--reduce-dtype", "--dp-mode fsdp or hsdp"),
            ((args.pp_split or args.pp_virtual != 1) and args.pp == 1, "--pp-split/--pp-virtual", "--pp > 1")):
        if problem:  # a flag that would silently do nothing in this layout
            raise UsageError(f"{flag}: has no effect without {needs}")
    if args.device not in (None, "cpu", "cuda"):
        raise UsageError(f"--device: unknown device {args.device!r}; choose cpu or cuda")
    if args.device == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device: cuda requested but no GPU is visible")


def model_config(args, vocab_size):
    base = M.PRESETS[args.model]
    overrides = {f: getattr(args, f) for f in ("n_layer", "d_model", "n_head", "n_kv_head", "ffn_dim",
                                               "vocab_size", "seq_len") if getattr(args, f) is not None}
    fields = {**base.__dict__, "dropout": args.dropout, **overrides}
    if not fields["vocab_size"]:
        fields["vocab_size"] = vocab_size
    cfg = M.ModelConfig(**fields)
    problem = cfg.validate()
    if problem:
        raise UsageError(f"{problem[0]}: {problem[1]}")
    return cfg


def peak_flops(args, device):
    """Per-device peak FLOP/s and where it came from."""
    if args.peak_tflops:
        return args.peak_tflops * 1e12, "--peak-tflops"
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for key, tf in PEAK_TFLOPS:
            if key in name:
                return tf * 1e12, f"{name} bf16 dense peak"
        return 0.0, f"{name} is not in the peak table; pass --peak-tflops"
    a = torch.randn(512, 512, dtype=DTYPES[args.dtype])
    b = torch.randn(512, 512, dtype=DTYPES[args.dtype])
    rates = []
    for _ in range(6):  # the best of six short trials: other jobs on the cores only ever slow a trial down
        n, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < 0.05:
            a @ b
            n += 1
        rates.append(2 * 512 ** 3 * n / (time.perf_counter() - t0))
    return max(rates), f"best measured CPU {args.dtype} matmul rate (no device table for CPU)"


def run_config(args, cfg, meta):
    """What must match on --resume: the model, the data and the optimization, not the layout."""
    train = {k: getattr(args, k) for k in ("global_batch", "lr", "min_lr", "warmup", "weight_decay", "grad_clip",
                                            "seed", "dtype", "steps")}
    return {"model": dict(cfg.__dict__), "train": train, "data": str(args.data or "pystdlib"),
            "tokenizer": meta["tokenizer"]}
