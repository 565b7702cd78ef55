"""Optimization pieces every layout shares: AdamW, the LR schedule, the fp16 loss scaler, clipping.

AdamW runs over fp32 masters. Clipping uses the global norm of sharded, partly replicated
gradients. Nothing here reads a value back to the host. The norm, the overflow flag and the loss
scale stay on the device, and fused AdamW skips an overflowed step by itself. So a training step
needs no host sync before its end."""
import math
from collections import defaultdict

import torch
import torch.distributed as dist


def make_adamw(params, lr, weight_decay, device):
    """AdamW over fp32 master weights. Matrices decay; norms (1-D) do not.

    Fused (one kernel for all parameters) where torch has it for the device."""
    params = [p for p in params if p.requires_grad]
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    try:
        return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95), eps=1e-8, fused=True)
    except RuntimeError:  # no fused kernel for this device in this torch
        return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95), eps=1e-8)


def lr_at(step, lr, min_lr, warmup, total, warmdown=None):
    """Linear warmup from lr/warmup to lr in `warmup` steps, then a decay to min_lr at `total`.

    warmdown None: cosine from the end of the warmup. warmdown K (warmup-stable-decay): lr until
    the last K steps, then linear to min_lr. A longer `total` lengthens the stable part.
    """
    if step < warmup:
        return lr * (step + 1) / warmup
    if warmdown is not None:
        left = min(1.0, max(0, total - step) / warmdown) if warmdown else 1.0  # 1 while stable
        return min_lr + left * (lr - min_lr)
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_lr + 0.5 * (1 + math.cos(math.pi * progress)) * (lr - min_lr)


def optimizer_step(opt, found_inf=None):
    """opt.step(), skipped where found_inf (a 0-dim device tensor) is 1.

    Fused AdamW reads the flag on the device. Without a fused kernel it is read on the host."""
    if found_inf is None or opt.defaults.get("fused"):
        opt.found_inf = found_inf
        opt.step()
    elif not found_inf.item():
        opt.step()


class LossScaler:
    """Dynamic loss scaling for fp16. A disabled scaler (fp32, bf16) is 1.

    The loss is multiplied by `scale` so small gradients survive fp16. The gradients are divided
    back before the step. On inf or nan the step is skipped and the scale halved. After
    `interval` clean steps it doubles. The scale and the count of clean steps live on the device."""

    def __init__(self, enabled, device="cpu", scale=2.0 ** 16, interval=2000):
        self.enabled, self.interval = enabled, interval
        self.scale = torch.tensor(scale if enabled else 1.0, device=device)  # 0-dim fp32
        self.clean_steps = torch.zeros((), dtype=torch.int32, device=device)

    def state_dict(self):
        return {"scale": self.scale.item(), "clean_steps": int(self.clean_steps.item())}

    def load_state_dict(self, d):
        self.scale.fill_(d["scale"])
        self.clean_steps.fill_(d["clean_steps"] % self.interval)

    def update(self, found_inf):
        """After the step: halve on overflow (found_inf 1), double after `interval` clean steps."""
        if self.enabled:
            torch._amp_update_scale_(self.scale, self.clean_steps, found_inf, 2.0, 0.5,
                                     self.interval)


def global_grad_norm(grads_and_replicas, world_group, also_sum=None):
    """The L2 norm of the full gradient. Returns the norm, or (norm, summed also_sum).

    Each entry is (grad, r): a tensor this rank holds, and how many ranks hold the same copy.
    So every element counts once. One _foreach_norm runs per replica count, then one all-reduce
    of the squared sum. `also_sum`, a 0-dim tensor, is summed over the world in the same call."""
    by_replicas = defaultdict(list)
    for g, replicas in grads_and_replicas:
        by_replicas[replicas].append(g)
    device = next((g.device for g, _ in grads_and_replicas), torch.device("cpu"))
    sums = torch.zeros(2, device=device, dtype=torch.float32)  # [sum of squares, also_sum]
    for replicas, grads in by_replicas.items():
        sums[0] += torch.stack(torch._foreach_norm(grads, 2)).float().pow(2).sum() / replicas
    if also_sum is not None:
        sums[1] = also_sum
    if world_group.size > 1:
        dist.all_reduce(sums, group=world_group.pg)  # two scalars: not counted as traffic
    norm = sums[0].sqrt()
    return norm if also_sum is None else (norm, sums[1])


@torch.no_grad()
def unscale_and_clip(grads_and_replicas, world_group, loss_scale, max_norm, bad_losses=None):
    """Divides the gradients by the loss scale and clips them to max_norm (0: no clipping).

    One pass, with no branch on a device value. Returns (norm, bad). norm: the pre-clip norm of
    the unscaled gradients, inf or nan if any gradient anywhere overflowed. bad: how many ranks
    had `bad_losses` 1, a loss that was not finite."""
    grads = [g for g, _ in grads_and_replicas]
    local_bad = bad_losses if bad_losses is not None else torch.zeros(
        (), device=grads[0].device if grads else "cpu")
    scaled_norm, bad = global_grad_norm(grads_and_replicas, world_group, also_sum=local_bad)
    norm = scaled_norm / loss_scale
    coef = 1 / loss_scale
    if max_norm > 0:
        coef = coef * (max_norm / (norm + 1e-6)).clamp(max=1.0)
    torch._foreach_mul_(grads, coef)
    return norm, bad
