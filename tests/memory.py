"""Counting the bytes of tensor storage that ops create, for memory tests that must not depend on an allocator."""
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class LiveBytes(TorchDispatchMode):
    """Bytes of the storages that ops create while active, from creation until freed; `peak` is the maximum.
    A storage's Python object outlives every tensor using it (PyTorch keeps it), so a finalizer marks the free."""

    def __init__(self):
        super().__init__()
        self.live, self.now, self.peak = {}, 0, 0

    def _free(self, key):
        self.now -= self.live.pop(key)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for t in tree_leaves(out):
            if not isinstance(t, torch.Tensor) or t.device.type == "meta":
                continue
            storage = t.untyped_storage()
            key, n = storage.data_ptr(), storage.nbytes()
            if n and key not in inputs and key not in self.live:  # views and in-place results are not new
                self.live[key] = n
                self.now += n
                weakref.finalize(storage, self._free, key)
        self.peak = max(self.peak, self.now)
        return out
