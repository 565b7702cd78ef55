"""Pipeline schedules as plain data: for every stage, the ordered list of actions it runs.

A model of P·V virtual stages is spread round-robin over P ranks: rank r holds virtual stages
r, r+P, r+2P, ... as its local chunks 0, 1, ..., V-1. A schedule is first a compute order per rank
(forward / backward of micro-batch i on local chunk c); `with_communication` then adds the sends
and receives each compute implies (the executor knows the activation shape from the config, so
nothing else is exchanged). Nothing here touches torch: the executor in pp.py runs the lists,
and the tests check them (each (chunk, mb) once, forward before backward, sends match receives,
no deadlock even when a communication batch blocks its stream until every op in it is matched,
as NCCL's does). bench/pp_draw.py renders the timeline.
"""
import bisect
from typing import NamedTuple


class Action(NamedTuple):
    op: str  # F, B (compute); SEND_F, RECV_F, SEND_B, RECV_B (p2p)
    chunk: int = 0  # local chunk index on this rank
    mb: int = 0  # micro-batch
    peer: int = -1  # pp rank on the other end of a send or receive

    def __str__(self):
        peer = "" if self.peer < 0 else ("->" if self.op in SENDS else "<-") + str(self.peer)
        return f"{self.op}(c{self.chunk},m{self.mb}{peer})"


class DeadlockError(RuntimeError):
    pass


COMPUTE, SENDS, RECVS = ("F", "B"), ("SEND_F", "SEND_B"), ("RECV_F", "RECV_B")


def stage_of(rank, chunk, P):
    """The virtual stage a rank's local chunk runs."""
    return chunk * P + rank


def place(v, P):
    """(rank, local chunk) of virtual stage v."""
    return v % P, v // P


# ---------------------------------------------------------------- compute orders

def gpipe(P, M, V=1):
    """Every forward, then every backward (in reverse): M activation sets live on every stage."""
    fwd = [Action("F", c, i) for c in range(V) for i in range(M)]
    bwd = [Action("B", c, i) for c in reversed(range(V)) for i in reversed(range(M))]
    return [fwd + bwd for _ in range(P)]


def one_f_one_b(P, M, V=1):
    """PipeDream-flush: stage r runs P-r-1 warmup forwards, then alternates one forward and one
    backward (steady state), then drains the remaining backwards (cooldown). At most P in flight."""
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
    """Megatron's interleaved 1F1B: micro-batches go in groups of P through chunk 0, then chunk 1, ...
    (backwards through the chunks in reverse); warmup (P-r-1)·2 + (V-1)·P units, then 1F1B.
    Each chunk is 1/V of a stage, so the fill and drain shrink V times: bubble (P-1)/(V·M)."""
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


SCHEDULES = {"gpipe": gpipe, "1f1b": one_f_one_b, "interleaved": interleaved}


def theoretical_utilization(P, M, V=1):
    """Busy / (busy + bubble) with equal stages: M/(M+P-1), and VM/(VM+P-1) when interleaved."""
    return V * M / (V * M + P - 1)


# ---------------------------------------------------------------- communication

def with_communication(orders, P, V):
    """Adds the p2p actions the compute orders imply.

    Each message gets the tick at which an ideal run (`simulate`) produces it. The sender posts it
    right after the compute that makes it; the receiver posts its receive before its first compute
    that starts at or after that tick, so the transfer overlaps whatever the receiver is busy with.
    Every rank then posts its messages in order of (tick, message), one global order that respects
    every data dependency, so in-order streams cannot deadlock (tests/pp_deadlock.py verifies it).
    """
    last = P * V - 1
    timeline = simulate(orders, P, V)
    gaps = [[[] for _ in range(len(order) + 1)] for order in orders]  # gaps[r][k]: comm before compute k

    starts = [[start for start, _, _ in row] for row in timeline]  # increasing on each rank

    def gap_for(r, tick):
        return bisect.bisect_left(starts[r], tick)  # before the first compute starting at or after tick

    for r in range(P):
        for k, (_, end, a) in enumerate(timeline[r]):
            v = stage_of(r, a.chunk, P)
            if a.op == "F" and v < last:
                (dst, c), kinds = place(v + 1, P), ("SEND_F", "RECV_F")
            elif a.op == "B" and v > 0:
                (dst, c), kinds = place(v - 1, P), ("SEND_B", "RECV_B")
            else:
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
    """Every rank's full action list for one optimizer step."""
    return with_communication(SCHEDULES[schedule](P, M, V), P, V)


def forward_only(P, M, V=1):
    """Evaluation: forwards in micro-batch order through the chunks, no backward."""
    orders = [[Action("F", c, i) for i in range(M) for c in range(V)] for _ in range(P)]
    return with_communication(orders, P, V)


def batches(actions):
    """Groups a rank's actions into runnable steps: a compute alone, or a run of
    consecutive p2p actions, which the executor posts as one batch_isend_irecv."""
    out = []
    for a in actions:
        if a.op in SENDS + RECVS and out and out[-1][0].op in SENDS + RECVS:
            out[-1].append(a)
        else:
            out.append([a])
    return out


# ---------------------------------------------------------------- checks and timelines

def simulate(orders, P, V, f=1, b=2):
    """Start and end tick of every compute when each runs as soon as its rank is free and its input
    is ready (forward f ticks, backward b). Returns per rank a list of (start, end, action)."""
    last = P * V - 1
    finish = {}  # (op, virtual stage, mb) -> end tick
    free, pc = [0] * P, [0] * P
    timeline = [[] for _ in range(P)]
    while any(pc[r] < len(orders[r]) for r in range(P)):
        moved = False
        for r in range(P):
            while pc[r] < len(orders[r]):
                a = orders[r][pc[r]]
                v = stage_of(r, a.chunk, P)
                dep = (("F", v - 1, a.mb) if v > 0 else None) if a.op == "F" else (
                    ("B", v + 1, a.mb) if v < last else ("F", v, a.mb))
                if dep is not None and dep not in finish:
                    break
                start = max(free[r], finish.get(dep, 0))
                free[r] = finish[(a.op, v, a.mb)] = start + (f if a.op == "F" else b)
                timeline[r].append((start, free[r], a))
                pc[r] += 1
                moved = True
        if not moved:
            raise DeadlockError(f"compute order deadlocks at {[str(orders[r][pc[r]]) for r in range(P)]}")
    return timeline
