"""Tensor parallel (Megatron) on mesh.tp_group, with optional sequence parallel (--sp).

Split:    q/k/v and gate/up by output rows (whole heads, GQA kv heads too; whole ffn columns), o and down by input
          columns, the embedding and lm_head by (padded) vocab rows. Column then row (L27): φ(X·[A_1 .. A_t])·[B_1;
          ..; B_t] = Σ_i φ(X·A_i)·B_i for columnwise φ (SwiGLU, per-head attention): one all-reduce (Σ) per sublayer.
Sends:    per layer per micro-batch, 4 all-reduces of the (b, s, d) activation, after o and down (fwd) and of the input
          grad of q/k/v and gate/up (bwd): 4 · 2(t-1)/t · 4bsd bytes in fp32; +1 the embedding's (fwd), +1 lm_head's
          input grad (bwd); the loss all-gathers 2 floats a token. --sp: each all-reduce is a reduce-scatter + an
          all-gather along the sequence (same bytes), the 2L+1 norm outputs are gathered again in backward (+1/4), the
          sequence-sharded norm weights' grads all-reduced once a step (tp_partial_grad). Overlap changes no byte.
Overlap:  (overlap=True) the input-grad all-reduce runs under the weight-grad matmuls of its q/k/v (gate/up, lm_head);
          --sp: every gather and reduce-scatter next to a matmul goes in ring hops under its chunks (tp_overlap.py).
          Exposed: the 2 forward all-reduces a layer without --sp; the embedding's collectives; the loss's all-gather.
Memory:   weights, grads, Adam state, attention and MLP activations / t; --sp: also the residual stream, norms, dropout
          masks and the matmuls' saved inputs (no (b, s, d) kept for backward). Logits: (tokens, V/t). Rings: +1/t."""
import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd import Function

from model import CrossEntropy, RMSNorm
from parallel import tag_tp_shard, tp_overlap
from parallel.mesh import LayoutError
from parallel.tp_collectives import EnterTP, all_gather_seq, all_reduce, leave_tp, reduce_scatter_seq

# ---------------------------------------------------------------- the matmuls fused with the collectives

class ColumnParallel(Function):
    """y_j = x_full · W_jᵀ for all the column-parallel weights reading one norm output x (q, k, v; gate, up; lm_head):
    one Function, so that backward sums their input gradients once and reduces that sum over tp while it computes
    the weight gradients (Megatron's f fused with the matmuls). x: the replicated (B, T, d), or under --sp this
    rank's block (B, T/t, d): the sequence is gathered in forward, gathered again in backward for the weight
    gradients (only the block is saved) and the input gradient reduce-scattered. overlap: --sp rings them
    (tp_overlap.py), and the all-reduce without --sp is async; else one blocking collective each. deferred: the
    zero-bubble split's (WeightGrads, weights read), which queues the weight gradients and the gather of x for W."""

    @staticmethod
    def forward(ctx, x, ring, sequence_parallel, overlap, deferred, *weights):
        ctx.ring, ctx.sp, ctx.overlap, ctx.deferred = ring, sequence_parallel, overlap, deferred
        ctx.save_for_backward(x, *weights)
        if sequence_parallel and overlap:
            return tuple(tp_overlap.gather_then_multiply(ring, x, weights))
        full = all_gather_seq(ring.group, x) if sequence_parallel else x  # (B, T, d)
        return tuple(F.linear(full, w) for w in weights)  # (B, T, out_j/t) each

    @staticmethod
    def backward(ctx, *grads):  # dy_j: (B, T, out_j/t)
        x, *weights = ctx.saved_tensors
        group, dtype, flags = ctx.ring.group, grads[0].dtype, (None, None, None, None)
        if ctx.deferred is not None:
            grad_x = tp_overlap.input_grad(grads, [w.to(dtype) for w in weights], slice(None), x.dtype)  # (B, T, d)
            grad_x = reduce_scatter_seq(group, grad_x) if ctx.sp else all_reduce(group, grad_x)
            def weight_grads():  # in W: dW_j = dy_jᵀ · x_full (out_j/t, d)
                full = (all_gather_seq(group, x) if ctx.sp else x).flatten(0, 1).to(dtype)
                return [g.flatten(0, 1).t() @ full for g in grads]
            ctx.deferred[0].defer(ctx.deferred[1], weight_grads)
            return grad_x, *flags, *[None] * len(weights)
        if ctx.sp and ctx.overlap:
            grad_x, weight_grads = tp_overlap.scatter_input_grads(ctx.ring, x, grads, weights)
            return grad_x, *flags, *weight_grads
        full = (all_gather_seq(group, x) if ctx.sp else x).flatten(0, 1).to(dtype)  # (B·T, d)
        grad_x = tp_overlap.input_grad(grads, [w.to(dtype) for w in weights], slice(None), x.dtype)  # (B, T, d)
        pending = None
        if ctx.sp:
            grad_x = reduce_scatter_seq(group, grad_x)  # (B, T/t, d)
        else:  # summed in place, no clone: grad_x was made just now, and nothing else refers to it
            pending = group.all_reduce(grad_x, async_op=ctx.overlap)
        weight_grads = [g.flatten(0, 1).t() @ full for g in grads]  # (out_j/t, d)
        if pending is not None:
            pending.wait()  # the all-reduce travelled under the weight-gradient matmuls
        return grad_x, *flags, *weight_grads


class SaveForRing(Function):
    """Saves RowParallelRing's x and W before it runs (passing x on), into `saved`: a checkpointed block's recompute
    stops once its last saved tensor is back, so before the ring and its matmuls, as before F.linear's."""

    @staticmethod
    def forward(ctx, x, weight, saved):
        ctx.save_for_backward(x, weight)
        saved.append(ctx)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad, None, None


class RowParallelRing(Function):
    """z = this rank's sequence block of Σ_tp x · Wᵀ under --sp with overlap: the matmul cut by destination block
    under the ring reduce-scatter; backward gathers the gradient the same way (tp_overlap.py)."""

    @staticmethod
    def forward(ctx, x, weight, ring, saved):
        ctx.ring, ctx.saved = ring, saved  # SaveForRing's ctx, holding x and W
        return tp_overlap.multiply_then_scatter(ring, x, weight)  # (B, T/t, d)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved.saved_tensors
        return *tp_overlap.gather_then_grads(ctx.ring, grad, x, weight), None, None


class ColumnInput:
    """What NormThenEnter hands the column-parallel linears reading it: their outputs (B, T, out/t), computed
    together, in `readers` order; `shape` is the full activation's (B, T, d), which attention reads."""

    def __init__(self, shape, outputs):
        self.shape, self.outputs = shape, outputs


def enter_tp(x, ring, sequence_parallel, readers, overlap=True, weight_grads=None):
    """The norm output (B, T, d), or its block (B, T/t, d) under --sp -> the ColumnInput of the linears `readers`.
    weight_grads (pp_bw_split.WeightGrads): their weight gradients are deferred; no autograd edge to the weights."""
    weights, deferred = [m.weight for m in readers], None
    if weight_grads is not None and torch.is_grad_enabled():
        weights, deferred = [w.detach() for w in weights], (weight_grads, weights)
    outputs = ColumnParallel.apply(x, ring, sequence_parallel, overlap, deferred, *weights)
    B, T, d = x.shape
    return ColumnInput((B, T * ring.size if sequence_parallel else T, d), outputs)


# ---------------------------------------------------------------- sharded modules

def shard(param, dim, group):
    """Tags a param as this rank's block of a global tensor (parallel/__init__.py): init gives it that slice."""
    return tag_tp_shard(param, dim, group.rank, group.size)


class ColumnParallelLinear(nn.Linear):
    """y_i = x · A_iᵀ, this rank's block of output features (B, T, out/t). The preceding norm (NormThenEnter)
    computes it, with the other projections reading the same input (q, k, v): x is its ColumnInput."""

    def __init__(self, in_features, out_features, group, slot=0):
        super().__init__(in_features, out_features // group.size, bias=False, device="meta")
        shard(self.weight, 0, group)
        self.slot = slot  # its place among the readers of its input

    def forward(self, x):
        return x.outputs[self.slot]  # (B, T, out/t)


class RowParallelLinear(nn.Linear):
    """z = Σ_i y_i · B_iᵀ: multiplies this rank's input features, then sums over tp (all-reduce, or
    reduce-scatter along the sequence under --sp). weight_grads: the zero-bubble split's, which defers dW (no ring)."""
    weight_grads = None

    def __init__(self, in_features, out_features, ring, sequence_parallel, overlap=True):
        super().__init__(in_features // ring.size, out_features, bias=False, device="meta")
        self.ring, self.sequence_parallel, self.overlap = ring, sequence_parallel, overlap
        self.linear = None  # fp8.py's matmul (then no ring); None: F.linear
        shard(self.weight, 1, ring.group)

    def forward(self, x):  # x: (B, T, in/t) -> (B, T, d), or its sequence block (B, T/t, d) under --sp
        if self.weight_grads is not None:
            return leave_tp(self.weight_grads.linear(x, self.weight), self.ring.group, self.sequence_parallel)
        if self.sequence_parallel and self.overlap and self.linear is None:
            saved = []
            x = SaveForRing.apply(x, self.weight, saved)
            return RowParallelRing.apply(x, self.weight, self.ring, saved[0])
        return leave_tp((self.linear or F.linear)(x, self.weight), self.ring.group, self.sequence_parallel)


class NormThenEnter(RMSNorm):
    """The RMSNorm in front of a column-parallel block, then the block's matmuls (enter_tp) for the linears that
    read it, `readers` (not submodules; in slot order). Same `weight` name. Under --sp it sees only this rank's
    tokens, so its weight grad is a partial sum over tp."""
    weight_grads = None  # the zero-bubble split's (pp_bw_split.py): the readers' weight gradients deferred

    def __init__(self, norm, ring, sequence_parallel, readers, overlap=True):
        super().__init__(norm.weight.shape[0], norm.eps)
        self.weight = nn.Parameter(torch.empty_like(norm.weight, device="meta"))
        self.ring, self.sequence_parallel, self.readers, self.overlap = ring, sequence_parallel, readers, overlap
        self.weight.tp_partial_grad = sequence_parallel
        self.linear = None  # fp8.py's matmul, one autograd op per reader after f (EnterTP); None: ColumnParallel

    def forward(self, x):
        if self.linear is None:
            return enter_tp(super().forward(x), self.ring, self.sequence_parallel, self.readers, self.overlap,
                            self.weight_grads)
        full = EnterTP.apply(super().forward(x), self.ring.group, self.sequence_parallel)  # (B, T, d)
        return ColumnInput(full.shape, [self.linear(full, m.weight) for m in self.readers])


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


def parallelize_attention(attn, cfg, ring, sequence_parallel, overlap=True):
    """Heads split over tp: q, k, v column-parallel (whole heads), o row-parallel. Attention reads the
    local head counts H/t and Hkv/t from the tensor shapes, and q head h still meets kv head h·Hkv/H."""
    d, hd, group = cfg.d_model, cfg.head_dim, ring.group
    attn.q_proj = ColumnParallelLinear(d, cfg.n_head * hd, group)
    attn.k_proj = ColumnParallelLinear(d, cfg.n_kv_head * hd, group, slot=1)
    attn.v_proj = ColumnParallelLinear(d, cfg.n_kv_head * hd, group, slot=2)
    attn.o_proj = RowParallelLinear(cfg.n_head * hd, d, ring, sequence_parallel, overlap)
    return [attn.q_proj, attn.k_proj, attn.v_proj]  # the readers of the norm in front, in slot order


def parallelize_mlp(mlp, cfg, ring, sequence_parallel, overlap=True):
    """SwiGLU: gate and up column-parallel, silu(gate)·up elementwise on the local columns, down row-parallel."""
    mlp.gate_proj = ColumnParallelLinear(cfg.d_model, cfg.ffn_dim, ring.group)
    mlp.up_proj = ColumnParallelLinear(cfg.d_model, cfg.ffn_dim, ring.group, slot=1)
    mlp.down_proj = RowParallelLinear(cfg.ffn_dim, cfg.d_model, ring, sequence_parallel, overlap)
    return [mlp.gate_proj, mlp.up_proj]


def parallelize(chunk, mesh, sequence_parallel=False, overlap=True):
    """Swaps a meta-device GPT chunk's modules for tp-sharded ones in place; parameter names do not change.
    Parts a pipeline stage does not own (embed_tokens, norm, lm_head) may be None. overlap=False (--no-overlap):
    every collective blocks, as one call."""
    cfg, ring, sp = chunk.cfg, tp_overlap.Ring(mesh.tp_group), sequence_parallel
    validate(cfg, ring.size, mesh.cp, sp)
    if chunk.embed_tokens is not None:
        chunk.embed_tokens = VocabParallelEmbedding(cfg.padded_vocab, cfg.d_model, ring.group, sp)
    for block in chunk.layers.values():
        readers = parallelize_attention(block.self_attn, cfg, ring, sp, overlap)
        block.input_layernorm = NormThenEnter(block.input_layernorm, ring, sp, readers, overlap)
        readers = parallelize_mlp(block.mlp, cfg, ring, sp, overlap)
        block.post_attention_layernorm = NormThenEnter(block.post_attention_layernorm, ring, sp, readers, overlap)
    if chunk.lm_head is not None:  # a pipeline stage holds norm and lm_head together, or neither
        chunk.lm_head = ColumnParallelLinear(cfg.d_model, cfg.padded_vocab, ring.group)  # logits (B, T, V/t)
        chunk.loss_fn = VocabParallelLoss(ring.group, cfg.padded_vocab // ring.size, cfg.vocab_size)
        chunk.norm = NormThenEnter(chunk.norm, ring, sp, [chunk.lm_head], overlap)
    if sp:
        chunk.seq_shards = ring.size  # hidden states carry T/t tokens; rope still needs all T positions
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
