"""The 4D layout planner: closed formulas for a layout's bytes, memory and step time, and the search over layouts.
`python -m bench.planner` is its command line (plan.py); the emulated cluster and the GPU run price layouts with it.
"""
