"""HSDP: FSDP inside a shard group of K ranks (one server's fast links), DDP across the dp/K replicas.

Split:    the model state K ways (mesh.shard_group, K = --dp-shard, times cp), replicated R = dp/K times
          (mesh.replicate_group); the batch over all dp x cp ranks.
Sends:    FSDP's traffic inside the shard group, (K-1)/K · P · (2·A·compute bytes + reduce bytes), plus one
          all-reduce of the fp32 gradient shard across replicas: 2·(R-1)/R · 4P/K bytes per rank.
          Only the all-reduce, 1/K of DDP's volume, crosses servers.
Overlap:  as FSDP; a unit's replica all-reduce runs as its reduce-scatter is finished (in backward, one unit
          behind; the last unit's in finish_grad_sync).
Memory:   16·P/K bytes of model state per rank: K, not dp, sets the saving.
"""
import torch

from parallel import fsdp
from parallel.fsdp import FSDP


class HSDP(FSDP):
    def average(self, shard_grad):
        self.mesh.replicate_group.all_reduce(shard_grad)  # sum over the replicas of this shard
        return shard_grad / (self.group.size * self.mesh.replicate_group.size)  # mean over every dp x cp rank

    def replicas(self, meta_param):
        return super().replicas(meta_param) * self.mesh.replicate_group.size


def wrap(module, mesh, device, init_param, compute_dtype=torch.float32, reduce_dtype=torch.float32, overlap=True):
    return fsdp.wrap(module, mesh, device, init_param, compute_dtype, reduce_dtype, overlap, cls=HSDP,
                     group=mesh.shard_group)


# -------------------------------------------------------------- traffic formulas (the planner's --code ours uses these)

def replica_bytes(n_params, shard_size, replicas, grad_bytes=4):
    """Bytes one rank sends all-reducing its gradient shard over the replicas: 2(R-1)/R · grad_bytes · n_params/K."""
    return 2 * (replicas - 1) / replicas * grad_bytes * n_params / shard_size
