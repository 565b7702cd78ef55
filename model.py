"""A Llama-architecture decoder: RMSNorm, RoPE, grouped-query attention, SwiGLU, untied head.

Parameter names follow the Hugging Face Llama checkpoint (embed_tokens, layers.i.self_attn.q_proj,
mlp.gate_proj, input_layernorm, ...), so exporting (saves/export.py) is a rename.

Parallel files plug in without subclassing:
- `pp` deletes the parts a stage does not own (embed_tokens/norm/lm_head may be None, layers is a
  ModuleDict keyed by the global layer index, so names never change);
- `tp` swaps Linear/Embedding modules for sharded ones and `loss_fn` for a vocab-parallel loss;
- `cp` swaps each attention's `attend` function; `ckpt` swaps `run_layers`.
Attention reads its head count from the tensor, so a head-sharded q_proj just works.
"""
import math
import zlib
from dataclasses import dataclass, fields

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class ModelConfig:
    n_layer: int = 4
    d_model: int = 128
    n_head: int = 8
    n_kv_head: int = 4
    ffn_dim: int = 384
    vocab_size: int = 0  # 0: taken from the data set's tokenizer
    seq_len: int = 256
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    dropout: float = 0.0

    @property
    def head_dim(self):
        return self.d_model // self.n_head

    @property
    def padded_vocab(self):
        return -(-self.vocab_size // 64) * 64

    def validate(self):
        """Returns the first problem as (flag, message), or None."""
        for name in ("n_layer", "d_model", "n_head", "n_kv_head", "ffn_dim", "vocab_size", "seq_len"):
            if getattr(self, name) <= 0:
                return f"--{name.replace('_', '-')}", f"must be positive, got {getattr(self, name)}"
        if self.d_model % self.n_head:
            return "--d-model", f"d_model {self.d_model} is not divisible by n_head {self.n_head}"
        if self.n_head % self.n_kv_head:
            return "--n-kv-head", f"n_head {self.n_head} is not divisible by n_kv_head {self.n_kv_head}"
        if self.head_dim % 2:
            return "--d-model", f"head_dim {self.head_dim} must be even for rotary embeddings"
        if not 0.0 <= self.dropout < 1.0:
            return "--dropout", f"must be in [0, 1), got {self.dropout}"
        return None


PRESETS = {
    "tiny": ModelConfig(n_layer=4, d_model=128, n_head=8, n_kv_head=4, ffn_dim=384, seq_len=256),
    "small": ModelConfig(n_layer=12, d_model=768, n_head=12, n_kv_head=12, ffn_dim=2048, seq_len=1024),
    "medium": ModelConfig(n_layer=24, d_model=1024, n_head=16, n_kv_head=16, ffn_dim=2816, seq_len=1024),
    "1b": ModelConfig(n_layer=16, d_model=2048, n_head=32, n_kv_head=8, ffn_dim=8192, vocab_size=128256,
                      seq_len=2048, rope_theta=500000.0),
    "llama3-8b": ModelConfig(n_layer=32, d_model=4096, n_head=32, n_kv_head=8, ffn_dim=14336,
                             vocab_size=128256, seq_len=8192, rope_theta=500000.0),
    "llama3-70b": ModelConfig(n_layer=80, d_model=8192, n_head=64, n_kv_head=8, ffn_dim=28672,
                              vocab_size=128256, seq_len=8192, rope_theta=500000.0),
    "llama3-405b": ModelConfig(n_layer=126, d_model=16384, n_head=128, n_kv_head=8, ffn_dim=53248,
                               vocab_size=128256, seq_len=8192, rope_theta=500000.0),
}


# ---------------------------------------------------------------- layers

class RMSNorm(nn.Module):
    def __init__(self, dim, eps):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


def rope_angles(positions, head_dim, theta):
    """cos, sin of shape (T, head_dim) for integer positions (T,), in fp32."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=positions.device).float() / head_dim)
    angles = positions.float()[:, None] * inv_freq[None, :]  # (T, head_dim/2)
    angles = torch.cat([angles, angles], dim=-1)  # (T, head_dim), the rotate-half layout
    return angles.cos(), angles.sin()


def apply_rope(x, cos, sin):
    """x: (B, H, T, hd). Rotates pairs (i, i + hd/2), as the Hugging Face Llama does."""
    x1, x2 = x.chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)
    return (x * cos + rotated * sin).to(x.dtype)


def causal_attention(q, k, v):
    """q: (B, H, T, hd), k/v: (B, Hkv, T, hd) -> (B, H, T, hd). Flash kernel on CUDA."""
    if k.shape[1] != q.shape[1]:
        repeat = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


class Attention(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        hd = cfg.head_dim
        self.head_dim = hd
        self.q_proj = nn.Linear(cfg.d_model, cfg.n_head * hd, bias=False)
        self.k_proj = nn.Linear(cfg.d_model, cfg.n_kv_head * hd, bias=False)
        self.v_proj = nn.Linear(cfg.d_model, cfg.n_kv_head * hd, bias=False)
        self.o_proj = nn.Linear(cfg.n_head * hd, cfg.d_model, bias=False)
        self.attend = causal_attention

    def forward(self, x, cos, sin):
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, -1, self.head_dim).transpose(1, 2)  # (B, H_local, T, hd)
        k = self.k_proj(x).view(B, T, -1, self.head_dim).transpose(1, 2)  # (B, Hkv_local, T, hd)
        v = self.v_proj(x).view(B, T, -1, self.head_dim).transpose(1, 2)
        y = self.attend(apply_rope(q, cos, sin), apply_rope(k, cos, sin), v)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, -1))  # (B, T, d)


class MLP(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.d_model, cfg.ffn_dim, bias=False)
        self.up_proj = nn.Linear(cfg.d_model, cfg.ffn_dim, bias=False)
        self.down_proj = nn.Linear(cfg.ffn_dim, cfg.d_model, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.mlp = MLP(cfg)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x, cos, sin):
        x = x + self.dropout(self.self_attn(self.input_layernorm(x), cos, sin))
        return x + self.dropout(self.mlp(self.post_attention_layernorm(x)))


def run_layers(layers, x, cos, sin):
    for block in layers.values():
        x = block(x, cos, sin)
    return x


def cross_entropy_loss(logits, targets):
    """Mean over all local tokens, computed in fp32."""
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


class GPT(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.padded_vocab, cfg.d_model)
        self.layers = nn.ModuleDict({str(i): Block(cfg) for i in range(cfg.n_layer)})
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.d_model, cfg.padded_vocab, bias=False)
        self.run_layers = run_layers
        self.loss_fn = cross_entropy_loss
        self.seq_shards = 1  # tp under --sp sets t: hidden states then hold T/t of the T positions

    def forward(self, x, targets=None, positions=None):
        """x: token ids (B, T) on the first stage, else hidden states (B, T, d).
        Returns the mean loss if targets are given and this is the last stage, else logits or hidden."""
        if self.embed_tokens is not None:
            x = self.embed_tokens(x)  # (B, T, d)
        if positions is None:
            positions = torch.arange(x.shape[1] * self.seq_shards, device=x.device)
        cos, sin = rope_angles(positions, self.cfg.head_dim, self.cfg.rope_theta)
        x = self.run_layers(self.layers, x, cos.to(x.dtype), sin.to(x.dtype))
        if self.lm_head is None:
            return x
        logits = self.lm_head(self.norm(x))  # (B, T, vocab_local)
        return logits if targets is None else self.loss_fn(logits, targets)


# ---------------------------------------------------------------- initialization

def init_std(name, cfg):
    """The std of each weight; the residual projections shrink with depth (GPT-2)."""
    if name.endswith(("o_proj.weight", "down_proj.weight")):
        return 0.02 / math.sqrt(2 * cfg.n_layer)
    return 0.02


def full_init(name, shape, cfg, seed):
    """The full initial tensor of one parameter: a function of (seed, name) only, on CPU in fp32."""
    if name.endswith("norm.weight"):
        return torch.ones(shape)
    gen = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
    return torch.randn(shape, generator=gen) * init_std(name, cfg)


def local_init(name, param, cfg, seed):
    """This rank's slice of one parameter. A tensor-parallel param carries `tp_shard = (dim, rank, world)`."""
    dim, rank, world = getattr(param, "tp_shard", (0, 0, 1))
    shape = list(param.shape)
    shape[dim] *= world
    return full_init(name, shape, cfg, seed).chunk(world, dim)[rank]


@torch.no_grad()
def init_weights(model, seed, device):
    """Materializes a meta-device model on `device` with the layout-independent initial weights."""
    marks = {name: dict(p.__dict__) for name, p in model.named_parameters()}  # tp_shard, tp_partial_grad
    model.to_empty(device=device)  # new Parameter objects: the marks must be carried over
    for name, p in model.named_parameters():
        p.__dict__.update(marks[name])
        p.copy_(local_init(name, p, model.cfg, seed))
    return model


# ---------------------------------------------------------------- FLOP accounting

def layer_param_count(cfg):
    """Parameters of one transformer block: q, k, v, o, gate, up, down and the two norms."""
    attn = cfg.d_model * cfg.head_dim * (2 * cfg.n_head + 2 * cfg.n_kv_head)
    return attn + 3 * cfg.d_model * cfg.ffn_dim + 2 * cfg.d_model


def layer_flops_per_token(cfg, seq_len=None):
    """Forward FLOPs of one block per token: 2 per weight, and 4·d·T for the attention scores and values."""
    return 2 * layer_param_count(cfg) + 4 * cfg.d_model * (seq_len or cfg.seq_len)


def param_counts(cfg):
    """(total, non-embedding) parameter counts. The lm_head is a matmul, so it counts as non-embedding."""
    embed = cfg.padded_vocab * cfg.d_model
    non_embedding = cfg.n_layer * layer_param_count(cfg) + cfg.d_model + cfg.padded_vocab * cfg.d_model
    return non_embedding + embed, non_embedding


def flops_per_token(cfg, seq_len=None, recomputed_layers=0.0):
    """Training FLOPs per token, PaLM Appendix B: 6·N_non-embedding + 12·L·d·T (no causal discount).

    recomputed_layers: how many layers' forwards run twice (activation checkpointing).
    With 0 this is the model FLOPs (MFU); otherwise hardware FLOPs (HFU), adding one more forward of each
    recomputed layer: 2·N_layer + 4·d·T.
    """
    T = seq_len or cfg.seq_len
    _, n = param_counts(cfg)
    return 6 * n + 12 * cfg.n_layer * cfg.d_model * T + recomputed_layers * layer_flops_per_token(cfg, T)


def config_from_dict(d):
    return ModelConfig(**{f.name: d[f.name] for f in fields(ModelConfig) if f.name in d})
