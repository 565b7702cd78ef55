"""python -m bench.vs_peers: see bench/vs_peers/__init__.py."""
import sys

import config
from bench import common
from bench.dry_run import GPUS
from bench.vs_peers import LAYOUTS
from bench.vs_peers.columns import COLUMNS, as_json, measure, table
from data.files import write_json


@common.command
def main(argv=None):
    p = common.parser(__doc__, results=False)
    p.add_argument("--layout", default="8b-fsdp8", type=config.one_of(LAYOUTS, "layout"),
                   help=", ".join(LAYOUTS))
    p.add_argument("--ckpt", choices=("op", "full"), help="recompute policy (default: the layout's)")
    p.add_argument("--columns", default=",".join(COLUMNS), help="of " + ", ".join(COLUMNS))
    p.add_argument("--json", help="also write the counts to this file")
    p.add_argument("--list", action="store_true", help="name the layouts and stop")
    args = p.parse_args(argv)
    if args.list:
        for lay in LAYOUTS.values():
            print(f"{lay.name:20s} {lay.model}, world {lay.world}: python train.py "
                  + " ".join(lay.train_argv()))
        return 0
    layout = LAYOUTS[args.layout]
    if args.ckpt:
        layout = type(layout)(**{**vars(layout), "ckpt": args.ckpt})
    names = [n for n in args.columns.split(",") if n]
    if set(names) - set(COLUMNS):
        p.error(f"--columns: choose among {', '.join(COLUMNS)}")
    print(f"counting {layout.name} --ckpt {layout.ckpt}: {', '.join(names)}", file=sys.stderr)
    columns = measure(layout, GPUS["h100"], names)
    print(table(layout, columns))
    if args.json:
        write_json(args.json, as_json(layout, columns))
    return 0
