"""Context parallel: the sequence is split over the cp group; only attention needs the other ranks' tokens.

Split:    zigzag: 2·CP chunks, cp rank r holds chunks r and 2CP-1-r, so causal attention work is equal on every
          rank. Tokens, targets and RoPE positions move together; norms, MLPs and the loss (a mean over local
          tokens) are token-local; the DP wrapper averages gradients over dp x cp (same weights, other tokens).
L25, the collective that lets a local query see all keys and values. Bytes sent per rank per layer in forward
(b micro-batch, s = T/CP local tokens, e bytes/element, |K_r| = |V_r| = b·s·Hkv·hd·e); a step sends this
x n_layer x micro-batches, plus backward:
  ring:      send/recv (batch_isend_irecv) of K,V around the ring, each hop overlapped with a block's attention:
             (CP-1)·2·|K_r|; backward the same + CP·2·|K_r|·4/e for the fp32 dK,dV (ring_attention.py).
  ulysses:   all-to-all (s tokens, all H heads) -> (all T tokens, H/CP heads), SDPA, all-to-all back:
             (CP-1)/CP · b·s·(2·H + 2·Hkv)·hd·e; backward the same.
  allgather: all-gather of K,V (Llama 3's choice): (CP-1)·2·|K_r|; backward a reduce-scatter of dK,dV, same size.
Memory:   activations are 1/CP of the sequence per rank; attention holds two K,V blocks (ring), the whole
          sequence's K,V (allgather) or the whole sequence for H/CP heads (ulysses).
"""
import math

import torch
import torch.nn.functional as F

from model import causal_attention
from parallel.mesh import LayoutError
from parallel.ring_attention import RingAttention, local_chunks

MODES = ("ring", "ulysses", "allgather")


def validate(cfg, mesh, mode):
    """Raises LayoutError for a layout cp cannot run (before any work starts)."""
    if mode not in MODES:
        raise LayoutError("--cp-mode", f"unknown mode {mode!r}; choose {', '.join(MODES)}")
    if cfg.seq_len % (2 * mesh.cp):
        raise LayoutError("--cp", f"seq_len {cfg.seq_len} is not divisible by 2·cp = {2 * mesh.cp} "
                                  "(the zigzag split cuts the sequence into 2·cp chunks)")
    heads = cfg.n_head // mesh.tp
    if mode == "ulysses" and heads % mesh.cp:
        raise LayoutError("--cp-mode", f"ulysses needs the heads per rank (n_head/tp = {heads}) "
                                       f"divisible by cp = {mesh.cp}")


def local_positions(seq_len, rank, cp, device=None, layout="zigzag"):
    """The sequence positions a cp rank holds, in its local order: (seq_len / CP,)."""
    chunks = local_chunks(rank, cp, layout)
    c = seq_len // (cp * len(chunks))  # chunk length: the sequence is cut into cp·len(chunks) chunks
    return torch.cat([torch.arange(i * c, (i + 1) * c, device=device) for i in chunks])


def gathered_positions(seq_len, cp, device=None, layout="zigzag"):
    """Positions of the sequence gathered in rank order (rank 0's tokens, then rank 1's, ...): (seq_len,)."""
    return torch.cat([local_positions(seq_len, r, cp, device, layout) for r in range(cp)])


def shard_batches(batches, mesh):
    """[(x, y)] of (b, T) -> this cp rank's zigzag tokens [(x, y)] of (b, T/CP), and their positions (T/CP,)."""
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
    """(B, h, T/CP, hd) local tokens, all heads -> (B, h/CP, T, hd): every rank's tokens (rank order), h/CP heads."""
    B, h, s, hd = x.shape
    cp = group.size
    blocks = x.reshape(B, cp, h // cp, s, hd).transpose(0, 1)  # (CP, B, h/CP, s, hd): head group j -> rank j
    got = _AllToAll.apply(blocks, group)  # block j: rank j's tokens of my head group
    return got.permute(1, 2, 0, 3, 4).reshape(B, h // cp, cp * s, hd)


def heads_to_seq(y, group):
    """The inverse of seq_to_heads: (B, h/CP, T, hd) -> (B, h, T/CP, hd)."""
    B, hl, T, hd = y.shape
    cp = group.size
    blocks = y.reshape(B, hl, cp, T // cp, hd).permute(2, 0, 1, 3, 4)  # (CP, B, h/CP, s, hd): rank j's tokens
    got = _AllToAll.apply(blocks, group)  # block j: my tokens, head group j
    return got.transpose(0, 1).reshape(B, cp * hl, T // cp, hd)


def ulysses_attention(q, k, v, group):
    cp, kv_heads = group.size, k.shape[1]
    if kv_heads % cp:  # too few kv heads to split: repeat each until cp divides them (GQA grouping holds)
        repeat = cp // math.gcd(kv_heads, cp)
        k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
    q, k, v = (seq_to_heads(t, group) for t in (q, k, v))  # (B, heads/CP, T, hd), zigzag rank order
    where = gathered_positions(q.shape[2], cp, q.device)  # position of each gathered token
    order = torch.argsort(where)  # gathered index of each position
    y = causal_attention(q[:, :, order], k[:, :, order], v[:, :, order])  # (B, H/CP, T, hd), position order
    return heads_to_seq(y[:, :, where], group)


# ---------------------------------------------------------------- allgather

class _GatherKV(torch.autograd.Function):
    """kv (2, B, Hkv, s, hd) -> (CP·2, B, Hkv, s, hd); backward reduce-scatters dK, dV back to their owners."""

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


def allgather_attention(q, k, v, group):
    cp, (B, H, s, hd) = group.size, q.shape
    kv = _GatherKV.apply(torch.stack([k, v]), group).view(cp, 2, *k.shape)  # (CP, 2, B, Hkv, s, hd)
    kv = kv.permute(1, 2, 3, 0, 4, 5).reshape(2, B, k.shape[1], cp * s, hd)  # all tokens, rank order
    order = torch.argsort(gathered_positions(cp * s, cp, q.device))
    k_all, v_all = kv[0][:, :, order], kv[1][:, :, order]  # (B, Hkv, T, hd), position order
    repeat = H // k.shape[1]
    if repeat > 1:
        k_all, v_all = k_all.repeat_interleave(repeat, dim=1), v_all.repeat_interleave(repeat, dim=1)
    mine = local_positions(cp * s, group.rank, cp, q.device)
    visible = mine[:, None] >= torch.arange(cp * s, device=q.device)[None, :]  # (s, T) causal by position
    return F.scaled_dot_product_attention(q, k_all, v_all, attn_mask=visible)


# ---------------------------------------------------------------- wiring

def make_attend(mesh, mode):
    group = mesh.cp_group
    if mode == "ring":
        return RingAttention(group)
    if mode == "ulysses":
        return lambda q, k, v: ulysses_attention(q, k, v, group)
    return lambda q, k, v: allgather_attention(q, k, v, group)


def parallelize(chunk, mesh, mode="ring"):
    """Swaps every Attention.attend of the chunk for the context-parallel one. Returns the chunk."""
    validate(chunk.cfg, mesh, mode)
    attend = make_attend(mesh, mode)
    for block in chunk.layers.values():
        block.self_attn.attend = attend
    return chunk


# -------------------------------------------------------------- traffic formulas (the planner's --code ours uses these)

def ulysses_bytes(tokens, head_dim, q_heads, kv_heads, cp, elem_bytes):
    """(fwd, bwd) bytes one rank sends per layer, each (cp-1)/cp · tokens · hd · (2q + 2·lcm(kv, cp)) · e."""
    each = (cp - 1) / cp * tokens * head_dim * (2 * q_heads + 2 * math.lcm(kv_heads, cp)) * elem_bytes
    return each, each


def allgather_bytes(kv_elements, cp, elem_bytes):
    """(fwd, bwd) bytes one rank sends per layer: all-gather K,V, reduce-scatter dK,dV, each (cp-1) · kv · e."""
    each = (cp - 1) * kv_elements * elem_bytes
    return each, each
