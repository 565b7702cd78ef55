"""The lab: what this code measures, each answer a command (bench/README.md has the results).

    python -m bench.run_all         # make bench: every script this machine can run, indexed in results/INDEX.md
    python -m bench.gpu --out DIR   # one GPU: our step against Hugging Face's, the planner's factors
    python -m bench.planner --model llama3-405b --gpus 16384 --seq-len 131072

Rooms: planner/ (the layout planner, which the cluster and the GPU run stand on), cluster/ (an emulated 2-node
cluster), gpu/ (one GPU), vs_torch/ (our parallelisms against torch's own), labs/ (one script per lab question).
common.py holds what they share; ranks.py runs a function on N gloo ranks (the tests use it too).
"""
