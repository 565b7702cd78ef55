"""One training step of ours, of torch's FSDP2 and of torchtitan, counted side by side on fake H100s.

    python -m bench.vs_peers --layout 8b-fsdp8 --ckpt op [--json FILE]
    python -m bench.vs_peers --list

Each column runs as rank 0 of the layout's full world on torch's fake process group and fake CUDA
tensors (bench/dry_run.py's machine), two steps, the same model, batch, sequence, bf16 weights in
compute, fp32 gradient reduce, eager, and the same recompute policy. One counter serves every
column: the rehearsal's ledger of live CUDA storages for the peak and its parts, and count.Count
for FLOPs by phase, kernel launches and collectives. Counted, not measured on a GPU.
"""
from dataclasses import dataclass


@dataclass(frozen=True)
class Layout:
    name: str
    model: str
    world: int
    tp: int = 1
    pp: int = 1
    sp: bool = False
    micro_batch: int = 2  # sequences per micro-batch, torchtitan's local batch
    micro_batches: int = 1
    seq_len: int = 8192
    ckpt: str = "op"  # the default; --ckpt picks

    @property
    def dp_shard(self):
        return self.world // (self.tp * self.pp)

    def train_argv(self):
        """The train.py command of our column."""
        argv = ["--model", self.model, "--dp-mode", "fsdp", "--micro-batch", str(self.micro_batch),
                "--seq-len", str(self.seq_len), "--ckpt", self.ckpt, "--global-batch",
                str(self.micro_batch * self.micro_batches * self.dp_shard), "--no-compile"]
        if self.tp > 1:
            argv += ["--tp", str(self.tp)] + ["--sp"] * self.sp
        if self.pp > 1:
            argv += ["--pp", str(self.pp)]
        return argv


LAYOUTS = {lay.name: lay for lay in (
    Layout("8b-fsdp8", "llama3-8b", 8),
    Layout("8b-fsdp128", "llama3-8b", 128),
    Layout("70b-fsdp32-tp8", "llama3-70b", 256, tp=8, sp=True, ckpt="full"),
    Layout("405b-fsdp8-tp8-pp8", "llama3-405b", 512, tp=8, pp=8, sp=True, micro_batch=1,
           micro_batches=8, ckpt="full"),
)}
