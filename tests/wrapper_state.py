"""Full tensors out of a data-parallel wrapper's shards, for tests that compare a layout with one process."""
import torch

from parallel import global_name
from parallel.fsdp import FSDP


def _gather_units(fsdp, tensors_of_unit):
    """{global name: full tensor} on the group's rank 0 ({} elsewhere), one unit at a time."""
    state = {}
    for unit in fsdp.units:
        full = torch.empty(unit.padded, device=unit.local.device)
        fsdp.group.all_gather(full, tensors_of_unit(unit))
        if fsdp.group.rank == 0:
            for slot, view in zip(unit.slots, unit.views(full)):
                state[slot[2]] = view.detach().cpu().clone()
    return state


def full_state(wrapper):
    """The model's full parameters by global name (FSDP: every rank of the group takes part)."""
    if isinstance(wrapper, FSDP):
        return _gather_units(wrapper, lambda unit: unit.local)
    return {global_name(k): v.detach().cpu().clone() for k, v in wrapper.module.state_dict().items()}


def full_grads(wrapper):
    """The averaged full gradients by global name."""
    if isinstance(wrapper, FSDP):
        return _gather_units(wrapper, lambda unit: torch.cat([
            (p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in unit.params]))
    return {global_name(name): p.grad.clone() for name, p in wrapper.module.named_parameters()}


@torch.no_grad()
def load_full_state(wrapper, state):
    """Loads a full state dict (global names) into this rank's parameters or shards; no communication."""
    if isinstance(wrapper, FSDP):
        for unit in wrapper.units:
            flat = torch.zeros(unit.padded)
            for slot, a, n in zip(unit.slots, unit.offsets, unit.sizes):
                flat[a:a + n] = state[slot[2]].reshape(-1)
            unit.local.copy_(flat[unit.start:unit.start + unit.shard_numel])
        return
    for name, p in wrapper.module.named_parameters():
        p.copy_(state[global_name(name)])
