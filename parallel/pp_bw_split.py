"""The backward split of the zero-bubble pipeline schedules (zb1, zbv in pp_schedule.py): a stage's backward runs
as B, the input gradient the stage before waits for, and later as W, the weight gradients nobody waits for but
the optimizer, placed by the schedule where the stage would otherwise idle.

Split:    every weight of a chunk but the embedding's, through the weight_grads hook (parallel/__init__.py) of each
          layer that owns one (model.Linear, model.RMSNorm and tp's layers): its matmul or gain runs as a Function
          without an autograd edge to its weight. In B, autograd goes from the stage output to the stage input only;
          each such Function returns its input gradient and queues a closure holding what its weight gradient needs
          (the matmul's input and output gradient). W runs the closures of one (chunk, micro-batch) and hands the
          results to autograd at the weights the forward used: DDP's bucket hooks and FSDP's reduce-scatter then
          fire as in any backward, once per chunk after its last W. The embedding has no input to differentiate:
          its gradient stays in stage 0's B.
Sends:    nothing new: B sends the input gradient, as a full backward did. Under tp, B waits for the reduction of
          the input gradient at once (the weight-gradient matmuls it hid under now run in W), and W all-gathers a
          sequence-parallel input again: the same collectives, calls and bytes; the tp ring layer is not used.
Overlap:  W fills the fill-and-drain bubble (pp_schedule.py); within a stage nothing runs concurrently.
Memory:   from its B to its W a micro-batch keeps each matmul's input and output gradient, about its activation
          set: the schedules count a set alive until W. A checkpointed block is recomputed once, in B; W reads
          the recomputed inputs its closures hold.
"""
import torch
import torch.nn.functional as F
from torch.autograd import Function

from model import compute_dtype


class WeightGrads:
    """One chunk's deferred weight gradients by micro-batch: the store of the weight_grads hook. The executor sets
    `mb` before each B."""

    def __init__(self):
        self.mb, self.pending = None, {}

    def defer(self, weights, compute):
        """In B: compute() will return the gradients of `weights`, the tensors the forward read."""
        self.pending.setdefault(self.mb, []).append((weights, compute))

    def run(self, mb):
        """W: micro-batch mb's weight gradients, accumulated by autograd into the weights (or their FSDP unit)."""
        weights, grads = [], []
        with torch.no_grad():
            for ws, compute in self.pending.pop(mb):
                weights += ws
                grads += [g.to(w.dtype) for w, g in zip(ws, compute())]
        torch.autograd.backward(weights, grads)

    @torch.compiler.disable
    def linear(self, x, weight):
        """x · Wᵀ, its weight gradient deferred."""
        if not torch.is_grad_enabled():
            return F.linear(x, weight)
        return DeferredLinear.apply(x, weight.detach(), (self, weight))

    @torch.compiler.disable
    def scale(self, weight, h):
        """weight · h (a norm's gain over the last dim of h), its weight gradient deferred."""
        if not torch.is_grad_enabled():
            return weight * h
        return DeferredScale.apply(h, weight.detach(), (self, weight))


class DeferredLinear(Function):
    """y = x · Wᵀ (x: (..., in), W: (out, in)); backward returns dx = dy · W and defers dW = dyᵀ · x."""

    @staticmethod
    def forward(ctx, x, weight, deferred):
        ctx.deferred, ctx.input_dtype, dtype = deferred, x.dtype, compute_dtype(x)  # autocast's cast, as F.linear's
        x, weight = x.to(dtype), weight.to(dtype)
        ctx.save_for_backward(x, weight)
        return F.linear(x, weight)  # (..., out)

    @staticmethod
    def backward(ctx, grad):  # (..., out)
        x, weight = ctx.saved_tensors
        store, live = ctx.deferred
        store.defer([live], lambda: [grad.flatten(0, -2).t() @ x.flatten(0, -2)])  # (out, in)
        return (grad @ weight).to(ctx.input_dtype), None, None


class DeferredScale(Function):
    """y = w · h (w: (d,), h: (..., d)); backward returns dh = dy · w and defers dw = Σ dy · h."""

    @staticmethod
    def forward(ctx, h, weight, deferred):
        ctx.deferred = deferred
        ctx.save_for_backward(h, weight)
        return weight.to(h.dtype) * h  # in h's dtype, as model.ScaledRMSNorm

    @staticmethod
    def backward(ctx, grad):
        h, weight = ctx.saved_tensors
        store, live = ctx.deferred
        store.defer([live], lambda: [(grad * h).flatten(0, -2).sum(0)])  # (d,)
        return (grad * weight.to(grad.dtype)).to(h.dtype), None, None


def apply(chunk):
    """Defers the weight gradients of a chunk: sets the weight_grads hook of every layer that has one, after tp, cp
    and checkpointing have swapped its modules and before the data-parallel wrapper wraps their forwards. Returns
    the chunk's WeightGrads (also `chunk.weight_grads`)."""
    store = WeightGrads()
    for module in chunk.modules():
        if hasattr(module, "weight_grads"):
            module.weight_grads = store
    chunk.weight_grads = store
    return store
