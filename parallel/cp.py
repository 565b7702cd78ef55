"""Context parallel: the sequence is split over the cp group. Only attention needs other tokens.

Split:    zigzag: 2·CP chunks; rank r holds chunks r and 2CP-1-r, for equal causal work. Tokens,
          targets and RoPE positions move together. The DP wrapper averages over dp x cp.
Sends:    per rank and layer, in forward. b: micro-batch, s = T/CP local tokens, e: bytes per
          element, |K_r| = |V_r| = b·s·Hkv·hd·e. A step sends this x n_layer x M, plus backward.
  ring:      K,V hop around the ring, each hop under a block's attention: (CP-1)·2·|K_r|.
             Backward: the same + CP·2·|K_r|·4/e for the fp32 dK,dV (ring_attention.py).
  ulysses:   q, k, v all-to-all from (s tokens, h heads) to (T tokens, h/CP heads). SDPA with
             GQA, and back: (CP-1)/CP · b·s·(2·H + 2·lcm(Hkv, CP))·hd·e. Backward: the same.
  allgather: K,V all-gathered: (CP-1)·2·|K_r|; backward reduce-scatters dK,dV, the same size.
             Each local query chunk makes two calls, merged by log-sum-exp. One is causal on its
             own key chunk, one full on all earlier keys. ulysses and allgather do not overlap.
Memory:   activations are 1/CP of the sequence. Attention holds two K,V blocks under ring, the
          whole sequence's K,V under allgather, all of it for H/CP heads under ulysses. K,V keep
          Hkv heads; only ulysses repeats them, to lcm(Hkv, CP), when CP does not divide Hkv.
"""
import math

import torch

from model import causal_attention
from parallel.mesh import LayoutError
from parallel.ring_attention import (
    RingAttention,
    attend_blocks,
    attend_blocks_backward,
    local_chunks,
    pick_kernel,
    running_output,
)

MODES = ("ring", "ulysses", "allgather")


def validate(cfg, cp, tp, mode):
    """Raises LayoutError for a layout cp cannot run, before any work starts."""
    if mode not in MODES:
        raise LayoutError("--cp-mode", f"unknown mode {mode!r}; choose {', '.join(MODES)}")
    if cfg.seq_len % (2 * cp):
        raise LayoutError("--cp", f"seq_len {cfg.seq_len} is not divisible by 2·cp = {2 * cp} "
                                  "(the zigzag split cuts the sequence into 2·cp chunks)")
    heads = cfg.n_head // tp
    if mode == "ulysses" and heads % cp:
        raise LayoutError("--cp-mode", f"ulysses needs the heads per rank (n_head/tp = {heads}) "
                                       f"divisible by cp = {cp}")


def local_positions(seq_len, rank, cp, device=None, layout="zigzag"):
    """The sequence positions a cp rank holds, in its local order: (seq_len / CP,)."""
    chunks = local_chunks(rank, cp, layout)
    c = seq_len // (cp * len(chunks))  # chunk length: the sequence is cp·len(chunks) chunks
    return torch.cat([torch.arange(i * c, (i + 1) * c, device=device) for i in chunks])


def gathered_positions(seq_len, cp, device=None, layout="zigzag"):
    """Positions of the sequence gathered in rank order (rank 0's tokens first): (seq_len,)."""
    return torch.cat([local_positions(seq_len, r, cp, device, layout) for r in range(cp)])


def shard_batches(batches, mesh):
    """[(x, y)] of (b, T) -> this cp rank's zigzag [(x, y)] of (b, T/CP), and positions (T/CP,)."""
    x0 = batches[0][0]
    positions = local_positions(x0.shape[1], mesh.cp_group.rank, mesh.cp_group.size, x0.device)
    return [(x[:, positions], y[:, positions]) for x, y in batches], positions


# ---------------------------------------------------------------- ulysses

class _AllToAll(torch.autograd.Function):
    """Block j of dim 0 goes to rank j. Its own adjoint: backward is the same all-to-all."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        x = x.contiguous()
        out = torch.empty_like(x)
        group.all_to_all(out, x)
        return out

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        out = torch.empty_like(grad)
        ctx.group.all_to_all(out, grad)
        return out, None


def seq_to_heads(x, group):
    """(B, h, T/CP, hd) local tokens, all heads -> (B, h/CP, T, hd) all tokens in rank order."""
    B, h, s, hd = x.shape
    cp = group.size
    # (CP, B, h/CP, s, hd): head group j goes to rank j
    blocks = x.reshape(B, cp, h // cp, s, hd).transpose(0, 1)
    got = _AllToAll.apply(blocks, group)  # block j: rank j's tokens of my head group
    return got.permute(1, 2, 0, 3, 4).reshape(B, h // cp, cp * s, hd)


def heads_to_seq(y, group):
    """The inverse of seq_to_heads: (B, h/CP, T, hd) -> (B, h, T/CP, hd)."""
    B, hl, T, hd = y.shape
    cp = group.size
    # (CP, B, h/CP, s, hd): rank j's tokens go to rank j
    blocks = y.reshape(B, hl, cp, T // cp, hd).permute(2, 0, 1, 3, 4)
    got = _AllToAll.apply(blocks, group)  # block j: my tokens, head group j
    return got.transpose(0, 1).reshape(B, cp * hl, T // cp, hd)


def ulysses_attention(q, k, v, group):
    cp, kv_heads = group.size, k.shape[1]
    if kv_heads % cp:
        repeat = cp // math.gcd(kv_heads, cp)
        k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
    q, k, v = (seq_to_heads(t, group) for t in (q, k, v))  # (B, heads/CP, T, hd), zigzag rank order
    where = gathered_positions(q.shape[2], cp, q.device)  # position of each gathered token
    order = torch.argsort(where)  # gathered index of each position
    # model.causal_attention passes the kv heads as they are to a GQA kernel, repeated to others
    y = causal_attention(q[:, :, order], k[:, :, order], v[:, :, order])  # (B, H/CP, T, hd)
    return heads_to_seq(y[:, :, where], group)


# ---------------------------------------------------------------- allgather

class _GatherKV(torch.autograd.Function):
    """kv (2, B, Hkv, s, hd) -> (CP·2, B, Hkv, s, hd). Backward reduce-scatters dK, dV to owners."""

    @staticmethod
    def forward(ctx, kv, group):
        ctx.group = group
        out = kv.new_empty((group.size * kv.shape[0],) + kv.shape[1:])
        group.all_gather(out, kv.contiguous())
        return out

    @staticmethod
    def backward(ctx, grad):
        out = grad.new_empty((grad.shape[0] // ctx.group.size,) + grad.shape[1:])
        ctx.group.reduce_scatter(out, grad.contiguous())
        return out, None


def _in_position_order(kv, cp):
    """(CP·2, B, Hkv, s, hd) in rank order -> (2, B, Hkv, T, hd) in position order, in one copy:
    first chunks in rank order, then second ones reversed. No index is built on the host."""
    _, B, kv_heads, s, hd = kv.shape
    # (2, B, Hkv, CP, 2, c, hd)
    chunks = kv.view(cp, 2, B, kv_heads, 2, s // 2, hd).permute(1, 2, 3, 0, 4, 5, 6)
    # (2, B, Hkv, 2CP, c, hd)
    ordered = torch.cat([chunks[:, :, :, :, 0], chunks[:, :, :, :, 1].flip(3)], dim=3)
    return ordered.reshape(2, B, kv_heads, cp * s, hd)


def _chunk_blocks(rank, cp, c):
    """[(q rows, k rows, causal)] per local query chunk p: causal on chunk p, full on earlier."""
    blocks = []
    for i, p in enumerate(local_chunks(rank, cp)):
        rows = slice(i * c, (i + 1) * c)
        blocks += ([(rows, slice(p * c, (p + 1) * c), True)]
                   + ([(rows, slice(0, p * c), False)] if p else []))
    return blocks


class _ChunkAttentionFn(torch.autograd.Function):
    """q (B, H, s, hd) against kv (2, B, Hkv, T, hd) -> (B, H, s, hd): ring_attention's blocks."""

    @staticmethod
    def forward(ctx, q, kv, blocks):
        kernel = pick_kernel(q)
        out = running_output(q)
        lse = torch.full(q.shape[:3], float("-inf"), dtype=torch.float32, device=q.device)
        ctx.aux = attend_blocks(q, kv, blocks, kernel, out, lse)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, kv, out, lse)
        ctx.blocks, ctx.kernel = blocks, kernel
        return out

    @staticmethod
    def backward(ctx, dout):
        q, kv, out, lse = ctx.saved_tensors
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        dkv = torch.zeros(kv.shape, dtype=torch.float32, device=q.device)
        attend_blocks_backward(dout, q, kv, out, lse, ctx.blocks, ctx.kernel, ctx.aux, dq, dkv)
        return dq.to(q.dtype), dkv.to(kv.dtype), None


def allgather_attention(q, k, v, group):
    cp, s = group.size, q.shape[2]
    kv = _in_position_order(_GatherKV.apply(torch.stack([k, v]), group), cp)  # (2, B, Hkv, T, hd)
    return _ChunkAttentionFn.apply(q, kv, _chunk_blocks(group.rank, cp, s // 2))


# ---------------------------------------------------------------- wiring

def make_attend(mesh, mode):
    group = mesh.cp_group
    if mode == "ring":
        return RingAttention(group)
    if mode == "ulysses":
        return lambda q, k, v: ulysses_attention(q, k, v, group)
    return lambda q, k, v: allgather_attention(q, k, v, group)


def parallelize(chunk, mesh, mode="ring"):
    """Swaps each Attention.attend of the chunk for the context-parallel one. Returns the chunk."""
    validate(chunk.cfg, mesh.cp, mesh.tp, mode)
    attend = make_attend(mesh, mode)
    for block in chunk.layers.values():
        block.self_attn.attend = attend
    return chunk
