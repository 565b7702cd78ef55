"""Optimization pieces shared by every layout: AdamW groups, the LR schedule, the fp16 loss scaler,
and gradient clipping by the global norm of a sharded, partly replicated set of gradients."""
import math

import torch
import torch.distributed as dist


def make_adamw(params, lr, weight_decay, device):
    """AdamW over fp32 master weights. Matrices decay; norms (1-D) do not."""
    params = [p for p in params if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    fused = {"fused": True} if str(device).startswith("cuda") else {}
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95), eps=1e-8, **fused)


def lr_at(step, lr, min_lr, warmup, total):
    """Linear warmup from lr/warmup to lr over `warmup` steps, then cosine decay to min_lr at `total`."""
    if step < warmup:
        return lr * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_lr + 0.5 * (1 + math.cos(math.pi * progress)) * (lr - min_lr)


class LossScaler:
    """Dynamic loss scaling for fp16: multiply the loss by `scale` so small gradients survive fp16,
    divide the gradients back before the step; on inf/nan skip the step and halve the scale,
    after `interval` clean steps double it. A disabled scaler (fp32/bf16) is the identity."""

    def __init__(self, enabled, scale=2.0 ** 16, interval=2000):
        self.enabled, self.scale, self.interval, self.clean_steps = enabled, scale if enabled else 1.0, interval, 0
        self.skipped = False  # whether the last update skipped its step

    def state_dict(self):
        return {"scale": self.scale, "clean_steps": self.clean_steps}

    def load_state_dict(self, d):
        self.scale, self.clean_steps = d["scale"], d["clean_steps"]

    def update(self, found_inf):
        """Returns True if the step should be skipped."""
        self.skipped = self.enabled and found_inf
        if not self.enabled:
            return False
        if found_inf:
            self.scale /= 2
            self.clean_steps = 0
            return True
        self.clean_steps += 1
        if self.clean_steps % self.interval == 0:
            self.scale *= 2
        return False


def global_grad_norm(grads_and_replicas, world_group):
    """The L2 norm of the full gradient. Each entry is (grad, r): a tensor this rank holds and the
    number of ranks holding an identical copy, so that every element is counted exactly once."""
    device = next((g.device for g, _ in grads_and_replicas), torch.device("cpu"))
    sq = torch.zeros((), device=device, dtype=torch.float32)
    for g, replicas in grads_and_replicas:
        sq += g.float().pow(2).sum() / replicas
    if world_group.size > 1:
        dist.all_reduce(sq, group=world_group.pg)  # a scalar: not counted as traffic
    return sq.sqrt()


@torch.no_grad()
def unscale_and_clip(grads_and_replicas, world_group, inv_scale, max_norm):
    """Divides by the loss scale, then clips to max_norm (0: no clipping). Returns the pre-clip norm,
    which is inf/nan if any gradient anywhere overflowed."""
    grads = [g for g, _ in grads_and_replicas]
    if inv_scale != 1.0:
        torch._foreach_mul_(grads, inv_scale)
    norm = global_grad_norm(grads_and_replicas, world_group)
    if max_norm > 0 and torch.isfinite(norm):
        coef = (max_norm / (norm + 1e-6)).clamp(max=1.0)
        torch._foreach_mul_(grads, coef)
    return norm
