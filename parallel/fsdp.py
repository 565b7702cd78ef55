"""FSDP: each of the g ranks of a group keeps 1/g of every parameter, gradient and Adam state.

Split:    the batch, as DDP, and the model state in units (the embedding, each block, norm + head).
          A unit is flattened, padded to a multiple of g and cut into g shards, kept in fp32.
Sends:    per micro-batch, every unit is all-gathered for forward, each block again for backward
          (compute dtype, c bytes). Each unit's gradient is reduce-scattered (r bytes). Per rank
          and step: (g-1)/g · M·((2N-E)·c + N·r), E the embedding's, norm's and head's parameters.
          Under pp units stay gathered through the step: (g-1)/g · N·(c + M·r).
Overlap:  forward prefetches the next unit's gather, backward the previous one's. A reduce-scatter
          is waited for after the next unit's backward, the backward's last at its end
          (--no-overlap: each at once).
Memory:   12·N/g bytes of state and 4·N/g of gradients, made as each unit's first reduce-scatter
          lands and freed after the step; about 2 gathered units; one unit's flat gradient.
"""
from collections import namedtuple

import torch
from torch import nn

from parallel import Piece, global_name, has_tp_partial_grad, keep_saved, tp_shard_of

SavedWeight = namedtuple("SavedWeight", "unit size stride offset")  # a saved view of a unit


def in_backward():
    """True inside autograd's backward: a forward there is recomputed by checkpointing."""
    return torch._C._current_graph_task_id() != -1


class Unit:
    """Parameters gathered, used and freed together: one flat buffer, padded, cut into shards.
    Layout: [matrices | vectors | padding]. A shard is two optimizer params split at the boundary.
    The matrices' is viewed as (1, k), so AdamW decays exactly the matrices."""

    def __init__(self, name, slots, group, device, compute_dtype):
        self.name, self.group, self.compute_dtype = name, group, compute_dtype
        # slots: (module, attribute, global name, meta param); matrices first
        self.slots = sorted(slots, key=lambda s: s[3].dim() < 2)
        self.sizes = [s[3].numel() for s in self.slots]
        self.offsets = [sum(self.sizes[:i]) for i in range(len(self.sizes))]
        self.numel = sum(self.sizes)
        self.shard_numel = -(-self.numel // group.size)
        self.padded = self.shard_numel * group.size
        self.start = group.rank * self.shard_numel  # this shard is flat[start:start + shard_numel]
        self.local = torch.zeros(self.shard_numel, device=device)  # the fp32 master shard
        k = min(max(self.matrix_numel() - self.start, 0), self.shard_numel)
        self.ranges = [r for r in ((0, k), (k, self.shard_numel)) if r[1] > r[0]]
        shards = [self.local[a:b] for a, b in self.ranges]
        self.params = [nn.Parameter(s.view(1, -1) if a == 0 and k > 0 else s)
                       for s, (a, _) in zip(shards, self.ranges)]
        self.full = None  # the gathered buffer
        self.pending = None  # (buffer, handle, what is sent) of the all-gather in flight
        self.gather = None  # hook (parallel/__init__.py): (unit) -> `pending`; None: compute dtype
        self.grad = None  # (shard_numel,) fp32: this step's gradient shard, summed over the group,
        # made when its first reduce-scatter lands
        self.reduction = None  # (output, handle, the step's last backward?) of the reduce-scatter

    def matrix_numel(self):
        return sum(n for n, s in zip(self.sizes, self.slots) if s[3].dim() >= 2)

    def views(self, flat):
        """The unit's parameters as views of a flat buffer."""
        return [flat[a:a + n].view(s[3].shape)
                for s, a, n in zip(self.slots, self.offsets, self.sizes)]

    def matrix_ranges(self):
        """The flat [start, end) of each matrix, in layout order."""
        return [(a, a + n) for s, a, n in zip(self.slots, self.offsets, self.sizes)
                if s[3].dim() >= 2]

    def segments(self):
        """(optimizer param index, start, end, slot): the pieces of this shard, one slot each."""
        out = []
        for slot, a, n in zip(self.slots, self.offsets, self.sizes):
            lo, hi = a - self.start, a + n - self.start  # the slot in shard coordinates
            for i, (ra, rb) in enumerate(self.ranges):
                s, e = max(lo, ra), min(hi, rb)
                if e > s:
                    out.append((i, s - ra, e - ra, slot))
        return out

    def start_gather(self):
        """Launches the all-gather of the shards; does not wait. False if there is one already."""
        if self.full is not None or self.pending is not None:
            return False
        if self.gather is not None:
            self.pending = self.gather(self)
            return True
        send = self.local.to(self.compute_dtype)  # bf16 halves the bytes
        full = torch.empty(self.padded, dtype=self.compute_dtype, device=self.local.device)
        self.pending = (full, self.group.all_gather(full, send, async_op=True), send)
        return True

    def wait_gathered(self):
        """The gathered (padded,) buffer, once the all-gather in flight (or a new one) is done."""
        if self.full is None:
            self.start_gather()
            full, handle, _ = self.pending
            handle.wait()
            full.fsdp_unit = self  # what the saved-weight rule recognizes a gathered weight by
            self.full, self.pending = full, None
        return self.full

    def attach(self, views):
        for (module, attr, _, _), view in zip(self.slots, views):
            setattr(module, attr, view)

    def detach(self):
        for module, attr, _, _ in self.slots:
            setattr(module, attr, None)


class GatherUnit(torch.autograd.Function):
    """Forward: the unit's parameters, views of its gathered buffer. Backward: after_backward."""

    @staticmethod
    def forward(ctx, fsdp, unit, *shards):
        ctx.fsdp, ctx.unit = fsdp, unit
        ctx.set_materialize_grads(False)
        return tuple(unit.views(unit.wait_gathered()))

    @staticmethod
    def backward(ctx, *grads):
        ctx.fsdp.after_backward(ctx.unit, grads)
        return (None, None) + (None,) * len(ctx.unit.params)


class FSDP:
    def __init__(self, module, mesh, group, init_param, device, compute_dtype=torch.float32,
                 reduce_dtype=torch.float32, overlap=True, keep_gathered=False):
        self.module, self.mesh, self.group, self.overlap = module, mesh, group, overlap
        self.keep_gathered = keep_gathered  # gathered once per step, not per micro-batch and pass
        self.reduce_dtype = reduce_dtype
        self.sync_grads = True  # the step's last backward of a chunk? HSDP then sums over replicas
        self.reducing = None  # the unit whose reduce-scatter is in flight
        self.reduced = set()  # units whose gradient shard holds some of this step's backwards
        self.units, self.next_unit, self.prev_unit = [], {}, {}
        names = {id(p): global_name(name) for name, p in module.named_parameters()}
        for chunk in module:
            parts = [("embed_tokens", [chunk.embed_tokens])] * (chunk.embed_tokens is not None)
            parts += [(f"layers.{i}", [block]) for i, block in chunk.layers.items()]
            parts += [("norm_head", [chunk.norm, chunk.lm_head])] * (chunk.lm_head is not None)
            units = [self.make_unit(name, tops, tops[0] if len(tops) == 1 else chunk, names,
                                    init_param, device, compute_dtype) for name, tops in parts]
            for (_, tops), unit in zip(parts, units):  # gather before the first, free after last
                tops[0].register_forward_pre_hook(lambda m, args, u=unit: self.before_forward(u))
                tops[-1].register_forward_hook(lambda m, args, out, u=unit: self.after_forward(u))
            for a, b in zip(units, units[1:]):  # forward order; backward runs it in reverse
                self.next_unit[a], self.prev_unit[b] = b, a
            self.units += units
            keep_saved(chunk, self.pack, self.unpack)

    def make_unit(self, name, tops, owner, names, init_param, device, compute_dtype):
        """One unit from the meta device: this rank makes only its shard of each initial value."""
        slots = [(m, attr, names[id(p)], p) for top in tops for m in top.modules()
                 for attr, p in m._parameters.items() if p is not None]
        unit = Unit(name, slots, self.group, device, compute_dtype)
        with torch.no_grad():
            for (_, _, name_, meta), a, n in zip(unit.slots, unit.offsets, unit.sizes):
                lo, hi = max(a, unit.start) - a, min(a + n, unit.start + unit.shard_numel) - a
                if hi > lo:  # in place: the shard and one tile of the grid are all this allocates
                    out = unit.local[a + lo - unit.start:a + hi - unit.start]
                    init_param(name_, meta, range(lo, hi), out)
        for module, attr, _, _ in unit.slots:
            del module._parameters[attr]  # a plain attribute now: a view while in use, else None
            setattr(module, attr, None)
        for i, p in enumerate(unit.params):
            owner.register_parameter(f"fsdp_shard_{name.replace('.', '_')}_{i}", p)
        return unit

    def replicas(self, meta_param):
        """Ranks holding an identical copy of one element of this rank's gradient shard."""
        return 1 if tp_shard_of(meta_param) else self.mesh.tp_group.size

    # ---------------------------------------------------------------- gather, use, free
    def before_forward(self, unit):
        """Gather the unit (prefetched, or now), attach its views, prefetch the next one."""
        recompute = in_backward()  # a checkpointed block's forward, run again in backward
        unit.start_gather()
        views = GatherUnit.apply(self, unit, *unit.params)  # waits for the all-gather
        if recompute:
            self.prefetch_backward(unit)
        elif self.overlap and unit in self.next_unit:
            self.next_unit[unit].start_gather()  # under this compute
        unit.attach(views)

    def after_forward(self, unit):
        """Detach the unit and free its buffer. A chunk's last unit stays: its backward is next."""
        unit.detach()
        backward_next = unit not in self.next_unit and torch.is_grad_enabled() and not in_backward()
        if not (self.keep_gathered or backward_next):
            unit.full = None

    def pack(self, t):
        """The saved-weight rule: a saved view of a gathered unit is kept as where it sits."""
        base = t if t._base is None else t._base
        unit = getattr(base, "fsdp_unit", None)
        return t if unit is None else SavedWeight(unit, t.size(), t.stride(), t.storage_offset())

    def unpack(self, saved):
        """Backward needs a weight: gather its unit again, and prefetch the one needed next."""
        if not isinstance(saved, SavedWeight):
            return saved
        saved.unit.start_gather()
        full = saved.unit.wait_gathered()
        self.prefetch_backward(saved.unit)
        return full.as_strided(saved.size, saved.stride, saved.offset)

    def prefetch_backward(self, unit):
        """Start gathering the unit before this one, under this unit's backward. The embedding's
        backward needs no weights: it is gathered only for a next micro-batch's forward."""
        prev = self.prev_unit.get(unit)
        embedding = prev is not None and prev.name == "embed_tokens"
        if self.overlap and prev is not None and not (embedding and self.sync_grads):
            prev.start_gather()

    # ---------------------------------------------------------------- reduce-scatter
    def after_backward(self, unit, grads):
        """A backward of the unit is done: free its buffer, reduce-scatter its gradient (async)."""
        unit.detach()  # a recompute that checkpointing stopped early never ran after_forward
        if not self.keep_gathered:
            unit.full = None
        if self.reducing is not None:  # launched one unit ago, done under this unit's backward
            self.finish_reduction(self.reducing)
        flat = self.flat_gradient(unit, grads)
        if flat is None:  # (unsharded accumulation: more backwards of the unit come this step)
            return
        out = flat[unit.start:unit.start + unit.shard_numel]  # in place: this rank's block
        unit.reduction = (out, self.group.reduce_scatter(out, flat, async_op=True), self.sync_grads)
        self.reducing = unit
        if not self.overlap or unit not in self.prev_unit:  # the backward's last: its flat gradient
            self.finish_reduction(unit)  # must not outlive it into the next forward

    def flat_gradient(self, unit, grads):
        """This backward's gradients as one flat (padded,) reduce-dtype buffer of the unit's size,
        freed when its reduce-scatter is done (a block's, not the largest unit's, at a time)."""
        flat = unit.local.new_empty(unit.padded, dtype=self.reduce_dtype)
        views = unit.views(flat)
        flat[unit.numel:].zero_()  # the padding
        # a param this backward did not reach (grad None): its view zeroed, copied onto itself
        torch._foreach_copy_(views, [v.zero_() if g is None else g for v, g in zip(views, grads)])
        return flat

    def finish_reduction(self, unit):
        """Waits for the unit's reduce-scatter and sums it into the gradient shard."""
        out, handle, last = unit.reduction
        unit.reduction, self.reducing = None, None
        handle.wait()
        if unit in self.reduced:
            unit.grad.add_(out)
        else:  # the step's first: the shard is made now (zero_grad frees it)
            unit.grad = out.to(torch.float32, copy=True)
        self.reduced.add(unit)
        if last:
            self.step_grad_ready(unit)

    # ---------------------------------------------------------------- what HSDP (hsdp.py) overrides
    def step_grad_ready(self, unit):
        """The unit's gradient shard holds this step's sum over the group. FSDP: nothing to add."""

    def finish_step_grads(self, units):
        """In finish_grad_sync, before the average: the units reduced this step. FSDP: nothing."""

    def averaged_over(self):  # ranks whose gradients the step averages
        return self.group.size

    def finish_grad_sync(self):
        """Waits for the reductions in flight, averages, sums the sp norms' gradients over tp."""
        for unit in self.units:
            if unit.pending is not None:  # an unused prefetch must not outlive the step
                unit.wait_gathered()
            unit.full = None
        if self.reducing is not None:
            self.finish_reduction(self.reducing)
        reduced = [u for u in self.units if u in self.reduced]
        self.finish_step_grads(reduced)
        for unit in reduced:
            unit.grad.div_(self.averaged_over())
            for p, (a, b) in zip(unit.params, unit.ranges):
                p.grad = unit.grad[a:b].view_as(p)
        self.reduced = set()
        if self.mesh.tp > 1:
            self.sum_partial_grads()

    def sum_partial_grads(self):
        """Sums sp's norm gain gradients over tp, one call a unit: each saw only its tokens."""
        for unit in self.units:
            pieces = [unit.params[i].grad.view(-1)[a:b] for i, a, b, slot in unit.segments()
                      if has_tp_partial_grad(slot[3]) and unit.params[i].grad is not None]
            if pieces:
                summed = torch.cat(pieces)
                self.mesh.tp_group.all_reduce(summed)
                torch._foreach_copy_(pieces, list(summed.split([p.numel() for p in pieces])))

    # ---------------------------------------------------------------- optimizer, norm, saves
    def zero_grad(self):
        """Frees the gradient shards: none is held through the next forward and the loss."""
        for unit in self.units:
            unit.grad = None
            for p in unit.params:
                p.grad = None

    def optim_params(self):
        return [p for unit in self.units for p in unit.params]

    def grads_for_norm(self):
        """Each element once: a shard is unique within the group; tp-replicated params repeat."""
        return [(unit.params[i].grad.view(-1)[a:b], self.replicas(slot[3])) for unit in self.units
                for i, a, b, slot in unit.segments() if unit.params[i].grad is not None]

    def owned_pieces(self):
        """This shard as Pieces, one per (optimizer param, slot) overlap. HSDP replicas hold the
        same shards: the first shard group writes. tp-replicated params: tp rank 0."""
        first = self.mesh.dp_cp_group.rank < self.group.size
        pieces = []
        for unit in self.units:
            slot_start = {id(slot[3]): a for slot, a in zip(unit.slots, unit.offsets)}
            for i, s, e, (_, _, name, meta) in unit.segments():
                tp = tp_shard_of(meta)
                offset = unit.start + unit.ranges[i][0] + s - slot_start[id(meta)]  # in the block
                pieces.append(Piece(name, unit.params[i], s, e, tuple(meta.shape), tp, offset,
                                    first and (tp is not None or self.mesh.coord["tp"] == 0)))
        return pieces


def wrap(module, mesh, device, init_param, compute_dtype=torch.float32, reduce_dtype=torch.float32,
         overlap=True, cls=FSDP, group=None):
    """module: meta GPT chunks, materialized unit by unit. cls: FSDP, HSDP, or fsdp_accumulate's."""
    return cls(module, mesh, group or mesh.dp_cp_group, init_param, device, compute_dtype,
               reduce_dtype, overlap=overlap, keep_gathered=mesh.pp > 1)
