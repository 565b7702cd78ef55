"""Which ranks share each process group, and where they land: one GPU, one server, or across servers (L28).

    python -m bench.labs.placement --world 64 --tp 8 --pp 2 --cp 2
"""
import argparse
import sys

from parallel.mesh import LayoutError, Mesh


def main(argv=None):
    p = argparse.ArgumentParser(description="Print which ranks share each group and where they land (L28).")
    p.add_argument("--world", type=int, required=True)
    for axis in ("dp", "pp", "cp", "tp", "dp-shard"):
        p.add_argument(f"--{axis}", type=int, default=None if axis in ("dp", "dp-shard") else 1)
    p.add_argument("--gpus-per-node", type=int, default=8)
    a = p.parse_args(argv)
    try:
        print(Mesh(0, a.world, a.dp, a.pp, a.cp, a.tp, a.dp_shard).describe(a.gpus_per_node))
    except LayoutError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
