"""The collective layer: thin wrappers over torch.distributed that count calls and bytes.

Every parallel file talks through a `Group`, one per mesh axis, never to torch.distributed. So
tests and benchmarks read the communication volume from one place. Bytes are "sent by this rank"
in ring terms. A group has g ranks; the payload is N bytes.
- all-reduce: 2(g-1)/g · N, a reduce-scatter then an all-gather.
- all-gather (N = the gathered output), reduce-scatter (N = the full input): (g-1)/g · N.
- all-to-all (N = the local input): (g-1)/g · N.
- send: N.
`wait_s`, the exposed part: seconds this rank's thread spent in blocking calls, async launches and
Pending.wait. gloo's reduce-scatter does much of its work in the launch. p2p waits are not timed.
"""
import time
from collections import defaultdict

import torch
import torch.distributed as dist

# Newer torch renames the single-tensor collectives and warns on the old names; older has only those
ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class CommStats:
    """Calls and bytes sent per collective kind, since the last reset (one per rank)."""

    def __init__(self):
        self.reset()

    def reset(self):
        self.calls = defaultdict(int)
        self.bytes = defaultdict(float)
        self.log = []  # (kind, group name, bytes) in launch order, for tests that check ordering
        # ("launch" | "wait", index into log): when collectives start and finish (p2p: no wait)
        self.timeline = []
        self.wait_s, self.launched_at = 0.0, 0.0  # seconds blocked; when the last one was launched
        self.idle_s = 0.0  # seconds a pipeline stage waited for its neighbours (parallel/pp.py)

    def add(self, kind, group, nbytes):
        self.calls[kind] += 1
        self.bytes[kind] += nbytes
        self.log.append((kind, group, nbytes))
        self.timeline.append(("launch", len(self.log) - 1))
        self.launched_at = time.perf_counter()
        return len(self.log) - 1

    def in_flight(self):
        """Indexes of the collectives launched and not yet waited for."""
        waited = {i for event, i in self.timeline if event == "wait"}
        return [i for event, i in self.timeline if event == "launch" and i not in waited]

    @property
    def total_bytes(self):
        return sum(self.bytes.values())


class Pending:
    """An async collective in flight. wait() waits once, then runs `after` (gloo: sum to mean)."""

    def __init__(self, work, stats=None, index=None, after=None):
        self.work, self.stats, self.index, self.after = work, stats, index, after

    def wait(self):
        if self.work is not None:
            t0 = time.perf_counter()
            self.work.wait()
            self.work = None
            if self.stats is not None:
                self.stats.wait_s += time.perf_counter() - t0
                self.stats.timeline.append(("wait", self.index))
            if self.after is not None:
                self.after()


def nbytes(t):
    return t.numel() * t.element_size()


class Group:
    """One process group of the mesh. `ranks` are global ranks; `rank` is this rank's index in it.
    Collectives run outside torch.compile: a traced log would recompile the block every call."""

    def __init__(self, name, ranks, pg, global_rank, stats):
        self.name, self.ranks, self.pg, self.stats = name, list(ranks), pg, stats
        self.size = len(self.ranks)
        self.rank = self.ranks.index(global_rank)
        # gloo has no ReduceOp.AVG
        self.native_mean = pg is not None and dist.get_backend(pg) == "nccl"
        self.p2p_timeout = None  # gloo's, set by Mesh.set_timeout (see Requests)

    def __repr__(self):
        return f"Group({self.name}, ranks={self.ranks})"

    def _count(self, kind, n):
        return self.stats.add(kind, self.name, n)

    def _started(self, work, index, async_op, after=None):
        """An async launch returns its Pending handle. A blocking one is done: `after` runs now."""
        # the whole call, or an async launch
        self.stats.wait_s += time.perf_counter() - self.stats.launched_at
        if async_op:
            return Pending(work, self.stats, index, after)
        self.stats.timeline.append(("wait", index))  # a blocking call is done when it returns
        if after is not None:
            after()
        return None

    @torch.compiler.disable
    def all_reduce(self, t, async_op=False):
        """Sum in place."""
        if self.size == 1:
            return Pending(None) if async_op else None
        index = self._count("all_reduce", 2 * (self.size - 1) / self.size * nbytes(t))
        return self._started(dist.all_reduce(t, group=self.pg, async_op=async_op), index, async_op)

    @torch.compiler.disable
    def all_reduce_mean(self, t, async_op=False):
        """Mean in place: one AVG all-reduce on NCCL; elsewhere sum, then divide once done."""
        if self.size == 1:
            return Pending(None) if async_op else None
        index = self._count("all_reduce", 2 * (self.size - 1) / self.size * nbytes(t))
        if self.native_mean:
            return self._started(dist.all_reduce(t, op=dist.ReduceOp.AVG, group=self.pg,
                                                 async_op=async_op), index, async_op)
        work = dist.all_reduce(t, group=self.pg, async_op=async_op)
        return self._started(work, index, async_op, after=lambda: t.div_(self.size))

    @torch.compiler.disable
    def max_all_reduce(self, t):
        """Max in place, blocking (fp8.py's amaxes: a few floats). Counted as all_reduce_max."""
        if self.size == 1:
            return None
        index = self._count("all_reduce_max", 2 * (self.size - 1) / self.size * nbytes(t))
        return self._started(dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.pg), index,
                             async_op=False)

    @torch.compiler.disable
    def all_gather(self, out, inp, async_op=False):
        """out: (size * n, ...) receives every rank's inp (n, ...) in rank order."""
        if self.size == 1:
            out.copy_(inp)
            return Pending(None) if async_op else None
        index = self._count("all_gather", (self.size - 1) / self.size * nbytes(out))
        return self._started(ALL_GATHER(out, inp, group=self.pg, async_op=async_op), index,
                             async_op)

    @torch.compiler.disable
    def reduce_scatter(self, out, inp, async_op=False):
        """Sums inp (size * n, ...) over ranks; this rank keeps its block of n rows in out."""
        if self.size == 1:
            out.copy_(inp)
            return Pending(None) if async_op else None
        index = self._count("reduce_scatter", (self.size - 1) / self.size * nbytes(inp))
        return self._started(REDUCE_SCATTER(out, inp, group=self.pg, async_op=async_op), index,
                             async_op)

    @torch.compiler.disable
    def all_to_all(self, out, inp):
        """Block i of inp (split along dim 0) goes to rank i. Block j of out comes from rank j."""
        if self.size == 1:
            out.copy_(inp)
            return None
        index = self._count("all_to_all", (self.size - 1) / self.size * nbytes(inp))
        return self._started(dist.all_to_all_single(out, inp, group=self.pg), index,
                             async_op=False)

    @torch.compiler.disable
    def send_recv(self, sends, recvs):
        """Batched p2p. sends, recvs: [(tensor, the peer's group index)]. Returns the requests."""
        ops = []
        for t, peer in sends:
            self._count("send", nbytes(t))
            ops.append(dist.P2POp(dist.isend, t, self.ranks[peer], group=self.pg))
        for t, peer in recvs:
            ops.append(dist.P2POp(dist.irecv, t, self.ranks[peer], group=self.pg))
        return dist.batch_isend_irecv(ops) if ops else []

    def barrier(self):
        """Every rank of the group has reached this point (not counted: no payload)."""
        if self.size > 1:
            dist.barrier(group=self.pg)

    @torch.compiler.disable
    def broadcast(self, t, src=0):
        if self.size == 1:
            return None
        index = self._count("broadcast", nbytes(t))
        return self._started(dist.broadcast(t, self.ranks[src], group=self.pg), index,
                             async_op=False)


class Uncounted:
    """Counters of a tp Ring's twin Group: hops count nothing; the Ring counts their collective."""

    def add(self, kind, group, nbytes):
        return None


class Requests:
    """One batch of p2p requests as one handle. Given a timeout (gloo's), each wait is bounded by
    it: gloo's p2p keeps the timeout its group was made with, the start-up one, where NCCL's
    watchdog applies the group's current one."""

    def __init__(self, works, timeout=None):
        self.works, self.timeout = works, timeout

    def wait(self):
        for work in self.works:
            work.wait(self.timeout) if self.timeout else work.wait()

    def is_completed(self):
        return all(work.is_completed() for work in self.works)


class Ring:
    """A group as a ring (cp's ring attention, tp's rings). cp counts each hop as sends. tp
    (hops_counted=False) counts the collective its hops make (start, finish), each hop 0 bytes."""

    def __init__(self, group, hops_counted=True):
        self.group, self.size, self.rank, self.stats = group, group.size, group.rank, group.stats
        self.next, self.prev = (self.rank + 1) % self.size, (self.rank - 1) % self.size
        self.p2p = group if hops_counted else Group(group.name, group.ranks, group.pg,
                                                    group.ranks[group.rank], Uncounted())

    @torch.compiler.disable
    def hop(self, sends):
        """Sends each tensor to rank+1, receives one like it from rank-1: (received, a handle)."""
        received, counted = [torch.empty_like(t) for t in sends], self.p2p is self.group
        if not counted:  # tp: logged with 0 bytes, its wait timed
            self.stats.log.append(("hop", self.group.name, 0))
            self.stats.timeline.append(("launch", len(self.stats.log) - 1))
        works = self.p2p.send_recv([(t, self.next) for t in sends],
                                   [(t, self.prev) for t in received])
        if counted:
            return received, Requests(works, self.group.p2p_timeout)
        return received, Pending(Requests(works, self.group.p2p_timeout), self.stats,
                                 len(self.stats.log) - 1)

    @torch.compiler.disable
    def start(self, kind, full_nbytes):
        """Counts one all_gather or reduce_scatter of `full_nbytes`; returns its log index."""
        if self.size == 1:
            return None
        return self.stats.add(kind, self.group.name, (self.size - 1) / self.size * full_nbytes)

    @torch.compiler.disable
    def finish(self, index):
        if index is not None:
            self.stats.timeline.append(("wait", index))


def all_reduce_max(group, value, device="cpu"):
    """A Python float, maxed over the group: for flags and error checks, not counted as traffic."""
    t = torch.tensor([float(value)], device=device)
    if group.size > 1:
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group.pg)
    return t.item()


# ---------------------------------------------------------------- scalars over the world

def global_grad_norm(grads_and_replicas, world_group, also_sum=None):
    """The L2 norm of the full gradient, or (norm, also_sum summed over the world): a vector of
    per-rank counts rides on the same all-reduce. Each entry of grads_and_replicas is (grad, r):
    a tensor this rank holds and r, the ranks holding the same copy."""
    by_replicas = defaultdict(list)
    for g, replicas in grads_and_replicas:
        by_replicas[replicas].append(g)
    device = next((g.device for g, _ in grads_and_replicas), torch.device("cpu"))
    extra = 0 if also_sum is None else also_sum.numel()
    sums = torch.zeros(1 + extra, device=device, dtype=torch.float32)  # [sum of squares, *also_sum]
    for replicas, grads in by_replicas.items():
        sums[0] += torch.stack(torch._foreach_norm(grads, 2)).float().pow(2).sum() / replicas
    if also_sum is not None:
        sums[1:] = also_sum.reshape(-1)
    if world_group.size > 1:
        dist.all_reduce(sums, group=world_group.pg)  # a few scalars: not counted as traffic
    norm = sums[0].sqrt()
    return norm if also_sum is None else (norm, sums[1:])


def replica_mean(local_loss, mesh):
    """The global mean loss on the device: the tp-rank-0 ranks' local means, averaged over dp x cp.
    Gathered and summed in rank order, not all-reduced, so it does not depend on how many losses
    reduce at once. Only the last pipeline stage's losses are not zeros. Not counted as traffic."""
    if mesh.world == 1:
        return local_loss
    flat = local_loss.reshape(-1).contiguous()
    gathered = flat.new_empty(mesh.world * flat.numel())
    ALL_GATHER(gathered, flat, group=mesh.world_group.pg)
    gathered = gathered.view(mesh.world, -1)  # (world, n): row r is rank r's losses
    owners = range(0, mesh.world, mesh.tp)  # tp rank 0 of each tp group: tp is innermost
    total = gathered[owners[0]]
    for r in owners[1:]:
        total = total + gathered[r]
    return (total / mesh.dp_cp_group.size).reshape(local_loss.shape)
