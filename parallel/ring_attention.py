"""Ring attention: exact causal attention when the sequence is sharded over the cp group (cp.py's `ring`).

Split:    rank r holds the queries and the K,V of its sequence chunks (zigzag: chunks r and 2CP-1-r of 2CP).
Sends:    K,V hop around the ring (batch_isend_irecv to r+1, from r-1). Per layer and rank, with K_r,V_r the
          local blocks: forward (CP-1)·(|K_r|+|V_r|); backward the same again plus CP hops of the fp32 dK,dV
          accumulator that travels with its block and ends back at the block's owner.
Overlap:  the next block's transfer is started before the attention of the block in hand, and the dK,dV
          accumulator's hop overlaps the next step's block gradients.
Merge:    each block returns (out_i, lse_i) from a fused kernel; online softmax: lse = logaddexp(lse, lse_i),
          out = out·exp(lse_old - lse) + out_i·exp(lse_i - lse). Backward needs only the final out and lse (the
          flash backward recomputes each block's probabilities as exp(s - lse)), so nothing per block is kept.
Causality per (query chunk, key chunk): earlier key chunk = full block, same chunk = causal, later = skipped.
          Under zigzag every step costs half a block on every rank (balanced); `flops` counts what ran.
Memory:   no rank ever holds more than two K,V blocks (in hand and arriving), never the whole sequence.
"""
import torch

_ATEN = torch.ops.aten


def has_op(name):
    try:
        getattr(_ATEN, name)
        return True
    except (AttributeError, RuntimeError):
        return False


def local_chunks(rank, cp, layout="zigzag"):
    """The sequence chunks (ascending) a cp rank holds. zigzag: 2·cp chunks; contiguous: cp chunks."""
    return [rank, 2 * cp - 1 - rank] if layout == "zigzag" else [rank]


def plan_blocks(q_chunks, k_chunks):
    """The attention calls for one (query rank, key rank) pair, in chunk units: [(q_lo, q_hi, k_hi, causal)].

    Own block: one causal call (local chunk order is position order). Another rank's block: key chunk j is
    visible to query chunk i iff k_chunks[j] < q_chunks[i], always a prefix of the keys; consecutive query
    chunks with the same non-empty prefix form one full call; pairs that causality masks are skipped."""
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


# ---------------------------------------------------------------- block kernels: (out, lse) and the backward

def _flash_cuda_fwd(q, k, v, causal, scale):
    out, lse, *aux = _ATEN._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=scale)
    return out, lse, aux[:6]  # cum_seq_q, cum_seq_k, max_q, max_k, philox_seed, philox_offset


def _flash_cuda_bwd(dout, q, k, v, out, lse, causal, scale, aux):
    cum_q, cum_k, max_q, max_k, seed, offset = aux
    return _ATEN._scaled_dot_product_flash_attention_backward(
        dout, q, k, v, out, lse, cum_q, cum_k, max_q, max_k, 0.0, causal, seed, offset, scale=scale)[:3]


def _flash_cpu_fwd(q, k, v, causal, scale):
    out, lse = _ATEN._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)
    return out, lse, None


def _flash_cpu_bwd(dout, q, k, v, out, lse, causal, scale, aux):
    return _ATEN._scaled_dot_product_flash_attention_for_cpu_backward(dout, q, k, v, out, lse, 0.0, causal,
                                                                       scale=scale)


def _scores(q, k, causal, scale):
    s = (q.float() @ k.float().transpose(-2, -1)) * scale  # (B, H, Tq, Tk)
    if causal:
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).triu(1), float("-inf"))
    return s


def _math_fwd(q, k, v, causal, scale):
    with torch.autocast(q.device.type, enabled=False):
        s = _scores(q, k, causal, scale)
        lse = s.logsumexp(-1)  # (B, H, Tq)
        return (torch.exp(s - lse[..., None]) @ v.float()).to(q.dtype), lse, None


def _math_bwd(dout, q, k, v, out, lse, causal, scale, aux):
    with torch.autocast(q.device.type, enabled=False):
        p = torch.exp(_scores(q, k, causal, scale) - lse[..., None])  # this block's share of the full softmax
        dout32 = dout.float()
        dv = p.transpose(-2, -1) @ dout32
        delta = (dout32 * out.float()).sum(-1, keepdim=True)  # (B, H, Tq, 1)
        ds = p * (dout32 @ v.float().transpose(-2, -1) - delta)
        dq, dk = ds @ k.float() * scale, ds.transpose(-2, -1) @ q.float() * scale
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


KERNELS = {"flash_cuda": (_flash_cuda_fwd, _flash_cuda_bwd), "flash_cpu": (_flash_cpu_fwd, _flash_cpu_bwd),
           "math": (_math_fwd, _math_bwd)}


def pick_kernel(q):
    """The fused kernel that returns the log-sum-exp for this device and dtype, else plain math."""
    hd = q.shape[-1]
    if (q.is_cuda and q.dtype in (torch.float16, torch.bfloat16) and hd % 8 == 0 and hd <= 256
            and torch.cuda.get_device_capability(q.device) >= (8, 0) and has_op("_scaled_dot_product_flash_attention")):
        return "flash_cuda"
    if (q.device.type == "cpu" and q.dtype in (torch.float32, torch.bfloat16)
            and has_op("_scaled_dot_product_flash_attention_for_cpu")
            and has_op("_scaled_dot_product_flash_attention_for_cpu_backward")):
        return "flash_cpu"
    return "math"


# ---------------------------------------------------------------- the ring

def _for_kernel(t, rows, repeat):
    """(B, Hkv, T, hd) -> the key rows the kernel needs, with the kv heads repeated: (B, H, rows, hd)."""
    t = t[:, :, rows]
    return (t if repeat == 1 else t.repeat_interleave(repeat, dim=1)).contiguous()


def _sum_to_kv_heads(g, repeat):
    B, H, T, hd = g.shape
    return g if repeat == 1 else g.view(B, H // repeat, repeat, T, hd).sum(2)


class _RingAttentionFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, ring):
        group, kernel = ring.group, ring.kernel or pick_kernel(q)
        fwd = KERNELS[kernel][0]
        cp, rank = group.size, group.rank
        B, H, T, hd = q.shape
        repeat, scale = H // k.shape[1], hd ** -0.5
        mine = local_chunks(rank, cp, ring.layout)
        c = T // len(mine)  # tokens per chunk
        kv = torch.stack([k, v])  # (2, B, Hkv, T, hd): one message per hop
        out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        lse = torch.full((B, H, T), float("-inf"), dtype=torch.float32, device=q.device)
        aux = []
        for step in range(cp):
            src = (rank - step) % cp  # whose K,V are in hand
            if step < cp - 1:
                arriving = torch.empty_like(kv)
                reqs = group.send_recv([(kv, (rank + 1) % cp)], [(arriving, (rank - 1) % cp)])
            for q_lo, q_hi, k_hi, causal in plan_blocks(mine, local_chunks(src, cp, ring.layout)):
                qs = slice(q_lo * c, q_hi * c)
                ks = slice(0, k_hi * c)
                o_i, lse_i, a = fwd(q[:, :, qs].contiguous(), _for_kernel(kv[0], ks, repeat),
                                    _for_kernel(kv[1], ks, repeat), causal, scale)
                merged = torch.logaddexp(lse[:, :, qs], lse_i)  # (B, H, q rows)
                out[:, :, qs] = (out[:, :, qs] * torch.exp(lse[:, :, qs] - merged)[..., None]
                                 + o_i.float() * torch.exp(lse_i - merged)[..., None])
                lse[:, :, qs] = merged
                aux.append(a)
                ring.flops += 4 * B * H * (q_hi - q_lo) * c * k_hi * c * hd * (0.5 if causal else 1.0)
            if step < cp - 1:
                for r in reqs:
                    r.wait()
                kv = arriving
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.ring, ctx.kernel, ctx.aux = ring, kernel, aux
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        ring, bwd, aux = ctx.ring, KERNELS[ctx.kernel][1], iter(ctx.aux)
        group, layout = ring.group, ring.layout
        cp, rank = group.size, group.rank
        B, H, T, hd = q.shape
        repeat, scale = H // k.shape[1], hd ** -0.5
        mine = local_chunks(rank, cp, layout)
        c = T // len(mine)
        dout = dout.contiguous()
        kv = torch.stack([k, v])
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        dkv_in_flight = None  # (requests, buffer): the accumulator of the block arriving next
        for step in range(cp):
            src = (rank - step) % cp
            if step < cp - 1:
                arriving = torch.empty_like(kv)
                reqs = group.send_recv([(kv, (rank + 1) % cp)], [(arriving, (rank - 1) % cp)])
            dkv = torch.zeros(kv.shape, dtype=torch.float32, device=q.device)  # (2, B, Hkv, T, hd)
            for q_lo, q_hi, k_hi, causal in plan_blocks(mine, local_chunks(src, cp, layout)):
                qs, ks = slice(q_lo * c, q_hi * c), slice(0, k_hi * c)
                dq_i, dk_i, dv_i = bwd(dout[:, :, qs].contiguous(), q[:, :, qs].contiguous(),
                                       _for_kernel(kv[0], ks, repeat), _for_kernel(kv[1], ks, repeat),
                                       out[:, :, qs].contiguous(), lse[:, :, qs].contiguous(), causal, scale,
                                       next(aux))
                dq[:, :, qs] += dq_i.float()
                dkv[0, :, :, ks] += _sum_to_kv_heads(dk_i.float(), repeat)
                dkv[1, :, :, ks] += _sum_to_kv_heads(dv_i.float(), repeat)
            if dkv_in_flight:  # add this block's other ranks' contributions, then pass it on
                for r in dkv_in_flight[0]:
                    r.wait()
                dkv += dkv_in_flight[1]
            if cp > 1:
                buffer = torch.empty_like(dkv)
                dkv_in_flight = (group.send_recv([(dkv, (rank + 1) % cp)], [(buffer, (rank - 1) % cp)]), buffer)
            if step < cp - 1:
                for r in reqs:
                    r.wait()
                kv = arriving
        if dkv_in_flight:  # after CP hops our own block's accumulator is back, with every rank's share
            for r in dkv_in_flight[0]:
                r.wait()
            dkv = dkv_in_flight[1]
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None


class RingAttention:
    """attend(q, k, v) for the cp group: q (B, H, T_local, hd), k/v (B, Hkv, T_local, hd) -> (B, H, T_local, hd).
    kernel: None picks the fused kernel for the device, or force "math". `flops` counts the attention run."""

    def __init__(self, group, layout="zigzag", kernel=None):
        self.group, self.layout, self.kernel = group, layout, kernel
        self.flops = 0.0

    def __call__(self, q, k, v):
        return _RingAttentionFn.apply(q, k.contiguous(), v.contiguous(), self)


# -------------------------------------------------------------- traffic formulas (the planner's --code ours uses these)

def ring_bytes(kv_elements, cp, elem_bytes):
    """(fwd, bwd) bytes one rank sends per layer: (cp-1) · kv · e each, bwd + cp hops of the fp32 dK,dV: cp · kv · 4."""
    forward = (cp - 1) * kv_elements * elem_bytes
    return forward, forward + cp * kv_elements * 4
