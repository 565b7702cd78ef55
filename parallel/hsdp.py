"""HSDP: FSDP inside a shard group of K ranks (one server's fast links), DDP across the R = dp/K replicas.

Split:    the model state K ways (mesh.shard_group, K = --dp-shard, times cp), replicated R times
          (mesh.replicate_group); the batch over all dp x cp ranks.
Sends:    FSDP's traffic inside the shard group, (K-1)/K · A·((2P-E)·c + P·r) per step (fsdp.py), plus, once per
          step, one all-reduce of each unit's fp32 gradient shard, summed over the step's micro-batches, across the
          replicas: 2·(R-1)/R · 4P/K bytes per rank, whatever A. Only that all-reduce, 1/K of DDP's, crosses servers.
Overlap:  a unit's replica all-reduce is launched as soon as the reduce-scatter of its last backward of the step
          (sync_grads) is in, at the end of the next unit's backward, and waited for at the end of the one after
          (the last units' in finish_grad_sync): it runs under backward compute.
Memory:   16·P/K bytes of model state per rank: K, not dp, sets the saving.
"""
import torch

from parallel import fsdp
from parallel.fsdp import FSDP


class HSDP(FSDP):
    def sum_replicas(self, shard_grad):
        return self.mesh.replicate_group.all_reduce(shard_grad, async_op=True)  # a Pending: FSDP waits for it

    def averaged_over(self):
        return self.group.size * self.mesh.replicate_group.size  # the mean over every dp x cp rank

    def replicas(self, meta_param):
        return super().replicas(meta_param) * self.mesh.replicate_group.size


def wrap(module, mesh, device, init_param, compute_dtype=torch.float32, reduce_dtype=torch.float32, overlap=True,
         accumulate="sharded"):
    return fsdp.wrap(module, mesh, device, init_param, compute_dtype, reduce_dtype, overlap, accumulate, cls=HSDP,
                     group=mesh.shard_group)


# -------------------------------------------------------------- traffic formulas (the planner's --code ours uses these)

def replica_bytes(n_params, shard_size, replicas, grad_bytes=4):
    """Bytes one rank sends all-reducing its gradient shard over the replicas, once per step whatever the number of
    micro-batches: 2(R-1)/R · grad_bytes · n_params/K (grad_bytes: the fp32 shard gradient, 4)."""
    return 2 * (replicas - 1) / replicas * grad_bytes * n_params / shard_size
