"""FSDP: each of the M ranks of a group keeps 1/M of every parameter, gradient and Adam state.

Split:    the batch (as DDP) and the model state. Units: one per transformer block, one per pipeline chunk for
          embed_tokens + norm + lm_head. A unit's params are flattened, padded to a multiple of M and cut into M
          equal shards; a rank keeps its shard in fp32 as the parameters the optimizer steps on.
Sends:    per micro-batch, every unit is all-gathered in forward and again in backward, in the compute dtype;
          per step its gradient is reduce-scattered (fp32, or --reduce-dtype bf16). Per rank, with P params:
          (M-1)/M · P · (2·A·compute bytes + reduce bytes) for A micro-batches: 3·(M-1)/M·4P in fp32 (DDP: 2·).
          Under pp (keep_gathered) a unit is gathered once per step and kept to its last backward: 2·A -> 1.
Overlap:  forward prefetches the next unit's all-gather while the current unit computes, backward the previous
          unit's; a unit's reduce-scatter is async, hidden under the next unit's backward and waited for when that
          unit's starts, so one unsharded gradient is in flight, not the model's (--no-overlap: none of this).
Memory:   16·P/M bytes of fp32 state per rank (+ padding) instead of 16·P, plus ~2 gathered units at a time (the
          embedding/head unit stays gathered through its chunk's forward and backward). Weights that autograd
          saves for backward are kept as (unit, offset) and gathered again (saved_tensors_hooks), so nothing
          full-size lives between forward and backward. Gradient accumulation (sync_grads False) keeps each
          unit's unsharded fp32 gradient until the last micro-batch: 4·P bytes, DDP's gradient size. Under pp
          the stage's units stay gathered through the step: its P in the compute dtype.
"""
from collections import Counter, namedtuple

import torch
from torch import nn
from torch.autograd.graph import saved_tensors_hooks

from parallel import Piece, global_name, has_tp_partial_grad, tp_shard_of

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
        self.shard_numel = -(-sum(self.sizes) // group.size)
        self.padded = self.shard_numel * group.size
        self.start = group.rank * self.shard_numel  # this rank's shard is flat[start:start + shard_numel]
        self.local = torch.zeros(self.shard_numel, device=device)  # fp32 master shard
        n_matrix = sum(n for n, s in zip(self.sizes, self.slots) if s[3].dim() >= 2)
        k = min(max(n_matrix - self.start, 0), self.shard_numel)
        self.ranges = [r for r in ((0, k), (k, self.shard_numel)) if r[1] > r[0]]  # shard ranges of the params
        self.params = [nn.Parameter(self.local[a:b].view(1, -1) if a == 0 and k > 0 else self.local[a:b])
                       for a, b in self.ranges]
        self.full = None  # the gathered (padded,) buffer in compute dtype, while in use
        self.pending = None  # (buffer, handle, send buffer) of an all-gather in flight
        self.reductions = []  # (output, handle, send buffer) of reduce-scatters in flight
        self.accumulated = None  # unsharded fp32 gradient kept across micro-batches

    def flat_from(self, tensor_of):
        """The (padded,) fp32 flat buffer holding tensor_of(slot) for every slot."""
        flat = torch.zeros(self.padded, device=self.local.device)
        for slot, a, n in zip(self.slots, self.offsets, self.sizes):
            flat[a:a + n] = tensor_of(slot).reshape(-1)
        return flat

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
        send = self.local.to(self.compute_dtype)  # bf16 halves the traffic
        full = torch.empty(self.padded, dtype=self.compute_dtype, device=self.local.device)
        self.pending = (full, self.group.all_gather(full, send, async_op=True), send)
        return True

    def wait_gathered(self):
        """The gathered (padded,) buffer, waiting for the all-gather in flight (or launching one)."""
        if self.full is None:
            self.start_gather()
            full, handle, _ = self.pending
            if handle is not None:
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
    """Forward: the unit's full parameters, views of one gathered buffer. Backward: hands their gradients to
    FSDP, which reduce-scatters them into the shards' .grad itself (possibly later, so it returns None)."""

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
        self.weight_dtype = compute_dtype  # forward computes with the gathered weights
        self.reduce_dtype = reduce_dtype
        self.sync_grads = True  # False on all but the last micro-batch: keep the unsharded gradient
        self.phase = "forward"  # labels the all-gathers; no forward prefetch while in backward
        self.all_gathers = Counter()  # {"forward": n, "backward": n}, cumulative; tests and benches read it
        self.reducing = None  # the unit whose reduce-scatter is in flight
        self.units, self.next_unit, self.prev_unit, self.in_forward = [], {}, {}, {}
        names = {id(p): global_name(name) for name, p in module.named_parameters()}
        for chunk in module:
            blocks = [(f"layers.{i}", [block], block) for i, block in chunk.layers.items()]
            root = [m for m in (chunk.embed_tokens, chunk.norm, chunk.lm_head) if m is not None]
            order = [("embed_norm_head", root, chunk)] * bool(root) + blocks  # forward order
            units = [self._make_unit(name, tops, owner, names, init_param, device, compute_dtype)
                     for name, tops, owner in order]
            for (_, _, owner), unit in zip(order, units):
                if owner is not chunk:
                    self._wrap_forward(owner, unit)
            self._wrap_chunk_forward(chunk, units[0] if root else None)
            for a, b in zip(units, units[1:]):
                self.next_unit[a] = b
            # backward runs the head (root unit) first, then the blocks in reverse
            backward = units[:1] + units[:0:-1] if root else units[::-1]
            for a, b in zip(backward, backward[1:]):
                self.prev_unit[a] = b
            self.units += units
        for unit in self.units:
            unit.norm_pieces = [(i, a, b, self.replicas(slot[3])) for i, a, b, slot in unit.segments()]
            unit.tp_partial = [(i, a, b) for i, a, b, slot in unit.segments()
                               if has_tp_partial_grad(slot[3])]

    def _make_unit(self, name, tops, owner, names, init_param, device, compute_dtype):
        """Materializes one unit from the meta device: only this unit's full tensors exist at once."""
        slots = [(m, attr, names[id(p)], p) for top in tops for m in top.modules()
                 for attr, p in m._parameters.items() if p is not None]
        unit = Unit(name, slots, self.group, device, compute_dtype)
        with torch.no_grad():
            flat = unit.flat_from(lambda s: init_param(s[2], s[3]))  # same values as the one-process init
            unit.local.copy_(flat[unit.start:unit.start + unit.shard_numel])
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
    def _wrap_forward(self, block, unit):
        forward = block.forward
        block.forward = lambda *args, **kwargs: self._run_gathered(unit, forward, args, kwargs)

    def _wrap_chunk_forward(self, chunk, root_unit):
        """In a chunk's forward, weights of gathered units that autograd saves become SavedWeight records."""
        forward = chunk.forward

        def run_chunk(*args, **kwargs):
            self.phase = "forward"
            with saved_tensors_hooks(self._pack, self._unpack):
                if root_unit is None:
                    return forward(*args, **kwargs)
                return self._run_gathered(root_unit, forward, args, kwargs)
        chunk.forward = run_chunk

    def _run_gathered(self, unit, forward, args, kwargs):
        self.all_gathers[self.phase] += unit.start_gather()
        views = GatherUnit.apply(self, unit, *unit.params)  # waits for the (prefetched) all-gather
        if self.overlap and self.phase == "forward" and unit in self.next_unit:
            self.all_gathers["forward"] += self.next_unit[unit].start_gather()  # prefetch under this compute
        unit.attach(views)
        self.in_forward[unit.full.untyped_storage().data_ptr()] = unit
        try:
            return forward(*args, **kwargs)
        finally:
            del self.in_forward[unit.full.untyped_storage().data_ptr()]
            unit.release(self.keep_gathered)

    def _pack(self, t):
        unit = self.in_forward.get(t.untyped_storage().data_ptr()) if t.numel() else None
        return t if unit is None else SavedWeight(unit, t.size(), t.stride(), t.storage_offset())

    def _unpack(self, saved):
        """Backward needs a weight: gather the unit again (prefetching the one backward needs next)."""
        if not isinstance(saved, SavedWeight):
            return saved
        self.phase = "backward"
        unit = saved.unit
        self.all_gathers["backward"] += unit.start_gather()
        full = unit.wait_gathered()
        if self.overlap and unit in self.prev_unit:
            self.all_gathers["backward"] += self.prev_unit[unit].start_gather()
        return full.as_strided(saved.size, saved.stride, saved.offset)

    # ---------------------------------------------------------------- backward
    def reduce_grads(self, unit, grads):
        """All of the unit's gradients are ready: free its gathered weights, then reduce-scatter (or keep)."""
        self.phase = "backward"
        if not self.keep_gathered:
            unit.full = None
        flat = torch.zeros(unit.padded, device=unit.local.device)
        for g, a, n in zip(grads, unit.offsets, unit.sizes):
            if g is not None:
                flat[a:a + n] = g.reshape(-1)
        if unit.accumulated is not None:
            flat += unit.accumulated
        if not self.sync_grads:
            unit.accumulated = flat  # (padded,) fp32: the memory price of skipping this reduce-scatter
            return
        unit.accumulated = None
        send = flat.to(self.reduce_dtype)
        out = torch.empty(unit.shard_numel, dtype=self.reduce_dtype, device=flat.device)
        handle = self.group.reduce_scatter(out, send, async_op=True)
        unit.reductions.append((out, handle, send))
        if not self.overlap:
            self._finish_reductions(unit)
            return
        if self.reducing not in (None, unit):  # launched one unit ago, done under this unit's backward: free it
            self._finish_reductions(self.reducing)
        self.reducing = unit

    def _finish_reductions(self, unit):
        for out, handle, _ in unit.reductions:
            if handle is not None:
                handle.wait()
            shard_grad = self.average(out.float())
            for p, (a, b) in zip(unit.params, unit.ranges):
                p.grad = shard_grad[a:b].view_as(p) if p.grad is None else p.grad + shard_grad[a:b].view_as(p)
        unit.reductions = []

    def average(self, shard_grad):
        """The summed gradient shard -> the mean over the group (HSDP also all-reduces across replicas here)."""
        return shard_grad / self.group.size

    def finish_grad_sync(self):
        """Waits for the reduce-scatters, averages, all-reduces sequence-parallel norm grads over tp."""
        for unit in self.units:
            if unit.pending is not None:  # an unused prefetch must not outlive the optimizer step
                unit.wait_gathered()
            unit.full = None  # (kept gathered: the step's micro-batches are done with it)
            self._finish_reductions(unit)
        self.reducing = None
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
        for p in self.optim_params():
            p.grad = None

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
    """module: nn.ModuleList of GPT chunks on the meta device, materialized here one unit at a time with
    init_param(global name, meta param) -> this rank's (tp-local) fp32 tensor. FSDP shards over dp x cp. Under pp a
    stage runs many micro-batches between a unit's first forward and last backward: it stays gathered."""
    return cls(module, mesh, group or mesh.dp_cp_group, init_param, device, compute_dtype, reduce_dtype,
               overlap=overlap, keep_gathered=mesh.pp > 1)


# -------------------------------------------------------------- traffic formulas (the planner's --code ours uses these)

def gathers_per_step(micro_batches, keep_gathered):
    """All-gathers of each unit per step: 1 when kept gathered (under pp), else 2 · micro_batches (fwd, bwd)."""
    return 1 if keep_gathered else 2 * micro_batches


def gather_reduce_bytes(n_params, shard_size, gathers, compute_bytes, reduce_bytes):
    """Bytes one rank sends per step for n_params: (gathers · compute_bytes + reduce_bytes)(S-1)/S · n_params."""
    return (gathers * compute_bytes + reduce_bytes) * (shard_size - 1) / shard_size * n_params
