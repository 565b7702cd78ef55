"""Tensor parallel (Megatron) on mesh.tp_group, with optional sequence parallel (--sp).

Split:    q/k/v and gate/up by output rows (whole heads, GQA kv heads too; whole ffn columns), o and down by
          input columns; the embedding and lm_head by (padded) vocab rows. Column then row (L27): with
          A = [A_1 .. A_t] and B = [B_1; ..; B_t],  φ(X·A)·B = Σ_i φ(X·A_i)·B_i  for any columnwise φ
          (SwiGLU, per-head attention), so each attention and each MLP needs one all-reduce (the Σ).
Sends:    per layer per micro-batch, 2 all-reduces of the (b, s, d) activation in forward (after o, down) and
          2 in backward (before q/k/v, gate/up): 4 · 2(t-1)/t · 4bsd bytes in fp32; plus 1 for the embedding
          (fwd) and 1 for lm_head's input (bwd), and the loss all-gathers 2 floats per token.
          --sp: each all-reduce becomes its halves, a reduce-scatter and an all-gather along the sequence: the
          same bytes; backward gathers each norm output again for the weight grads (2 per layer, 1 for the head:
          +1/4 bytes); sequence-sharded norm weights get one grad all-reduce per step (tp_partial_grad).
Overlap:  none: each collective sits on the critical path, which is why tp stays on one server's NVLink.
Memory:   weights, grads and Adam state of every matmul / t; attention and MLP activations / t; with --sp also
          the residual stream, norms, dropout masks and the matmuls' saved inputs / t (no (b, s, d) tensor is
          kept for backward). Logits stay (tokens, V/t): the vocab-parallel loss never builds (tokens, V).
"""
import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd import Function

from model import CrossEntropy, RMSNorm
from parallel import tag_tp_shard
from parallel.mesh import LayoutError

# ---------------------------------------------------------------- the four collectives of Megatron TP

def all_gather_seq(group, x):
    """(B, T/t, d) -> (B, T, d): every tp rank's sequence block, in rank order."""
    local = x.transpose(0, 1).contiguous()  # (T/t, B, d): the collective concatenates along dim 0
    out = local.new_empty((local.shape[0] * group.size, *local.shape[1:]))  # (T, B, d)
    group.all_gather(out, local)
    return out.transpose(0, 1).contiguous()


def reduce_scatter_seq(group, x):
    """(B, T, d) partial sums -> (B, T/t, d): this rank's sequence block of the sum over tp."""
    full = x.transpose(0, 1).contiguous()  # (T, B, d)
    out = full.new_empty((full.shape[0] // group.size, *full.shape[1:]))  # (T/t, B, d)
    group.reduce_scatter(out, full)
    return out.transpose(0, 1).contiguous()


def all_reduce(group, x):
    out = x.contiguous().clone()  # never modify a tensor autograd (or selective checkpointing) may hold
    group.all_reduce(out)
    return out


class CopyToTP(Function):
    """Megatron's f: identity in forward, all-reduce in backward (each rank's grad is a partial sum)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        return all_reduce(ctx.group, grad), None


class ReduceFromTP(Function):
    """Megatron's g: all-reduce in forward (sum the row-parallel partial outputs), identity in backward."""

    @staticmethod
    def forward(ctx, x, group):
        return all_reduce(group, x)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class GatherSequence(Function):
    """Sequence parallel's f: all-gather the sequence in forward, reduce-scatter the grad in backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return all_gather_seq(group, x)

    @staticmethod
    def backward(ctx, grad):
        return reduce_scatter_seq(ctx.group, grad), None


class ScatterSequence(Function):
    """Sequence parallel's g: reduce-scatter the partial sums in forward, all-gather the grad in backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return reduce_scatter_seq(group, x)

    @staticmethod
    def backward(ctx, grad):
        return all_gather_seq(ctx.group, grad), None


class GatheredInput:
    """The sequence all-gather of one norm output under --sp, as the column-parallel linears reading it save it:
    this rank's (B, T/t, d) shard, gathered again in backward once for all of them (as Megatron does), instead
    of each keeping the (B, T, d) tensor until backward."""

    def __init__(self, group):
        self.group, self.users, self.full = group, 0, None

    def regather(self, shard, dtype):
        if self.full is None:
            self.full = all_gather_seq(self.group, shard).to(dtype)  # (B, T, d) in the grads' dtype
        return self.full

    def release(self):
        self.users -= 1
        if self.users == 0:
            self.full = None


class LinearOnGathered(Function):
    """y = x_full · Wᵀ that saves the shard x_full was gathered from, not x_full (see GatheredInput)."""

    @staticmethod
    def forward(ctx, full, shard, weight, gathered):
        ctx.gathered = gathered
        gathered.users += 1
        ctx.save_for_backward(shard, weight)
        return F.linear(full, weight)

    @staticmethod
    def backward(ctx, grad):  # grad: (B, T, out/t)
        shard, weight = ctx.saved_tensors
        full = ctx.gathered.regather(shard, grad.dtype)  # (B, T, d)
        grad_full = grad @ weight.to(grad.dtype)  # (B, T, d)
        grad_weight = grad.flatten(0, 1).t() @ full.flatten(0, 1)  # (out/t, d)
        ctx.gathered.release()
        return grad_full, None, grad_weight, None


def enter_tp(x, group, sequence_parallel):
    """Replicated (or sequence-sharded) activation -> the full input every column-parallel rank needs."""
    if not sequence_parallel:
        return CopyToTP.apply(x, group)
    full = GatherSequence.apply(x, group)
    full.sequence_shard = x, GatheredInput(group)  # what ColumnParallelLinear saves in place of `full`
    return full


def leave_tp(x, group, sequence_parallel):
    """Partial sums over tp -> the replicated (or sequence-sharded) residual stream."""
    return ScatterSequence.apply(x, group) if sequence_parallel else ReduceFromTP.apply(x, group)


# ---------------------------------------------------------------- sharded modules

def shard(param, dim, group):
    """Tags a param as this rank's block of a global tensor (parallel/__init__.py): init gives it that slice."""
    return tag_tp_shard(param, dim, group.rank, group.size)


class ColumnParallelLinear(nn.Linear):
    """y_i = x · A_iᵀ, this rank's block of output features (B, T, out/t). The input must already be the full
    activation: the preceding norm enters the tp region once for all projections that read it (q, k, v)."""

    def __init__(self, in_features, out_features, group):
        super().__init__(in_features, out_features // group.size, bias=False, device="meta")
        shard(self.weight, 0, group)

    def forward(self, x):
        if not hasattr(x, "sequence_shard"):
            return F.linear(x, self.weight)
        local, gathered = x.sequence_shard
        return LinearOnGathered.apply(x, local, self.weight, gathered)  # (B, T, out/t)


class RowParallelLinear(nn.Linear):
    """z = Σ_i y_i · B_iᵀ: multiplies this rank's input features, then sums over tp (all-reduce, or
    reduce-scatter along the sequence under --sp)."""

    def __init__(self, in_features, out_features, group, sequence_parallel):
        super().__init__(in_features // group.size, out_features, bias=False, device="meta")
        self.group, self.sequence_parallel = group, sequence_parallel
        shard(self.weight, 1, group)

    def forward(self, x):
        return leave_tp(F.linear(x, self.weight), self.group, self.sequence_parallel)  # (B, T[/t], d)


class NormThenEnter(RMSNorm):
    """The RMSNorm in front of a column-parallel block, followed by f (or the sequence all-gather). Same
    `weight` name. Under --sp it sees only this rank's tokens, so its weight grad is a partial sum over tp."""

    def __init__(self, norm, group, sequence_parallel):
        super().__init__(norm.weight.shape[0], norm.eps)
        self.weight = nn.Parameter(torch.empty_like(norm.weight, device="meta"))
        self.group, self.sequence_parallel = group, sequence_parallel
        self.weight.tp_partial_grad = sequence_parallel

    def forward(self, x):
        return enter_tp(super().forward(x), self.group, self.sequence_parallel)


class VocabParallelEmbedding(nn.Embedding):
    """Rows [r·V/t, (r+1)·V/t) of the padded vocab. Each rank looks up the ids it owns (zeros elsewhere);
    the sum over tp is the full embedding (all-reduce, or reduce-scatter along the sequence under --sp)."""

    def __init__(self, num_embeddings, dim, group, sequence_parallel):
        super().__init__(num_embeddings // group.size, dim, device="meta")
        self.group, self.sequence_parallel = group, sequence_parallel
        self.vocab_start = group.rank * self.num_embeddings
        shard(self.weight, 0, group)

    def forward(self, ids):
        local = ids - self.vocab_start  # (B, T)
        mine = (local >= 0) & (local < self.num_embeddings)
        x = F.embedding(local.clamp(0, self.num_embeddings - 1), self.weight) * mine.unsqueeze(-1)  # (B, T, d)
        return leave_tp(x, self.group, self.sequence_parallel)


# ---------------------------------------------------------------- vocab-parallel cross-entropy

def combine_over_vocab_shards(group):
    """The global per-token (lse, target logit) from each rank's over its vocabulary shard: log Σ_r exp(lse_r), and
    the target logit, which lives on one rank (zeros elsewhere), summed. Both travel in one all-gather of (2, N)
    fp32 per rank (the comm layer sums; Megatron's MAX all-reduce is not needed)."""
    def combine(lse, target_logit):
        stats = torch.stack([lse, target_logit])  # (2, N)
        gathered = stats.new_empty((group.size * 2, stats.shape[1]))
        group.all_gather(gathered, stats)
        gathered = gathered.view(group.size, 2, -1)  # (t, 2, N)
        return torch.logsumexp(gathered[:, 0], dim=0), gathered[:, 1].sum(0)
    return combine


class VocabParallelLoss:
    """GPT.loss_fn under tp: logits (B, T, V/t), targets (B, T) -> mean CE over the local tokens, never gathering the
    logits: model.CrossEntropy on this rank's vocabulary shard, its statistics combined over tp. Backward is local:
    softmax - onehot on the shard."""

    def __init__(self, group, vocab_per_rank):
        self.vocab_start, self.combine = group.rank * vocab_per_rank, combine_over_vocab_shards(group)

    def __call__(self, logits, targets):
        return CrossEntropy.apply(logits.flatten(0, 1), targets.flatten(), self.vocab_start, self.combine)


# ---------------------------------------------------------------- applying it to a GPT chunk

def validate(cfg, tp, cp=1, sequence_parallel=False):
    for field, flag in (("n_head", "--n-head"), ("n_kv_head", "--n-kv-head"), ("ffn_dim", "--ffn-dim")):
        if getattr(cfg, field) % tp:
            raise LayoutError("--tp", f"{field} {getattr(cfg, field)} is not divisible by tp {tp} ({flag})")
    if cfg.padded_vocab % tp:
        raise LayoutError("--tp", f"the vocab {cfg.vocab_size}, padded to {cfg.padded_vocab}, "
                                  f"is not divisible by tp {tp}")
    if sequence_parallel and cfg.seq_len % (cp * tp):
        raise LayoutError("--sp", f"seq_len {cfg.seq_len} is not divisible by cp x tp = {cp} x {tp}: "
                                  "sequence parallel shards each rank's tokens over tp")


def parallelize_attention(attn, cfg, group, sequence_parallel):
    """Heads split over tp: q, k, v column-parallel (whole heads), o row-parallel. Attention reads the
    local head counts H/t and Hkv/t from the tensor shapes, and q head h still meets kv head h·Hkv/H."""
    d, hd = cfg.d_model, cfg.head_dim
    attn.q_proj = ColumnParallelLinear(d, cfg.n_head * hd, group)
    attn.k_proj = ColumnParallelLinear(d, cfg.n_kv_head * hd, group)
    attn.v_proj = ColumnParallelLinear(d, cfg.n_kv_head * hd, group)
    attn.o_proj = RowParallelLinear(cfg.n_head * hd, d, group, sequence_parallel)


def parallelize_mlp(mlp, cfg, group, sequence_parallel):
    """SwiGLU: gate and up column-parallel, silu(gate)·up elementwise on the local columns, down row-parallel."""
    mlp.gate_proj = ColumnParallelLinear(cfg.d_model, cfg.ffn_dim, group)
    mlp.up_proj = ColumnParallelLinear(cfg.d_model, cfg.ffn_dim, group)
    mlp.down_proj = RowParallelLinear(cfg.ffn_dim, cfg.d_model, group, sequence_parallel)


def parallelize(chunk, mesh, sequence_parallel=False):
    """Swaps a meta-device GPT chunk's modules for tp-sharded ones in place; parameter names do not change.
    Parts a pipeline stage does not own (embed_tokens, norm, lm_head) may be None."""
    cfg, group = chunk.cfg, mesh.tp_group
    validate(cfg, group.size, mesh.cp, sequence_parallel)
    sp = sequence_parallel
    if chunk.embed_tokens is not None:
        chunk.embed_tokens = VocabParallelEmbedding(cfg.padded_vocab, cfg.d_model, group, sp)
    for block in chunk.layers.values():
        block.input_layernorm = NormThenEnter(block.input_layernorm, group, sp)
        parallelize_attention(block.self_attn, cfg, group, sp)
        block.post_attention_layernorm = NormThenEnter(block.post_attention_layernorm, group, sp)
        parallelize_mlp(block.mlp, cfg, group, sp)
    if chunk.norm is not None:
        chunk.norm = NormThenEnter(chunk.norm, group, sp)  # under --sp: all-gathered before lm_head
    if chunk.lm_head is not None:
        chunk.lm_head = ColumnParallelLinear(cfg.d_model, cfg.padded_vocab, group)  # logits (B, T, V/t)
        chunk.loss_fn = VocabParallelLoss(group, cfg.padded_vocab // group.size)
    if sp:
        chunk.seq_shards = group.size  # hidden states carry T/t tokens; rope still needs all T positions
    return chunk


# -------------------------------------------------------------- traffic formulas (the planner's --code ours uses these)

def seq_collective_bytes(tokens, d_model, tp, elem_bytes):
    """Bytes one rank sends in an all_gather_seq or reduce_scatter_seq of (tokens, d): (tp-1)/tp · tokens · d · e."""
    return (tp - 1) / tp * tokens * d_model * elem_bytes


def activation_collectives(layers, embedding, head, sequence_parallel, recompute):
    """(tokens, d) collectives per micro-batch, an all-reduce counting 2: 8 a block (sp 10), +2 recomputed (sp 3),
    2 the embedding, 2 the head (sp 3: its input gathered again in backward)."""
    sp = sequence_parallel
    return layers * (8 + 2 * sp + recompute * (3 if sp else 2)) + 2 * embedding + (2 + sp) * head


def loss_bytes(tokens, tp):
    """Bytes one rank sends in the vocab-parallel loss's all-gather of (2, tokens) fp32: (tp-1) · 2 · tokens · 4."""
    return (tp - 1) * 2 * tokens * 4
