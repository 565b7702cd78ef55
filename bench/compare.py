"""Runs side by side: each run's summary and the flags that differ; with --plot, their curves.

    python -m bench.compare runs/tiny runs/tiny-ckpt_full runs/b/metrics.jsonl [--plot ablation.png]

One row per run (a folder or its metrics file): final train and val loss, median tokens/s and MFU (the first step
left out), peak memory, wall time, a column per flag that differs; a run on a GPU the planner knows gets its MFU beside
the planner's range. --plot draws train and val loss, tokens/s and peak memory (bench/README.md, "Runs side by side";
matplotlib, requirements-dev.txt). A run without a summary: one line on stderr, exit 2.
"""
import itertools
from pathlib import Path
from types import SimpleNamespace

from bench import common
from bench.common import markdown_table
from bench.planner.command import expected_mfu
from config import UsageError
from data.files import atomic_write
from data.metrics import read_metrics
from model import ModelConfig

try:  # a tooling dependency (requirements-dev.txt); the table needs none
    from matplotlib.figure import Figure
except ImportError:
    Figure = None

NUMBER = (int, float)
# what a summary holds (train.run_summary), and its types
SUMMARY = {"run": (str,), "steps": (int,), "loss": NUMBER, "val_loss": NUMBER + (type(None),),
           "tok_s": NUMBER + (type(None),), "mfu": NUMBER + (type(None),),
           "mem_gb": NUMBER + (type(None),), "wall_s": NUMBER, "flags": (dict,)}
# what a step row holds that the plot draws
ROW = {"step": (int,), "loss": NUMBER, "val_loss": NUMBER + (type(None),), "tokens": NUMBER,
       "tok_s": NUMBER, "mem_gb": NUMBER + (type(None),)}
STYLES = ["-", "--", ":", "-."]
PANELS = [("train loss", "loss"), ("val loss", "val_loss"), ("tokens/s", "tok_s"), ("peak memory GB", "mem_gb")]


def checked(record, types, what):
    """The record if it is a dict whose keys hold values of their types (bool is no number), else UsageError."""
    if not isinstance(record, dict):
        raise UsageError(f"{what} is {type(record).__name__}, not an object")
    for key, allowed in types.items():
        value = record.get(key)
        if not isinstance(value, allowed) or (isinstance(value, bool) and bool not in allowed):
            names = " or ".join("null" if t is type(None) else t.__name__ for t in allowed)
            raise UsageError(f"{what}: {key!r} is {value!r}, not {names}")
    return record


def read_run(path, rows_too=False):
    """(the newest summary, [its step rows, the last run of each step, first to last] if rows_too)
    of a run folder or a metrics file."""
    path = Path(path)
    metrics = path / "metrics.jsonl" if path.is_dir() else path
    if not metrics.is_file():
        raise UsageError(f"{path}: no metrics file (a run folder holds metrics.jsonl)")
    try:
        rows, summaries = read_metrics(metrics)
    except (ValueError, TypeError) as e:  # not JSON lines, or a line that is no object
        raise UsageError(f"{metrics}: not a metrics file ({e})") from None
    if not summaries:
        raise UsageError(f"{metrics}: no summary: the run did not finish")
    summary = checked(summaries[-1], SUMMARY, f"{metrics}: the summary")
    steps = {checked(r, ROW, f"{metrics}: a step row")["step"]: r for r in rows} if rows_too else {}
    return summary, [steps[s] for s in sorted(steps)]


def differing(summaries):
    """The flags whose values are not the same in every run."""
    keys = sorted({k for s in summaries for k in s["flags"]})
    return [k for k in keys if len({repr(s["flags"].get(k)) for s in summaries}) > 1]


def layout_of(summary):
    """(ranks, layout) of a run, from its resolved flags ("-" for a summary without them)."""
    r = summary.get("resolved")
    if not isinstance(r, dict) or not isinstance(r.get("world"), int):
        return "-", "-"
    axes = [f"{r.get('dp_mode', 'ddp')} {r.get('dp', 1)}"] + [
        f"{k} {r[k]}" for k in ("tp", "pp", "cp") if isinstance(r.get(k), int) and r[k] > 1]
    return str(r["world"]), " x ".join(axes) + " sp" * bool(r.get("sp"))


def shown(value):
    """A flag's value as the table shows it: a switch as on or off."""
    return {True: "on", False: "off"}.get(value, str(value)) if isinstance(value, bool) else str(value)


def table(paths):
    """(header, rows) of the runs' summaries and the flags that differ between them; the ranks and
    the layout where those differ (a 2-rank DDP run beside one process)."""
    summaries = [read_run(p)[0] for p in paths]
    differ = differing(summaries)
    layouts = [layout_of(s) for s in summaries]
    placed = len(set(layouts)) > 1
    header = (["run"] + ["ranks", "layout"] * placed + ["steps", "loss", "val loss", "tok/s", "MFU", "peak GB",
                                                          "wall s"] + [f"--{k}" for k in differ])

    def number(value, spec):
        return "-" if value is None else format(value, spec)
    rows = [[s["run"]] + list(where) * placed + [
        s["steps"], number(s["loss"], ".4f"), number(s["val_loss"], ".4f"), number(s["tok_s"], ".0f"),
        number(s["mfu"], ".1%"), number(s["mem_gb"], ".3f"), number(s["wall_s"], ".0f")]
            + [shown(s["flags"].get(k, "-")) for k in differ] for s, where in zip(summaries, layouts)]
    return header, rows


WAITS = {"input_share": "input-bound: the step waited for its batch",
         "comm_wait_share": "exposed communication: the step waited in collectives",
         "pp_wait_share": "pipeline bubble: stages waited for their neighbours"}


def speed_line(s, expected):
    """The measured MFU beside the planner's range; below it, the largest measured wait."""
    low, high = expected
    said = (f"speed: MFU {s['mfu']:.1%}; the planner predicts {low:.1%}-{high:.1%} for this "
            "model, layout and GPU")
    if s["mfu"] >= low:
        return said + (": within it" if s["mfu"] <= high else ": above it")
    why = max(WAITS, key=lambda k: s[k])
    if s[why] < 0.05:
        return said + ": below it, and no wait explains it (the kernels, compilation, the clocks)"
    return said + f": below it; {WAITS[why]} {s[why]:.0%} of its time"




def speed(summary):
    """The speed line of a run's summary, or None: no GPU the planner knows, no MFU."""
    if summary.get("mfu") is None or not isinstance(summary.get("resolved"), dict):
        return None
    run, cfg = SimpleNamespace(**summary["resolved"]), ModelConfig(**summary["model"])
    expected = expected_mfu(run, cfg, summary.get("gpu"))
    return f"{summary['run']}: {speed_line(summary, expected)}" if expected else None


def plot(paths, out):
    """Draws the runs' curves into the PNG `out`; returns the Figure (its axes in PANELS' order)."""
    runs = [read_run(p, rows_too=True) for p in paths]
    differ = differing([s for s, _ in runs])
    labels = [" ".join(f"--{k} {shown(s['flags'][k])}" for k in differ if k in s["flags"]) or "defaults"
              for s, _ in runs]
    labels = [f"{x} ({Path(s['run']).name})" if labels.count(x) > 1 else x for x, (s, _) in zip(labels, runs)]
    batches = {r["tokens"] for _, rows in runs for r in rows}  # tokens per step
    per_step = next(iter(batches)) if len(batches) == 1 else None  # None: the runs' batches differ
    fig = Figure(figsize=(12, 8), layout="constrained")
    axes = fig.subplots(2, 2).flat
    for ax, (title, key) in zip(axes, PANELS):
        loss = key in ("loss", "val_loss")
        x_tokens = loss and per_step is None
        for i, ((_, rows), label) in enumerate(zip(runs, labels)):
            # tokens seen: each run's batch is the same every step
            points = [(r["step"] * r["tokens"] if x_tokens else r["step"], r[key]) for r in rows
                      if r.get(key) is not None]
            if points:  # a style per run: curves that coincide stay visible
                ax.plot(*zip(*points), STYLES[i % len(STYLES)],
                        marker="o" if key == "val_loss" else None, markersize=3, label=label)
        ax.set_title(title)
        ax.set_xlabel("tokens" if x_tokens else "step")
        ax.grid(alpha=0.3)
        if loss and per_step:
            top = ax.secondary_xaxis("top", functions=(lambda s: s * per_step, lambda t: t / per_step))
            top.set_xlabel("tokens")
    fig.axes[0].legend(fontsize="small")
    losses = [tuple(r["loss"] for r in rows) for _, rows in runs]
    for i, j in itertools.combinations(range(len(runs)), 2):
        if losses[i] == losses[j]:
            print(f"note: {labels[i]} and {labels[j]} have the same train loss at every step: "
                  "their curves coincide (told apart by their line styles)")
    try:
        with atomic_write(out) as f:  # whole or not at all: a full disk leaves no empty file
            fig.savefig(f, format="png", dpi=100)
    except OSError as e:
        raise UsageError(f"--plot: cannot write {out}: {e.strerror}") from None
    return fig


def check_plot(out):
    """--plot writes a new file or replaces a PNG, never through a link (a run's metrics, say)."""
    out = Path(out)
    if out.is_symlink() or (out.exists() and not out.is_file()):
        raise UsageError(f"--plot: {out} is a link or not a file; choose another name")
    if out.exists() and out.read_bytes()[:8] != b"\x89PNG\r\n\x1a\n":
        raise UsageError(f"--plot: {out} exists and is not a PNG; choose another name")


@common.command
def main(argv=None):
    parser = common.parser(__doc__, results=False)
    parser.add_argument("runs", nargs="+", help="run folders (or their metrics files)")
    parser.add_argument("--plot", metavar="FILE.png", help="also draw the runs' curves into this PNG")
    args = parser.parse_args(argv)
    if args.plot and not args.plot.lower().endswith(".png"):
        raise UsageError(f"--plot: {args.plot!r} is not a .png file name")
    if args.plot and Figure is None:
        raise UsageError("--plot: needs matplotlib (pip install -r requirements-dev.txt)")
    if args.plot:
        check_plot(args.plot)
    print(markdown_table(*table(args.runs)))
    for line in filter(None, (speed(read_run(p)[0]) for p in args.runs)):
        print(line)
    if args.plot:
        plot(args.runs, args.plot)
        print(f"wrote {args.plot}")
    return 0
