"""The backward split of the zero-bubble schedules (zb1, zbv): B now, W later.

B is the input gradient, which the stage before waits for. W is the weight gradients, which only
the optimizer waits for.
Split:    every weight but the embedding's, which has no input to differentiate: its gradient
          stays in stage 0's B. Each layer with a weight (model.Linear, model.RMSNorm, tp's
          layers) has a weight_grads hook. Its matmul or gain then runs as a Function with no
          autograd edge to the weight.
Sends:    nothing new: the same collectives, calls and bytes. The tp ring layer is not used.
          Under tp, B waits at once for the input gradient's reduction. The weight-gradient
          matmuls it hid under run in W now. W all-gathers a sequence-parallel input again.
Overlap:  the schedule (pp_schedule.py) puts W in the fill-and-drain bubble, where a stage idles.
Memory:   from B to W a micro-batch keeps each matmul's input and output gradient, about its
          activation set. The schedules count the set alive until W. A checkpointed block is
          recomputed once, in B. W reads the recomputed inputs its closures hold.
"""
import torch
import torch.nn.functional as F
from torch.autograd import Function

from model import compute_dtype


class WeightGrads:
    """One chunk's deferred weight gradients by micro-batch (`mb`, set before each B).

    In B each deferred Function queues a closure over its input and output gradient. W hands the
    closures' results to autograd at the weights. So DDP's hooks and FSDP's reduce-scatter fire
    once per chunk, after its last W."""

    def __init__(self):
        self.mb, self.pending = None, {}

    def defer(self, weights, compute):
        """In B: compute() will return the gradients of `weights`, the tensors the forward read."""
        self.pending.setdefault(self.mb, []).append((weights, compute))

    def run(self, mb):
        """W: micro-batch mb's weight gradients, added by autograd to the weights (or FSDP unit)."""
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
    """y = x · Wᵀ (x: (..., in), W: (out, in)). Backward returns dx = dy · W; dW = dyᵀ · x waits."""

    @staticmethod
    def forward(ctx, x, weight, deferred):
        # autocast's cast, as F.linear's
        ctx.deferred, ctx.input_dtype, dtype = deferred, x.dtype, compute_dtype(x)
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
    """y = w · h (w: (d,), h: (..., d)). Backward returns dh = dy · w; dw = Σ dy · h waits."""

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
    """Defers a chunk's weight gradients: one WeightGrads, also `chunk.weight_grads`, on every
    weight_grads hook. Runs after tp, cp and checkpointing, before the data-parallel wrapper."""
    store = WeightGrads()
    for module in chunk.modules():
        if hasattr(module, "weight_grads"):
            module.weight_grads = store
    chunk.weight_grads = store
    return store
