"""Our DDP, FSDP, TP and PP against torch's own, side by side on gloo ranks. `python -m bench.vs_torch` (measure.py).
"""
