"""What torch's own FSDP2 and DTensor need of the rehearsal's fake machine (bench/dry_run.py) to
build and step there: DTensor first in dispatch, meshes made from real CPU tensors, and streams."""
from contextlib import contextmanager

import torch
from torch._subclasses.fake_tensor import FakeTensor, unset_fake_temporarily
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class SubclassesFirst(TorchDispatchMode):
    """DTensor handles its ops before the modes below, which see only the ops on its local shards,
    the kernels a GPU runs. Else FakeCUDA, which runs an op on meta tensors with dispatch off,
    would make a meta DTensor (torchtitan shards on meta) a plain tensor, and a counting mode
    would take a DTensor op's output for a tensor of its global shape."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented
        return func(*args, **(kwargs or {}))


class HostMeshes(SubclassesFirst):
    """SubclassesFirst, and ops on real CPU tensors run on the CPU: a DeviceMesh made while
    parallelizing (fully_shard joins the dp and tp meshes) finds its ranks in a CPU tensor."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        device = torch.device((kwargs or {}).get("device") or "cpu")
        if device.type == "cpu" and not any(isinstance(t, FakeTensor) or t.device.type != "cpu"
                                            for t in tensors):
            with unset_fake_temporarily():
                return func(*args, **(kwargs or {}))
        return super().__torch_dispatch__(func, types, args, kwargs)


@contextmanager
def host_streams():
    """torch.cuda's streams and events are torch.cpu's stand-ins for the block: FSDP2 orders its
    copies and collectives with them, which a CPU build of torch lacks and fake tensors need not."""
    names = ("Stream", "Event", "current_stream", "stream")
    saved = {name: getattr(torch.cuda, name) for name in names}
    try:
        for name in names:
            setattr(torch.cuda, name, getattr(torch.cpu, name))
        yield
    finally:
        for name, original in saved.items():
            setattr(torch.cuda, name, original)
