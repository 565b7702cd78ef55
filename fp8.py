"""FP8 training (--dtype fp8): the scale rule and every cast point of the block matmuls, in one place.

Which tensor is in which format:
    block linear inputs x (q, k, v, gate, up: the norm output; o: attention; down: silu(gate)·up)   e4m3
    block linear weights W (q, k, v, o, gate, up, down)                                             e4m3
    the gradient dY of a block linear's output, in backward                                         e5m2
    Y = x·Wᵀ and dx = dY·W: fp32 accumulation, out in bf16 (dx in x's dtype); dW = dYᵀ·x out in W's dtype
    everything else (embedding, attention, norms, residual stream, lm_head, loss): bf16 autocast, as --dtype bf16
    master weights, their gradients, AdamW's moments: fp32, as in every mode
e4m3 (3 mantissa bits, max 448) for values, e5m2 (2 bits, max 57344: more range) for gradients, as torchao and
Transformer Engine do; Hopper multiplies e4m3 x e4m3 and e5m2 x e4m3 at twice the bf16 rate.

Scale rule (dynamic, tensorwise): a tensor t is cast as q = fmt(bf16(t)·s), s = 2^k the largest power of two with
amax·s <= the format's max, amax = max |bf16(t)| over the whole tensor; the matmul multiplies q and undoes s.
Where each amax comes from: x's and W's from the tensors in forward, dY's from the gradient in backward; nothing is
delayed, nothing is kept across steps. Powers of two make the multiply exact, so the scale only decides what
underflows, and an fp8 value dequantized to bf16 casts back to itself: FSDP's fp8 all-gather then gives the very
values of a bf16 all-gather cast here, bit for bit.
Layouts: a scale must be the one a single process would use, so the amax is the whole tensor's: each is MAX-all-
reduced over the groups that split its tensor (a few bytes, counted as `all_reduce_max`). Under tp a column-parallel
linear holds a shard of W and of dY, a row-parallel one of W and of x; cp splits every x and dY by tokens. A block's
weights are reduced together, once per forward (BlockWeights): per layer and micro-batch, tp alone, 3 reductions in
forward (the weights, o's and down's inputs) and 5 in backward (the column linears' dY), where every tensor reduced
over tp and cp took 14 (28 with cp). dp and pp ranks run whole micro-batches, FSDP gathers whole weights: no
reduction. The matmul then runs on the local shard.
FSDP/HSDP --fp8-all-gather (gather_in_fp8): a block unit's shard is cast with each matrix's scale (the amax
MAX-reduced over the shard group and tp first) and all-gathered as e4m3 bytes, exactly half the bf16 all-gather:
(g-1)/g · padded unit · 1 byte; its norm gains are not matmul weights and travel in bf16 beside it, (g-1) · 2v bytes
(v: the most norm elements one shard holds, <= 2d). Then dequantized into the bf16 unit buffer (exact): the rest of
FSDP does not change. Embedding and norm + head units stay in bf16.
Costs. Memory: nothing more is saved for backward (x and W as they came, and their scales; bf16 autocast saves a
bf16 copy of x per linear); transients of 1 byte/element (the casts, column-major copies for backward), FSDP
--fp8-all-gather 1 byte/element more while a unit arrives. Time: per linear and step 3 amax passes (x, W, dY), 5
casts (x and W again in backward: no second amax) and 3 transposed fp8 copies, which torch.compile fuses; under tp
or cp the few tiny blocking reductions above. --sp's rings (tp_ring.py) stay off:
under fp8 each sp gather and reduce-scatter is one call, and backward keeps the gathered input.
CPU: torch._scaled_mm runs there, but as a reference loop (about 1000x slower than a bf16 matmul of 512x128x384),
so on CPU scaled_mm upcasts the fp8 operands to fp32 (exact) and multiplies in fp32: exact products, fp32 sums,
one rounding, the arithmetic of _scaled_mm (tests/test_fp8.py checks one against the other).
"""
import math
from functools import partial

import torch

from model import Linear
from parallel import tp_shard_of

E4M3, E5M2 = getattr(torch, "float8_e4m3fn", None), getattr(torch, "float8_e5m2", None)
MULTIPLE = 16  # _scaled_mm on a GPU: the inner dimension and the columns of every operand, multiples of 16


def missing():
    """What this torch lacks for fp8 training, as a sentence, or None."""
    lacks = [f"torch.{n}" for n in ("_scaled_mm", "float8_e4m3fn", "float8_e5m2") if not hasattr(torch, n)]
    return f"this torch ({torch.__version__}) has no {', '.join(lacks)}" if lacks else None


def misfit(cfg, tp, tokens):
    """(flag, message) of the first block-matmul dimension that is not a multiple of 16, or None. tokens: the rows
    of one micro-batch on a rank (the inner dimension of the weight gradient)."""
    hd = cfg.head_dim
    dims = [("--d-model", "d_model", cfg.d_model, 1, 1), ("--n-head", "n_head / tp x head_dim", cfg.n_head, tp, hd),
            ("--n-kv-head", "n_kv_head / tp x head_dim", cfg.n_kv_head, tp, hd),
            ("--ffn-dim", "ffn_dim / tp", cfg.ffn_dim, tp, 1),
            ("--micro-batch", "micro-batch x seq_len / cp", tokens, 1, 1)]
    for flag, what, n, split, width in dims:
        if n % split == 0 and n // split * width % MULTIPLE:  # (not divisible by tp: tp.validate says so)
            return flag, f"fp8 matmuls need every dimension a multiple of {MULTIPLE}; {what} = {n // split * width}"
    return None


# ---------------------------------------------------------------- the scale rule and the casts

def scale_for(amax, fmt):
    """The largest power of two s with amax·s <= fmt's max, elementwise over fp32 amaxes: from the exponents, so
    exact (amax 0: any s works; inf or nan: the cast gives nan, and the run stops on a non-finite loss)."""
    mantissa, exponent = math.frexp(torch.finfo(fmt).max)  # 448 = 0.875·2^9, 57344 = 0.875·2^16
    m, e = torch.frexp(amax)
    return torch.exp2((exponent - e - (m > mantissa).int()).clamp(-126, 126).float())


def amaxes(tensors, groups):
    """max |t| of each (bf16) tensor, fp32 (n,), MAX-all-reduced over the groups the tensors are split over."""
    out = torch.stack([t.abs().amax() if t.numel() else t.new_zeros(()) for t in tensors]).float()
    for group in groups:
        group.max_all_reduce(out)
    return out


def cast(t, scale, fmt):
    """fmt(bf16(t)·scale): the multiply is exact (a power of two) and nothing saturates (amax·scale <= max)."""
    return (t.to(torch.bfloat16) * scale).to(fmt)


def scaled_mm(a, b, scale_a, scale_b, out_dtype, fast_accum=False):
    """(a / scale_a) · (b / scale_b) for fp8 a (m, k) row-major and b (k, n) column-major, accumulated in fp32, rounded
    once to out_dtype: torch._scaled_mm on a GPU; on CPU the same arithmetic through an exact upcast to fp32."""
    inverse = (1 / scale_a).float(), (1 / scale_b).float()  # exact: powers of two
    if a.is_cuda:
        return torch._scaled_mm(a, b, scale_a=inverse[0], scale_b=inverse[1], out_dtype=out_dtype,
                                use_fast_accum=fast_accum)
    with torch.autocast("cpu", enabled=False):
        return (a.float() @ b.float() * (inverse[0] * inverse[1])).to(out_dtype)


def column_major(t):
    """The same (k, n) matrix stored column by column, as _scaled_mm on a GPU wants its second operand."""
    return t.t().contiguous().t() if t.is_cuda else t


def row_major(t):
    """The same matrix stored row by row, as _scaled_mm on a GPU wants its first operand."""
    return t.contiguous() if t.is_cuda else t


class ScaledLinear(torch.autograd.Function):
    """y = x·Wᵀ with x, W in e4m3 and dY in e5m2: W's scale given (w_scale), x's and dY's from their amaxes, each
    MAX-reduced over the groups that split that tensor (x_groups, dy_groups)."""

    @staticmethod
    def forward(ctx, x, weight, w_scale, x_groups, dy_groups, x_scale=None):
        xb, wb = x.to(torch.bfloat16).reshape(-1, x.shape[-1]), weight.to(torch.bfloat16)  # (M, K), (N, K)
        x_scale = scale_for(amaxes([xb], x_groups), E4M3)[0] if x_scale is None else x_scale
        scales = torch.stack([x_scale, w_scale])
        ctx.save_for_backward(x, weight, scales)  # as they came: nothing new is kept (FSDP gathers W again)
        ctx.dy_groups = dy_groups
        y = scaled_mm(cast(xb, scales[0], E4M3), cast(wb, scales[1], E4M3).t(), scales[0], scales[1], torch.bfloat16,
                      fast_accum=True)  # (M, N)
        return y.view(*x.shape[:-1], -1)

    @staticmethod
    def backward(ctx, grad):
        x, weight, scales = ctx.saved_tensors
        x8 = cast(x.reshape(-1, x.shape[-1]), scales[0], E4M3)  # (M, K): forward's values, no second amax
        w8 = cast(weight, scales[1], E4M3)  # (N, K)
        g = grad.reshape(-1, grad.shape[-1]).to(torch.bfloat16)  # (M, N)
        g_scale = scale_for(amaxes([g], ctx.dy_groups), E5M2)[0]
        g8 = cast(g, g_scale, E5M2)
        grad_x = scaled_mm(g8, column_major(w8), g_scale, scales[1], x.dtype)  # (M, N)·(N, K)
        grad_w = scaled_mm(row_major(g8.t()), column_major(x8), g_scale, scales[0], weight.dtype)  # (N, M)·(M, K)
        return grad_x.view(x.shape), grad_w, None, None, None, None


def linear(x, weight, groups=()):
    """y = x·Wᵀ in fp8, every amax reduced over `groups` (each tensor split over each of them; x's and W's in one)."""
    scales = scale_for(amaxes([x.to(torch.bfloat16), weight.to(torch.bfloat16)], groups), E4M3)
    return ScaledLinear.apply(x, weight, scales[1], [], list(groups), scales[0])


class BlockWeights:
    """The e4m3 scales of one block's linear weights: at the block's first fp8 matmul of each forward (q_proj's, in
    the block's order), one MAX all-reduce over tp of every weight's amax; the block's other matmuls read theirs. An
    amax of the fp32 master is the amax of its bf16 copy rounded (rounding is monotonic): no copy is made."""

    def __init__(self, linears, group):
        self.linears, self.groups, self.scales = linears, [group] if group is not None else [], None

    def scale(self, module):
        if module is self.linears[0] or self.scales is None:
            amax = torch.stack([m.weight.detach().abs().amax() for m in self.linears]).to(torch.bfloat16)
            self.scales = scale_for(reduce_max(amax, self.groups), E4M3)
        return self.scales[self.linears.index(module)]


def reduce_max(values, groups):
    """fp32 values MAX-all-reduced over the groups."""
    out = values.float()
    for group in groups:
        group.max_all_reduce(out)
    return out


def apply(chunk, tp_group=None, cp_group=None):
    """Routes a GPT chunk's block matmuls through fp8, in place, through their matmul hook (parallel/__init__.py): the
    linears of every block (model.Linear, tp's column and row linears alike); the embedding, attention and lm_head
    stay as they are. groups: (the tp group, the cp group). Each amax is reduced only over the groups that split its
    tensor, read from the weight's tp_shard tag: a column-parallel linear (split by output features) sees its whole
    input and a shard of dY; a row-parallel one a shard of its input and the whole dY; cp splits every x and dY by
    tokens, no weight. A block's weights share one reduction (BlockWeights)."""
    tp = [tp_group] if tp_group is not None and tp_group.size > 1 else []
    cp = [cp_group] if cp_group is not None and cp_group.size > 1 else []
    matmul = block_linear
    if tp or cp:  # the amax all-reduces break a compiled block's graph: run the matmul eagerly, or dynamo compiles
        matmul = torch.compiler.disable(block_linear)  # its pieces once per weight shape and dtype, past its limit
    for block in chunk.layers.values():
        linears = [m for m in block.modules() if isinstance(m, Linear)]
        weights = BlockWeights(linears, tp[0] if tp else None)
        for module in linears:
            dim = (tp_shard_of(module.weight) or (None,))[0]  # 0: column-parallel, 1: row-parallel, None: whole
            x_groups, dy_groups = (tp if dim == 1 else []) + cp, (tp if dim == 0 else []) + cp
            module.matmul = partial(matmul, module=module, weights=weights, x_groups=x_groups, dy_groups=dy_groups)
    return chunk


def block_linear(x, weight, module, weights, x_groups, dy_groups):
    return ScaledLinear.apply(x, weight, weights.scale(module), x_groups, dy_groups)


# ---------------------------------------------------------------- FSDP: block units all-gathered in e4m3

def gather_in_fp8(wrapper, tp_group):
    """--fp8-all-gather: every block unit of an FSDP/HSDP wrapper all-gathers in e4m3, through the units' gather hook
    (parallel/__init__.py)."""
    for unit in wrapper.units:
        if unit.name.startswith("layers."):
            unit.gather = FP8Gather(unit, [g for g in (unit.group, tp_group) if g.size > 1])
    return wrapper


class FP8Gather:
    """One unit's fp8 all-gather: the matrices of the flat shard as e4m3 bytes (vectors and padding zero), and the
    norm gains this shard holds as bf16 beside them, padded to the most any shard holds (v)."""

    def __init__(self, unit, groups):
        self.groups, n, start = groups, unit.shard_numel, unit.start
        matrices = unit.matrix_ranges()
        self.matrices = matrices  # flat ranges of the matrices, each with its own scale
        self.local = [(max(a, start) - start, min(b, start + n) - start) for a, b in matrices]  # in this shard
        vectors = matrices[-1][1] if matrices else 0, unit.numel  # the flat layout: matrices, then vectors
        self.vectors = [(max(vectors[0], r * n), min(vectors[1], (r + 1) * n)) for r in range(unit.group.size)]
        self.v = max(max(b - a, 0) for a, b in self.vectors)

    def __call__(self, unit):
        shard = unit.local.to(torch.bfloat16)  # (n,)
        scales = scale_for(amaxes([shard[max(a, 0):max(b, 0)] for a, b in self.local], self.groups), E4M3)
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
    """The handle FSDP waits for: both all-gathers, then the bf16 unit written from them (exact: s is a power of 2)."""

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
