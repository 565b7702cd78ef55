"""A layer on tensor parallel (tp.py): the column linears that read one input, as one Function.

train.build switches it in after tp.parallelize. fp8 and the zero-bubble split keep tp's plain path.
Parameters, names and collectives stay. f and the column matmuls of one input become one Function:
q, k, v; gate, up; lm_head.
Overlap:  backward sums the readers' input gradients once. That sum's all-reduce runs under the
          weight-gradient matmuls (--no-overlap: it blocks).
Memory:   under --sp only this rank's block of the input is saved, not the gathered sequence.
          Backward gathers it again: 2L+1 more all-gathers of (b, T, d) a step, 1/4 more bytes.
"""
from collections import namedtuple

import torch.nn.functional as F
from torch.autograd import Function

from model import RMSNorm
from parallel.tp import ColumnParallelLinear, NormThenEnterTP, all_gather_seq, reduce_scatter_seq

# What a fused norm hands its readers: their outputs (B, T, out/t) in slot order; the input's shape.
ColumnInput = namedtuple("ColumnInput", "shape outputs")


def input_grad(grads, weights, dtype):
    """Σ_j dy_j · W_j summed in `dtype` (the input's): this rank's part of the input's gradient."""
    parts = [(g @ w.to(g.dtype)).to(dtype) for g, w in zip(grads, weights)]  # (B, T, d) each
    return sum(parts[1:], parts[0])


class ColumnParallel(Function):
    """f fused with the column matmuls that read x: y_j = x · W_jᵀ, each (B, T, out_j/t).

    x is the replicated (B, T, d), or under --sp this rank's block (B, T/t, d). The block is
    gathered in forward and again in backward. Backward reduces the summed input gradient under
    the weight-gradient matmuls.
    """

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


def apply(chunk, overlap=True):
    """Fuses each norm of a tp-parallelized chunk with the column linears that read it, in place.
    Like torch's parametrize it swaps classes: parameters, names and tags stay. overlap=False
    (--no-overlap): the input gradient's all-reduce blocks."""
    for block in chunk.layers.values():
        attn, mlp = block.self_attn, block.mlp
        fuse(block.input_layernorm, [attn.q_proj, attn.k_proj, attn.v_proj], overlap)
        fuse(block.post_attention_layernorm, [mlp.gate_proj, mlp.up_proj], overlap)
    if chunk.lm_head is not None:
        fuse(chunk.norm, [chunk.lm_head], overlap)
    return chunk
