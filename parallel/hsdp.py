"""HSDP: FSDP in a shard group of K ranks (one server), DDP across the R = dp/K replicas.

Split:    the model state K ways (mesh.shard_group, K = --dp-shard, times cp), replicated R times
          (mesh.replicate_group). The batch goes over all dp x cp ranks.
Sends:    in the shard group, FSDP's (K-1)/K · M·((2N-E)·c + N·r) per step (fsdp.py). Once per
          step, each unit's fp32 gradient shard, summed over micro-batches, is all-reduced over
          the replicas: 2(R-1)/R · 4N/K bytes per rank, whatever M. Only this all-reduce crosses
          servers. It is 1/K of DDP's.
Overlap:  a unit's replica all-reduce starts when its last reduce-scatter lands, in the next
          unit's backward. It is waited for at the next launch, so it runs under backward.
Memory:   16·N/K bytes of model state per rank. K, not dp, sets the saving.
"""
import torch

from parallel import fsdp
from parallel.fsdp import FSDP


class HSDP(FSDP):
    """FSDP over the shard group, and a chain of replica all-reduces on its two hooks."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.replica = {}  # unit -> its gradient shard's all-reduce over the replicas, this step
        self.in_flight = None  # the unit launched last: waited for at the next launch

    def after_backward(self, unit, grads):
        if unit in self.replica:
            raise RuntimeError(
                f"{unit.name}: a backward after the step's last (sync_grads) one, "
                "summed over replicas")
        super().after_backward(unit, grads)

    def step_grad_ready(self, unit):
        self.wait_in_flight()
        self.replica[unit] = self.mesh.replicate_group.all_reduce(unit.grad, async_op=True)
        self.in_flight = unit
        if not self.overlap:
            self.wait_in_flight()

    def wait_in_flight(self):
        if self.in_flight is not None:
            self.replica[self.in_flight].wait()
            self.in_flight = None

    def finish_step_grads(self, units):
        """Waits for each reduced unit's all-reduce over the replicas. Those backward did not
        launch (no sync_grads) start now, in unit order."""
        self.wait_in_flight()
        for unit in units:
            if unit not in self.replica:
                self.replica[unit] = self.mesh.replicate_group.all_reduce(unit.grad, async_op=True)
        for unit in units:
            self.replica.pop(unit).wait()

    def averaged_over(self):
        return self.group.size * self.mesh.replicate_group.size  # the mean over every dp x cp rank

    def replicas(self, meta_param):
        return super().replicas(meta_param) * self.mesh.replicate_group.size


def wrap(module, mesh, device, init_param, compute_dtype=torch.float32, reduce_dtype=torch.float32,
         overlap=True, cls=HSDP):
    return fsdp.wrap(module, mesh, device, init_param, compute_dtype, reduce_dtype, overlap,
                     cls=cls, group=mesh.shard_group)
