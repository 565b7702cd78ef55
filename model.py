"""A Llama decoder: RMSNorm, RoPE (Llama 3's scaling too), grouped-query attention, SwiGLU.

Parameter names are Hugging Face Llama's (layers.3.self_attn.q_proj, ...): an export is a rename.
The model knows no layout. The parallel files change it in place on the meta device: pp deletes what
a stage does not own, tp swaps in sharded modules, cp each attention's `attend`, ckpt `run_layers`.
Two hooks on each layer with a weight, `matmul` and `weight_grads`, serve optional layers.
"""
import math
from dataclasses import dataclass
from functools import partial
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

# ---------------------------------------------------------------- the config

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
    # Fields added later default to None, as a save written before them reads: that save's config
    # compares equal on --resume, loads in sample.py and export. rope_scaling: Llama 3's
    # {"rope_type": "llama3", "factor", "low_freq_factor", "high_freq_factor", "original_max_..."}
    rope_scaling: Optional[dict] = None  # None: plain RoPE
    tie_embeddings: Optional[bool] = None  # True: lm_head's weight is embed_tokens'. None: untied

    @property
    def head_dim(self):
        return self.d_model // self.n_head

    @property
    def padded_vocab(self):
        return -(-self.vocab_size // 64) * 64

    def validate(self):
        """The first problem as (flag, message), or None. A field with no flag goes by its name."""
        for name in ("n_layer", "d_model", "n_head", "n_kv_head", "ffn_dim", "vocab_size",
                     "seq_len"):
            if getattr(self, name) <= 0:
                return f"--{name.replace('_', '-')}", f"must be positive, got {getattr(self, name)}"
        if self.d_model % self.n_head:
            return "--d-model", f"d_model {self.d_model} is not divisible by n_head {self.n_head}"
        if self.n_head % self.n_kv_head:
            return "--n-kv-head", (f"n_head {self.n_head} is not divisible by "
                                   f"n_kv_head {self.n_kv_head}")
        if self.head_dim % 2:
            return "--d-model", f"head_dim {self.head_dim} must be even for rotary embeddings"
        if not 0.0 <= self.dropout < 1.0:
            return "--dropout", f"must be in [0, 1), got {self.dropout}"
        for name in ("rope_theta", "norm_eps"):
            if not math.isfinite(getattr(self, name)) or getattr(self, name) <= 0:
                return name, f"must be a finite positive number, got {getattr(self, name)}"
        if self.rope_scaling is not None:
            problem = rope_scaling_problem(self.rope_scaling)
            if problem:
                return f"rope_scaling.{problem[0]}", problem[1]
        return None


ROPE_SCALING_KEYS = ("factor", "low_freq_factor", "high_freq_factor",
                     "original_max_position_embeddings")


def rope_scaling_problem(scaling):
    """(key, what is wrong) of a rope_scaling dict, or None: rope_type "llama3", the three factors
    finite positive numbers, high_freq_factor above low_freq_factor, and
    original_max_position_embeddings a positive integer."""
    if not isinstance(scaling, dict):
        return "", f"must be an object, got {scaling!r}"
    if scaling.get("rope_type") != "llama3":
        return "rope_type", (f"is {scaling.get('rope_type')!r}; "
                             "this model's only frequency scaling is 'llama3'")
    unknown = sorted(set(scaling) - {"rope_type", *ROPE_SCALING_KEYS})
    if unknown:
        return unknown[0], "is not a field of Llama 3's frequency scaling"
    for key in ROPE_SCALING_KEYS:
        value = scaling.get(key)
        integer = key == "original_max_position_embeddings"
        if not is_number(value, integer) or not math.isfinite(value) or value <= 0:
            return key, (f"must be a finite positive {'integer' if integer else 'number'}, "
                         f"got {value!r}")
    if scaling["high_freq_factor"] <= scaling["low_freq_factor"]:
        return "high_freq_factor", (f"{scaling['high_freq_factor']} must be above low_freq_factor "
                                    f"{scaling['low_freq_factor']}")
    return None


def is_number(value, integer=False):
    """A JSON number (an integer if asked), not a bool."""
    return isinstance(value, int if integer else (int, float)) and not isinstance(value, bool)


LLAMA3 = dict(vocab_size=128256, seq_len=8192, rope_theta=500000.0)
PRESETS = {
    "tiny": ModelConfig(n_layer=4, d_model=128, n_head=8, n_kv_head=4, ffn_dim=384, seq_len=256),
    "small": ModelConfig(n_layer=12, d_model=768, n_head=12, n_kv_head=12, ffn_dim=2048,
                         seq_len=1024),
    "medium": ModelConfig(n_layer=24, d_model=1024, n_head=16, n_kv_head=16, ffn_dim=2816,
                          seq_len=1024),
    "1b": ModelConfig(n_layer=16, d_model=2048, n_head=32, n_kv_head=8, ffn_dim=8192,
                      **{**LLAMA3, "seq_len": 2048}),
    "llama3-8b": ModelConfig(n_layer=32, d_model=4096, n_head=32, n_kv_head=8, ffn_dim=14336,
                             **LLAMA3),
    "llama3-70b": ModelConfig(n_layer=80, d_model=8192, n_head=64, n_kv_head=8, ffn_dim=28672,
                              **LLAMA3),
    "llama3-405b": ModelConfig(n_layer=126, d_model=16384, n_head=128, n_kv_head=8,
                               ffn_dim=53248, **LLAMA3),
}


# ---------------------------------------------------------------- layers

class ScaledRMSNorm(torch.autograd.Function):
    """weight · x̂, x̂ = x / rms(x) in fp32 rounded to x's dtype. Saves x and 1/rms, not fp32 x̂."""

    @staticmethod
    def forward(ctx, x, weight, eps):
        x32 = x.to(torch.promote_types(x.dtype, torch.float32))  # fp64 stays fp64 (gradcheck)
        rstd = torch.rsqrt(x32.square().mean(-1, keepdim=True) + eps)  # (..., 1) fp32
        ctx.save_for_backward(x, weight, rstd)
        return ScaledRMSNorm.output(x, weight, rstd, x32)

    @staticmethod
    def output(x, weight, rstd, x32=None):  # from what backward keeps: also --ckpt selective's
        return weight.to(x.dtype) * ((x.to(rstd.dtype) if x32 is None else x32) * rstd).to(x.dtype)

    @staticmethod
    def backward(ctx, grad):
        x, weight, rstd = ctx.saved_tensors
        x_hat = x.to(rstd.dtype) * rstd
        grad_weight = (grad * x_hat.to(x.dtype)).reshape(-1, x.shape[-1]).sum(0).to(weight.dtype)
        g = (grad * weight.to(grad.dtype)).to(rstd.dtype)  # d loss / d x̂
        grad_x = rstd * (g - x_hat * (g * x_hat).mean(-1, keepdim=True))
        return grad_x.to(x.dtype), grad_weight, None


class RMSNorm(nn.Module):
    weight_grads = None  # hook: a store that defers the gain's gradient (parallel/__init__.py)

    def __init__(self, dim, eps):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        if self.weight_grads is None:
            return ScaledRMSNorm.apply(x, self.weight, self.eps)
        x_hat = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps).to(x.dtype)
        return self.weight_grads.scale(self.weight, x_hat)


class Linear(nn.Linear):
    """x·Wᵀ, no bias. Hooks: `matmul` makes the product, `weight_grads` defers dW."""
    matmul = None
    weight_grads = None

    def __init__(self, in_features, out_features, device=None):
        super().__init__(in_features, out_features, bias=False, device=device)

    def forward(self, x):
        if self.weight_grads is not None:
            return self.weight_grads.linear(x, self.weight)
        return (self.matmul or F.linear)(x, self.weight)


class SwiGLU(torch.autograd.Function):
    """silu(gate) · up. Saves gate and up only; backward recomputes silu."""

    @staticmethod
    def forward(ctx, gate, up):
        ctx.save_for_backward(gate, up)
        return SwiGLU.output(gate, up)

    @staticmethod
    def output(gate, up):  # also --ckpt selective's recompute
        return F.silu(gate) * up

    @staticmethod
    def backward(ctx, grad):
        gate, up = ctx.saved_tensors  # in place: two (tokens, f) temporaries fewer
        grad_gate = grad * up
        torch.ops.aten.silu_backward.grad_input(grad_gate, gate, grad_input=grad_gate)
        return grad_gate, F.silu(gate).mul_(grad)


def compute_dtype(x):
    """The dtype matmuls run in: autocast's where it is on, else x's."""
    on = torch.is_autocast_enabled(x.device.type)
    return torch.get_autocast_dtype(x.device.type) if on else x.dtype


class Embedding(nn.Embedding):
    """The token embedding; its rows come out in the compute dtype, as the residual stream."""

    def forward(self, ids):
        return F.embedding(ids, self.weight).to(compute_dtype(self.weight))  # (B, T, d)


def rope_frequencies(head_dim, theta, scaling=None, device=None):
    """The head_dim/2 frequencies θ^(-2i/head_dim), fp32. Llama 3's scaling: over the original
    context C, a frequency turning r = C·f/2π times is kept if r >= high_freq_factor, divided by
    `factor` if r <= low_freq_factor, and blended linearly in r between."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=device).float() / head_dim)
    if scaling is None:
        return inv_freq  # (head_dim/2,)
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    turns = scaling["original_max_position_embeddings"] * inv_freq / (2 * math.pi)  # r
    kept = ((turns - low) / (high - low)).clamp(0.0, 1.0)  # 0: scaled whole, 1: kept as it is
    return inv_freq * (kept + (1.0 - kept) / scaling["factor"])


def rope_angles(positions, head_dim, theta, scaling=None):
    """cos, sin of shape (T, head_dim) in fp32 for integer positions (T,)."""
    inv_freq = rope_frequencies(head_dim, theta, scaling, positions.device)
    angles = positions.float()[:, None] * inv_freq[None, :]  # (T, head_dim/2)
    angles = torch.cat([angles, angles], dim=-1)  # (T, head_dim): the rotate-half layout
    return angles.cos(), angles.sin()


def apply_rope(x, cos, sin):
    """x: (B, H, T, hd); cos, sin: (T, hd). Rotates pairs (i, i + hd/2), as Hugging Face's Llama."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin  # the second term: x rotated by half


def fused_gqa(device_type, dtype):
    """Whether a fused SDPA kernel takes fewer K, V heads than Q heads: flash on CUDA in fp16 and
    bf16, the CPU kernel always. CUDA's fp32 kernel does not (SDPA would use the math kernel)."""
    return device_type != "cuda" or dtype in (torch.float16, torch.bfloat16)


def causal_attention(q, k, v):
    """q: (B, H, T, hd), k, v: (B, Hkv, T, hd) -> (B, H, T, hd); query head h reads kv head h·Hkv/H.
    Only fp32 on CUDA repeats each kv head for its query heads."""
    H, Hkv = q.shape[1], k.shape[1]
    if Hkv == H or fused_gqa(q.device.type, q.dtype):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=Hkv != H)
    k, v = k.repeat_interleave(H // Hkv, 1), v.repeat_interleave(H // Hkv, 1)  # (B, H, T, hd)
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


class Attention(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.head_dim = hd = cfg.head_dim
        self.q_proj = Linear(cfg.d_model, cfg.n_head * hd)
        self.k_proj = Linear(cfg.d_model, cfg.n_kv_head * hd)
        self.v_proj = Linear(cfg.d_model, cfg.n_kv_head * hd)
        self.o_proj = Linear(cfg.n_head * hd, cfg.d_model)
        self.attend = causal_attention

    def forward(self, x, cos, sin):
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, -1, self.head_dim).transpose(1, 2)  # (B, H, T, hd)
        k = self.k_proj(x).view(B, T, -1, self.head_dim).transpose(1, 2)  # (B, Hkv, T, hd)
        v = self.v_proj(x).view(B, T, -1, self.head_dim).transpose(1, 2)
        y = self.attend(apply_rope(q, cos, sin), apply_rope(k, cos, sin), v)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, -1))  # (B, T, d)


class MLP(nn.Module):
    activation = SwiGLU.apply  # compiled.py swaps it under --ckpt selective

    def __init__(self, cfg):
        super().__init__()
        self.gate_proj = Linear(cfg.d_model, cfg.ffn_dim)
        self.up_proj = Linear(cfg.d_model, cfg.ffn_dim)
        self.down_proj = Linear(cfg.ffn_dim, cfg.d_model)

    def forward(self, x):
        return self.down_proj(self.activation(self.gate_proj(x), self.up_proj(x)))


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


# ---------------------------------------------------------------- the loss

def loss_chunks(n_rows, n_cols, budget=2 ** 25):
    """Row slices of an (n_rows, n_cols) matrix: at most `budget` elements each, at least four."""
    rows = max(1, min(-(-n_rows // 4), budget // n_cols))
    return [slice(i, min(i + rows, n_rows)) for i in range(0, n_rows, rows)]


def log_sum_exp(logits, real):
    """(N,) fp32 log-sum-exp of each row over its first `real` columns, one chunk at a time."""
    lse = torch.empty(logits.shape[0], dtype=torch.float32, device=logits.device)
    for rows in loss_chunks(*logits.shape):
        lse[rows] = torch.logsumexp(logits[rows, :real].float(), dim=1)  # one fp32 chunk
    return lse


def softmax_minus_onehot(logits, lse, targets, mine, real, scale, out=None):
    """(softmax - onehot) · scale chunk by chunk, in the logits' dtype; columns past `real` get 0.
    `mine`: the rows whose target's column is here. `out` may be the logits themselves."""
    grad = torch.empty_like(logits) if out is None else out
    for rows in loss_chunks(*logits.shape):
        probs = torch.exp(logits[rows].float() - lse[rows, None])  # (rows, V): this chunk's softmax
        probs[:, real:] = 0.0
        probs.scatter_add_(1, targets[rows, None], -mine[rows, None].to(probs.dtype))
        grad[rows] = probs * scale
    return grad


class CrossEntropy(torch.autograd.Function):
    """Mean cross-entropy of logits (N, V) in their own dtype; no (N, V) fp32 tensor exists. Columns
    at or past vocab_size pad the vocabulary to 64s: no part, no gradient. `overwrite` (logits made
    for the loss alone): their gradient is written over them, one (N, V) tensor at the peak."""

    @staticmethod
    def forward(ctx, logits, targets, vocab_size=None, overwrite=False):
        real = logits.shape[1] if vocab_size is None else vocab_size
        lse = log_sum_exp(logits, real)
        ctx.save_for_backward(logits, lse, targets)
        ctx.real, ctx.overwrite = real, overwrite
        return (lse - logits.gather(1, targets[:, None]).squeeze(1).float()).mean()  # - target's

    @staticmethod
    def backward(ctx, grad):
        logits, lse, targets = ctx.saved_tensors
        mine, scale = torch.ones_like(targets, dtype=torch.bool), grad / logits.shape[0]
        out = logits if ctx.overwrite else None  # the logits' gradient takes their place
        return softmax_minus_onehot(logits, lse, targets, mine, ctx.real, scale, out), *[None] * 3


def cross_entropy_loss(logits, targets, vocab_size=None, overwrite=False):
    """logits (B, T, V), targets (B, T) -> the mean over all local tokens."""
    return CrossEntropy.apply(logits.flatten(0, 1), targets.flatten(), vocab_size, overwrite)


# ---------------------------------------------------------------- the model

class GPT(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = Embedding(cfg.padded_vocab, cfg.d_model)
        self.layers = nn.ModuleDict({str(i): Block(cfg) for i in range(cfg.n_layer)})
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.lm_head = Linear(cfg.d_model, cfg.padded_vocab)
        if cfg.tie_embeddings:  # one Parameter, saved once, as embed_tokens.weight
            self.lm_head.weight = self.embed_tokens.weight
        self.run_layers = run_layers
        self.loss_fn = partial(cross_entropy_loss, vocab_size=cfg.vocab_size, overwrite=True)
        self.seq_shards = 1  # --sp sets t: hidden states then hold T/t of the T positions
        self.rope_cache = None

    def forward(self, x, targets=None, positions=None):
        """x: ids (B, T) on the first stage, else hidden states (B, T, d). Returns the mean loss
        (the last stage, given targets), the logits, or the hidden states."""
        if self.embed_tokens is not None:
            x = self.embed_tokens(x)  # (B, T, d)
        cos, sin = self.rope(positions, x.shape[1] * self.seq_shards, x.device, compute_dtype(x))
        x = self.run_layers(self.layers, x, cos, sin)
        if self.lm_head is None:
            return x
        logits = self.lm_head(self.norm(x))  # (B, T, V)
        return logits if targets is None else self.loss_fn(logits, targets)

    def rope(self, positions, seq_len, device, dtype):
        """cos, sin (T, hd) in the compute dtype, kept while the positions stay (a step)."""
        key = (seq_len, device, dtype) if positions is None else (id(positions), dtype)
        if self.rope_cache is None or self.rope_cache[0] != key:
            if positions is None:
                positions = torch.arange(seq_len, device=device)
            cfg = self.cfg
            cos, sin = rope_angles(positions, cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
            self.rope_cache = (key, cos.to(dtype), sin.to(dtype), positions)  # held: its id stays
        return self.rope_cache[1], self.rope_cache[2]


def init_std(name, cfg):
    """The std of each weight's initial value; residual projections shrink with depth (GPT-2)."""
    residual = name.endswith(("o_proj.weight", "down_proj.weight"))
    return 0.02 / math.sqrt(2 * cfg.n_layer) if residual else 0.02


# ---------------------------------------------------------------- FLOP accounting

def layer_param_count(cfg):
    """Parameters of one block: q, k, v, o, gate, up, down and the two norms."""
    attn = cfg.d_model * cfg.head_dim * (2 * cfg.n_head + 2 * cfg.n_kv_head)
    return attn + 3 * cfg.d_model * cfg.ffn_dim + 2 * cfg.d_model


def layer_flops_per_token(cfg, seq_len=None):
    """Forward FLOPs of one block per token: 2 a weight, 4·d·T for attention's scores and values."""
    return 2 * layer_param_count(cfg) + 4 * cfg.d_model * (seq_len or cfg.seq_len)


def param_counts(cfg):
    """(total, non-embedding) parameters; the head counts as non-embedding (a tied one, once)."""
    embed = cfg.padded_vocab * cfg.d_model
    non_embedding = cfg.n_layer * layer_param_count(cfg) + cfg.d_model + embed  # embed: the head
    return non_embedding + (0 if cfg.tie_embeddings else embed), non_embedding


def flops_per_token(cfg, seq_len=None, recomputed_layers=0.0):
    """Training FLOPs per token (PaLM, Appendix B): 6·N_non-embedding + 12·L·d·T, no causal
    discount: MFU's. HFU adds a forward (2·N_layer + 4·d·T) per recomputed layer."""
    T = seq_len or cfg.seq_len
    model_flops = 6 * param_counts(cfg)[1] + 12 * cfg.n_layer * cfg.d_model * T
    return model_flops + recomputed_layers * layer_flops_per_token(cfg, T)
