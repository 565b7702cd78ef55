"""A Llama-architecture decoder: RMSNorm, RoPE (optionally with Llama 3's frequency scaling), grouped-query
attention, SwiGLU, and a head that is its own matrix or, tied, the embedding's.

Parameter names follow the Hugging Face Llama checkpoint (embed_tokens, layers.i.self_attn.q_proj, mlp.gate_proj,
input_layernorm, ...), so exporting (saves/export.py) is a rename. Parallel files plug in without subclassing:
- `pp` deletes the parts a stage does not own (embed_tokens/norm/lm_head may be None, layers is a ModuleDict keyed
  by the global layer index, so names never change);
- `tp` swaps Linear/Embedding modules for sharded ones (attention reads its head count from the tensor, so a
  head-sharded q_proj just works) and `loss_fn` for a vocab-parallel loss;
- `cp` swaps each attention's `attend`; `ckpt` swaps `run_layers` or recomputes the norms' and SwiGLU's outputs;
- optional layers plug into two hooks of every layer that owns a matmul weight (`Linear`, `RMSNorm`; the contract is in
  parallel/__init__.py): `matmul` replaces how x·Wᵀ is computed (fp8), `weight_grads` defers the weight's gradient (the
  zero-bubble pipeline's B/W split).
A tied model (ModelConfig.tie_embeddings) holds one Parameter as embed_tokens.weight and lm_head.weight, which one
process and DDP keep as it is; pp, tp and FSDP would hold the two apart (saves/hf.py refuses those layouts).
The config (ModelConfig, the presets, the checks on a saved config) is model_config.py, re-exported here.
"""
import hashlib
import math
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from model_config import LLAMA3, PRESETS, ModelConfig, config_from_dict  # noqa: F401  (model.X everywhere)

# ---------------------------------------------------------------- layers

class ScaledRMSNorm(torch.autograd.Function):
    """weight · x̂, x̂ = x / rms(x) computed in fp32 and rounded to x's dtype (as the Hugging Face Llama does). Saves
    x as it is and the fp32 1/rms per row, where autograd would keep an fp32 copy of x and x̂: backward recomputes x̂."""

    @staticmethod
    def forward(ctx, x, weight, eps):
        x32 = x.to(torch.promote_types(x.dtype, torch.float32))  # fp64 stays fp64 (gradcheck)
        rstd = torch.rsqrt(x32.square().mean(-1, keepdim=True) + eps)  # (..., 1) fp32
        ctx.save_for_backward(x, weight, rstd)
        return ScaledRMSNorm.output(x, weight, rstd, x32)

    @staticmethod
    def output(x, weight, rstd, x32=None):  # also --ckpt selective's recomputation, from what backward keeps
        return weight.to(x.dtype) * ((x.to(rstd.dtype) if x32 is None else x32) * rstd).to(x.dtype)  # x's dtype

    @staticmethod
    def backward(ctx, grad):
        x, weight, rstd = ctx.saved_tensors
        x_hat = x.to(rstd.dtype) * rstd
        grad_weight = (grad * x_hat.to(x.dtype)).reshape(-1, x.shape[-1]).sum(0).to(weight.dtype)
        g = (grad * weight.to(grad.dtype)).to(rstd.dtype)  # d loss / d x̂
        grad_x = rstd * (g - x_hat * (g * x_hat).mean(-1, keepdim=True))
        return grad_x.to(x.dtype), grad_weight, None


class RMSNorm(nn.Module):
    weight_grads = None  # the hook that defers the gain's gradient (parallel/__init__.py): None, or its store

    def __init__(self, dim, eps):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        if self.weight_grads is None:  # one Function that recomputes x̂ in backward
            return ScaledRMSNorm.apply(x, self.weight, self.eps)
        return self.weight_grads.scale(self.weight, F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps).to(x.dtype))


class Linear(nn.Linear):
    """x·Wᵀ, no bias, with the two hooks of parallel/__init__.py: `matmul` (None: F.linear) computes the product,
    and `weight_grads` (None: autograd as usual) defers the weight's gradient."""
    matmul = None
    weight_grads = None

    def __init__(self, in_features, out_features, device=None):
        super().__init__(in_features, out_features, bias=False, device=device)

    def forward(self, x):
        if self.weight_grads is not None:
            return self.weight_grads.linear(x, self.weight)
        return (self.matmul or F.linear)(x, self.weight)


class SwiGLU(torch.autograd.Function):
    """silu(gate) · up, saving gate and up only (autograd would keep silu(gate) too): backward recomputes silu."""

    @staticmethod
    def forward(ctx, gate, up):
        ctx.save_for_backward(gate, up)
        return SwiGLU.output(gate, up)

    @staticmethod
    def output(gate, up):  # also --ckpt selective's recomputation
        return F.silu(gate) * up

    @staticmethod
    def backward(ctx, grad):
        gate, up = ctx.saved_tensors
        return torch.ops.aten.silu_backward(grad * up, gate), grad * F.silu(gate)


def compute_dtype(x):
    """The dtype matmuls run in: autocast's where it is on, else x's."""
    device = x.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x.dtype


class Embedding(nn.Embedding):
    """The token embedding, its rows in the compute dtype: the residual stream starts there (the precision policy,
    parallel/__init__.py), whatever dtype the table is kept in (fp32 masters; FSDP gathers it in the compute dtype)."""

    def forward(self, ids):
        out = F.embedding(ids, self.weight)  # (B, T, d)
        return out.to(compute_dtype(out))


def rope_frequencies(head_dim, theta, scaling=None, device=None):
    """The head_dim/2 angular frequencies θ^(-2i/head_dim), in fp32, with Llama 3's scaling when given: over the
    original context C = original_max_position_embeddings, a frequency turning r = C·f/2π times keeps its value if
    r >= high_freq_factor, is divided by `factor` if r <= low_freq_factor, and in between is blended, linearly in r:
    f · (s + (1 - s) / factor) with s = (r - low_freq_factor) / (high_freq_factor - low_freq_factor). So the short
    wavelengths that resolve nearby tokens stay as trained, and the long ones stretch over a `factor` times longer
    context."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=device).float() / head_dim)  # (head_dim/2,)
    if scaling is None:
        return inv_freq
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    turns = scaling["original_max_position_embeddings"] * inv_freq / (2 * math.pi)  # r: turns over the context
    kept = ((turns - low) / (high - low)).clamp(0.0, 1.0)  # s: 0 scaled whole, 1 kept as it is
    return inv_freq * (kept + (1.0 - kept) / scaling["factor"])


def rope_angles(positions, head_dim, theta, scaling=None):
    """cos, sin of shape (T, head_dim) for integer positions (T,), in fp32 (scaling: ModelConfig.rope_scaling)."""
    inv_freq = rope_frequencies(head_dim, theta, scaling, positions.device)
    angles = positions.float()[:, None] * inv_freq[None, :]  # (T, head_dim/2)
    angles = torch.cat([angles, angles], dim=-1)  # (T, head_dim), the rotate-half layout
    return angles.cos(), angles.sin()


def apply_rope(x, cos, sin):
    """x: (B, H, T, hd), cos/sin: (T, hd) in x's dtype. Rotates pairs (i, i + hd/2), as the Hugging Face Llama."""
    x1, x2 = x.chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)
    return x * cos + rotated * sin


def fused_gqa(device_type, dtype):
    """Whether a fused SDPA kernel takes grouped-query K/V as they are (enable_gqa) on this device and dtype: flash on
    CUDA in fp16 and bf16, and the CPU's flash kernel in any dtype. CUDA's fp32 kernel (memory-efficient) needs as
    many K/V heads as query heads; handed fewer, SDPA would fall back to the math kernel and its (T x T) scores."""
    return device_type != "cuda" or dtype in (torch.float16, torch.bfloat16)


def causal_attention(q, k, v):
    """q: (B, H, T, hd), k/v: (B, Hkv, T, hd) -> (B, H, T, hd) through a fused kernel. Where the kernel takes the Hkv
    heads as they are (fused_gqa), query head h reads kv head h·Hkv/H and no copy of K or V is made; else (fp32 on
    CUDA) each kv head is repeated for its H/Hkv query heads, the memory-efficient kernel's price for O(T) memory."""
    H, Hkv = q.shape[1], k.shape[1]
    if Hkv == H or fused_gqa(q.device.type, q.dtype):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=Hkv != H)
    k, v = k.repeat_interleave(H // Hkv, 1), v.repeat_interleave(H // Hkv, 1)  # (B, H, T, hd) each
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


class Attention(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        hd = cfg.head_dim
        self.head_dim = hd
        self.q_proj = Linear(cfg.d_model, cfg.n_head * hd)
        self.k_proj = Linear(cfg.d_model, cfg.n_kv_head * hd)
        self.v_proj = Linear(cfg.d_model, cfg.n_kv_head * hd)
        self.o_proj = Linear(cfg.n_head * hd, cfg.d_model)
        self.attend = causal_attention

    def forward(self, x, cos, sin):
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, -1, self.head_dim).transpose(1, 2)  # (B, H_local, T, hd)
        k = self.k_proj(x).view(B, T, -1, self.head_dim).transpose(1, 2)  # (B, Hkv_local, T, hd)
        v = self.v_proj(x).view(B, T, -1, self.head_dim).transpose(1, 2)
        y = self.attend(apply_rope(q, cos, sin), apply_rope(k, cos, sin), v)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, -1))  # (B, T, d)


class MLP(nn.Module):
    activation = SwiGLU.apply  # silu(gate)·up; --ckpt selective in a compiled block swaps it (parallel/ckpt.py)

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


def loss_chunks(n_rows, n_cols, budget=2 ** 25):
    """Row slices of an (n_rows, n_cols) matrix: at most `budget` elements each, and at least four slices."""
    rows = max(1, min(-(-n_rows // 4), budget // n_cols))
    return [slice(i, min(i + rows, n_rows)) for i in range(0, n_rows, rows)]


class CrossEntropy(torch.autograd.Function):
    """Mean cross-entropy over N tokens from logits (N, V) kept in their own dtype (bf16 under autocast).

    Forward takes the log-sum-exp in fp32 one chunk of rows at a time and saves only the logits and the (N,) fp32
    lse; backward writes softmax - onehot chunk by chunk into a gradient of the logits' dtype. So no (N, V) tensor
    exists in fp32, only one chunk (loss_chunks). The logits may be this rank's vocabulary shard [vocab_start,
    vocab_start + V): `combine(lse, target_logit)` then returns the global per-token values (tp.py).
    vocab_size: the true vocabulary. The columns at or past it (the rows GPT pads its embedding and head with, up to
    a multiple of 64) take no part in the log-sum-exp and get a zero gradient, so padding changes no number; None:
    every column is a token."""

    @staticmethod
    def forward(ctx, logits, targets, vocab_start=0, combine=None, vocab_size=None):
        n, vocab = logits.shape
        real = vocab if vocab_size is None else min(max(vocab_size - vocab_start, 0), vocab)  # this shard's tokens
        local = targets - vocab_start
        mine = (local >= 0) & (local < vocab)  # the target's logit lives in this shard
        local = local.clamp(0, vocab - 1)
        lse = torch.empty(n, dtype=torch.float32, device=logits.device)
        for rows in loss_chunks(n, vocab):
            lse[rows] = torch.logsumexp(logits[rows, :real].float(), dim=1)  # (rows, real) fp32: one chunk
        target_logit = logits.gather(1, local[:, None]).squeeze(1).float() * mine  # (N,)
        if combine is not None:
            lse, target_logit = combine(lse, target_logit)
        ctx.save_for_backward(logits, lse, local, mine)
        ctx.real = real
        return (lse - target_logit).mean()

    @staticmethod
    def backward(ctx, grad):
        logits, lse, local, mine = ctx.saved_tensors
        grad_logits = torch.empty_like(logits)
        scale = grad / logits.shape[0]
        for rows in loss_chunks(*logits.shape):
            probs = torch.exp(logits[rows].float() - lse[rows, None])  # (rows, V): this chunk's softmax
            probs[:, ctx.real:] = 0.0  # the padding columns: no gradient
            probs.scatter_add_(1, local[rows, None], -mine[rows, None].to(probs.dtype))
            grad_logits[rows] = probs * scale
        return grad_logits, None, None, None, None


def cross_entropy_loss(logits, targets, vocab_size=None):
    """logits (B, T, V), targets (B, T) -> the mean over all local tokens; columns at or past vocab_size are padding
    (GPT binds its vocab_size: GPT.loss_fn)."""
    return CrossEntropy.apply(logits.flatten(0, 1), targets.flatten(), 0, None, vocab_size)


class GPT(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = Embedding(cfg.padded_vocab, cfg.d_model)
        self.layers = nn.ModuleDict({str(i): Block(cfg) for i in range(cfg.n_layer)})
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.lm_head = Linear(cfg.d_model, cfg.padded_vocab)
        if cfg.tie_embeddings:  # one Parameter, listed (and saved) once, as embed_tokens.weight
            self.lm_head.weight = self.embed_tokens.weight
        self.run_layers = run_layers
        self.loss_fn = partial(cross_entropy_loss, vocab_size=cfg.vocab_size)  # (logits, targets); tp swaps it
        self.seq_shards = 1  # tp under --sp sets t: hidden states then hold T/t of the T positions
        self.rope_cache = None

    def forward(self, x, targets=None, positions=None):
        """x: token ids (B, T) on the first stage, else hidden states (B, T, d).
        Returns the mean loss if targets are given and this is the last stage, else logits or hidden."""
        if self.embed_tokens is not None:
            x = self.embed_tokens(x)  # (B, T, d)
        cos, sin = self.rope(positions, x.shape[1] * self.seq_shards, x.device, compute_dtype(x))
        x = self.run_layers(self.layers, x, cos, sin)
        if self.lm_head is None:
            return x
        logits = self.lm_head(self.norm(x))  # (B, T, vocab_local)
        return logits if targets is None else self.loss_fn(logits, targets)

    def rope(self, positions, seq_len, device, dtype):
        """cos, sin (T, hd) in the compute dtype, made once and reused while the positions are the same (every
        micro-batch and layer of a step: under cp the step's positions are one tensor)."""
        key = ("length", seq_len, device, dtype) if positions is None else ("positions", id(positions), dtype)
        if self.rope_cache is None or self.rope_cache[0] != key:
            if positions is None:
                positions = torch.arange(seq_len, device=device)
            cos, sin = rope_angles(positions, self.cfg.head_dim, self.cfg.rope_theta, self.cfg.rope_scaling)
            self.rope_cache = (key, cos.to(dtype), sin.to(dtype), positions)  # holding positions keeps its id its own
        return self.rope_cache[1], self.rope_cache[2]


# ---------------------------------------------------------------- initialization

def init_std(name, cfg):
    """The std of each weight; the residual projections shrink with depth (GPT-2)."""
    return 0.02 / math.sqrt(2 * cfg.n_layer) if name.endswith(("o_proj.weight", "down_proj.weight")) else 0.02


INIT_TILE = 1024  # the initial values are drawn tile by tile over a fixed grid of (1024, 1024) tiles


def init_tile(name, tile_rows, tile_cols, shape, cfg, seed):
    """One tile of a weight's initial value: a function of (seed, name, tile index) only, on CPU in fp32."""
    key = hashlib.blake2b(f"{seed}/{name}/{tile_rows.start}/{tile_cols.start}".encode(), digest_size=8).digest()
    gen = torch.Generator().manual_seed(int.from_bytes(key, "little") >> 1)
    return torch.randn(shape, generator=gen).mul_(init_std(name, cfg))


def full_init(name, shape, cfg, seed):
    return local_init(name, torch.empty(shape, device="meta"), cfg, seed)  # the whole tensor: tests, one process


def local_init(name, param, cfg, seed, flat=None, out=None):
    """This rank's part of one parameter's initial value: its tp block when the meta param carries
    `tp_shard = (dim, rank, world)` (parallel/__init__.py), and of that block only the flattened elements in range
    `flat` when given (an FSDP shard; then 1-D). Written into `out` if given. Built from the grid tiles that overlap
    the part, one tile at a time, so a rank allocates its part and one tile, never a whole parameter."""
    dim, rank, world = getattr(param, "tp_shard", (0, 0, 1))
    rows, cols = param.shape[0] if param.dim() else 1, math.prod(param.shape[1:])  # the tp block as a matrix
    whole = flat is None
    flat = range(rows * cols) if whole else flat
    out = torch.empty(len(flat)) if out is None else out
    if name.endswith("norm.weight"):
        return out.fill_(1.0).view(param.shape) if whole else out.fill_(1.0)
    n_rows, n_cols = (rows * world, cols) if dim == 0 else (rows, cols * world)  # the global matrix
    row0, col0 = (rank * rows, 0) if dim == 0 else (0, rank * cols)  # where the block sits in it
    first, last = flat.start // cols, -(-flat.stop // cols)  # block rows the range touches
    full_lo, full_hi = -(-flat.start // cols), flat.stop // cols  # block rows it covers whole
    for r in range((row0 + first) // INIT_TILE * INIT_TILE, row0 + last, INIT_TILE):
        for c in range(col0 // INIT_TILE * INIT_TILE, col0 + cols, INIT_TILE):
            tr, tc = range(r, min(r + INIT_TILE, n_rows)), range(c, min(c + INIT_TILE, n_cols))
            tile = init_tile(name, tr, tc, (len(tr), len(tc)), cfg, seed)
            lr0, lr1 = tr.start - row0, tr.stop - row0  # the tile's rows and columns in block coordinates
            lc0, lc1 = max(tc.start - col0, 0), min(tc.stop - col0, cols)
            tile = tile[:, lc0 + col0 - tc.start:lc1 + col0 - tc.start]  # (tile rows, lc1 - lc0)
            a, b = max(lr0, full_lo), min(lr1, full_hi)
            if b > a:  # whole rows of the range: one 2-D copy
                out[a * cols - flat.start:b * cols - flat.start].view(b - a, cols)[:, lc0:lc1] = tile[a - lr0:b - lr0]
            for row in {first, last - 1} - set(range(full_lo, full_hi)):  # at most two partial rows
                lo, hi = max(flat.start, row * cols + lc0), min(flat.stop, row * cols + lc1)
                if lr0 <= row < lr1 and hi > lo:
                    out[lo - flat.start:hi - flat.start] = tile[row - lr0, lo - row * cols - lc0:hi - row * cols - lc0]
            del tile  # before the next one is drawn: one tile alive at a time
    return out.view(param.shape) if whole else out


@torch.no_grad()
def materialize(module, device, init_param):
    """Meta parameters -> real ones on `device`, each filled in place by init_param(name, param, out=its flat view).
    Tags set on the meta parameters (tp_shard, tp_partial_grad) are carried over to the new Parameter objects, and a
    Parameter held in two places (a tied head) is still one Parameter after."""
    tags = {name: dict(p.__dict__) for name, p in module.named_parameters()}
    places = {}  # id of a Parameter -> the names it is held under, the first as named_parameters() lists it
    for name, p in module.named_parameters(remove_duplicate=False):
        places.setdefault(id(p), []).append(name)
    module.to_empty(device=device)  # gives every place its own tensor
    for first, *others in places.values():
        for name in others:
            owner, _, attr = name.rpartition(".")
            setattr(module.get_submodule(owner), attr, module.get_parameter(first))
    for name, p in module.named_parameters():
        p.__dict__.update(tags[name])
        init_param(name, p, out=p.view(-1))
    return module


def init_weights(model, seed, device):
    """Materializes a meta-device GPT on `device` with the layout-independent initial weights."""
    return materialize(model, device, lambda name, p, out: local_init(name, p, model.cfg, seed, out=out))


# ---------------------------------------------------------------- FLOP accounting

def layer_param_count(cfg):
    """Parameters of one transformer block: q, k, v, o, gate, up, down and the two norms."""
    attn = cfg.d_model * cfg.head_dim * (2 * cfg.n_head + 2 * cfg.n_kv_head)
    return attn + 3 * cfg.d_model * cfg.ffn_dim + 2 * cfg.d_model


def layer_flops_per_token(cfg, seq_len=None):
    """Forward FLOPs of one block per token: 2 per weight, and 4·d·T for the attention scores and values."""
    return 2 * layer_param_count(cfg) + 4 * cfg.d_model * (seq_len or cfg.seq_len)


def param_counts(cfg):
    """(total, non-embedding) parameter counts. The lm_head is a matmul, so it counts as non-embedding; tied, it is
    the embedding's matrix, counted once."""
    embed = cfg.padded_vocab * cfg.d_model
    non_embedding = cfg.n_layer * layer_param_count(cfg) + cfg.d_model + cfg.padded_vocab * cfg.d_model
    return non_embedding + (0 if cfg.tie_embeddings else embed), non_embedding


def flops_per_token(cfg, seq_len=None, recomputed_layers=0.0):
    """Training FLOPs per token, PaLM Appendix B: 6·N_non-embedding + 12·L·d·T (no causal discount).

    recomputed_layers: how many layers' forwards run twice (activation checkpointing).
    With 0 this is the model FLOPs (MFU); otherwise hardware FLOPs (HFU), adding one more forward of each
    recomputed layer: 2·N_layer + 4·d·T.
    """
    T = seq_len or cfg.seq_len
    _, n = param_counts(cfg)
    return 6 * n + 12 * cfg.n_layer * cfg.d_model * T + recomputed_layers * layer_flops_per_token(cfg, T)
