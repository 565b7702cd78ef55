"""One GPU, one command of under 10 minutes: our training step against Hugging Face's, the attention kernels, ring
attention and the planner's efficiency factors. `python -m bench.gpu --out DIR` (measure.py).
"""
