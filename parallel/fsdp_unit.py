"""An FSDP unit: parameters gathered, used and freed together, stored as one flat buffer cut into shards.

Split:    a unit's parameters over the M ranks of its group: flattened, padded to a multiple of M, one shard each.
Sends:    start_gather all-gathers the shards in the compute dtype: (M-1)/M · c bytes per parameter of the unit.
Overlap:  start_gather launches and returns; wait_gathered waits, so the caller prefetches (fsdp.py decides when).
Memory:   the fp32 shard (+ padding) always; the gathered buffer only while the unit is in use.
"""
from collections import namedtuple

import torch
from torch import nn

SavedWeight = namedtuple("SavedWeight", "unit size stride offset")  # a saved view of a gathered unit


class Unit:
    """Parameters gathered, used and freed together, stored as one flat padded buffer cut into shards.

    Flat layout: [params with dim >= 2 | 1-D params | padding]. A rank's shard is split at the matrix/vector
    boundary into two optimizer params, the first viewed as (1, k), so make_adamw's dim >= 2 rule decays
    exactly the matrices, as in one process."""

    def __init__(self, name, slots, group, device, compute_dtype):
        self.name, self.group, self.compute_dtype = name, group, compute_dtype
        # slots: (module, attribute, global name, meta param); matrices first, stable within each kind
        self.slots = sorted(slots, key=lambda s: s[3].dim() < 2)
        self.sizes = [s[3].numel() for s in self.slots]
        self.offsets = [sum(self.sizes[:i]) for i in range(len(self.sizes))]
        self.numel = sum(self.sizes)
        self.shard_numel = -(-self.numel // group.size)
        self.padded = self.shard_numel * group.size
        self.start = group.rank * self.shard_numel  # this rank's shard is flat[start:start + shard_numel]
        self.local = torch.zeros(self.shard_numel, device=device)  # fp32 master shard
        n_matrix = sum(n for n, s in zip(self.sizes, self.slots) if s[3].dim() >= 2)
        k = min(max(n_matrix - self.start, 0), self.shard_numel)
        self.ranges = [r for r in ((0, k), (k, self.shard_numel)) if r[1] > r[0]]  # shard ranges of the params
        self.params = [nn.Parameter(self.local[a:b].view(1, -1) if a == 0 and k > 0 else self.local[a:b])
                       for a, b in self.ranges]
        self.full, self.pending = None, None  # the gathered (padded,) buffer in use; (it, handle, send) in flight
        self.gather = None  # (unit) -> `pending`: an all-gather of its own (fp8.py's in e4m3); None: compute dtype
        self.grad = None  # (shard_numel,) fp32: the gradient shard summed over the group and the step's backwards
        self.fresh = True  # nothing summed into grad yet this step: the first reduce-scatter overwrites it
        self.reduction = None  # (output, handle, the step's last backward?) of the reduce-scatter in flight
        self.summed, self.summing = None, False  # unsharded accumulation: the (padded,) sum of this step's backwards
        self.replica = None  # HSDP: the all-reduce of grad over the replicas, once launched this step

    def views(self, flat):
        """The unit's parameters as views of a flat buffer."""
        return [flat[a:a + n].view(s[3].shape) for s, a, n in zip(self.slots, self.offsets, self.sizes)]

    def segments(self):
        """(optimizer param index, start, end, slot): the pieces of this rank's shard, each inside one slot."""
        out = []
        for slot, a, n in zip(self.slots, self.offsets, self.sizes):
            lo, hi = a - self.start, a + n - self.start  # the slot in shard coordinates
            for i, (ra, rb) in enumerate(self.ranges):
                s, e = max(lo, ra), min(hi, rb)
                if e > s:
                    out.append((i, s - ra, e - ra, slot))
        return out

    def start_gather(self):
        """Launches the all-gather of the shards in the compute dtype; does not wait. False if already there."""
        if self.full is not None or self.pending is not None:
            return False
        if self.gather is not None:
            self.pending = self.gather(self)
            return True
        send = self.local.to(self.compute_dtype)  # bf16 halves the traffic
        full = torch.empty(self.padded, dtype=self.compute_dtype, device=self.local.device)
        self.pending = (full, self.group.all_gather(full, send, async_op=True), send)
        return True

    def wait_gathered(self):
        """The gathered (padded,) buffer, waiting for the all-gather in flight (or launching one)."""
        if self.full is None:
            self.start_gather()
            full, handle, _ = self.pending
            handle.wait()
            self.full, self.pending = full, None
        return self.full

    def attach(self, views):
        for (module, attr, _, _), view in zip(self.slots, views):
            setattr(module, attr, view)

    def release(self, keep_gathered=False):
        for module, attr, _, _ in self.slots:
            setattr(module, attr, None)
        if not keep_gathered:
            self.full = None


class GatherUnit(torch.autograd.Function):
    """Forward: the unit's full parameters, views of one gathered buffer. Backward: FSDP reduces their gradients."""

    @staticmethod
    def forward(ctx, fsdp, unit, *shards):
        ctx.fsdp, ctx.unit = fsdp, unit
        ctx.set_materialize_grads(False)
        return tuple(unit.views(unit.wait_gathered()))

    @staticmethod
    def backward(ctx, *grads):
        ctx.fsdp.reduce_grads(ctx.unit, grads)
        return (None, None) + (None,) * len(ctx.unit.params)
