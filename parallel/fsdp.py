"""FSDP: each of the g ranks of a group keeps 1/g of every parameter, gradient and Adam state.

Split:    the batch (as DDP) and the model state in units per pipeline chunk (the embedding, each block, final norm +
          lm_head), each flattened, padded to a multiple of g and cut into g shards; a rank keeps its shard in fp32.
Sends:    per micro-batch an all-gather in the compute dtype (c bytes) of every unit for forward and of each block for
          backward, and a reduce-scatter (r bytes: fp32, or --reduce-dtype bf16) of each unit's gradient: per rank
          and step, N params (E in embedding, norm, head), M micro-batches, (g-1)/g · M·((2N-E)·c + N·r); under pp
          units are gathered once per step: (g-1)/g · N(c + M·r); fsdp_accumulate.py's unsharded sum: M·r becomes r.
Overlap:  forward prefetches the next unit's all-gather, backward the previous unit's (also where checkpointing
          recomputes a forward); a reduce-scatter is waited for after the next unit's backward (--no-overlap: none).
Memory:   16·N/g bytes of fp32 state (+ padding), ~2 gathered units, one flat gradient the size of the largest unit
          during backward (unsharded accumulation: every unit's, all step, r·N). Saved weights are (unit, offset)
          records gathered again in backward; under pp a stage's units stay gathered through the step.
"""
from collections import Counter, namedtuple

import torch
from torch import nn

from parallel import Piece, global_name, has_tp_partial_grad, tp_shard_of
from parallel.ckpt import keep_saved

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
        self.gather = None  # the gather hook (parallel/__init__.py): (unit) -> `pending`; None: in the compute dtype
        self.grad = None  # (shard_numel,) fp32: the gradient shard summed over the group and the step's backwards
        self.fresh = True  # nothing summed into grad yet this step: the first reduce-scatter overwrites it
        self.reduction = None  # (output, handle, the step's last backward?) of the reduce-scatter in flight

    def views(self, flat):
        """The unit's parameters as views of a flat buffer."""
        return [flat[a:a + n].view(s[3].shape) for s, a, n in zip(self.slots, self.offsets, self.sizes)]

    def matrix_ranges(self):
        """The flat [start, end) of each matrix (dim >= 2) of the unit, in layout order."""
        return [(a, a + n) for s, a, n in zip(self.slots, self.offsets, self.sizes) if s[3].dim() >= 2]

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


class FSDP:
    def __init__(self, module, mesh, group, init_param, device, compute_dtype=torch.float32,
                 reduce_dtype=torch.float32, overlap=True, keep_gathered=False):
        self.module, self.mesh, self.group, self.overlap = module, mesh, group, overlap
        self.keep_gathered = keep_gathered  # gather each unit once per step, not per micro-batch and pass
        self.reduce_dtype = reduce_dtype
        self.sync_grads = True  # the step's last backward (of a chunk)? HSDP then sums over replicas; if not, more come
        self.phase = "forward"  # labels the all-gathers; no forward prefetch while in backward
        self.all_gathers = Counter()  # {"forward": n, "backward": n} by the pass that uses them; tests read it
        self.reducing = None  # the unit whose reduce-scatter is in flight
        self.flat = None  # the flat gradient being reduced: one per step, sized for the largest unit
        self.units, self.next_unit, self.prev_unit, self.in_forward = [], {}, {}, {}
        names = {id(p): global_name(name) for name, p in module.named_parameters()}
        for chunk in module:
            parts = [("embed_tokens", [chunk.embed_tokens])] * (chunk.embed_tokens is not None)
            parts += [(f"layers.{i}", [block]) for i, block in chunk.layers.items()]
            parts += [("norm_head", [chunk.norm, chunk.lm_head])] * (chunk.lm_head is not None)  # forward order
            units = [self._make_unit(name, tops, tops[0] if len(tops) == 1 else chunk, names, init_param, device,
                                     compute_dtype) for name, tops in parts]
            for (_, tops), unit in zip(parts, units):
                self._wrap_forward(unit, tops)
            self._wrap_chunk_forward(chunk)
            for a, b in zip(units, units[1:]):  # backward runs them in reverse
                self.next_unit[a], self.prev_unit[b] = b, a
            self.units += units
        for unit in self.units:
            unit.norm_pieces = [(i, a, b, self.replicas(slot[3])) for i, a, b, slot in unit.segments()]
            unit.tp_partial = [(i, a, b) for i, a, b, slot in unit.segments() if has_tp_partial_grad(slot[3])]

    def _make_unit(self, name, tops, owner, names, init_param, device, compute_dtype):
        """Materializes one unit from the meta device: this rank generates only its shard of each initial value
        (init_param(name, meta, flat=range)), never a full parameter."""
        slots = [(m, attr, names[id(p)], p) for top in tops for m in top.modules()
                 for attr, p in m._parameters.items() if p is not None]
        unit = Unit(name, slots, self.group, device, compute_dtype)
        with torch.no_grad():
            for (_, _, global_name, meta), a, n in zip(unit.slots, unit.offsets, unit.sizes):
                lo, hi = max(a, unit.start) - a, min(a + n, unit.start + unit.shard_numel) - a  # within the slot
                if hi > lo:  # written in place: the shard and one tile of the grid are all this rank allocates
                    init_param(global_name, meta, range(lo, hi), unit.local[a + lo - unit.start:a + hi - unit.start])
        for module, attr, _, _ in unit.slots:
            del module._parameters[attr]  # becomes a plain attribute: a view while in use, else None
            setattr(module, attr, None)
        for i, p in enumerate(unit.params):
            owner.register_parameter(f"fsdp_shard_{name.replace('.', '_')}_{i}", p)
        return unit

    def replicas(self, meta_param):
        """Ranks holding an identical copy of one element of this rank's gradient shard."""
        return 1 if tp_shard_of(meta_param) else self.mesh.tp_group.size

    # ---------------------------------------------------------------- forward
    def _wrap_chunk_forward(self, chunk):
        """In a chunk's forward, weights of gathered units that autograd saves become SavedWeight records."""
        keep_saved(chunk, self._pack, self._unpack)
        forward = chunk.forward

        def run_chunk(*args, **kwargs):
            self.phase = "forward"
            return forward(*args, **kwargs)
        chunk.forward = run_chunk

    def _wrap_forward(self, unit, modules):
        """The unit is gathered as its first module's forward starts and released as its last module's ends."""
        run_last = modules[-1].forward

        def run_then_release(*args, **kwargs):
            try:
                return run_last(*args, **kwargs)
            finally:
                del self.in_forward[unit.full.untyped_storage()]
                last = unit not in self.next_unit and self.phase == "forward" and torch.is_grad_enabled()
                unit.release(self.keep_gathered or last)  # the last unit's backward comes next: keep it
        modules[-1].forward = run_then_release
        run_first = modules[0].forward

        def gather_then_run(*args, **kwargs):
            self.all_gathers[self.phase] += unit.start_gather()
            views = GatherUnit.apply(self, unit, *unit.params)  # waits for the (prefetched) all-gather
            if self.overlap and self.phase == "forward" and unit in self.next_unit:
                self.all_gathers["forward"] += self.next_unit[unit].start_gather()  # prefetch under this compute
            elif self.phase == "backward":  # a forward recomputed in backward (activation checkpointing)
                self._prefetch_backward(unit)
            unit.attach(views)
            self.in_forward[unit.full.untyped_storage()] = unit
            return run_first(*args, **kwargs)
        modules[0].forward = gather_then_run

    def _pack(self, t):
        unit = self.in_forward.get(t.untyped_storage()) if t.numel() else None
        return t if unit is None else SavedWeight(unit, t.size(), t.stride(), t.storage_offset())

    def _unpack(self, saved):
        """Backward needs a weight: gather the unit again (prefetching the one backward needs next)."""
        if not isinstance(saved, SavedWeight):
            return saved
        self.phase = "backward"
        self.all_gathers["backward"] += saved.unit.start_gather()
        full = saved.unit.wait_gathered()
        self._prefetch_backward(saved.unit)
        return full.as_strided(saved.size, saved.stride, saved.offset)

    def _prefetch_backward(self, unit):
        """Backward goes on to the unit before this one: its gather starts now, under this unit's backward (and
        recompute). The embedding's backward needs no weights: only the next micro-batch's forward, if one follows."""
        prev = self.prev_unit.get(unit)
        if self.overlap and prev is not None and (prev.name != "embed_tokens" or not self.sync_grads):
            self.all_gathers["forward" if prev.name == "embed_tokens" else "backward"] += prev.start_gather()

    # ---------------------------------------------------------------- backward
    def reduce_grads(self, unit, grads):
        """A backward of the unit is done: free its gathered weights, reduce-scatter its gradient (async)."""
        self.phase = "backward"
        if not self.keep_gathered:
            unit.full = None
        if self.reducing is not None:  # launched one unit ago, done under this unit's backward: free its buffer
            self._finish_reduction(self.reducing)
        flat = self.flat_gradient(unit, grads)
        if flat is None:  # (unsharded accumulation: more backwards of the unit come this step)
            return
        out = flat[unit.start:unit.start + unit.shard_numel]  # in place: this rank's block of the sum
        unit.reduction = (out, self.group.reduce_scatter(out, flat, async_op=True), self.sync_grads)
        self.reducing = unit
        if not self.overlap:
            self._finish_reduction(unit)

    def flat_gradient(self, unit, grads):
        """This backward's gradients of the unit as one flat (padded,) buffer in the reduce dtype, to reduce-scatter
        now: one buffer for every unit, used one at a time (the reduce-scatter that read it is done)."""
        if self.flat is None:  # freed by finish_grad_sync
            self.flat = unit.local.new_empty(max(u.padded for u in self.units), dtype=self.reduce_dtype)
        flat, views = self.flat[:unit.padded], unit.views(self.flat)
        flat[unit.numel:].zero_()  # the padding (under g elements)
        # a param this backward did not reach (grad None): its view zeroed, copied onto itself
        torch._foreach_copy_(views, [v.zero_() if g is None else g for v, g in zip(views, grads)])
        return flat

    def _finish_reduction(self, unit):
        """Waits for the unit's reduce-scatter and sums it into the shard gradient; after the step's last backward of
        the unit, its step gradient shard is complete (step_grad_ready)."""
        out, handle, last = unit.reduction
        unit.reduction, self.reducing = None, None
        handle.wait()
        if unit.grad is None:  # allocated once, kept across steps
            unit.grad = torch.empty(unit.shard_numel, device=out.device)
        (unit.grad.copy_ if unit.fresh else unit.grad.add_)(out)
        unit.fresh = False
        if last:
            self.step_grad_ready(unit)

    # ---------------------------------------------------------------- what HSDP (hsdp.py) overrides
    def step_grad_ready(self, unit):
        """The unit's gradient shard holds the sum over the group and this step's backwards. FSDP: nothing to add."""

    def finish_step_grads(self, units):
        """In finish_grad_sync, before the average: the units reduced this step. FSDP: nothing to add."""

    def averaged_over(self):  # ranks whose gradients the step averages
        return self.group.size

    def finish_grad_sync(self):
        """Waits for the reductions in flight, averages, all-reduces sequence-parallel norm grads over tp."""
        for unit in self.units:
            if unit.pending is not None:  # an unused prefetch must not outlive the optimizer step
                unit.wait_gathered()
            unit.full = None  # (kept gathered: the step's micro-batches are done with it)
        if self.reducing is not None:
            self._finish_reduction(self.reducing)
        reduced = [u for u in self.units if not u.fresh]  # reduced this step
        self.finish_step_grads(reduced)
        for unit in reduced:
            unit.grad.div_(self.averaged_over())
            unit.fresh = True
            for p, (a, b) in zip(unit.params, unit.ranges):
                p.grad = unit.grad[a:b].view_as(p)
        self.flat = None
        if self.mesh.tp > 1:
            for unit in self.units:
                pieces = [unit.params[i].grad.view(-1)[a:b] for i, a, b in unit.tp_partial
                          if unit.params[i].grad is not None]
                if pieces:
                    summed = torch.cat(pieces)
                    self.mesh.tp_group.all_reduce(summed)
                    torch._foreach_copy_(pieces, list(summed.split([p.numel() for p in pieces])))
        self.phase = "forward"

    # ---------------------------------------------------------------- optimizer, norm, state
    def zero_grad(self):
        """The shard gradients, whose views are the params' .grad, stay allocated across steps."""
        for unit in (u for u in self.units if u.grad is not None):
            unit.grad.zero_()

    def optim_params(self):
        return [p for unit in self.units for p in unit.params]

    def grads_for_norm(self):
        """Each element once: a shard is unique within the group; tp-replicated params repeat over tp."""
        return [(unit.params[i].grad.view(-1)[a:b], r) for unit in self.units for i, a, b, r in unit.norm_pieces
                if unit.params[i].grad is not None]

    def owned_pieces(self):
        """This rank's shard as Pieces, one per (optimizer param, slot) overlap. HSDP replicas hold
        the same shards: only the first shard group (dp x cp ranks [0, K·cp)) writes; tp-replicated: tp rank 0."""
        first = self.mesh.dp_cp_group.rank < self.group.size
        pieces = []
        for unit in self.units:
            slot_start = {id(slot[3]): a for slot, a in zip(unit.slots, unit.offsets)}  # in the unit's flat buffer
            for i, s, e, (_, _, name, meta) in unit.segments():
                tp = tp_shard_of(meta)
                offset = unit.start + unit.ranges[i][0] + s - slot_start[id(meta)]  # within the tp-local tensor
                pieces.append(Piece(name, unit.params[i], s, e, tuple(meta.shape), tp, offset,
                                    first and (tp is not None or self.mesh.coord["tp"] == 0)))
        return pieces


def wrap(module, mesh, device, init_param, compute_dtype=torch.float32, reduce_dtype=torch.float32, overlap=True,
         cls=FSDP, group=None):
    """module: nn.ModuleList of GPT chunks on the meta device, materialized one unit at a time with init_param(global
    name, meta param) -> this rank's (tp-local) fp32 tensor. FSDP shards over dp x cp; under pp units stay gathered.
    cls: FSDP, HSDP, or either with fsdp_accumulate's unsharded accumulation."""
    return cls(module, mesh, group or mesh.dp_cp_group, init_param, device, compute_dtype, reduce_dtype,
               overlap=overlap, keep_gathered=mesh.pp > 1)


# -------------------------------------------------------------- traffic formulas (the planner's --code ours uses these)

def gathers_per_step(micro_batches, keep_gathered, backward=True):
    """All-gathers of a unit per step: 1 when kept gathered (under pp), else one per micro-batch for forward, and
    for a block (backward=True) one more for backward; the embedding and norm + head units: backward=False."""
    return 1 if keep_gathered else (1 + backward) * micro_batches


def gather_reduce_bytes(n_params, shard_size, gathers, compute_bytes, reduce_bytes, reduces=1):
    """Bytes one rank sends per step for n_params: (gathers · compute_bytes + reduces · reduce_bytes)(S-1)/S · n_params.
    reduces: the backwards per step (micro-batches), each reduce-scatters its unit."""
    return (gathers * compute_bytes + reduces * reduce_bytes) * (shard_size - 1) / shard_size * n_params
