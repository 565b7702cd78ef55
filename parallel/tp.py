"""Tensor parallel (Megatron-LM) over the tp group of t ranks, with sequence parallel (--sp).

Split:    q, k, v, gate, up by output features (whole heads); o, down by input features; the
          embedding and lm_head by vocabulary rows. Column then row needs one sum per sublayer:
          φ(X·[A_1 .. A_t])·[B_1; ..; B_t] = Σ_i φ(X·A_i)·B_i for a columnwise φ.
Sends:    f enters a sublayer (identity forward, all-reduce backward); g leaves it (all-reduce
          forward). Per layer and micro-batch: 4 all-reduces of (b, T, d), 4·2(t-1)/t·b·T·d·e bytes.
          --sp turns each into an all-gather and a reduce-scatter along the sequence: same bytes.
Overlap:  none here: every collective blocks. By default tp_overlap.py hides f's reduction under
          the weight-gradient matmuls, and --sp-ring cuts --sp's collectives into ring hops.
Memory:   weights, gradients, Adam state, attention and MLP activations / t. --sp: the residual
          stream and the norms / t too. Logits are (tokens, V/t): no (tokens, V) tensor exists.
"""
import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd import Function

from model import Linear, RMSNorm, compute_dtype, log_sum_exp, softmax_minus_onehot
from parallel import tag_tp_shard
from parallel.mesh import LayoutError

# ---------------------------------------------------------------- collectives along the sequence

def all_gather_seq(group, x):
    """(B, T/t, d) -> (B, T, d): every tp rank's block of the sequence, in rank order."""
    local = x.transpose(0, 1).contiguous()  # (T/t, B, d): the collective concatenates dim 0
    out = local.new_empty((local.shape[0] * group.size, *local.shape[1:]))  # (T, B, d)
    group.all_gather(out, local)
    return out.transpose(0, 1).contiguous()


def reduce_scatter_seq(group, x):
    """(B, T, d) partial sums -> (B, T/t, d): this rank's block of the sum over tp."""
    full = x.transpose(0, 1).contiguous()  # (T, B, d)
    out = full.new_empty((full.shape[0] // group.size, *full.shape[1:]))  # (T/t, B, d)
    group.reduce_scatter(out, full)
    return out.transpose(0, 1).contiguous()


def all_reduce(group, x):
    """The sum of x over tp, in a new tensor (autograd may share x with another path)."""
    out = x.contiguous().clone()
    group.all_reduce(out)
    return out


# ---------------------------------------------------------------- Megatron's f and g

class EnterTP(Function):
    """f: identity forward, the gradient summed over tp backward.
    --sp: the sequence all-gathered forward, the gradient reduce-scattered backward."""

    @staticmethod
    def forward(ctx, x, group, sequence_parallel):
        ctx.group, ctx.sp = group, sequence_parallel
        return all_gather_seq(group, x) if sequence_parallel else x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = reduce_scatter_seq(ctx.group, grad) if ctx.sp else all_reduce(ctx.group, grad)
        return grad, None, None


class LeaveTP(Function):
    """g: the row-parallel partial outputs summed forward, identity backward.
    --sp: reduce-scattered along the sequence forward, the gradient all-gathered backward."""

    @staticmethod
    def forward(ctx, x, group, sequence_parallel):
        ctx.group, ctx.sp = group, sequence_parallel
        if sequence_parallel:
            return reduce_scatter_seq(group, x)
        if x._base is not None:  # a view (fp8's matmul): autograd forbids changing it in place
            return all_reduce(group, x)
        ctx.mark_dirty(x)  # a fresh matmul output that no backward reads: summed in place
        group.all_reduce(x)
        return x

    @staticmethod
    def backward(ctx, grad):
        return all_gather_seq(ctx.group, grad) if ctx.sp else grad, None, None


# ---------------------------------------------------------------- sharded modules

def shard(param, dim, group):
    """Tags a param as this rank's block of a global tensor; init gives it that slice."""
    return tag_tp_shard(param, dim, group.rank, group.size)


class ColumnParallelLinear(Linear):
    """y_i = x · A_iᵀ: this rank's block of output features, (B, T, out/t). x is f's output."""

    def __init__(self, in_features, out_features, group):
        super().__init__(in_features, out_features // group.size, device="meta")
        shard(self.weight, 0, group)


class RowParallelLinear(Linear):
    """z = Σ_i y_i · B_iᵀ: this rank's input features multiplied, then g sums over tp."""

    def __init__(self, in_features, out_features, group, sequence_parallel):
        super().__init__(in_features // group.size, out_features, device="meta")
        self.group, self.sequence_parallel = group, sequence_parallel
        shard(self.weight, 1, group)

    def forward(self, x):  # (B, T, in/t) -> (B, T, d), or (B, T/t, d) under --sp
        partial_sum = super().forward(x)  # its own statement: dynamo resumes after a break in it
        return LeaveTP.apply(partial_sum, self.group, self.sequence_parallel)


class NormThenEnterTP(RMSNorm):
    """The RMSNorm in front of column-parallel linears, then f. Under --sp it sees only this rank's
    tokens, so its gain's gradient is a partial sum over tp."""

    def __init__(self, norm, group, sequence_parallel):
        super().__init__(norm.weight.shape[0], norm.eps)
        self.weight = nn.Parameter(torch.empty_like(norm.weight, device="meta"))
        self.group, self.sequence_parallel = group, sequence_parallel
        self.weight.tp_partial_grad = sequence_parallel

    def forward(self, x):
        h = super().forward(x)  # (B, T, d), or this rank's block (B, T/t, d) under --sp
        return EnterTP.apply(h, self.group, self.sequence_parallel)  # (B, T, d)


class VocabParallelEmbedding(nn.Embedding):
    """Rows [r·V/t, (r+1)·V/t) of the padded vocabulary. A rank looks up the ids it owns (zeros
    elsewhere); g sums the rows over tp."""

    def __init__(self, num_embeddings, dim, group, sequence_parallel):
        super().__init__(num_embeddings // group.size, dim, device="meta")
        self.group, self.sequence_parallel = group, sequence_parallel
        self.vocab_start = group.rank * self.num_embeddings
        shard(self.weight, 0, group)

    def forward(self, ids):
        local = ids - self.vocab_start  # (B, T)
        mine = (local >= 0) & (local < self.num_embeddings)
        x = F.embedding(local.clamp(0, self.num_embeddings - 1), self.weight) * mine.unsqueeze(-1)
        x = x.to(compute_dtype(x))  # (B, T, d): summed in the compute dtype
        return LeaveTP.apply(x, self.group, self.sequence_parallel)


# ---------------------------------------------------------------- vocab-parallel cross-entropy

class VocabParallelCrossEntropy(Function):
    """Mean cross-entropy from this rank's vocabulary shard of the logits, (N, V/t) at vocab_start.
    combine() makes each shard's log-sum-exp and target logit global. Backward is local. Columns
    past vocab_size are padding."""

    @staticmethod
    def forward(ctx, logits, targets, vocab_start, combine, vocab_size=None, overwrite=False):
        n, vocab = logits.shape
        real = vocab if vocab_size is None else min(max(vocab_size - vocab_start, 0), vocab)
        local = targets - vocab_start
        mine = (local >= 0) & (local < vocab)  # the target's logit lives in this shard
        local = local.clamp(0, vocab - 1)
        lse = log_sum_exp(logits, real)
        target_logit = logits.gather(1, local[:, None]).squeeze(1).float() * mine  # (N,)
        lse, target_logit = combine(lse, target_logit)
        ctx.save_for_backward(logits, lse, local, mine)
        ctx.real, ctx.overwrite = real, overwrite
        return (lse - target_logit).mean()

    @staticmethod
    def backward(ctx, grad):
        logits, lse, local, mine = ctx.saved_tensors
        scale = grad / logits.shape[0]
        out = logits if ctx.overwrite else None  # model.CrossEntropy's `overwrite`
        grad_logits = softmax_minus_onehot(logits, lse, local, mine, ctx.real, scale, out)
        return grad_logits, None, None, None, None, None


def combine_over_vocab_shards(group):
    """log Σ_r exp(lse_r) and Σ_r target_logit_r, from one all-gather of (2, N) fp32 per rank."""
    def combine(lse, target_logit):
        stats = torch.stack([lse, target_logit])  # (2, N)
        gathered = stats.new_empty((group.size * 2, stats.shape[1]))
        group.all_gather(gathered, stats)
        gathered = gathered.view(group.size, 2, -1)  # (t, 2, N)
        return torch.logsumexp(gathered[:, 0], dim=0), gathered[:, 1].sum(0)
    return combine


class VocabParallelLoss:
    """GPT.loss_fn under tp: logits (B, T, V/t), targets (B, T) -> the local tokens' mean."""

    def __init__(self, group, vocab_per_rank, vocab_size=None, overwrite=False):
        self.vocab_start, self.vocab_size = group.rank * vocab_per_rank, vocab_size
        self.combine, self.overwrite = combine_over_vocab_shards(group), overwrite

    def __call__(self, logits, targets):
        return VocabParallelCrossEntropy.apply(logits.flatten(0, 1), targets.flatten(),
                                               self.vocab_start, self.combine, self.vocab_size,
                                               self.overwrite)


# ---------------------------------------------------------------- applying it to a GPT chunk

def validate(cfg, tp, cp=1, sequence_parallel=False):
    for field in ("n_head", "n_kv_head", "ffn_dim"):
        if getattr(cfg, field) % tp:
            flag = "--" + field.replace("_", "-")
            n = getattr(cfg, field)
            raise LayoutError("--tp", f"{field} {n} is not divisible by tp {tp} ({flag})")
    if cfg.padded_vocab % tp:
        raise LayoutError("--tp", f"the vocab {cfg.vocab_size}, padded to {cfg.padded_vocab}, "
                                  f"is not divisible by tp {tp}")
    if sequence_parallel and cfg.seq_len % (cp * tp):
        raise LayoutError("--sp", f"seq_len {cfg.seq_len} is not divisible by cp x tp = "
                          f"{cp} x {tp}: sequence parallel shards each rank's tokens over tp")


def parallelize_attention(attn, cfg, group, sequence_parallel):
    """Heads split over tp: q, k, v column-parallel, o row-parallel. Attention reads its local head
    counts H/t and Hkv/t from the shapes, and q head h still meets kv head h·Hkv/H."""
    d, hd = cfg.d_model, cfg.head_dim
    attn.q_proj = ColumnParallelLinear(d, cfg.n_head * hd, group)
    attn.k_proj = ColumnParallelLinear(d, cfg.n_kv_head * hd, group)
    attn.v_proj = ColumnParallelLinear(d, cfg.n_kv_head * hd, group)
    attn.o_proj = RowParallelLinear(cfg.n_head * hd, d, group, sequence_parallel)


def parallelize_mlp(mlp, cfg, group, sequence_parallel):
    """SwiGLU: gate and up column-parallel, silu(gate)·up on local columns, down row-parallel."""
    mlp.gate_proj = ColumnParallelLinear(cfg.d_model, cfg.ffn_dim, group)
    mlp.up_proj = ColumnParallelLinear(cfg.d_model, cfg.ffn_dim, group)
    mlp.down_proj = RowParallelLinear(cfg.ffn_dim, cfg.d_model, group, sequence_parallel)


def parallelize(chunk, mesh, sequence_parallel=False):
    """Swaps a meta GPT chunk's modules for ones sharded over mesh.tp_group, names unchanged."""
    cfg, sp, group = chunk.cfg, sequence_parallel, mesh.tp_group
    validate(cfg, group.size, mesh.cp, sp)
    if chunk.embed_tokens is not None:
        chunk.embed_tokens = VocabParallelEmbedding(cfg.padded_vocab, cfg.d_model, group, sp)
    for block in chunk.layers.values():
        block.input_layernorm = NormThenEnterTP(block.input_layernorm, group, sp)
        parallelize_attention(block.self_attn, cfg, group, sp)
        block.post_attention_layernorm = NormThenEnterTP(block.post_attention_layernorm, group, sp)
        parallelize_mlp(block.mlp, cfg, group, sp)
    if chunk.lm_head is not None:
        chunk.norm = NormThenEnterTP(chunk.norm, group, sp)
        chunk.lm_head = ColumnParallelLinear(cfg.d_model, cfg.padded_vocab, group)  # (B, T, V/t)
        chunk.loss_fn = VocabParallelLoss(group, cfg.padded_vocab // group.size, cfg.vocab_size,
                                          overwrite=True)  # as GPT's own loss
    if sp:
        chunk.seq_shards = group.size  # hidden states hold T/t tokens; RoPE still needs all T
    return chunk
