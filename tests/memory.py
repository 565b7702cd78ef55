"""Counting the bytes of tensor storage that ops create, for memory tests that must not depend on an allocator:
train.py's own counter, which mem_gb on CPU uses."""
from parallel.memory import LiveBytes, storage_bytes

__all__ = ["LiveBytes", "storage_bytes"]
