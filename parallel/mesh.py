"""The 4D device mesh: rank <-> (dp, pp, cp, tp) coordinates and one process group per axis.

Ranks are laid out with tp innermost, then cp, then pp, and dp outermost, as in Llama 3.
    rank = ((dp_i · PP + pp_i) · CP + cp_i) · TP + tp_i.
So a tp group is TP consecutive ranks (one server's NVLink), and a dp group spans servers.

Besides the four axes there is `dp_cp`, the group gradients are synchronized over. CP ranks hold
the same weights and see different tokens. HSDP splits dp_cp into `shard` (inner, fast links) and
`replicate` (outer). With dp_shard = K, the dp coordinate is dp_i = rep_i · K + shard_i.
"""
from datetime import timedelta

import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from parallel.comm import CommStats, Group

AXES = ("dp", "pp", "cp", "tp")  # outermost -> innermost
SET_TIMEOUT = getattr(dist, "set_timeout", None) or c10d._set_pg_timeout  # older torch: private


class LayoutError(ValueError):
    """A bad parallel layout. `flag` names the command-line flag at fault."""

    def __init__(self, flag, message):
        super().__init__(f"{flag}: {message}")
        self.flag = flag


def infer_dp(world, tp=1, pp=1, cp=1, dp=None):
    """The dp degree: given, or world / (tp·pp·cp). LayoutError if it does not multiply out."""
    inner = tp * pp * cp
    for flag, n in (("--tp", tp), ("--pp", pp), ("--cp", cp)):
        if n < 1:
            raise LayoutError(flag, f"must be >= 1, got {n}")
    if dp is None:
        if world % inner:
            culprit = next((f for f, n in (("--pp", pp), ("--cp", cp), ("--tp", tp)) if world % n),
                           "--tp")
            raise LayoutError(culprit, f"tp·pp·cp = {tp}·{pp}·{cp} = {inner} does not divide "
                                       f"the world size {world}")
        return world // inner
    if dp < 1:
        raise LayoutError("--dp", f"must be >= 1, got {dp}")
    if dp * inner != world:
        raise LayoutError("--dp", f"dp·tp·pp·cp = {dp}·{tp}·{pp}·{cp} = {dp * inner} "
                                  f"!= world size {world}")
    return dp


class Mesh:
    def __init__(self, rank=0, world=1, dp=None, pp=1, cp=1, tp=1, dp_shard=None, timeout_s=300):
        self.dp = infer_dp(world, tp, pp, cp, dp)
        self.pp, self.cp, self.tp, self.world, self.global_rank = pp, cp, tp, world, rank
        self.dp_shard = dp_shard or self.dp
        if self.dp_shard < 1 or self.dp % self.dp_shard:
            raise LayoutError("--dp-shard",
                              f"dp_shard {self.dp_shard} does not divide dp {self.dp}")
        self.stats = CommStats()
        self.sizes = dict(dp=self.dp, pp=pp, cp=cp, tp=tp)
        self.coord = self.coords(rank)
        timeout, self.pgs = timedelta(seconds=timeout_s), []
        # Every rank creates every group, in the same order: torch.distributed's rule, and what
        # DeviceMesh does without communicator splitting. A rank outside a group gets a
        # placeholder back at once. The groups become attributes: dp_group, pp_group, cp_group,
        # tp_group, dp_cp_group, world_group, shard_group, replicate_group.
        for name, members in self.partitions():
            mine = None
            for g in members:
                pg = self._new_group(g, timeout)
                if rank in g:
                    mine = (g, pg)
            setattr(self, name + "_group", Group(name, mine[0], mine[1], rank, self.stats))

    def _new_group(self, ranks, timeout):
        if self.world == 1 or len(ranks) == 1 or not dist.is_initialized():  # a layout to describe
            return None
        if len(ranks) == self.world:
            return dist.group.WORLD
        pg = dist.new_group(ranks, timeout=timeout)
        if pg is not dist.GroupMember.NON_GROUP_MEMBER:
            self.pgs.append(pg)
        return pg

    def set_timeout(self, seconds):
        """How long this rank's collectives may wait from now on, in every group it belongs to.

        --startup-timeout for set-up and the first steps, --timeout after."""
        for pg in self.pgs + ([dist.group.WORLD] if self.world > 1 and dist.is_initialized()
                              else []):
            SET_TIMEOUT(timedelta(seconds=seconds), pg)

    def rank_of(self, dp=0, pp=0, cp=0, tp=0):
        return ((dp * self.pp + pp) * self.cp + cp) * self.tp + tp

    def coords(self, rank):
        tp = rank % self.tp
        cp = rank // self.tp % self.cp
        pp = rank // (self.tp * self.cp) % self.pp
        dp = rank // (self.tp * self.cp * self.pp)
        return dict(dp=dp, pp=pp, cp=cp, tp=tp)

    def groups_along(self, varying):
        """The ranks that share every coordinate but those in `varying`, as lists.

        Each list is ascending; the lists come in order of their first rank. O(world): every rank
        is placed once."""
        fixed = [a for a in AXES if a not in varying]
        groups = {}
        for rank in range(self.world):
            c = self.coords(rank)
            groups.setdefault(tuple(c[a] for a in fixed), []).append(rank)
        return list(groups.values())  # dicts keep insertion order: by first rank

    def partitions(self):
        """(name, list of rank lists) for every group kind, in a fixed order."""
        out = [(name, self.groups_along(varying)) for name, varying in (
            ("dp", ["dp"]), ("pp", ["pp"]), ("cp", ["cp"]), ("tp", ["tp"]), ("dp_cp", ["dp", "cp"]),
            ("world", list(AXES)))]
        K, shard, replicate = self.dp_shard, [], []
        for g in dict(out)["dp_cp"]:
            # g is ordered by (dp_i, cp_i); dp_i = rep_i·K + shard_i, so a shard group is K·CP
            # consecutive members and a replicate group takes every (K·CP)-th member.
            span = K * self.cp
            shard += [g[i:i + span] for i in range(0, len(g), span)]
            replicate += [g[i::span] for i in range(span)]
        out += [("shard", shard), ("replicate", replicate)]
        return out

    def describe(self, gpus_per_node=8):
        """For each axis: its degree, the ranks sharing rank 0's group, and the physical scope."""
        lines = [f"mesh: world {self.world} = dp {self.dp} x pp {self.pp} x cp {self.cp} "
                 f"x tp {self.tp}"
                 f" (tp innermost), {gpus_per_node} GPUs per server"]
        for name, members in self.partitions():
            if name == "world":
                continue
            g = members[0]
            nodes = {r // gpus_per_node for r in g}
            scope = "one GPU" if len(g) == 1 else (
                "inside one server" if len(nodes) == 1 else f"across {len(nodes)} servers")
            shown = g if len(g) <= 8 else g[:4] + ["..."] + g[-2:]
            lines.append(f"  {name:9s} size {len(g):4d}  {len(members):4d} groups  "
                         f"e.g. ranks {shown}  {scope}")
        return "\n".join(lines)
