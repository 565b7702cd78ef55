"""The collective layer: thin wrappers over torch.distributed that count calls and bytes.

Every parallel file talks through a `Group` (one per mesh axis), never to torch.distributed
directly, so tests and benchmarks read the communication volume from one place.

Bytes are "sent by this rank" in ring terms, for a group of g ranks and a payload of N bytes:
- all-reduce: 2(g-1)/g · N  (a reduce-scatter then an all-gather);
- all-gather (N = the gathered output) and reduce-scatter (N = the full input): (g-1)/g · N;
- all-to-all (N = the local input): (g-1)/g · N;  send: N.
A group of one rank communicates nothing and counts nothing.
"""
from collections import defaultdict

import torch
import torch.distributed as dist

# Newer torch renames the single-tensor collectives and warns on the old names, which older torch only has
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

    def add(self, kind, group, nbytes):
        self.calls[kind] += 1
        self.bytes[kind] += nbytes
        self.log.append((kind, group, nbytes))

    @property
    def total_bytes(self):
        return sum(self.bytes.values())


def nbytes(t):
    return t.numel() * t.element_size()


class Group:
    """One process group of the mesh. `ranks` are global ranks; `rank` is this rank's index in it.

    The collectives run outside torch.compile (--compile): a compiled block breaks its graph around each,
    and dynamo never traces the counters, whose growing log would otherwise become a guard that fails, and
    recompiles the block, on every call."""

    def __init__(self, name, ranks, pg, global_rank, stats):
        self.name, self.ranks, self.pg, self.stats = name, list(ranks), pg, stats
        self.size = len(self.ranks)
        self.rank = self.ranks.index(global_rank)

    def __repr__(self):
        return f"Group({self.name}, ranks={self.ranks})"

    def _count(self, kind, n):
        self.stats.add(kind, self.name, n)

    @torch.compiler.disable
    def all_reduce(self, t, async_op=False):
        """Sum in place. (gloo has no AVG: callers divide.)"""
        if self.size == 1:
            return None
        self._count("all_reduce", 2 * (self.size - 1) / self.size * nbytes(t))
        return dist.all_reduce(t, group=self.pg, async_op=async_op)

    @torch.compiler.disable
    def all_gather(self, out, inp, async_op=False):
        """out: (size * n, ...) receives every rank's inp (n, ...) in rank order."""
        if self.size == 1:
            out.copy_(inp)
            return None
        self._count("all_gather", (self.size - 1) / self.size * nbytes(out))
        return ALL_GATHER(out, inp, group=self.pg, async_op=async_op)

    @torch.compiler.disable
    def reduce_scatter(self, out, inp, async_op=False):
        """Sums inp (size * n, ...) over ranks; this rank keeps its block of n rows in out."""
        if self.size == 1:
            out.copy_(inp)
            return None
        self._count("reduce_scatter", (self.size - 1) / self.size * nbytes(inp))
        return REDUCE_SCATTER(out, inp, group=self.pg, async_op=async_op)

    @torch.compiler.disable
    def all_to_all(self, out, inp):
        """Block i of inp (split along dim 0) goes to rank i; block j of out comes from rank j."""
        if self.size == 1:
            out.copy_(inp)
            return None
        self._count("all_to_all", (self.size - 1) / self.size * nbytes(inp))
        return dist.all_to_all_single(out, inp, group=self.pg)

    @torch.compiler.disable
    def send_recv(self, sends, recvs):
        """Batched p2p: sends/recvs are lists of (tensor, group index of the peer). Returns the requests."""
        ops = []
        for t, peer in sends:
            self._count("send", nbytes(t))
            ops.append(dist.P2POp(dist.isend, t, self.ranks[peer], group=self.pg))
        for t, peer in recvs:
            ops.append(dist.P2POp(dist.irecv, t, self.ranks[peer], group=self.pg))
        return dist.batch_isend_irecv(ops) if ops else []

    @torch.compiler.disable
    def broadcast(self, t, src=0):
        if self.size == 1:
            return None
        self._count("broadcast", nbytes(t))
        return dist.broadcast(t, self.ranks[src], group=self.pg)


def all_reduce_max(group, value, device="cpu"):
    """A Python float, maxed over the group (for flags and error checks, not counted as traffic)."""
    t = torch.tensor([float(value)], device=device)
    if group.size > 1:
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group.pg)
    return t.item()
