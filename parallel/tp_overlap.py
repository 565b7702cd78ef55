"""Layers on tensor parallel (tp.py) that hide its collectives under its matmuls.

build() applies fuse_columns after tp.parallelize whenever --tp is on, except under fp8 or zb1/zbv,
which keep tp's plain path. Under --sp-ring it applies `rings` on top. Both swap the classes of
tp.py's modules, as torch's parametrize does: parameters, names, tags and bytes sent stay.
fuse:     f and the column matmuls that read one input (q, k, v; gate, up; lm_head) become one
          Function. Backward sums the readers' input gradients once. That sum's all-reduce runs
          under the weight-gradient matmuls (--no-overlap: it blocks). Under --sp only this rank's
          block of the input is saved, and backward gathers it again. That is 2L+1 more
          all-gathers of (b, T, d) a step, 1/4 more bytes.
rings:    --sp's all-gathers and reduce-scatters become t-1 hops of a comm.Ring. Each hop travels
          under one step's matmuls, as the functions below show. The hops send the collective's
          bytes, counted once as that collective. Memory: one chunk arrives while one is in use.
"""
from collections import namedtuple

import torch
import torch.nn.functional as F
from torch.autograd import Function

from model import RMSNorm
from parallel.comm import Ring
from parallel.tp import (
    ColumnParallelLinear,
    NormThenEnterTP,
    RowParallelLinear,
    all_gather_seq,
    reduce_scatter_seq,
)

# What a fused norm hands its readers: their outputs (B, T, out/t) in slot order; the input's shape.
ColumnInput = namedtuple("ColumnInput", "shape outputs")


def input_grad(grads, weights, dtype, rows=slice(None)):
    """This rank's part of the input's gradient: Σ_j dy_j[:, rows] · W_j, summed in `dtype`."""
    parts = [(g[:, rows] @ w.to(g.dtype)).to(dtype) for g, w in zip(grads, weights)]  # (B, r, d)
    return sum(parts[1:], parts[0])


# ---------------------------------------------------------------- fuse: f with the column matmuls

class ColumnParallel(Function):
    """f fused with the column matmuls that read x: y_j = x · W_jᵀ, each (B, T, out_j/t).
    x: the replicated (B, T, d), or under --sp this rank's block (B, T/t, d)."""

    @staticmethod
    def forward(ctx, x, group, sequence_parallel, overlap, *weights):
        ctx.group, ctx.sp, ctx.overlap = group, sequence_parallel, overlap
        ctx.save_for_backward(x, *weights)
        full = all_gather_seq(group, x) if sequence_parallel else x  # (B, T, d)
        return tuple(F.linear(full, w) for w in weights)

    @staticmethod
    def backward(ctx, *grads):  # dy_j: (B, T, out_j/t)
        x, *weights = ctx.saved_tensors
        full = all_gather_seq(ctx.group, x) if ctx.sp else x  # (B, T, d)
        grad_x = input_grad(grads, weights, x.dtype)  # (B, T, d)
        pending = None
        if ctx.sp:
            grad_x = reduce_scatter_seq(ctx.group, grad_x)  # (B, T/t, d)
        else:  # in place: grad_x is new, and nothing else refers to it
            pending = ctx.group.all_reduce(grad_x, async_op=ctx.overlap)
        rows = full.flatten(0, 1)
        grads_w = [g.flatten(0, 1).t() @ rows.to(g.dtype) for g in grads]  # (out_j/t, d)
        if pending is not None:
            pending.wait()  # the all-reduce travelled under the weight-gradient matmuls
        return grad_x, None, None, None, *grads_w


class FusedNormThenEnter(NormThenEnterTP):
    """tp.NormThenEnterTP whose f runs with its readers' matmuls: returns their ColumnInput."""

    def forward(self, x):
        h = RMSNorm.forward(self, x)  # (B, T, d), or this rank's block (B, T/t, d) under --sp
        B, T, d = h.shape
        shape = (B, T * self.group.size if self.sequence_parallel else T, d)
        weights = [r.weight for r in self.readers]
        sp = self.sequence_parallel
        outputs = ColumnParallel.apply(h, self.group, sp, self.overlap, *weights)
        return ColumnInput(shape, outputs)


class ColumnReader(ColumnParallelLinear):
    """tp.ColumnParallelLinear whose product the fused norm in front computed: it picks its slot."""

    def forward(self, x):
        return x.outputs[self.slot]  # (B, T, out/t)


def fuse(norm, readers, overlap):
    norm.__class__, norm.readers, norm.overlap = FusedNormThenEnter, readers, overlap
    for slot, reader in enumerate(readers):
        reader.__class__, reader.slot = ColumnReader, slot


def fuse_columns(chunk, overlap=True):
    """Fuses each norm of a tp-parallelized chunk with the column linears that read it, in place."""
    for block in chunk.layers.values():
        attn, mlp = block.self_attn, block.mlp
        fuse(block.input_layernorm, [attn.q_proj, attn.k_proj, attn.v_proj], overlap)
        fuse(block.post_attention_layernorm, [mlp.gate_proj, mlp.up_proj], overlap)
    if chunk.lm_head is not None:
        fuse(chunk.norm, [chunk.lm_head], overlap)
    return chunk


# ---------------------------------------------------------------- rings: --sp-ring

def block(i, t, n):
    """The sequence positions of block i (mod t) of t blocks of n."""
    i %= t
    return slice(i * n, (i + 1) * n)


def gather_then_multiply(ring, x, weights):
    """Column forward: x, this rank's block (B, T/t, d) -> [x_full · W_jᵀ (B, T, out_j)]."""
    t, n = ring.size, x.shape[1]
    index, chunk, ys = ring.start("all_gather", t * x.nbytes), x.contiguous(), [None] * len(weights)
    for s in range(t):
        if s < t - 1:
            # rank r-s-1's block (B, T/t, d), while this one is multiplied
            (arriving,), hop = ring.hop([chunk])
        rows = block(ring.rank - s, t, n)  # whose block is in hand
        for j, w in enumerate(weights):
            y = F.linear(chunk, w)  # (B, T/t, out_j)
            if ys[j] is None:
                ys[j] = y.new_empty(y.shape[0], t * n, y.shape[2])
            ys[j][:, rows] = y
        if s < t - 1:
            hop.wait()
            chunk = arriving
    ring.finish(index)
    return ys


def multiply_then_scatter(ring, h, weight):
    """Row forward: h (B, T, k) -> this rank's block (B, T/t, d) of Σ_tp h · Wᵀ. Step s computes
    this rank's share of block r-s-1 while step s-1's accumulator travels, then adds it."""
    t, r, n = ring.size, ring.rank, h.shape[1] // ring.size
    acc = F.linear(h[:, block(r - 1, t, n)], weight)  # (B, T/t, d): step 0, rank r-1's first share
    index = ring.start("reduce_scatter", t * acc.nbytes)
    for s in range(1, t):
        (arriving,), hop = ring.hop([acc])  # rank r-1's accumulator for block r-s-1
        mine = F.linear(h[:, block(r - s - 1, t, n)], weight)  # (B, T/t, d), while it travels
        hop.wait()
        acc = arriving + mine  # (B, T/t, d)
    ring.finish(index)
    return acc  # block r - t = r: the sum over every rank


def scatter_input_grads(ring, x, grads, weights):
    """Column backward. grads: dy_j (B, T, out_j), the whole sequence. x: the saved (B, T/t, d).

    Returns this rank's block of Σ_tp Σ_j dy_j · W_j (B, T/t, d), reduce-scattered as in
    multiply_then_scatter. And dW_j = dy_jᵀ · x_full (out_j, d), x gathered in the same hops."""
    t, r, n, dtype = ring.size, ring.rank, x.shape[1], grads[0].dtype
    weights = [w.to(dtype) for w in weights]
    full = x.new_empty(x.shape[0], t * n, x.shape[2], dtype=dtype)  # x gathered, in grads' dtype
    gather, scatter = (ring.start("all_gather", t * x.nbytes),
                       ring.start("reduce_scatter", t * x.nbytes))
    chunk, acc = x, None
    for s in range(t):
        # x block r-s; the accumulator of step s-1
        sends = ([chunk] if s < t - 1 else []) + ([acc] if s > 0 else [])
        received, hop = ring.hop(sends)
        full[:, block(r - s, t, n)] = chunk
        # (B, T/t, d), while they travel
        mine = input_grad(grads, weights, x.dtype, block(r - s - 1, t, n))
        if s == t - 1:  # x is whole: the weight gradients run under the last hop
            weight_grads = [g.flatten(0, 1).t() @ full.flatten(0, 1) for g in grads]  # (out_j, d)
        hop.wait()
        if s == t - 2:
            ring.finish(gather)
        if s < t - 1:
            chunk = received[0]
        acc = mine if s == 0 else received[-1] + mine
    ring.finish(scatter)
    return acc, weight_grads


def gather_then_grads(ring, grad, h, weight):
    """Row backward. grad: this rank's block (B, T/t, d) of the output gradient; h: the saved
    (B, T, k). Returns dh = dz_full · W (B, T, k) and dW = dz_fullᵀ · h (d, k), summed in fp32."""
    t, n, dtype = ring.size, grad.shape[1], grad.dtype
    weight = weight.to(dtype)
    index, chunk = ring.start("all_gather", t * grad.nbytes), grad.contiguous()
    grad_h = h.new_empty(h.shape, dtype=dtype)
    grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
    for s in range(t):
        if s < t - 1:
            # rank r-s-1's block (B, T/t, d), while this one is used
            (arriving,), hop = ring.hop([chunk])
        rows = block(ring.rank - s, t, n)
        grad_h[:, rows] = chunk @ weight  # (B, T/t, k)
        grad_w += chunk.flatten(0, 1).t() @ h[:, rows].flatten(0, 1).to(dtype)  # (d, k)
        if s < t - 1:
            hop.wait()
            chunk = arriving
    ring.finish(index)
    return grad_h, grad_w


class RingColumnParallel(Function):
    """tp's column parallel under --sp, on rings: x, this rank's block (B, T/t, d) -> every
    y_j = x_full · W_jᵀ (B, T, out_j/t). Only the block is saved."""

    @staticmethod
    def forward(ctx, x, ring, *weights):
        ctx.ring = ring
        ctx.save_for_backward(x, *weights)
        return tuple(gather_then_multiply(ring, x, weights))

    @staticmethod
    def backward(ctx, *grads):
        x, *weights = ctx.saved_tensors
        grad_x, weight_grads = scatter_input_grads(ctx.ring, x, grads, weights)
        return grad_x, None, *weight_grads


class SaveForRing(Function):
    """Saves RowParallelRing's x and W into `saved` before it runs, and passes x on. A
    checkpointed recompute then stops before the ring and its matmuls, as before F.linear's."""

    @staticmethod
    def forward(ctx, x, weight, saved):
        ctx.save_for_backward(x, weight)
        saved.append(ctx)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad, None, None


class RowParallelRing(Function):
    """z = this rank's sequence block of Σ_tp x · Wᵀ: multiply_then_scatter, gather_then_grads."""

    @staticmethod
    def forward(ctx, x, weight, ring, saved):
        ctx.ring, ctx.saved = ring, saved  # SaveForRing's ctx, holding x and W
        return multiply_then_scatter(ring, x, weight)  # (B, T/t, d)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved.saved_tensors
        return *gather_then_grads(ctx.ring, grad, x, weight), None, None


class RingNormThenEnter(FusedNormThenEnter):
    """FusedNormThenEnter whose column matmuls ride RingColumnParallel."""

    def forward(self, x):
        h = RMSNorm.forward(self, x)  # this rank's block (B, T/t, d)
        B, T, d = h.shape
        weights = [r.weight for r in self.readers]
        return ColumnInput((B, T * self.ring.size, d),
                           RingColumnParallel.apply(h, self.ring, *weights))


class RingRowParallelLinear(RowParallelLinear):
    """tp.RowParallelLinear whose matmul and reduce-scatter ride RowParallelRing."""

    def forward(self, x):  # (B, T, in/t) -> this rank's block (B, T/t, d)
        saved = []
        x = SaveForRing.apply(x, self.weight, saved)
        return RowParallelRing.apply(x, self.weight, self.ring, saved[0])


def rings(chunk):
    """Switches a tp-parallelized chunk's --sp modules to their ring versions, in place."""
    for module in list(chunk.modules()):
        kind = {FusedNormThenEnter: RingNormThenEnter,
                RowParallelLinear: RingRowParallelLinear}.get(type(module))
        if kind is not None and module.sequence_parallel:
            module.__class__, module.ring = kind, Ring(module.group, hops_counted=False)
    return chunk
