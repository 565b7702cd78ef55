"""A layer on tensor parallel under --sp: its sequence collectives cut into ring hops under matmuls.

--sp-ring switches it in: apply(chunk) runs after tp.parallelize and tp_fused.apply. It changes how
the tp modules run, not what they hold: same parameters, same names, same bytes.

Ring:     rank r sends to r+1 and receives from r-1. An all-gather of t sequence blocks is t-1
          hops, each passing on the chunk in hand. A reduce-scatter is t-1 hops of an accumulator:
          each rank adds its share of the block it is bound for. A hop is one async batched p2p,
          launched before its step's matmuls and waited for after them. On a GPU the bytes move
          on the communication stream while the compute stream multiplies.
Uses:     column forward: each gathered chunk times every weight, while the next one travels.
          Row forward: the partial output for one destination block, while the last accumulator
          travels. Column backward: the input gradient is reduce-scattered and the input gathered
          again, in the same hops. The weight gradients run under the last hop. Row backward: each
          chunk of the output gradient times the weight and the saved input, as it travels.
Bytes:    t-1 hops of 1/t of the tensor: (t-1)/t of it per rank, the collective's bytes. The comm
          layer counts each ring once, as that collective. The hops go through an uncounted twin
          of the tp Group and are logged with 0 bytes.
Memory:   per ring, one chunk (1/t of the tensor) arrives while one is in use. That is on top of
          what the collective held.
"""
import torch
import torch.nn.functional as F
from torch.autograd import Function

from model import RMSNorm
from parallel.comm import Group, Pending
from parallel.tp import RowParallelLinear
from parallel.tp_fused import ColumnInput, FusedNormThenEnter


class Uncounted:
    """The counters of a Ring's twin Group: hops count nothing. The Ring counts the collective."""

    def add(self, kind, group, nbytes):
        return None


class Requests:
    """One hop's p2p requests as one handle for comm.Pending, which waits and records the wait."""

    def __init__(self, works):
        self.works = works

    def wait(self):
        for work in self.works:
            work.wait()


class Ring:
    """The tp group as a ring.

    `start` counts a logical collective. `hop` passes tensors on. `finish` records its end."""

    def __init__(self, group):
        self.group, self.size, self.rank, self.stats = group, group.size, group.rank, group.stats
        self.p2p = Group(group.name, group.ranks, group.pg, group.ranks[group.rank], Uncounted())
        self.next, self.prev = (self.rank + 1) % self.size, (self.rank - 1) % self.size

    @torch.compiler.disable
    def start(self, kind, full_nbytes):
        """Counts one all_gather or reduce_scatter of `full_nbytes`, as the comm layer would.

        Returns its log index."""
        if self.size == 1:
            return None
        return self.stats.add(kind, self.group.name, (self.size - 1) / self.size * full_nbytes)

    @torch.compiler.disable
    def finish(self, index):
        if index is not None:
            self.stats.timeline.append(("wait", index))

    @torch.compiler.disable
    def hop(self, sends):
        """Sends each tensor to rank+1, receives one like it from rank-1: (received, a handle)."""
        received = [torch.empty_like(t) for t in sends]
        self.stats.log.append(("hop", self.group.name, 0))
        index = len(self.stats.log) - 1
        self.stats.timeline.append(("launch", index))
        works = self.p2p.send_recv([(t, self.next) for t in sends],
                                   [(t, self.prev) for t in received])
        return received, Pending(Requests(works), self.stats, index)


def block(i, t, n):
    """The sequence positions of block i (mod t) of t blocks of n."""
    i %= t
    return slice(i * n, (i + 1) * n)


def input_grad(grads, weights, rows, dtype):
    """Σ_j dy_j[:, rows] · W_j, summed in `dtype` (the input's).

    This rank's part of the input gradient's block."""
    parts = [(g[:, rows] @ w).to(dtype) for g, w in zip(grads, weights)]  # (B, rows, d) each
    return sum(parts[1:], parts[0])


def gather_then_multiply(ring, x, weights):
    """Column forward: x (B, T/t, d), this rank's block -> [x_full · W_jᵀ (B, T, out_j)] per weight.

    The sequence is gathered hop by hop. The chunk in hand is sent on before it is multiplied."""
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
    """Row forward: h (B, T, k) -> this rank's block (B, T/t, d) of Σ_tp h · Wᵀ.

    Step s computes this rank's share of the block bound for rank r-s-1. Meanwhile the
    accumulator of step s-1 travels. Then it adds the one that arrived."""
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

    Returns this rank's block of Σ_tp Σ_j dy_j · W_j (B, T/t, d), reduce-scattered on the ring as
    in multiply_then_scatter. Also returns dW_j = dy_jᵀ · x_full (out_j, d); x is gathered in the
    same hops, chunk by chunk."""
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
        mine = input_grad(grads, weights, block(r - s - 1, t, n), x.dtype)
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
    """Row backward. grad: this rank's block (B, T/t, d) of the output gradient. h: the saved input.

    h is (B, T, k). Returns dh = dz_full · W (B, T, k) and dW = dz_fullᵀ · h (d, k), summed in fp32.
    The gradient is gathered hop by hop. The chunk in hand is sent on before its two matmuls."""
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


# -------------------------------------------------------------- the Functions and modules on rings

class RingColumnParallel(Function):
    """tp's column parallel under --sp, its gathers and reduce-scatter as rings.

    x, this rank's block (B, T/t, d) -> y_j = x_full · W_jᵀ (B, T, out_j/t) for every weight.
    Only the block is saved."""

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
    """Saves RowParallelRing's x and W into `saved` before it runs, and passes x on.

    A checkpointed block's recompute stops once its last saved tensor is back. Saved here, that
    is before the ring and its matmuls, as it is before F.linear's."""

    @staticmethod
    def forward(ctx, x, weight, saved):
        ctx.save_for_backward(x, weight)
        saved.append(ctx)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad, None, None


class RowParallelRing(Function):
    """z = this rank's sequence block of Σ_tp x · Wᵀ.

    The matmul is cut by destination block under the ring reduce-scatter. Backward gathers the
    output gradient the same way."""

    @staticmethod
    def forward(ctx, x, weight, ring, saved):
        ctx.ring, ctx.saved = ring, saved  # SaveForRing's ctx, holding x and W
        return multiply_then_scatter(ring, x, weight)  # (B, T/t, d)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved.saved_tensors
        return *gather_then_grads(ctx.ring, grad, x, weight), None, None


class RingNormThenEnter(FusedNormThenEnter):
    """tp_fused.FusedNormThenEnter whose column matmuls ride RingColumnParallel."""

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


def apply(chunk):
    """Switches a tp-parallelized chunk's --sp modules to their ring versions, in place.

    Like torch's parametrize, it swaps each module's class: the parameters, their names and tags
    stay. Returns the chunk."""
    for module in list(chunk.modules()):
        kind = {FusedNormThenEnter: RingNormThenEnter,
                RowParallelLinear: RingRowParallelLinear}.get(type(module))
        if kind is not None and module.sequence_parallel:
            module.__class__, module.ring = kind, Ring(module.group)
    return chunk
