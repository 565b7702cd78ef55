"""Which ranks share each process group, and where they land: one GPU, one server, or across servers (L28).

    python -m bench.labs.placement --world 64 --tp 8 --pp 2 --cp 2
"""

from bench import common
from config import UsageError
from parallel.mesh import LayoutError, Mesh


@common.command
def main(argv=None):
    p = common.parser(__doc__, results=False)
    p.add_argument("--world", type=int, required=True)
    for axis in ("dp", "pp", "cp", "tp", "dp-shard"):
        p.add_argument(f"--{axis}", type=int, default=None if axis in ("dp", "dp-shard") else 1)
    p.add_argument("--gpus-per-node", type=int, default=8)
    a = p.parse_args(argv)
    try:
        print(Mesh(0, a.world, a.dp, a.pp, a.cp, a.tp, a.dp_shard).describe(a.gpus_per_node))
    except LayoutError as e:
        raise UsageError(str(e)) from None
    return 0
