"""FP8 training (--dtype fp8): the scale rule and every cast point of the block matmuls.

Formats, as in torchao and Transformer Engine. Hopper multiplies fp8 at twice the bf16 rate.
    e4m3   block linear inputs x and weights W: 3 mantissa bits, max 448.
    e5m2   dY, the gradient of a block linear's output: 2 bits, max 57344, for more range.
    fp32   the sums of Y = x·Wᵀ, dx = dY·W and dW = dYᵀ·x. Y is bf16, dx x's dtype, dW W's.
    bf16   the rest (embedding, attention, norms, residual stream, lm_head, loss): autocast.
    fp32   master weights, their gradients and AdamW's moments, as in every mode.
A block linear's x: the norm output (q, k, v, gate, up), attention (o), silu(gate)·up (down).

Scale rule (dynamic, tensorwise): q = fmt(bf16(t)·s), and the matmul undoes s. s is the largest
power of two with amax·s <= the format's max. amax = max |bf16(t)| over the whole tensor.
x's and W's amaxes come from the tensors in forward, dY's from the gradient in backward. Nothing
is delayed or kept across steps. A power of two makes the multiply exact, so the scale only
decides what underflows.
Layouts: a scale must be the one a single process would use, so amax is the whole tensor's. It is
MAX-all-reduced over the groups that split its tensor (apply; counted as `all_reduce_max`). With
tp alone, per layer and micro-batch: 3 reductions in forward, 5 in backward, a few bytes each.
Forward reduces the weights and o's and down's inputs; backward, the column linears' dY. dp and
pp ranks run whole micro-batches, and FSDP gathers whole weights: no reduction. The matmul then
runs on the local shard.
Memory: backward keeps x and W as they came, and their scales. bf16 autocast keeps a bf16 copy of
x per linear. Transients of 1 byte/element: the casts, the column-major copies for backward.
Under --fp8-all-gather, also a unit arriving (gather_in_fp8).
Time: per linear and step, 3 amax passes (x, W, dY) and 5 casts. Backward casts x and W again,
with no second amax. Add 3 transposed fp8 copies; torch.compile fuses them all. Under tp or cp,
add the tiny blocking reductions. --sp's rings (tp_overlap.py) stay off. Under fp8 each sp gather
and reduce-scatter is one call, and backward keeps the gathered input.
"""
import math
from functools import partial

import torch

from model import Linear
from parallel import tp_shard_of

E4M3, E5M2 = getattr(torch, "float8_e4m3fn", None), getattr(torch, "float8_e5m2", None)
MULTIPLE = 16  # _scaled_mm on a GPU: the inner dim and every operand's columns, multiples of 16


def missing():
    """What this torch lacks for fp8 training, as a sentence, or None."""
    lacks = [f"torch.{n}" for n in ("_scaled_mm", "float8_e4m3fn", "float8_e5m2")
             if not hasattr(torch, n)]
    return f"this torch ({torch.__version__}) has no {', '.join(lacks)}" if lacks else None


def misfit(cfg, tp, tokens):
    """(flag, message) of the first block-matmul dimension not a multiple of 16, or None.

    tokens: the rows of one micro-batch on a rank, the inner dimension of the weight gradient."""
    hd = cfg.head_dim
    dims = [("--d-model", "d_model", cfg.d_model, 1, 1),
            ("--n-head", "n_head / tp x head_dim", cfg.n_head, tp, hd),
            ("--n-kv-head", "n_kv_head / tp x head_dim", cfg.n_kv_head, tp, hd),
            ("--ffn-dim", "ffn_dim / tp", cfg.ffn_dim, tp, 1),
            ("--micro-batch", "micro-batch x seq_len / cp", tokens, 1, 1)]
    for flag, what, n, split, width in dims:
        if n % split == 0 and n // split * width % MULTIPLE:  # not divisible by tp: tp.validate's
            return flag, (f"fp8 matmuls need every dimension a multiple of {MULTIPLE}; "
                          f"{what} = {n // split * width}")
    return None


# ---------------------------------------------------------------- the scale rule and the casts

def scale_for(amax, fmt):
    """The largest power of two s with amax·s <= fmt's max, elementwise over fp32 amaxes.

    Computed from the exponents, so exact. amax 0: any s works. inf or nan: the cast gives nan,
    and the run stops on a non-finite loss."""
    mantissa, exponent = math.frexp(torch.finfo(fmt).max)  # 448 = 0.875·2^9, 57344 = 0.875·2^16
    m, e = torch.frexp(amax)
    return torch.exp2((exponent - e - (m > mantissa).int()).clamp(-126, 126).float())


def amaxes(tensors, groups):
    """max |t| of each (bf16) tensor, fp32 (n,), MAX-all-reduced over the groups that split them."""
    out = torch.stack([t.abs().amax() if t.numel() else t.new_zeros(()) for t in tensors]).float()
    for group in groups:
        group.max_all_reduce(out)
    return out


def cast(t, scale, fmt):
    """fmt(bf16(t)·scale). The multiply is exact (a power of two); amax·s <= max: no saturation."""
    return (t.to(torch.bfloat16) * scale).to(fmt)


def scaled_mm(a, b, scale_a, scale_b, out_dtype, fast_accum=False):
    """(a / scale_a) · (b / scale_b) for fp8 a (m, k) row-major and b (k, n) column-major.

    Summed in fp32, rounded once to out_dtype: torch._scaled_mm on a GPU. On CPU _scaled_mm is a
    reference loop, about 1000x slower than a bf16 matmul of 512x128x384. So there the operands
    are upcast to fp32 (exact) and multiplied in fp32. Exact products, fp32 sums, one rounding:
    _scaled_mm's arithmetic. tests/test_fp8.py checks one against the other."""
    inverse = (1 / scale_a).float(), (1 / scale_b).float()  # exact: powers of two
    if a.is_cuda:
        return torch._scaled_mm(a, b, scale_a=inverse[0], scale_b=inverse[1], out_dtype=out_dtype,
                                use_fast_accum=fast_accum)
    with torch.autocast("cpu", enabled=False):
        return (a.float() @ b.float() * (inverse[0] * inverse[1])).to(out_dtype)


def column_major(t):
    """The same (k, n) matrix stored column by column: _scaled_mm's second operand on a GPU."""
    return t.t().contiguous().t() if t.is_cuda else t


def row_major(t):
    """The same matrix stored row by row, as _scaled_mm on a GPU wants its first operand."""
    return t.contiguous() if t.is_cuda else t


class ScaledLinear(torch.autograd.Function):
    """y = x·Wᵀ with x, W in e4m3 and dY in e5m2.

    W's scale is given (w_scale); x's and dY's come from their amaxes. Each amax is MAX-reduced
    over the groups that split its tensor (x_groups, dy_groups)."""

    @staticmethod
    def forward(ctx, x, weight, w_scale, x_groups, dy_groups, x_scale=None):
        # (M, K), (N, K)
        xb, wb = x.to(torch.bfloat16).reshape(-1, x.shape[-1]), weight.to(torch.bfloat16)
        x_scale = scale_for(amaxes([xb], x_groups), E4M3)[0] if x_scale is None else x_scale
        scales = torch.stack([x_scale, w_scale])
        ctx.save_for_backward(x, weight, scales)  # as they came, nothing new (FSDP gathers W again)
        ctx.dy_groups = dy_groups
        y = scaled_mm(cast(xb, scales[0], E4M3), cast(wb, scales[1], E4M3).t(), scales[0],
                      scales[1], torch.bfloat16, fast_accum=True)  # (M, N)
        return y.view(*x.shape[:-1], -1)

    @staticmethod
    def backward(ctx, grad):
        x, weight, scales = ctx.saved_tensors
        # (M, K): forward's values, no second amax
        x8 = cast(x.reshape(-1, x.shape[-1]), scales[0], E4M3)
        w8 = cast(weight, scales[1], E4M3)  # (N, K)
        g = grad.reshape(-1, grad.shape[-1]).to(torch.bfloat16)  # (M, N)
        g_scale = scale_for(amaxes([g], ctx.dy_groups), E5M2)[0]
        g8 = cast(g, g_scale, E5M2)
        grad_x = scaled_mm(g8, column_major(w8), g_scale, scales[1], x.dtype)  # (M, N)·(N, K)
        # (N, M)·(M, K)
        grad_w = scaled_mm(row_major(g8.t()), column_major(x8), g_scale, scales[0], weight.dtype)
        return grad_x.view(x.shape), grad_w, None, None, None, None


def linear(x, weight, groups=()):
    """y = x·Wᵀ in fp8, every amax reduced over `groups`, x's and W's in one reduction.

    Each tensor is split over each of the groups."""
    scales = scale_for(amaxes([x.to(torch.bfloat16), weight.to(torch.bfloat16)], groups), E4M3)
    return ScaledLinear.apply(x, weight, scales[1], [], list(groups), scales[0])


class BlockWeights:
    """The e4m3 scales of one block's linear weights, reduced together once per forward.

    The block's first fp8 matmul of each forward (q_proj's, in block order) reduces the amax of
    every weight. It is one MAX all-reduce over tp. The block's other matmuls read theirs. With one
    reduction per tensor a layer would take 14 (28 with cp). The amax of the fp32 master is that
    of its bf16 copy, rounded. Rounding is monotonic, so no copy is made."""

    def __init__(self, linears, group):
        self.linears, self.groups, self.scales = linears, [group] if group is not None else [], None

    def scale(self, module):
        if module is self.linears[0] or self.scales is None:
            amax = torch.stack([m.weight.detach().abs().amax()
                                for m in self.linears]).to(torch.bfloat16)
            self.scales = scale_for(reduce_max(amax, self.groups), E4M3)
        return self.scales[self.linears.index(module)]


def reduce_max(values, groups):
    """fp32 values MAX-all-reduced over the groups."""
    out = values.float()
    for group in groups:
        group.max_all_reduce(out)
    return out


def apply(chunk, tp_group=None, cp_group=None):
    """Routes a GPT chunk's block matmuls through fp8, in place, by their matmul hook.

    The hook is parallel/__init__.py's. Every block's linears take it: model.Linear, and tp's
    column and row linears alike. The embedding, attention and lm_head stay as they are.
    Each amax is reduced only over the groups (tp, cp) that split its tensor. The weight's
    tp_shard tag tells which. A column-parallel linear (split by output features) sees its whole
    input and a shard of dY. A row-parallel one sees a shard of its input and the whole dY. cp
    splits every x and dY by tokens, no weight. A block's weights share one reduction."""
    tp = [tp_group] if tp_group is not None and tp_group.size > 1 else []
    cp = [cp_group] if cp_group is not None and cp_group.size > 1 else []
    matmul = block_linear
    # The amax all-reduces break a compiled block's graph. So the matmul runs eagerly: else dynamo
    # compiles its pieces once per weight shape and dtype, past its limit.
    if tp or cp:
        matmul = torch.compiler.disable(block_linear)
    for block in chunk.layers.values():
        linears = [m for m in block.modules() if isinstance(m, Linear)]
        weights = BlockWeights(linears, tp[0] if tp else None)
        for module in linears:
            # 0: column-parallel, 1: row-parallel, None: whole
            dim = (tp_shard_of(module.weight) or (None,))[0]
            x_groups, dy_groups = (tp if dim == 1 else []) + cp, (tp if dim == 0 else []) + cp
            module.matmul = partial(matmul, module=module, weights=weights, x_groups=x_groups,
                                    dy_groups=dy_groups)
    return chunk


def block_linear(x, weight, module, weights, x_groups, dy_groups):
    return ScaledLinear.apply(x, weight, weights.scale(module), x_groups, dy_groups)


# ---------------------------------------------------------- FSDP: block units all-gathered in e4m3

def gather_in_fp8(wrapper, tp_group):
    """--fp8-all-gather: every block unit of an FSDP/HSDP wrapper all-gathers in e4m3.

    It goes through the units' gather hook (parallel/__init__.py). Each matrix of a unit's shard
    is cast with its own scale. Its amax is MAX-reduced over the shard group and tp first.
    The e4m3 bytes are half the bf16 all-gather: (g-1)/g · padded unit · 1 byte. The norm gains
    are not matmul weights. They travel in bf16 beside them: (g-1) · 2v bytes, v the most norm
    elements a shard holds (<= 2d). Then all is written into the bf16 unit buffer, exactly. The
    rest of FSDP does not change. The embedding and norm + head units stay in bf16.
    An fp8 value dequantized to bf16 casts back to itself. So the matmuls' e4m3 operands are
    those of a bf16 all-gather cast there, bit for bit."""
    for unit in wrapper.units:
        if unit.name.startswith("layers."):
            unit.gather = FP8Gather(unit, [g for g in (unit.group, tp_group) if g.size > 1])
    return wrapper


class FP8Gather:
    """One unit's fp8 all-gather: the matrices of the flat shard as e4m3 bytes, gains in bf16.

    In the e4m3 bytes, vectors and padding are zero. The norm gains this shard holds travel beside
    them in bf16. They are padded to the most any shard holds (v)."""

    def __init__(self, unit, groups):
        self.groups, n, start = groups, unit.shard_numel, unit.start
        matrices = unit.matrix_ranges()
        self.matrices = matrices  # flat ranges of the matrices, each with its own scale
        # the ranges within this shard
        self.local = [(max(a, start) - start, min(b, start + n) - start) for a, b in matrices]
        vectors = matrices[-1][1] if matrices else 0, unit.numel  # flat layout: matrices, vectors
        self.vectors = [(max(vectors[0], r * n), min(vectors[1], (r + 1) * n))
                        for r in range(unit.group.size)]
        self.v = max(max(b - a, 0) for a, b in self.vectors)

    def __call__(self, unit):
        shard = unit.local.to(torch.bfloat16)  # (n,)
        scales = scale_for(amaxes([shard[max(a, 0):max(b, 0)] for a, b in self.local], self.groups),
                           E4M3)
        wire = torch.zeros(unit.shard_numel, dtype=E4M3, device=shard.device)
        for (a, b), scale in zip(self.local, scales):
            if b > a:
                wire[a:b] = cast(shard[a:b], scale, E4M3)
        a, b = (x - unit.start for x in self.vectors[unit.group.rank])
        side = shard.new_zeros(self.v)
        if b > a:
            side[:b - a] = shard[a:b]
        got = torch.empty(unit.padded, dtype=torch.uint8, device=shard.device)
        got_side = shard.new_empty(unit.group.size * self.v)
        handles = [unit.group.all_gather(got, wire.view(torch.uint8), async_op=True),
                   unit.group.all_gather(got_side, side, async_op=True)]
        full = torch.empty(unit.padded, dtype=torch.bfloat16, device=shard.device)
        return full, Dequantize(self, handles, got, got_side, full, scales), (wire, side)


class Dequantize:
    """The handle FSDP waits for: both all-gathers, then the bf16 unit written from them.

    Exact: s is a power of 2."""

    def __init__(self, gather, handles, got, got_side, full, scales):
        self.gather, self.handles, self.got, self.got_side, self.full, self.scales = (
            gather, handles, got, got_side, full, scales)

    def wait(self):
        if self.handles is None:
            return
        for handle in self.handles:
            handle.wait()
        fp8 = self.got.view(E4M3)
        for (a, b), scale in zip(self.gather.matrices, self.scales):
            self.full[a:b] = fp8[a:b].to(torch.bfloat16) * (1 / scale)
        for r, (a, b) in enumerate(self.gather.vectors):
            if b > a:
                self.full[a:b] = self.got_side[r * self.gather.v:r * self.gather.v + b - a]
        self.handles = None
