"""A deadlock checker for pipeline action lists (parallel/pp_schedule.py), under NCCL's rules."""
from parallel.pp_schedule import COMPUTE, SENDS, DeadlockError, batches, dependency, place, stage_of


def check_no_deadlock(actions, P, V, vshape=False):
    """Runs the action lists under NCCL-like rules: each rank posts its p2p batches in order onto one
    stream; only the batch at the head of a stream makes progress; a send and the matching receive
    (the k-th on each (src, dst) channel) transfer when both are at their stream heads; a batch
    completes when all its ops have. Computes wait for their receives, or, when the stage they depend on is
    on the same rank (the V's turn, a W after its B), for that compute. Raises DeadlockError naming each
    rank's stuck action."""
    steps = [batches(a) for a in actions]
    pc, posted = [0] * P, [False] * P  # program counter; whether the current step's batch is posted
    stream = [[] for _ in range(P)]  # per rank, posted batches: lists of ops [kind, channel, index, done, action]
    received = [set() for _ in range(P)]  # completed receives as (op, chunk, mb)
    computed = set()  # (op, virtual stage, mb) of the computes that ran
    counts = {}  # (kind, src, dst) -> ops posted so far on that channel

    def post(r, batch):
        ops = []
        for a in batch:
            kind, channel = ("send", (r, a.peer)) if a.op in SENDS else ("recv", (a.peer, r))
            k = counts.get((kind, channel), 0)
            counts[(kind, channel)] = k + 1
            ops.append([kind, channel, k, False, a])
        stream[r].append(ops)

    def runnable(r, a):
        if a.op in COMPUTE:
            v = stage_of(r, a.chunk, P, vshape)
            dep = dependency(a, v, P * V - 1)
            if dep is None or place(dep[1], P, vshape)[0] == r:
                return dep is None or dep in computed
            return ("RECV_" + a.op, a.chunk, a.mb) in received[r]
        return True

    progress = True
    while progress:
        progress = False
        for r in range(P):  # each rank's program runs until it waits
            while pc[r] < len(steps[r]):
                step = steps[r][pc[r]]
                if step[0].op not in COMPUTE and not posted[r]:
                    post(r, step)
                    posted[r] = True
                if not runnable(r, step[0]):
                    break
                if step[0].op in COMPUTE:
                    computed.add((step[0].op, stage_of(r, step[0].chunk, P, vshape), step[0].mb))
                pc[r], posted[r], progress = pc[r] + 1, False, True
        heads = [stream[r][0] if stream[r] else [] for r in range(P)]
        for h in heads:
            for op in h:
                if op[0] == "send" and not op[3]:
                    dst = op[1][1]
                    match = [o for o in heads[dst] if o[0] == "recv" and o[1] == op[1] and o[2] == op[2]]
                    if match:
                        op[3] = match[0][3] = True
        for r in range(P):
            while stream[r] and all(op[3] for op in stream[r][0]):
                for op in stream[r].pop(0):
                    if op[0] == "recv":
                        received[r].add((op[4].op, op[4].chunk, op[4].mb))
                progress = True
    stuck = {r: str(steps[r][pc[r]][0]) if pc[r] < len(steps[r]) else "unfinished communication"
             for r in range(P) if pc[r] < len(steps[r]) or stream[r]}
    if stuck:
        raise DeadlockError(f"schedule deadlocks; stuck at {stuck}")
