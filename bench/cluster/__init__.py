"""An emulated cluster on one Linux machine: network namespaces as nodes, shaped links, a torchrun per node.
`python -m bench.cluster` measures L12 and L15 on it (measure.py) and prices the same layouts with the planner.
"""
