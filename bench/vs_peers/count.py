"""One counter for every column: matmul FLOPs by phase, kernel launches, collectives by group.

A dispatch mode sees each aten op of a step on fake CUDA tensors. A matmul or attention op adds
torch's own FLOP formula (torch.utils.flop_counter) to its phase: forward, backward (the autograd
engine runs it) or recomputed (in a checkpoint's recompute_fn, remaking forward). Every op that
is not a view or an allocation is one kernel launch. A c10d op adds a call and the bytes of its
whole buffer (all-gather's output, reduce-scatter's input, all-reduce's tensor) to its group,
named by the mesh dimension torch gave it, else by its size.
"""
import sys
from collections import Counter, defaultdict

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.flop_counter import flop_registry

_DEVICE = torch.ops.prim.device.default
ATTENTION = "attention"
FREE = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "detach", "alias",
        "lift_fresh", "_local_scalar_dense", "set_", "resize_"}  # no kernel on a GPU


def phase():
    """forward, backward or recomputed (torch.utils.checkpoint's recompute_fn on the stack)."""
    if torch._C._current_graph_task_id() == -1:
        return "forward"
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name == "recompute_fn":
            return "recomputed"
        frame = frame.f_back
    return "backward"


def group_of(func, args):
    """(name, size) of the process group a c10d op runs on."""
    names = [a for a in args if isinstance(a, str)]  # a functional collective's group: its last
    boxed = [a for a in args if isinstance(a, torch.ScriptObject)]
    if boxed:
        pg = dist.ProcessGroup.unbox(boxed[0])
    elif names and func.namespace == "_c10d_functional":
        pg = dist.distributed_c10d._resolve_process_group(names[-1])
    else:
        return "world", dist.get_world_size()
    desc = getattr(pg, "group_desc", "") or ""
    name = desc.removeprefix("mesh_") if desc.startswith("mesh_") else f"{pg.size()} ranks"
    return name, pg.size()


class Count(TorchDispatchMode):
    """One step's counts; reset() before the step to count."""

    def __init__(self):
        super().__init__()
        self.reset()

    def reset(self):
        self.flops = Counter()  # {phase: FLOPs}; attention's also under "attention <phase>"
        self.launches = 0
        self.collectives = defaultdict(lambda: [0, 0])  # {(group, op): [calls, bytes]}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is _DEVICE:
            return args[0].device
        out = func(*args, **kwargs)
        name = func._opname
        if func.namespace in ("c10d", "_c10d_functional"):
            if name not in ("barrier", "wait_tensor"):
                sizes = [t.numel() * t.element_size() for t in tree_leaves((args, out))
                         if isinstance(t, torch.Tensor)]
                entry = self.collectives[(group_of(func, args)[0], name.rstrip("_"))]
                entry[0] += 1
                entry[1] += max(sizes, default=0)
            return out
        if func.is_view or name in FREE:
            return out
        self.launches += 1
        count = flop_registry.get(func._overloadpacket)
        if count is not None:
            flops = count(*args, **kwargs, out_val=out)
            now = phase()
            self.flops[now] += flops
            if "attention" in name:
                self.flops[f"{ATTENTION} {now}"] += flops
        return out

    def summary(self):
        """The counts as plain numbers: FLOPs per phase, launches, {group: {op: [calls, bytes]}}."""
        groups = defaultdict(dict)
        for (group, op), (calls, nbytes) in sorted(self.collectives.items()):
            groups[group][op] = [calls, nbytes]
        phases = ("forward", "backward", "recomputed")
        return {"flops": {p: self.flops[p] for p in phases},
                "attention_flops": {p: self.flops[f"{ATTENTION} {p}"] for p in phases},
                "launches": self.launches, "collectives": dict(groups)}
