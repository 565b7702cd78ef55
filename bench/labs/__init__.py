"""The lab questions, one script each, named for what it answers (bench/README.md maps the lab's items to them).
Each runs as `python -m bench.labs.NAME` and writes its tables, headed by that command, into bench/results/.
"""
