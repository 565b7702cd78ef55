"""Draw a pipeline schedule and its theoretical utilization (L26).

    python -m bench.labs.pp_draw --pp 4 --microbatches 8 --schedule 1f1b
    python -m bench.labs.pp_draw --pp 4 --microbatches 8 --schedule interleaved --virtual 2
    python -m bench.labs.pp_draw --pp 4 --microbatches 8 --schedule zb1   # or zbv: two chunks per rank in a V
"""

from bench import common
from config import UsageError, positive_int
from parallel import pp_schedule as S

MAX_P, MAX_M, MAX_V = 64, 256, 8  # what a drawing can show a reader, simulated in seconds

FORMULAS = {"gpipe": ("M/(M+P-1)", lambda P, M, V: (M, M + P - 1)),
            "1f1b": ("M/(M+P-1)", lambda P, M, V: (M, M + P - 1)),
            "interleaved": ("VM/(VM+P-1)", lambda P, M, V: (V * M, V * M + P - 1)),
            "zb1": ("3M/(3M+max(P-1, 2P-1-M))", lambda P, M, V: (3 * M, 3 * M + max(P - 1, 2 * P - 1 - M))),
            "zbv": ("6M/(6M+max(P-1, 3P-3-M, 4P-1-3M))",
                    lambda P, M, V: (6 * M, 6 * M + max(P - 1, 3 * P - 3 - M, 4 * P - 1 - 3 * M)))}


def draw(schedule, P, M, V=1):
    """The classic diagram, one row per stage: F3 = forward of micro-batch 3 (one tick), B3 and its
    '--' tail = backward (two ticks; zb1/zbv: B3 the input gradient and W3 the weight gradient, one tick each),
    a letter after the number = the chunk (interleaved, zbv), . = idle."""
    V = S.chunks_per_rank(schedule, V)
    timeline = S.simulate(S.SCHEDULES[schedule](P, M, V), P, V, schedule in S.VSHAPED)
    split = schedule in S.SPLIT_BACKWARD
    width = len(str(M - 1)) + 1 + (V > 1)
    end = max(e for row in timeline for _, e, _ in row)
    lines = [f"{schedule}: P={P} stages, M={M} micro-batches" + (f", V={V} chunks per stage" if V > 1 else "")
             + ("; F3 = forward of micro-batch 3, B3 = its input gradient, W3 = its weight gradient (1 tick each)"
                if split else "; F3 = forward of micro-batch 3 (1 tick), B3 -- = its backward (2 ticks)")
             + (", a/b/.. = the chunk" if V > 1 else "") + (" (zbv: a runs down the stages, b back up)"
                                                            if schedule in S.VSHAPED else "") + ", . = idle"]
    for r, row in enumerate(timeline):
        cells = ["." * width] * end
        for start, stop, a in row:
            label = f"{a.op}{a.mb}{'abcdefgh'[a.chunk] if V > 1 else ''}".ljust(width)
            cells[start] = label
            for t in range(start + 1, stop):
                cells[t] = "-" * width
        lines.append(f"stage {r} |" + " ".join(cells))
    busy = sum(e - s for s, e, _ in timeline[0])
    formula, (num, den) = FORMULAS[schedule][0], FORMULAS[schedule][1](P, M, V)
    lines.append(f"simulated utilization {busy / end:.3f} ({busy} busy of {end} ticks per stage); "
                 f"theory {formula} = {num}/{den} = {S.theoretical_utilization(P, M, V, schedule):.3f}"
                 + (" (gpipe: the same bubble, M activation sets in flight, not P)" if schedule == "gpipe" else ""))
    return "\n".join(lines)


@common.command
def main(argv=None):
    p = common.parser(__doc__, results=False)
    p.add_argument("--pp", type=positive_int, default=4, help="stages P")
    p.add_argument("--microbatches", type=positive_int, default=8, help="micro-batches M")
    p.add_argument("--schedule", default="1f1b", choices=sorted(S.SCHEDULES))
    p.add_argument("--virtual", type=positive_int, default=1, help="chunks per stage V (interleaved)")
    args = p.parse_args(argv)
    P, M, V = args.pp, args.microbatches, args.virtual
    for bad, message in ((P > MAX_P, f"--pp: at most {MAX_P} stages to draw"),
                         (M > MAX_M, f"--microbatches: at most {MAX_M} to draw"),
                         (V > MAX_V, f"--virtual: at most {MAX_V} chunks per stage to draw"),
                         (V > 1 and args.schedule != "interleaved", "--virtual: V > 1 needs --schedule interleaved"),
                         (V > 1 and M > P and M % P, "--microbatches: interleaved needs M a multiple of P or M <= P")):
        if bad:
            raise UsageError(message)
    print(draw(args.schedule, P, M, V))
    return 0
