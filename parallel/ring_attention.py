"""Ring attention: exact causal attention on a sequence sharded over cp (cp.py's `ring`).

Split:    rank r holds the queries and K,V of its sequence chunks (zigzag: r and 2CP-1-r of 2CP).
Sends:    K,V hop around the ring (comm.Ring: to r+1, from r-1). Per layer and rank, with K_r,V_r
          the local blocks (Hkv heads): forward (CP-1)·(|K_r|+|V_r|). Backward: the same, plus CP
          hops of the fp32 dK,dV accumulator. It travels with its block, back to the block's owner.
Overlap:  each hop travels under the attention of the block in hand, dK,dV's under the next step.
Kernels:  K,V keep their own Hkv heads, each shared by its H/Hkv query heads. An earlier key chunk
          is a full block, the same chunk causal, a later one skipped. Under zigzag each step
          costs every rank half a block.
Merge:    online softmax of the blocks' (out_i, lse_i). lse = logaddexp(lse, lse_i);
          out = out·exp(lse_old - lse) + out_i·exp(lse_i - lse). Backward needs only the final
          out and lse. cp.py's allgather reuses both.
Memory:   at most two K,V blocks per rank, in hand and arriving. Never the whole sequence.
"""
import torch

from parallel.comm import Ring

_ATEN = torch.ops.aten


# ---------------------------------------------------------------- the ring

class _RingAttentionFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, attention):
        ring, kernel = attention.ring, attention.kernel or pick_kernel(q)
        cp, rank, layout = ring.size, ring.rank, attention.layout
        mine = local_chunks(rank, cp, layout)
        c = q.shape[2] // len(mine)  # tokens per chunk
        kv = torch.stack([k, v])  # (2, B, Hkv, T, hd): one message per hop
        out = running_output(q)  # .to(q.dtype) keeps its layout
        lse = torch.full(q.shape[:3], float("-inf"), dtype=torch.float32, device=q.device)
        aux = []
        for step in range(cp):
            src = (rank - step) % cp  # whose K,V are in hand
            if step < cp - 1:  # the next block travels while this one is attended to
                (arriving,), hop = ring.hop([kv])
            blocks = _ring_blocks(mine, local_chunks(src, cp, layout), c)
            aux.append(attend_blocks(q, kv, blocks, kernel, out, lse))
            if step < cp - 1:
                hop.wait()
                kv = arriving
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.attention, ctx.kernel, ctx.aux = attention, kernel, aux
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        ring, layout = ctx.attention.ring, ctx.attention.layout
        cp, rank = ring.size, ring.rank
        mine = local_chunks(rank, cp, layout)
        c = q.shape[2] // len(mine)
        kv = torch.stack([k, v])
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        dkv_in_flight = None  # (hop, arriving accumulator, the one sent): held until waited for
        for step in range(cp):
            src = (rank - step) % cp
            if step < cp - 1:
                (arriving,), hop = ring.hop([kv])
            dkv = torch.zeros(kv.shape, dtype=torch.float32, device=q.device)  # (2, B, Hkv, T, hd)
            attend_blocks_backward(dout, q, kv, out, lse,
                                   _ring_blocks(mine, local_chunks(src, cp, layout), c),
                                   ctx.kernel, ctx.aux[step], dq, dkv)
            if dkv_in_flight:  # add this block's other ranks' contributions, then pass it on
                dkv_in_flight[0].wait()
                dkv += dkv_in_flight[1]
            if cp > 1:
                (buffer,), dkv_hop = ring.hop([dkv])
                dkv_in_flight = (dkv_hop, buffer, dkv)
            if step < cp - 1:
                hop.wait()
                kv = arriving
        if dkv_in_flight:  # after CP hops our block's accumulator is back, with every rank's share
            dkv_in_flight[0].wait()
            dkv = dkv_in_flight[1]
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None


class RingAttention:
    """attend(q, k, v) for the cp group: q (B, H, Tl, hd), k/v (B, Hkv, Tl, hd) -> (B, H, Tl, hd).
    kernel: None picks the fused kernel for the device; "math" forces the fallback."""

    def __init__(self, group, layout="zigzag", kernel=None):
        self.ring, self.layout, self.kernel = Ring(group), layout, kernel

    def __call__(self, q, k, v):
        return _RingAttentionFn.apply(q, k.contiguous(), v.contiguous(), self)


def _ring_blocks(mine, theirs, c):
    """plan_blocks in rows of the local q and the K,V block in hand: [(q rows, k rows, causal)]."""
    return [(slice(q_lo * c, q_hi * c), slice(0, k_hi * c), causal)
            for q_lo, q_hi, k_hi, causal in plan_blocks(mine, theirs)]


def local_chunks(rank, cp, layout="zigzag"):
    """The sequence chunks (ascending) a cp rank holds. zigzag: 2·cp chunks; contiguous: cp."""
    return [rank, 2 * cp - 1 - rank] if layout == "zigzag" else [rank]


def plan_blocks(q_chunks, k_chunks):
    """A (query rank, key rank) pair's attention calls, in chunks: [(q_lo, q_hi, k_hi, causal)].

    Own block: one causal call, as local chunk order is position order. Another rank's: query
    chunk i sees key chunk j iff k_chunks[j] < q_chunks[i], a prefix of the keys. Consecutive
    query chunks with the same non-empty prefix form one full call."""
    if q_chunks == k_chunks:
        return [(0, len(q_chunks), len(k_chunks), True)]
    prefix = [sum(k < q for k in k_chunks) for q in q_chunks]
    blocks, i = [], 0
    while i < len(prefix):
        j = i
        while j < len(prefix) and prefix[j] == prefix[i]:
            j += 1
        if prefix[i]:
            blocks.append((i, j, prefix[i], False))
        i = j
    return blocks


# ---------------------------------------------------------------- blocks merged by log-sum-exp

def running_output(q):
    """The fp32 output the blocks merge into: (B, H, T, hd), laid out (B, T, H, hd) as flash does.
    o_proj's input, y.transpose(1, 2), is then a view: backward saves one copy of it, not two."""
    B, H, T, hd = q.shape
    return torch.zeros(B, T, H, hd, dtype=torch.float32, device=q.device).transpose(1, 2)


def attend_blocks(q, kv, blocks, kernel, out, lse):
    """Attends q (B, H, Tq, hd) to kv (2, B, Hkv, Tk, hd) over blocks [(q rows, k rows, causal)].
    Merges into the fp32 out (B, H, Tq, hd) and lse (B, H, Tq); returns each call's aux."""
    fwd, scale, aux = KERNELS[kernel][0], q.shape[-1] ** -0.5, []
    for qs, ks, causal in blocks:
        o_i, lse_i, a = fwd(q[:, :, qs].contiguous(), kv[0][:, :, ks], kv[1][:, :, ks], causal,
                            scale)
        merged = torch.logaddexp(lse[:, :, qs], lse_i)  # (B, H, q rows)
        out[:, :, qs] = (out[:, :, qs] * torch.exp(lse[:, :, qs] - merged)[..., None]
                         + o_i.float() * torch.exp(lse_i - merged)[..., None])
        lse[:, :, qs] = merged
        aux.append(a)
    return aux


def attend_blocks_backward(dout, q, kv, out, lse, blocks, kernel, aux, dq, dkv):
    """attend_blocks' gradients from the final out and lse, added into fp32 dq and dkv (as kv)."""
    bwd, scale = KERNELS[kernel][1], q.shape[-1] ** -0.5
    for (qs, ks, causal), a in zip(blocks, aux):
        dq_i, dk_i, dv_i = bwd(dout[:, :, qs].contiguous(), q[:, :, qs].contiguous(),
                               kv[0][:, :, ks], kv[1][:, :, ks], out[:, :, qs].contiguous(),
                               lse[:, :, qs].contiguous(), causal, scale, a)
        dq[:, :, qs] += dq_i
        dkv[0, :, :, ks] += dk_i
        dkv[1, :, :, ks] += dv_i


# ------------------------------------------ block kernels: q (B, H, Tq, hd), k/v (B, Hkv, Tk, hd)

def has_op(name):
    try:
        getattr(_ATEN, name)
        return True
    except (AttributeError, RuntimeError):
        return False


def _flash_cuda_fwd(q, k, v, causal, scale):
    out, lse, *aux = _ATEN._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False,
                                                               scale=scale)
    return out, lse, aux[:6]  # cum_seq_q, cum_seq_k, max_q, max_k, philox_seed, philox_offset


def _flash_cuda_bwd(dout, q, k, v, out, lse, causal, scale, aux):
    cum_q, cum_k, max_q, max_k, seed, offset = aux
    return _ATEN._scaled_dot_product_flash_attention_backward(
        dout, q, k, v, out, lse, cum_q, cum_k, max_q, max_k, 0.0, causal, seed, offset,
        scale=scale)[:3]


# CPU only: the fused kernel and its loop run eagerly; compiling around it is slow.
@torch.compiler.disable
def _flash_cpu_fwd(q, k, v, causal, scale):
    out, lse = _ATEN._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)
    return out, lse, None


@torch.compiler.disable
def _flash_cpu_bwd(dout, q, k, v, out, lse, causal, scale, aux):
    return _ATEN._scaled_dot_product_flash_attention_for_cpu_backward(
        dout, q, k, v, out, lse, 0.0, causal, scale=scale)


def _by_kv_head(x, kv_heads):
    """(B, H, T, d) -> (B, Hkv, H/Hkv·T, d): each kv head's query heads, stacked along rows.
    The matmuls then copy no K,V and sum dK,dV over the group. A view when x is contiguous."""
    B, H, T, d = x.shape
    return x.reshape(B, kv_heads, H // kv_heads * T, d)


MATH_SCORES = 2 ** 26  # fp32 scores one math-kernel call may hold (256 MB); more rows: in chunks


def _query_chunks(q, k):
    """Slices of q's rows, each with (heads x rows x keys) fp32 scores that fit in MATH_SCORES."""
    B, H, tq, _ = q.shape
    rows = max(1, MATH_SCORES // (B * H * k.shape[2]))
    return [slice(i, min(i + rows, tq)) for i in range(0, tq, rows)]


def _scores(q_rows, k, causal, scale, rows):
    """q_rows (B, Hkv, G·r, hd), rows `rows` by kv head; k (B, Hkv, Tk, hd) -> fp32 scores
    (B, Hkv, G·r, Tk). Causal: a diagonal block, masked per query head, row i sees keys <= i."""
    s = (q_rows.float() @ k.float().transpose(-2, -1)) * scale
    if causal:
        B, kv_heads, n, tk = s.shape
        r = rows.stop - rows.start
        future = (torch.arange(tk, device=s.device)
                  > torch.arange(rows.start, rows.stop, device=s.device)[:, None])
        s = (s.view(B, kv_heads, n // r, r, tk).masked_fill(future, float("-inf"))
             .view(B, kv_heads, n, tk))
    return s


def _math_fwd(q, k, v, causal, scale):
    """Plain attention for dtypes no fused kernel with a log-sum-exp takes (fp32 on CUDA)."""
    B, H, tq, hd = q.shape
    out, lse = torch.empty_like(q), torch.empty(B, H, tq, dtype=torch.float32, device=q.device)
    with torch.autocast(q.device.type, enabled=False):
        for rows in _query_chunks(q, k):
            s = _scores(_by_kv_head(q[:, :, rows], k.shape[1]), k, causal, scale, rows)
            chunk_lse = s.logsumexp(-1)  # (B, Hkv, G·r)
            o = torch.exp(s - chunk_lse[..., None]) @ v.float()  # (B, Hkv, G·r, hd)
            out[:, :, rows] = o.view(B, H, -1, hd).to(q.dtype)
            lse[:, :, rows] = chunk_lse.view(B, H, -1)
    return out, lse, None


def _math_bwd(dout, q, k, v, out, lse, causal, scale, aux):
    B, H, tq, hd = q.shape
    kv_heads = k.shape[1]
    dq = torch.empty_like(q)
    dk, dv = (torch.zeros(k.shape, dtype=torch.float32, device=q.device),
              torch.zeros(v.shape, dtype=torch.float32, device=q.device))
    with torch.autocast(q.device.type, enabled=False):
        for rows in _query_chunks(q, k):
            q_rows = _by_kv_head(q[:, :, rows], kv_heads).float()
            dout_rows = _by_kv_head(dout[:, :, rows], kv_heads).float()
            s = _scores(q_rows, k, causal, scale, rows)
            # (B, Hkv, G·r, Tk): the softmax
            p = torch.exp(s - _by_kv_head(lse[:, :, rows, None], kv_heads))
            dv += p.transpose(-2, -1) @ dout_rows  # (B, Hkv, Tk, hd): the matmul sums the group
            delta = ((dout_rows * _by_kv_head(out[:, :, rows], kv_heads).float())
                     .sum(-1, keepdim=True))
            ds = p * (dout_rows @ v.float().transpose(-2, -1) - delta)
            dq[:, :, rows] = (ds @ k.float() * scale).view(B, H, -1, hd).to(q.dtype)
            dk += ds.transpose(-2, -1) @ q_rows * scale  # (B, Hkv, Tk, hd)
    return dq, dk.to(k.dtype), dv.to(v.dtype)


KERNELS = {"flash_cuda": (_flash_cuda_fwd, _flash_cuda_bwd),
           "flash_cpu": (_flash_cpu_fwd, _flash_cpu_bwd), "math": (_math_fwd, _math_bwd)}


def pick_kernel(q):
    """The fused kernel that returns the log-sum-exp for this device and dtype, else plain math."""
    hd = q.shape[-1]
    if (q.is_cuda and q.dtype in (torch.float16, torch.bfloat16) and hd % 8 == 0 and hd <= 256
            and torch.cuda.get_device_capability(q.device) >= (8, 0)
            and has_op("_scaled_dot_product_flash_attention")):
        return "flash_cuda"
    if (q.device.type == "cpu" and q.dtype in (torch.float32, torch.bfloat16)
            and has_op("_scaled_dot_product_flash_attention_for_cpu")
            and has_op("_scaled_dot_product_flash_attention_for_cpu_backward")):
        return "flash_cpu"
    return "math"
