"""The collectives of the tensor-parallel region as autograd functions (Megatron's f and g), for parallel/tp.py.

Split:    nothing of its own: the (B, T, d) activation is replicated over tp, or cut along the sequence (--sp).
Sends:    g: an all-reduce of the row-parallel partial sums in forward, 2(t-1)/t · B·T·d·e bytes (--sp: a
          reduce-scatter, (t-1)/t ·, and an all-gather of the gradient in backward); f (EnterTP): identity forward
          (--sp: the sequence gathered), the input gradient summed over tp in backward.
Overlap:  none here: each call blocks. tp.py's ColumnParallel and tp_overlap.py hide the ones next to a matmul.
Memory:   nothing kept for backward.
"""
from torch.autograd import Function


def all_gather_seq(group, x):
    """(B, T/t, d) -> (B, T, d): every tp rank's sequence block, in rank order."""
    local = x.transpose(0, 1).contiguous()  # (T/t, B, d): the collective concatenates along dim 0
    out = local.new_empty((local.shape[0] * group.size, *local.shape[1:]))  # (T, B, d)
    group.all_gather(out, local)
    return out.transpose(0, 1).contiguous()


def reduce_scatter_seq(group, x):
    """(B, T, d) partial sums -> (B, T/t, d): this rank's sequence block of the sum over tp."""
    full = x.transpose(0, 1).contiguous()  # (T, B, d)
    out = full.new_empty((full.shape[0] // group.size, *full.shape[1:]))  # (T/t, B, d)
    group.reduce_scatter(out, full)
    return out.transpose(0, 1).contiguous()


def all_reduce(group, x):
    """The sum of x over tp, in a new tensor: a gradient autograd hands over may be shared by another path (a
    residual add passes the same tensor to both branches)."""
    out = x.contiguous().clone()
    group.all_reduce(out)
    return out


class ReduceFromTP(Function):
    """Megatron's g: all-reduce in forward (sum the row-parallel partial outputs), identity in backward."""

    @staticmethod
    def forward(ctx, x, group):  # x: a row-parallel matmul's fresh output, which no backward reads: summed in place
        if x._base is not None:  # a view a custom matmul returned (fp8.py): autograd forbids changing it in place
            return all_reduce(group, x)
        ctx.mark_dirty(x)
        group.all_reduce(x)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class ScatterSequence(Function):
    """Sequence parallel's g: reduce-scatter the partial sums in forward, all-gather the grad in backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return reduce_scatter_seq(group, x)

    @staticmethod
    def backward(ctx, grad):
        return all_gather_seq(ctx.group, grad), None


class EnterTP(Function):
    """Megatron's f on its own, for matmuls that are autograd ops of their own (fp8.py): identity forward (--sp: gather
    the sequence), the input gradient summed over tp in backward (--sp: reduce-scattered)."""

    @staticmethod
    def forward(ctx, x, group, sequence_parallel):
        ctx.group, ctx.sp = group, sequence_parallel
        return all_gather_seq(group, x) if sequence_parallel else x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return reduce_scatter_seq(ctx.group, grad) if ctx.sp else all_reduce(ctx.group, grad), None, None


def leave_tp(x, group, sequence_parallel):
    """Partial sums over tp -> the replicated (or sequence-sharded) residual stream."""
    return ScatterSequence.apply(x, group) if sequence_parallel else ReduceFromTP.apply(x, group)
