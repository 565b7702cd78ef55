"""HSDP: FSDP inside a shard group of K ranks (one server's fast links), DDP across the dp/K replicas.

Split:    the model state K ways (mesh.shard_group, K = --dp-shard, times cp), replicated R = dp/K times
          (mesh.replicate_group); the batch over all dp x cp ranks.
Sends:    FSDP's traffic inside the shard group, (K-1)/K · P · (2·A·compute bytes + reduce bytes), plus one
          all-reduce of the fp32 gradient shard across replicas: 2·(R-1)/R · 4P/K bytes per rank.
          Only the all-reduce, 1/K of DDP's volume, crosses servers.
Overlap:  as FSDP; the replica all-reduces run after the last reduce-scatter, in finish_grad_sync.
Memory:   16·P/K bytes of model state per rank: K, not dp, sets the saving.
"""
from parallel.fsdp import FSDP, dtypes


class HSDP(FSDP):
    def reduce_across_replicas(self, shard_grad):
        self.mesh.replicate_group.all_reduce(shard_grad)  # sum over replicas of the same shard
        return shard_grad

    def grad_divisor(self):
        return self.group.size * self.mesh.replicate_group.size  # the mean over every dp x cp rank

    def replicas(self, meta_param):
        return super().replicas(meta_param) * self.mesh.replicate_group.size


def wrap(module, mesh, args, device, init_param):
    compute_dtype, reduce_dtype = dtypes(args)
    return HSDP(module, mesh, mesh.shard_group, init_param, device, compute_dtype, reduce_dtype,
                overlap=not args.no_overlap)
