"""Runs side by side: each run's summary (the last line train.py writes to its metrics) and the flags that differ.

    python compare.py runs/tiny runs/tiny-ckpt=full runs/tiny-dtype=bf16
    python compare.py out/a/metrics.jsonl out/b            # a run folder, or its metrics file

One row per run: final train and val loss, median tokens/s and MFU (the first step left out), peak memory, wall time,
and a column for every flag whose value is not the same in all of them (a flag a run leaves at its default shows as
"-"). A run that wrote no summary (killed, or still running) is one line on stderr, exit 2.
"""
import argparse
import sys
from pathlib import Path

from bench.common import markdown_table
from config import OneLineParser, UsageError
from train import read_metrics


def summary_of(path):
    """The newest summary of a run folder (its metrics.jsonl) or of a metrics file."""
    path = Path(path)
    metrics = path / "metrics.jsonl" if path.is_dir() else path
    if not metrics.is_file():
        raise UsageError(f"{path}: no metrics file (a run folder holds metrics.jsonl)")
    try:
        summaries = read_metrics(metrics)[1]
    except ValueError as e:
        raise UsageError(f"{metrics}: not a metrics file ({e})") from None
    if not summaries:
        raise UsageError(f"{metrics}: no summary: the run did not finish")
    return summaries[-1]


def table(paths):
    """(header, rows) of the runs' summaries and the flags that differ between them."""
    summaries = [summary_of(p) for p in paths]
    keys = sorted({k for s in summaries for k in s["flags"]})
    differ = [k for k in keys if len({repr(s["flags"].get(k)) for s in summaries}) > 1]
    header = ["run", "steps", "loss", "val loss", "tok/s", "MFU", "peak GB", "wall s"] + [f"--{k}" for k in differ]

    def number(value, spec):
        return "-" if value is None else format(value, spec)
    rows = [[s["run"], s["steps"], number(s["loss"], ".4f"), number(s["val_loss"], ".4f"), number(s["tok_s"], ".0f"),
             number(s["mfu"], ".1%"), number(s["mem_gb"], ".3f"), number(s["wall_s"], ".0f")]
            + [str(s["flags"].get(k, "-")) for k in differ] for s in summaries]
    return header, rows


def main(argv=None):
    parser = OneLineParser(description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="+", help="run folders (or their metrics files)")
    try:
        print(markdown_table(*table(parser.parse_args(argv).runs)))
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
