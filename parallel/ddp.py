"""DDP: every rank holds the whole model (or its tp/pp piece) and averages gradients over dp x cp.

Split:       the batch. Each dp rank (and each cp rank, which sees other tokens) gets its own slice.
Sends:       one all-reduce of the gradients per optimizer step: 2(g-1)/g · 4·N bytes per rank (fp32, N params).
Overlap:     the gradients live in flat fp32 buckets (--bucket-mb) laid out in reverse creation order, the order in
             which backward produces them; each parameter's .grad is a view into its bucket, so autograd accumulates
             straight into what the all-reduce sends: no copy in or out. A bucket's async all-reduce (ReduceOp.AVG
             on NCCL; sum, then divide, on gloo) starts from an autograd hook the moment its last gradient is ready,
             while backward continues on earlier layers; every bucket stays in flight until finish_grad_sync waits
             for them. --no-overlap launches every bucket after backward instead; --bucket-mb 0 puts each parameter
             in its own bucket, the naive one-all-reduce-per-tensor version.
Memory:      nothing saved: params, grads and Adam state are replicated (16 B/param with fp32 Adam); the buckets are
             the gradients, so buckets in flight cost nothing more. Gradient accumulation (sync_grads False) adds
             each micro-batch into the buckets, and only the last one's backward launches the all-reduces.
Average, not sum (L7): each rank's loss is a mean over its tokens, so the mean of the rank gradients is the
gradient of the mean over the global batch, and the learning rate does not depend on the world size.
"""
import torch

from parallel import Piece, global_name, has_tp_partial_grad, tp_shard_of
from parallel.materialize import materialize


def grad_replicas(p, mesh):
    """How many ranks hold an identical copy of p's gradient after sync (for the global grad norm)."""
    return mesh.dp_cp_group.size * (1 if tp_shard_of(p) else mesh.tp_group.size)


def sync_tp_partial_grads(params, mesh):
    """Sequence-parallel norms see only their tp rank's tokens: their grads are partial sums over tp."""
    for p in params:
        if has_tp_partial_grad(p):
            mesh.tp_group.all_reduce(p.grad)


class Bucket:
    """Parameters whose gradients are one flat fp32 buffer: each .grad is a view into it."""

    def __init__(self, params):
        self.params = params
        self.buffer = torch.zeros(sum(p.numel() for p in params), device=params[0].device)
        offsets = [0]
        for p in params:
            offsets.append(offsets[-1] + p.numel())
        self.views = [self.buffer[a:b].view_as(p) for p, a, b in zip(params, offsets, offsets[1:])]
        self.ready = 0
        self.pending = None  # the all-reduce in flight
        for p, view in zip(params, self.views):
            p.grad = view

    def adopt(self, p, view):
        """Makes p.grad the bucket's view again if something replaced it (an optimizer's zero_grad(set_to_none)
        lets autograd create a fresh gradient): that gradient is the whole accumulated one, so it is copied in."""
        if p.grad is not view:
            if p.grad is None:
                view.zero_()
            else:
                view.copy_(p.grad)
            p.grad = view

    def launch(self, group):
        for p, view in zip(self.params, self.views):
            self.adopt(p, view)
        self.pending = group.all_reduce_mean(self.buffer, async_op=True)

    def finish(self):
        self.pending.wait()
        self.pending, self.ready = None, 0


class DDP:
    def __init__(self, module, mesh, bucket_mb=25.0, overlap=True):
        self.module, self.mesh, self.overlap = module, mesh, overlap
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
                for p, view in zip(bucket.params, bucket.views):
                    p.register_post_accumulate_grad_hook(self._hook(bucket, view))
        self.launched_in_backward = 0  # buckets whose all-reduce started inside backward (tests read it)

    def _hook(self, bucket, view):
        def on_grad_ready(param):
            bucket.adopt(param, view)
            if not self.sync_grads:
                return
            bucket.ready += 1
            if bucket.ready == len(bucket.params):
                bucket.launch(self.group)
                self.launched_in_backward += 1
        return on_grad_ready

    def finish_grad_sync(self):
        """Launches the buckets backward did not, then waits for every one in launch order."""
        for bucket in self.buckets:
            if self.group.size > 1 and bucket.pending is None:
                bucket.launch(self.group)
            for p, view in zip(bucket.params, bucket.views):
                bucket.adopt(p, view)
        for bucket in self.buckets:
            if bucket.pending is not None:
                bucket.finish()
        sync_tp_partial_grads(self.params, self.mesh)
        self.launched_in_backward = 0

    def zero_grad(self):
        for bucket in self.buckets:
            bucket.buffer.zero_()
            for p, view in zip(bucket.params, bucket.views):
                p.grad = view

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
    materialize(module, device, lambda name, p, out: init_param(global_name(name), p, out=out))
    return DDP(module, mesh, bucket_mb=bucket_mb, overlap=overlap)


# -------------------------------------------------------------- traffic formulas (the planner's --code ours uses these)

def all_reduce_bytes(n_params, group_size, grad_bytes=4):
    """Bytes one rank sends all-reducing n_params gradients, ring terms: 2(g-1)/g · grad_bytes · n_params."""
    return 2 * (group_size - 1) / group_size * grad_bytes * n_params
