"""DDP: every rank holds the whole model (or its tp/pp piece) and averages gradients over dp x cp.

Split:       the batch. Each dp rank (and each cp rank, which sees other tokens) gets its own slice.
Sends:       one all-reduce of the gradients per optimizer step: 2(g-1)/g · 4·P bytes per rank (fp32).
Overlap:     gradients are packed into buckets (--bucket-mb) in reverse creation order, the order in
             which backward produces them. A bucket's async all-reduce starts from an autograd hook
             the moment its last gradient is ready, while backward continues on earlier layers, and the
             bucket before it is waited for, averaged and copied back, freeing its copy.
             --no-overlap launches every bucket after backward instead; --bucket-mb 0 puts each
             parameter in its own bucket, the naive one-all-reduce-per-tensor version.
Memory:      nothing saved: params, grads and Adam state are replicated (16 B/param with fp32 Adam),
             plus the fp32 copies of the (at most two) buckets whose all-reduce is in flight. Gradient
             accumulation (sync_grads False) costs nothing extra: micro-batches add into p.grad, and only
             the last one's backward launches the all-reduces.
Average, not sum (L7): each rank's loss is a mean over its tokens, so the mean of the rank gradients is the
gradient of the mean over the global batch, and the learning rate does not depend on the world size.
"""
import torch

import model as M
from parallel import Piece, global_name, has_tp_partial_grad, tp_shard_of


def grad_replicas(p, mesh):
    """How many ranks hold an identical copy of p's gradient after sync (for the global grad norm)."""
    return mesh.dp_cp_group.size * (1 if tp_shard_of(p) else mesh.tp_group.size)


def sync_tp_partial_grads(params, mesh):
    """Sequence-parallel norms see only their tp rank's tokens: their grads are partial sums over tp."""
    for p in params:
        if has_tp_partial_grad(p):
            mesh.tp_group.all_reduce(p.grad)


class Bucket:
    def __init__(self, params):
        self.params = params
        self.ready = 0
        self.buffer = None
        self.handle = None

    def launch(self, group):
        """Copy the grads into one flat buffer and start its all-reduce without waiting."""
        self.buffer = torch.cat([p.grad.reshape(-1) for p in self.params])
        self.handle = group.all_reduce(self.buffer, async_op=True)

    def finish(self, group):
        if self.handle is not None:
            self.handle.wait()
        self.buffer /= group.size
        offset = 0
        for p in self.params:
            p.grad.copy_(self.buffer[offset:offset + p.numel()].view_as(p.grad))
            offset += p.numel()
        self.buffer, self.handle = None, None


class DDP:
    def __init__(self, module, mesh, bucket_mb=25.0, overlap=True):
        self.module, self.mesh, self.overlap = module, mesh, overlap
        self.weight_dtype = torch.float32  # forward computes with the fp32 masters (autocast casts per matmul)
        self.group = mesh.dp_cp_group
        self.params = [p for p in module.parameters() if p.requires_grad]
        self.sync_grads = True  # False on all but the last micro-batch: grads just accumulate
        self.buckets = []
        current, size = [], 0
        for p in reversed(self.params):  # backward produces the last layers' grads first
            current.append(p)
            size += p.numel() * 4
            if size >= bucket_mb * 2 ** 20:
                self.buckets.append(Bucket(current))
                current, size = [], 0
        if current:
            self.buckets.append(Bucket(current))
        if self.group.size > 1 and overlap:
            for bucket in self.buckets:
                for p in bucket.params:
                    p.register_post_accumulate_grad_hook(self._hook(bucket))
        self.launched_in_backward = 0  # buckets whose all-reduce started inside backward (tests read it)
        self.in_flight = None  # the bucket launched last in backward, finished when the next one launches

    def _hook(self, bucket):
        def on_grad_ready(_param):
            if not self.sync_grads:
                return
            bucket.ready += 1
            if bucket.ready == len(bucket.params):
                bucket.launch(self.group)
                self.launched_in_backward += 1
                if self.in_flight is not None:  # its all-reduce ran under this bucket's backward: free its copy
                    self.in_flight.finish(self.group)
                self.in_flight = bucket
        return on_grad_ready

    def finish_grad_sync(self):
        """Wait for every bucket (launching those backward did not), then average."""
        if self.group.size > 1:
            for bucket in self.buckets:
                if bucket.ready < len(bucket.params):  # not launched in backward
                    bucket.launch(self.group)
            for bucket in self.buckets:
                if bucket.buffer is not None:  # not finished in backward
                    bucket.finish(self.group)
                bucket.ready = 0
        sync_tp_partial_grads(self.params, self.mesh)
        self.launched_in_backward, self.in_flight = 0, None

    def optim_params(self):
        return self.params

    def grads_for_norm(self):
        return [(p.grad, grad_replicas(p, self.mesh)) for p in self.params if p.grad is not None]

    def owned_pieces(self):
        """Every param whole; written by dp x cp rank 0 (tp-replicated params: by tp rank 0 of those)."""
        first = self.mesh.dp_cp_group.rank == 0
        return [Piece(global_name(name), p, 0, p.numel(), tuple(p.shape), tp_shard_of(p), 0,
                      first and (tp_shard_of(p) is not None or self.mesh.coord["tp"] == 0))
                for name, p in self.module.named_parameters() if p.requires_grad]


def wrap(module, mesh, device, init_param, bucket_mb=25.0, overlap=True):
    """module: nn.ModuleList of GPT chunks on the meta device. Every rank materializes all of it."""
    M.materialize(module, device, lambda name, p: init_param(global_name(name), p))
    return DDP(module, mesh, bucket_mb=bucket_mb, overlap=overlap)


# -------------------------------------------------------------- traffic formulas (the planner's --code ours uses these)

def all_reduce_bytes(n_params, group_size, grad_bytes=4):
    """Bytes one rank sends all-reducing n_params gradients, ring terms: 2(g-1)/g · grad_bytes · n_params."""
    return 2 * (group_size - 1) / group_size * grad_bytes * n_params
