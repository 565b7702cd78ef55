"""Tensor parallel (Megatron-LM) over the tp group of t ranks, with sequence parallel (--sp).

Split:    q, k, v, gate, up by output features (whole heads, GQA kv heads too), o and down by input features, the
          embedding and lm_head by vocabulary rows. Column then row (L27): φ(X·[A_1 .. A_t])·[B_1; ..; B_t] =
          Σ_i φ(X·A_i)·B_i for a columnwise φ (SwiGLU, per-head attention): one sum per sublayer.
Sends:    f enters a sublayer (identity forward, input gradient all-reduced backward), g leaves it (all-reduce forward):
          per layer and micro-batch 4 all-reduces of (b, s, d), 4·2(t-1)/t·bsd·e bytes, + the embedding's g, the head's
          f and the loss's all-gather of 2 floats a token. --sp: an all-reduce becomes a reduce-scatter + all-gather
          along the sequence (same bytes), column inputs are gathered again in backward (+1/4), norm gains summed.
Overlap:  f's all-reduce of the input gradient runs under the weight-gradient matmuls; the rest blocks (tp stays on
          one server). tp_ring.py, a layer on top, cuts --sp's collectives into hops under the matmuls.
Memory:   weights, gradients, Adam state, attention and MLP activations / t; --sp: also the residual stream, norms and
          the column matmuls' saved inputs. Logits (tokens, V/t): no (tokens x V) tensor ever exists.
"""
from collections import namedtuple

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd import Function

from model import CrossEntropy, Linear, RMSNorm, compute_dtype
from parallel import tag_tp_shard
from parallel.mesh import LayoutError

# ---------------------------------------------------------------- the collectives along the sequence (--sp)

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
    """The sum of x over tp, in a new tensor (a gradient autograd hands over may be shared with another path)."""
    out = x.contiguous().clone()
    group.all_reduce(out)
    return out


# ---------------------------------------------------------------- Megatron's f and g

class EnterTP(Function):
    """f: identity forward (--sp: gather the sequence), the input gradient summed over tp backward (--sp: reduce-
    scattered). Used on its own where the matmuls are autograd ops of their own (the matmul hook); otherwise
    ColumnParallel fuses it with them."""

    @staticmethod
    def forward(ctx, x, group, sequence_parallel):
        ctx.group, ctx.sp = group, sequence_parallel
        return all_gather_seq(group, x) if sequence_parallel else x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return reduce_scatter_seq(ctx.group, grad) if ctx.sp else all_reduce(ctx.group, grad), None, None


class LeaveTP(Function):
    """g: all-reduce forward, the sum of the row-parallel partial outputs (--sp: reduce-scattered along the
    sequence); identity backward (--sp: the gradient all-gathered)."""

    @staticmethod
    def forward(ctx, x, group, sequence_parallel):
        ctx.group, ctx.sp = group, sequence_parallel
        if sequence_parallel:
            return reduce_scatter_seq(group, x)
        if x._base is not None:  # a view a custom matmul returned (fp8.py): autograd forbids changing it in place
            return all_reduce(group, x)
        ctx.mark_dirty(x)  # a fresh matmul output that no backward reads: summed in place
        group.all_reduce(x)
        return x

    @staticmethod
    def backward(ctx, grad):
        return all_gather_seq(ctx.group, grad) if ctx.sp else grad, None, None


def input_grad(grads, weights, dtype):
    """Σ_j dy_j · W_j summed in `dtype` (the input's): this rank's part of the gradient of the shared input."""
    parts = [(g @ w.to(g.dtype)).to(dtype) for g, w in zip(grads, weights)]  # (B, T, d) each
    return sum(parts[1:], parts[0])


class ColumnParallel(Function):
    """f fused with the column-parallel matmuls reading one input (q, k, v; gate, up; lm_head): y_j = x · W_jᵀ, each
    (B, T, out_j/t). One Function, so that backward sums their input gradients once and reduces that sum while the
    weight gradients are computed. x is the replicated (B, T, d), or under --sp this rank's block (B, T/t, d): gathered
    in forward and gathered again in backward (only the block is saved), the input gradient reduce-scattered.
    deferred (the weight_grads hook): (store, the weights forward read); their gradients wait in the store."""

    @staticmethod
    def forward(ctx, x, group, sequence_parallel, overlap, deferred, *weights):
        ctx.group, ctx.sp, ctx.overlap, ctx.deferred = group, sequence_parallel, overlap, deferred
        ctx.save_for_backward(x, *weights)
        full = all_gather_seq(group, x) if sequence_parallel else x  # (B, T, d)
        return tuple(F.linear(full, w) for w in weights)

    @staticmethod
    def backward(ctx, *grads):  # dy_j: (B, T, out_j/t)
        x, *weights = ctx.saved_tensors

        def gathered():  # x over the whole sequence (B, T, d): under --sp gathered again from the saved block
            return all_gather_seq(ctx.group, x) if ctx.sp else x

        def weight_grads(full):  # dW_j = dy_jᵀ · x_full: (out_j/t, d)
            return [g.flatten(0, 1).t() @ full.flatten(0, 1).to(g.dtype) for g in grads]
        full = None if ctx.deferred else gathered()
        grad_x = input_grad(grads, weights, x.dtype)  # (B, T, d)
        pending = None
        if ctx.sp:
            grad_x = reduce_scatter_seq(ctx.group, grad_x)  # (B, T/t, d)
        else:  # summed in place, no clone: grad_x was made just now, and nothing else refers to it
            pending = ctx.group.all_reduce(grad_x, async_op=ctx.overlap)
        if ctx.deferred:  # the weight_grads hook: the schedule's W runs the matmuls (and --sp's gather) later
            ctx.deferred[0].defer(ctx.deferred[1], lambda: weight_grads(gathered()))
        grads_w = [None] * len(weights) if ctx.deferred else weight_grads(full)
        if pending is not None:
            pending.wait()  # the all-reduce travelled under the weight-gradient matmuls
        return grad_x, None, None, None, None, *grads_w


# ---------------------------------------------------------------- sharded modules

def shard(param, dim, group):
    """Tags a param as this rank's block of a global tensor (parallel/__init__.py): init gives it that slice."""
    return tag_tp_shard(param, dim, group.rank, group.size)


# What NormThenEnter hands the column-parallel linears reading it: their outputs (B, T, out/t), computed together, in
# `readers` order; `shape` is the full activation's (B, T, d).
ColumnInput = namedtuple("ColumnInput", "shape outputs")


class ColumnParallelLinear(Linear):
    """y_i = x · A_iᵀ, this rank's block of output features (B, T, out/t). The norm in front (NormThenEnter) runs the
    matmul with the other linears reading the same input; x is its ColumnInput, from which this picks its own."""

    def __init__(self, in_features, out_features, group, slot=0):
        super().__init__(in_features, out_features // group.size, device="meta")
        shard(self.weight, 0, group)
        self.slot = slot  # its place among the readers of its input

    def forward(self, x):
        return x.outputs[self.slot]  # (B, T, out/t)


class RowParallelLinear(Linear):
    """z = Σ_i y_i · B_iᵀ: multiplies this rank's input features (Linear's forward, hooks included), then g sums over
    tp (all-reduce, or reduce-scatter along the sequence under --sp)."""

    def __init__(self, in_features, out_features, group, sequence_parallel):
        super().__init__(in_features // group.size, out_features, device="meta")
        self.group, self.sequence_parallel = group, sequence_parallel
        shard(self.weight, 1, group)

    def forward(self, x):  # x: (B, T, in/t) -> (B, T, d), or its sequence block (B, T/t, d) under --sp
        partial_sum = super().forward(x)  # a statement of its own: where a graph breaks in it (fp8), dynamo resumes
        return LeaveTP.apply(partial_sum, self.group, self.sequence_parallel)  # without LeaveTP.apply (new each call)


class NormThenEnter(RMSNorm):
    """The RMSNorm in front of column-parallel linears (`readers`, in slot order; not submodules), then f and their
    matmuls (enter_tp). The same `weight` name as the norm it replaces. Under --sp it sees only this rank's tokens,
    so its gain's gradient is a partial sum over tp."""

    def __init__(self, norm, group, sequence_parallel, readers, overlap=True):
        super().__init__(norm.weight.shape[0], norm.eps)
        self.weight = nn.Parameter(torch.empty_like(norm.weight, device="meta"))
        self.group, self.sequence_parallel, self.readers, self.overlap = group, sequence_parallel, readers, overlap
        self.weight.tp_partial_grad = sequence_parallel

    def forward(self, x):
        h = super().forward(x)  # (B, T, d), or this rank's block (B, T/t, d) under --sp
        return enter_tp(h, self.group, self.sequence_parallel, self.readers, self.overlap)


def enter_tp(x, group, sequence_parallel, readers, overlap=True):
    """f and the matmuls of the column-parallel linears `readers` that read x: their ColumnInput. Readers with a
    matmul hook (fp8) run it after f, one autograd op each; with a weight_grads hook, their weight gradients wait in
    its store (no autograd edge to the weights)."""
    B, T, d = x.shape
    shape = (B, T * group.size if sequence_parallel else T, d)
    if any(r.matmul is not None for r in readers):
        full = EnterTP.apply(x, group, sequence_parallel)  # (B, T, d)
        return ColumnInput(shape, [r.matmul(full, r.weight) for r in readers])
    weights, deferred, store = [r.weight for r in readers], None, readers[0].weight_grads
    if store is not None and torch.is_grad_enabled():
        weights, deferred = [w.detach() for w in weights], (store, weights)
    return ColumnInput(shape, ColumnParallel.apply(x, group, sequence_parallel, overlap, deferred, *weights))


class VocabParallelEmbedding(nn.Embedding):
    """Rows [r·V/t, (r+1)·V/t) of the padded vocab. Each rank looks up the ids it owns (zeros elsewhere); g sums over
    tp to the full embedding (all-reduce, or reduce-scatter along the sequence under --sp)."""

    def __init__(self, num_embeddings, dim, group, sequence_parallel):
        super().__init__(num_embeddings // group.size, dim, device="meta")
        self.group, self.sequence_parallel = group, sequence_parallel
        self.vocab_start = group.rank * self.num_embeddings
        shard(self.weight, 0, group)

    def forward(self, ids):
        local = ids - self.vocab_start  # (B, T)
        mine = (local >= 0) & (local < self.num_embeddings)
        x = F.embedding(local.clamp(0, self.num_embeddings - 1), self.weight) * mine.unsqueeze(-1)  # (B, T, d)
        return LeaveTP.apply(x.to(compute_dtype(x)), self.group, self.sequence_parallel)  # summed in the compute dtype


# ---------------------------------------------------------------- vocab-parallel cross-entropy

def combine_over_vocab_shards(group):
    """The global per-token (lse, target logit) from each rank's over its vocabulary shard: log Σ_r exp(lse_r), and the
    target logit, which lives on one rank (zeros elsewhere), summed. Both travel in one all-gather of (2, N) fp32 per
    rank (the comm layer sums; Megatron's MAX all-reduce is not needed)."""
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

    def __init__(self, group, vocab_per_rank, vocab_size=None):
        self.vocab_start, self.combine = group.rank * vocab_per_rank, combine_over_vocab_shards(group)
        self.vocab_size = vocab_size  # the columns at or past it are padding: masked in model.CrossEntropy

    def __call__(self, logits, targets):
        return CrossEntropy.apply(logits.flatten(0, 1), targets.flatten(), self.vocab_start, self.combine,
                                  self.vocab_size)


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
    """Heads split over tp: q, k, v column-parallel (whole heads), o row-parallel. Attention reads the local head
    counts H/t and Hkv/t from the tensor shapes, and q head h still meets kv head h·Hkv/H."""
    d, hd = cfg.d_model, cfg.head_dim
    attn.q_proj = ColumnParallelLinear(d, cfg.n_head * hd, group)
    attn.k_proj = ColumnParallelLinear(d, cfg.n_kv_head * hd, group, slot=1)
    attn.v_proj = ColumnParallelLinear(d, cfg.n_kv_head * hd, group, slot=2)
    attn.o_proj = RowParallelLinear(cfg.n_head * hd, d, group, sequence_parallel)
    return [attn.q_proj, attn.k_proj, attn.v_proj]  # the readers of the norm in front, in slot order


def parallelize_mlp(mlp, cfg, group, sequence_parallel):
    """SwiGLU: gate and up column-parallel, silu(gate)·up elementwise on the local columns, down row-parallel."""
    mlp.gate_proj = ColumnParallelLinear(cfg.d_model, cfg.ffn_dim, group)
    mlp.up_proj = ColumnParallelLinear(cfg.d_model, cfg.ffn_dim, group, slot=1)
    mlp.down_proj = RowParallelLinear(cfg.ffn_dim, cfg.d_model, group, sequence_parallel)
    return [mlp.gate_proj, mlp.up_proj]


def parallelize(chunk, mesh, sequence_parallel=False, overlap=True):
    """Swaps a meta-device GPT chunk's modules for ones sharded over mesh.tp_group, in place; parameter names do not
    change. Parts a pipeline stage does not own (embed_tokens, norm, lm_head) may be None. overlap=False
    (--no-overlap): f's all-reduce blocks too."""
    cfg, sp, group = chunk.cfg, sequence_parallel, mesh.tp_group
    validate(cfg, group.size, mesh.cp, sp)
    if chunk.embed_tokens is not None:
        chunk.embed_tokens = VocabParallelEmbedding(cfg.padded_vocab, cfg.d_model, group, sp)
    for block in chunk.layers.values():
        readers = parallelize_attention(block.self_attn, cfg, group, sp)
        block.input_layernorm = NormThenEnter(block.input_layernorm, group, sp, readers, overlap)
        readers = parallelize_mlp(block.mlp, cfg, group, sp)
        block.post_attention_layernorm = NormThenEnter(block.post_attention_layernorm, group, sp, readers, overlap)
    if chunk.lm_head is not None:  # a pipeline stage holds norm and lm_head together, or neither
        chunk.lm_head = ColumnParallelLinear(cfg.d_model, cfg.padded_vocab, group)  # logits (B, T, V/t)
        chunk.loss_fn = VocabParallelLoss(group, cfg.padded_vocab // group.size, cfg.vocab_size)
        chunk.norm = NormThenEnter(chunk.norm, group, sp, [chunk.lm_head], overlap)
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
