"""A layer on FSDP and HSDP (--accumulate unsharded): micro-batch gradients summed locally.

A unit's gradients are summed unsharded over the step's micro-batches, then reduce-scattered once.
Sends:    the reduce-scatter's (g-1)/g · N·r bytes once per step, not M times. All-gathers: same.
Overlap:  as FSDP's: a unit's one reduce-scatter runs under the next unit's backward.
Memory:   every unit's flat gradient (reduce dtype, r·N bytes) stays all step, not one shared
          buffer. The memory FSDP saves on gradients buys fewer bytes sent (DDP's no_sync, sharded).
"""
import torch


def unsharded(cls):
    """cls (fsdp.FSDP or hsdp.HSDP) with its micro-batch gradients accumulated unsharded."""
    class Unsharded(cls):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.summing = set()  # units whose sum has more backwards to take this step

        def flat_gradient(self, unit, grads):
            if getattr(unit, "summed", None) is None:  # allocated once, kept across steps
                unit.summed = unit.local.new_empty(unit.padded, dtype=self.reduce_dtype)
            views = unit.views(unit.summed)
            if unit in self.summing:  # add this backward's gradients to the step's sum
                reached = [(v, g) for v, g in zip(views, grads) if g is not None]
                torch._foreach_add_([v for v, _ in reached], [g for _, g in reached])
            else:  # the step's first backward of the unit overwrites the sum
                unit.summed[unit.numel:].zero_()
                torch._foreach_copy_(views,
                                     [v.zero_() if g is None else g for v, g in zip(views, grads)])
            if not self.sync_grads:  # more backwards of this unit this step: reduce after the last
                self.summing.add(unit)
                return None
            self.summing.discard(unit)
            return unit.summed

        def finish_grad_sync(self):
            if self.summing:
                raise RuntimeError(
                    "unsharded accumulation: no backward of this step was marked sync_grads")
            super().finish_grad_sync()

    Unsharded.__name__ = Unsharded.__qualname__ = f"{cls.__name__}Unsharded"
    return Unsharded
