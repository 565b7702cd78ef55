"""Pipeline schedules as plain data: for every stage, the ordered list of actions it runs.

A model of P·V virtual stages is spread round-robin over P ranks. Rank r holds virtual stages r,
r+P, r+2P, ... as its local chunks 0, 1, ..., V-1. zbv places V = 2 in a V instead: rank r holds
stages r and 2P-1-r. So rank P-1 runs stages P-1 and P back to back, and rank 0 both ends.

A schedule is first a compute order per rank: F and B of micro-batch i on local chunk c. The
zero-bubble schedules split B into B, the input gradient, and a later W, the weight one.
`with_communication` adds the sends and receives each compute implies. The executor knows the
activation shape from the config. Neighbouring stages on one rank exchange nothing.
Nothing here touches torch. pp.py runs the lists; bench.labs.pp_draw draws them. The tests check
that each (chunk, mb) runs once, forward before backward, and that sends match receives. Nothing
deadlocks, even when a p2p batch blocks its stream until all of it is matched, as NCCL's does.
"""
import bisect
from typing import NamedTuple


class Action(NamedTuple):
    op: str  # F, B, W (compute); SEND_F, RECV_F, SEND_B, RECV_B (p2p)
    chunk: int = 0  # local chunk index on this rank
    mb: int = 0  # micro-batch
    peer: int = -1  # pp rank on the other end of a send or receive

    def __str__(self):
        peer = "" if self.peer < 0 else ("->" if self.op in SENDS else "<-") + str(self.peer)
        return f"{self.op}(c{self.chunk},m{self.mb}{peer})"


class DeadlockError(RuntimeError):
    pass


COMPUTE, SENDS, RECVS = ("F", "B", "W"), ("SEND_F", "SEND_B"), ("RECV_F", "RECV_B")
VSHAPED = ("zbv",)  # schedules whose two chunks per rank sit in a V
SPLIT_BACKWARD = ("zb1", "zbv")  # schedules whose backward is a B and a later W


def stage_of(rank, chunk, P, vshape=False):
    """The virtual stage a rank's local chunk runs."""
    return 2 * P - 1 - rank if vshape and chunk else chunk * P + rank


def place(v, P, vshape=False):
    """(rank, local chunk) of virtual stage v."""
    if vshape:
        return (v, 0) if v < P else (2 * P - 1 - v, 1)
    return v % P, v // P


def chunks_per_rank(schedule, V=1):
    """zbv always runs two chunks per rank; the others run V (--pp-virtual, interleaved)."""
    return 2 if schedule in VSHAPED else V


# ---------------------------------------------------------------- compute orders

def gpipe(P, M, V=1):
    """Every forward, then every backward in reverse. M activation sets live on every stage."""
    fwd = [Action("F", c, i) for c in range(V) for i in range(M)]
    bwd = [Action("B", c, i) for c in reversed(range(V)) for i in reversed(range(M))]
    return [fwd + bwd for _ in range(P)]


def one_f_one_b(P, M, V=1):
    """PipeDream-flush (1F1B): warmup, one forward and one backward in turn, cooldown. At most P
    micro-batches are in flight."""
    if V > 1:
        return interleaved(P, M, V)
    orders = []
    for r in range(P):
        warm = min(P - r - 1, M)
        order = [Action("F", 0, i) for i in range(warm)]
        for k in range(M - warm):
            order += [Action("F", 0, warm + k), Action("B", 0, k)]
        orders.append(order + [Action("B", 0, i) for i in range(M - warm, M)])
    return orders


def interleaved(P, M, V):
    """Megatron's interleaved 1F1B: micro-batches go in groups of P through chunk 0, then chunk 1.

    Rank r keeps up to P + (P-2r-1)/V stages' activation sets. The bubble is (P-1)/(V·M), as a
    chunk is 1/V of a stage. The warmup's second P-r-1 forwards are slack: without them the
    bubble simulates the same, but measured 10-15% lower utilization (bench/labs/pp_bubble.py)."""
    if V == 1:
        return one_f_one_b(P, M)
    fwd, bwd = [], []
    for start in range(0, M, P):
        group = range(start, min(start + P, M))
        fwd += [Action("F", c, i) for c in range(V) for i in group]
        bwd += [Action("B", c, i) for c in reversed(range(V)) for i in group]
    orders = []
    for r in range(P):
        warm = min((P - r - 1) * 2 + (V - 1) * P, M * V)
        order = fwd[:warm]
        for k in range(M * V - warm):
            order += [fwd[warm + k], bwd[k]]
        orders.append(order + bwd[M * V - warm:])
    return orders


def zero_bubble_h1(P, M, V=1):
    """ZB-H1 (Qi et al., 2024): 1F1B's order, each backward split into B and W (pp_bw_split.py).

    Stage r enters the cooldown with r W's in hand, run where 1F1B waits for the next B. At most
    P activation sets live on every stage. With F = B = W the bubble is P-1 passes, not 3(P-1):
    utilization 3M/(3M+P-1) for M >= P."""
    orders = []
    for r in range(P):
        warm = min(P - r - 1, M)
        order = [Action("F", 0, i) for i in range(warm)]
        for k in range(M):
            order += [Action("F", 0, warm + k)] if warm + k < M else []
            order += [Action("B", 0, k)] + ([Action("W", 0, k - r)] if k >= r else [])
        orders.append(order + [Action("W", 0, i) for i in range(max(M - r, 0), M)])
    return orders


def zero_bubble_v(P, M, V=2):
    """ZB-V: two chunks per rank in a V (stages r and 2P-1-r), B and W split.

    The warmup fills the V, and backwards start on rank 0 as soon as it is full. At most 2P
    chunk activation sets live: 1F1B's P stages' worth. With F = B = W per chunk the
    bubble is P-1 chunk passes, half of ZB-H1's: 6M/(6M+P-1) for M >= 2P-2."""
    return [_v_rank(P, M, r) for r in range(P)]


def _v_rank(P, M, r):
    order, done = [], {(op, c): 0 for op in "FBW" for c in (0, 1)}

    def run(*steps):
        for op, c in steps:  # skipped once chunk c has no micro-batch left for it
            if done[(op, c)] < M:
                order.append(Action(op, c, done[(op, c)]))
                done[(op, c)] += 1
    run(*[("F", 0)] * (2 * (P - r) - 1), *[("F", 1), ("F", 0)] * r,
        *[("F", 1), ("B", 1), ("W", 1)] * (P - r))
    while done[("B", 0)] < M and (done[("F", 0)] < M or done[("F", 1)] < M):
        run(("F", 0), ("B", 0), ("W", 0), ("F", 1), ("B", 1), ("W", 1))
    run(*[("B", 0), ("B", 1)] * r, *[("B", 0), ("W", 0)] * (P - r), *[("W", 1)] * M,
        *[("W", 0)] * M)
    return order


SCHEDULES = {"gpipe": gpipe, "1f1b": one_f_one_b, "interleaved": interleaved,
             "zb1": zero_bubble_h1, "zbv": zero_bubble_v}


def theoretical_utilization(P, M, V=1, schedule="1f1b"):
    """Busy / (busy + bubble) with equal stages and F = B = W (a full backward B + W = 2F).
    M/(M+P-1); interleaved VM/(VM+P-1); zb1 3M/(3M + max(P-1, 2P-1-M)).
    zbv, in chunk passes: 6M/(6M + max(P-1, 3P-3-M, 4P-1-3M)).
    In the last two, fewer micro-batches than the warmup fills add to the bubble."""
    if schedule == "zb1":
        return 3 * M / (3 * M + max(P - 1, 2 * P - 1 - M))
    if schedule == "zbv":
        return 6 * M / (6 * M + max(P - 1, 3 * P - 3 - M, 4 * P - 1 - 3 * M))
    return V * M / (V * M + P - 1)


# ---------------------------------------------------------------- communication

def with_communication(orders, P, V, vshape=False):
    """Adds the p2p actions the compute orders imply.

    A message is posted at the tick an ideal run (`simulate`) makes it: by the sender after that
    compute, by the receiver before its first compute from then on. So it travels under work.
    Every rank posts in (tick, message) order, one global order that respects every dependency.
    So in-order streams cannot deadlock (tests/pp_deadlock.py)."""
    last = P * V - 1
    timeline = simulate(orders, P, V, vshape)
    gaps = [[[] for _ in range(len(order) + 1)] for order in orders]  # [r][k]: p2p before compute k

    starts = [[start for start, _, _ in row] for row in timeline]  # increasing on each rank

    def gap_for(r, tick):
        return bisect.bisect_left(starts[r], tick)  # before the first compute starting >= tick

    for r in range(P):
        for k, (_, end, a) in enumerate(timeline[r]):
            v = stage_of(r, a.chunk, P, vshape)
            if a.op == "F" and v < last:
                (dst, c), kinds = place(v + 1, P, vshape), ("SEND_F", "RECV_F")
            elif a.op == "B" and v > 0:
                (dst, c), kinds = place(v - 1, P, vshape), ("SEND_B", "RECV_B")
            else:
                continue
            if dst == r:  # the V's turn: the next stage is this rank's other chunk, nothing sent
                continue
            key = (end, r, f"{a.op}{a.chunk}.{a.mb}")  # the same on both ends of the message
            gaps[r][k + 1].append((key, Action(kinds[0], a.chunk, a.mb, dst)))
            gaps[dst][gap_for(dst, end)].append((key, Action(kinds[1], c, a.mb, r)))
    out = []
    for r, order in enumerate(orders):
        actions = []
        for k in range(len(order) + 1):
            actions += [a for _, a in sorted(gaps[r][k])]
            if k < len(order):
                actions.append(order[k])
        out.append(actions)
    return out


def build(schedule, P, M, V=1):
    """Every rank's full action list for one optimizer step; DeadlockError if it cannot run."""
    V = chunks_per_rank(schedule, V)
    return with_communication(SCHEDULES[schedule](P, M, V), P, V, schedule in VSHAPED)


def forward_only(P, M, V=1, vshape=False):
    """Evaluation's forwards: micro-batch by micro-batch, or down the V and back."""
    order = [Action("F", c, i) for c in range(V) for i in range(M)] if vshape else [
        Action("F", c, i) for i in range(M) for c in range(V)]
    return with_communication([order] * P, P, V, vshape)


def batches(actions):
    """A rank's actions as steps: a compute alone, or a run of p2p actions, posted as one batch."""
    out = []
    for a in actions:
        if a.op in SENDS + RECVS and out and out[-1][0].op in SENDS + RECVS:
            out[-1].append(a)
        else:
            out.append([a])
    return out


# ---------------------------------------------------------------- checks and timelines

def dependency(a, v, last):
    """(op, virtual stage, mb) that must finish before action a on stage v can start, or None."""
    if a.op == "F":
        return ("F", v - 1, a.mb) if v > 0 else None
    if a.op == "W":
        return ("B", v, a.mb)
    return ("B", v + 1, a.mb) if v < last else ("F", v, a.mb)


def simulate(orders, P, V, vshape=False, f=1, b=1, w=1):
    """Per rank, [(start, end, action)] of every compute, run once its rank and input are ready.
    F takes f ticks, B b, W w. A backward not split (no W in the orders) takes b + w."""
    last = P * V - 1
    ticks = {"F": f, "B": b if any(a.op == "W" for order in orders for a in order) else b + w,
             "W": w}
    finish = {}  # (op, virtual stage, mb) -> end tick
    free, pc = [0] * P, [0] * P
    timeline = [[] for _ in range(P)]
    while any(pc[r] < len(orders[r]) for r in range(P)):
        moved = False
        for r in range(P):
            while pc[r] < len(orders[r]):
                a = orders[r][pc[r]]
                v = stage_of(r, a.chunk, P, vshape)
                dep = dependency(a, v, last)
                if dep is not None and dep not in finish:
                    break
                start = max(free[r], finish.get(dep, 0))
                free[r] = finish[(a.op, v, a.mb)] = start + ticks[a.op]
                timeline[r].append((start, free[r], a))
                pc[r] += 1
                moved = True
        if not moved:
            raise DeadlockError(
                f"compute order deadlocks at {[str(orders[r][pc[r]]) for r in range(P)]}")
    return timeline
