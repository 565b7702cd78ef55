"""DDP: every rank holds the whole model (or its tp/pp piece) and averages gradients over dp x cp.

Split:    the batch. Each dp rank gets its own slice; each cp rank sees other tokens.
Sends:    one all-reduce of the fp32 gradients per step: 2(g-1)/g · 4·N bytes per rank.
Overlap:  gradients live in flat fp32 buckets (--bucket-mb) in backward's order. Each .grad is a
          view into its bucket, so autograd adds straight into what is sent. A hook starts a
          bucket's async all-reduce once its last gradient is ready (AVG on NCCL; sum, then divide,
          on gloo). --no-overlap launches them after backward. --bucket-mb 0: one per tensor.
Memory:   nothing saved. Params, grads, Adam state: replicated (16 B/param). Buckets are the grads.
Average, not sum: each rank's loss is a mean over its tokens. The mean of the rank gradients is
the gradient of the global batch's mean, so the learning rate does not depend on the world size.
"""
import torch

from parallel import Piece, global_name, has_tp_partial_grad, tp_shard_of
from parallel.materialize import materialize


def grad_replicas(p, mesh):
    """How many ranks hold the same copy of p's gradient after sync (for the global grad norm)."""
    return mesh.dp_cp_group.size * (1 if tp_shard_of(p) else mesh.tp_group.size)


def sync_tp_partial_grads(params, mesh):
    """Sequence-parallel norms see only their tp rank's tokens: their grads are partial over tp."""
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
        """Makes p.grad the bucket's view again, copying in a fresh gradient (after set_to_none)."""
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

    def _hook(self, bucket, view):
        def on_grad_ready(param):
            bucket.adopt(param, view)
            if not self.sync_grads:
                return
            bucket.ready += 1
            if bucket.ready == len(bucket.params):
                bucket.launch(self.group)
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
        """Every param whole. dp x cp rank 0 writes them; tp-replicated ones, its tp rank 0."""
        first = self.mesh.dp_cp_group.rank == 0
        return [Piece(global_name(name), p, 0, p.numel(), tuple(p.shape), tp_shard_of(p), 0,
                      first and (tp_shard_of(p) is not None or self.mesh.coord["tp"] == 0))
                for name, p in self.module.named_parameters() if p.requires_grad]


def wrap(module, mesh, device, init_param, bucket_mb=25.0, overlap=True):
    """module: nn.ModuleList of GPT chunks on the meta device. Every rank materializes all of it."""
    materialize(module, device, lambda name, p, out: init_param(global_name(name), p, out=out))
    return DDP(module, mesh, bucket_mb=bucket_mb, overlap=overlap)
