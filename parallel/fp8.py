"""FP8 training (--dtype fp8): the scale rule and every cast point of the block matmuls.

Formats, as in torchao and Transformer Engine. Hopper multiplies fp8 at twice the bf16 rate.
    e4m3   block linear inputs x and weights W: 3 mantissa bits, max 448.
    e5m2   dY, the gradient of a block linear's output: 2 bits, max 57344, for more range.
    fp32   the sums of Y = x·Wᵀ, dx = dY·W and dW = dYᵀ·x. Y is bf16, dx x's dtype, dW W's.
    bf16   the rest (embedding, attention, norms, residual stream, lm_head, loss): autocast.
A block linear's x: the norm output (q, k, v, gate, up), attention (o), silu(gate)·up (down).
Scale rule (dynamic, tensorwise): q = fmt(bf16(t)·s), and the matmul undoes s. s is the largest
power of two with amax·s <= the format's max. amax = max |bf16(t)| over the whole tensor, as one
process would take it: x's and W's in forward, dY's in backward. Nothing is kept across steps.
A power of two makes the multiply exact, so the scale only decides what underflows.
Layouts: amax is MAX-all-reduced over the groups that split its tensor (`all_reduce_max`); the
matmul runs on the local shard. With tp alone, per layer and micro-batch: 3 reductions in forward,
5 in backward, a few bytes each. dp, pp and FSDP split no tensor a matmul reads: no reduction.
Memory: backward keeps x and W as they came, and their scales. bf16 autocast keeps a bf16 copy of
x per linear. Transients of 1 byte/element: the casts, column-major copies, an fp8-gathered unit.
Time: per linear and step, 3 amax passes, 5 casts and 3 transposed copies, fused by torch.compile.
Under tp or cp, add the blocking reductions. --sp's rings stay off: each sp collective is one
call, and backward keeps the gathered input.
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
    tokens: a micro-batch's rows on a rank, the weight gradient's inner dimension."""
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
    """The largest power of two s with amax·s <= fmt's max, exact from fp32 amaxes' exponents.
    amax 0: any s works. inf or nan: the cast gives nan, and the run stops on its loss."""
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

    torch._scaled_mm on a GPU: fp32 sums, rounded once. On CPU, where that is a slow loop, the
    operands are upcast to fp32, exactly: the same arithmetic (tests/test_fp8.py)."""
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
    """y = x·Wᵀ, x and W in e4m3, dY in e5m2. x's and dY's amaxes are reduced over their groups."""

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
    """y = x·Wᵀ in fp8. x's and W's amaxes are reduced together over `groups`, which split both."""
    scales = scale_for(amaxes([x.to(torch.bfloat16), weight.to(torch.bfloat16)], groups), E4M3)
    return ScaledLinear.apply(x, weight, scales[1], [], list(groups), scales[0])


class BlockWeights:
    """The e4m3 scales of a block's linear weights: one MAX all-reduce over tp per forward.

    The first fp8 matmul (q_proj's) reduces every weight's amax, not 14 reductions (28 with cp).
    An fp32 master's amax is its bf16 copy's, rounded. Rounding is monotonic: no copy is made."""

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
    """Routes a chunk's block matmuls, tp's linears too, through fp8 by their matmul hook.

    Each amax is reduced over the groups that split its tensor. Over tp a column linear splits dY,
    a row linear x (the weight's tp_shard tells which). cp splits every x and dY."""
    tp = [tp_group] if tp_group is not None and tp_group.size > 1 else []
    cp = [cp_group] if cp_group is not None and cp_group.size > 1 else []
    matmul = block_linear
    # Eager: the amax all-reduces break the graph, recompiled per weight shape past dynamo's limit
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
    """--fp8-all-gather: every block unit of an FSDP/HSDP wrapper gathers in e4m3 (its gather hook).

    Each matrix of a shard has its own scale, its amax MAX-reduced over the shard group and tp.
    The e4m3 bytes are half of bf16's: (g-1)/g · padded unit · 1 byte. Norm gains travel in bf16
    beside them: (g-1) · 2v bytes. v is the most norm elements a shard holds (<= 2d). An fp8 value
    dequantized to bf16 casts back to itself. So the matmuls' operands are a bf16 gather's, bit
    for bit."""
    for unit in wrapper.units:
        if unit.name.startswith("layers."):
            unit.gather = FP8Gather(unit, [g for g in (unit.group, tp_group) if g.size > 1])
    return wrapper


class FP8Gather:
    """One unit's fp8 all-gather: the shard's matrices as e4m3 bytes, its norm gains in bf16."""

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
    """FSDP's handle: both all-gathers, then the bf16 unit. Exact, as s is a power of 2."""

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
