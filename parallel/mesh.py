"""The 4D device mesh: rank <-> (dp, pp, cp, tp) coordinates and one process group per axis.

Ranks are laid out with tp innermost, then cp, then pp, and dp outermost, as in Llama 3.
    rank = ((dp_i · PP + pp_i) · CP + cp_i) · TP + tp_i.
So a tp group is TP consecutive ranks (one server's NVLink), and a dp group spans servers.

Besides the four axes there is `dp_cp`, the group gradients are synchronized over. CP ranks hold
the same weights and see different tokens. HSDP splits dp_cp into `shard` (inner, fast links) and
`replicate` (outer). With dp_shard = K, the dp coordinate is dp_i = rep_i · K + shard_i.
"""
import os
import re
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from parallel.comm import CommStats, Group

AXES = ("dp", "pp", "cp", "tp")  # outermost -> innermost
SET_TIMEOUT = getattr(dist, "set_timeout", None) or c10d._set_pg_timeout  # older torch: private


class LayoutError(ValueError):
    """A bad parallel layout. `flag` names the command-line flag at fault. Exit status 2."""
    exit_status = 2

    def __init__(self, flag, message):
        super().__init__(f"{flag}: {message}")
        self.flag, self.message = flag, message

    def __reduce__(self):  # whole across processes: the rehearsal's workers raise it
        return type(self), (self.flag, self.message)


def launcher(environ):
    """(RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE) as torchrun sets them (else one process),
    checked: integers, each rank inside its size."""
    values, names = {}, ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")
    for name, default in zip(names, (0, 1, 0, 1)):
        text = str(environ.get(name, default))
        if not text.isdigit():
            raise LayoutError(name, f"{text!r} is not a non-negative integer (the launcher's)")
        values[name] = int(text)
    for rank, size in (("RANK", "WORLD_SIZE"), ("LOCAL_RANK", "LOCAL_WORLD_SIZE")):
        if values[rank] >= values[size] and (size in environ or rank == "RANK"):
            raise LayoutError(rank, f"{values[rank]} is not a rank of {size} {values[size]}")
    return tuple(values.values())


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
        # Every rank creates every group, in the same order (torch.distributed's rule). Outside
        # one it gets a placeholder. Each becomes an attribute: dp_group, ..., replicate_group.
        for name, members in self.partitions():
            mine = None
            for g in members:
                pg = self._new_group(g, timeout, name)
                if rank in g:
                    mine = (g, pg)
            setattr(self, name + "_group", Group(name, mine[0], mine[1], rank, self.stats))

    def agree(self, values):
        """LayoutError unless every rank holds the same {flag: value}: the first flag that differs,
        its value on rank 0 and on a rank that differs. One all_gather_object, at start-up."""
        if self.world == 1 or not dist.is_initialized():
            return
        every = [None] * self.world
        dist.all_gather_object(every, values)
        for rank, theirs in enumerate(every):
            for name, value in every[0].items():
                if theirs.get(name) != value:
                    raise LayoutError(f"--{name.replace('_', '-')}", f"rank {rank} has "
                                      f"{theirs.get(name)!r}, rank 0 {value!r}: every rank must "
                                      "run the same command")

    def _new_group(self, ranks, timeout, name):
        if self.world == 1 or len(ranks) == 1 or not dist.is_initialized():  # a layout to describe
            return None
        if len(ranks) == self.world:
            return dist.group.WORLD
        pg = dist.new_group(ranks, timeout=timeout, group_desc=f"mesh_{name}")  # named in logs
        if pg is not dist.GroupMember.NON_GROUP_MEMBER:
            self.pgs.append(pg)
        return pg

    def set_timeout(self, seconds):
        """How long this rank's collectives may wait from now on (--startup-timeout, --timeout)."""
        for pg in self.pgs + ([dist.group.WORLD] if self.world > 1 and dist.is_initialized()
                              else []):
            SET_TIMEOUT(timedelta(seconds=seconds), pg)
        for group in vars(self).values():  # gloo's p2p waits are given it (comm.Requests)
            if isinstance(group, Group) and group.pg and dist.get_backend(group.pg) == "gloo":
                group.p2p_timeout = timedelta(seconds=seconds)

    def rank_of(self, dp=0, pp=0, cp=0, tp=0):
        return ((dp * self.pp + pp) * self.cp + cp) * self.tp + tp

    def coords(self, rank):
        tp = rank % self.tp
        cp = rank // self.tp % self.cp
        pp = rank // (self.tp * self.cp) % self.pp
        dp = rank // (self.tp * self.cp * self.pp)
        return dict(dp=dp, pp=pp, cp=cp, tp=tp)

    def groups_along(self, varying):
        """Ascending lists of the ranks that share every coordinate but `varying`, by first rank."""
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
            # g is ordered by (dp_i, cp_i): K·CP consecutive members share a shard group
            span = K * self.cp
            shard += [g[i:i + span] for i in range(0, len(g), span)]
            replicate += [g[i::span] for i in range(span)]
        out += [("shard", shard), ("replicate", replicate)]
        return out

    def describe(self, gpus_per_node=8, on_gpus=True):
        """For each axis: its degree, the ranks sharing rank 0's group, and the physical scope (of
        GPUs in servers, or of processes in machines)."""
        each, many, box = ("GPU", "GPUs", "server") if on_gpus else ("process", "processes",
                                                                     "machine")
        lines = [f"mesh: world {self.world} = dp {self.dp} x pp {self.pp} x cp {self.cp} "
                 f"x tp {self.tp} (tp innermost), {gpus_per_node} {many} per {box}"]
        for name, members in self.partitions():
            if name == "world":
                continue
            g = members[0]
            nodes = {r // gpus_per_node for r in g}
            scope = f"one {each}" if len(g) == 1 else (
                f"inside one {box}" if len(nodes) == 1 else f"across {len(nodes)} {box}s")
            shown = ", ".join(map(str, g if len(g) <= 8 else g[:4] + ["..."] + g[-2:]))
            lines.append(f"  {name:9s} size {len(g):4d}  {len(members):4d} groups  "
                         f"e.g. ranks {shown}  {scope}")
        return "\n".join(lines)


# ---------------------------------------------------------------- starting, and naming a hang

def init_process_group(backend, device, rank, world, timeout_s, trace_dir):
    """The default process group: gloo on CPU, NCCL on CUDA. NCCL's communicators are made now,
    not at first use. Its flight recorder dumps into trace_dir on a timeout."""
    options = {"device_id": torch.device(device)} if backend == "nccl" else {}
    if backend == "nccl":
        for name, value in flight_recorder(trace_dir).items():
            os.environ.setdefault(name, value)  # what the user set stays
    dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s), **options,
                            **restart_store(rank, world))


def flight_recorder(out):
    """NCCL's flight recorder: each rank's last collectives, dumped into `out` on a timeout."""
    return {"TORCH_NCCL_TRACE_BUFFER_SIZE": "20000", "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
            "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": str(Path(out) / "nccl_trace_rank_")}


def restart_store(rank, world):
    """init_process_group's store arguments: a key prefix per torchrun restart, else {}. The store
    outlives a failed attempt, and its keys name dead peers that new workers would wait on."""
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    if restart is None:
        return {}
    agent_hosts_it = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world,
                          is_master=rank == 0 and not agent_hosts_it, timeout=timedelta(minutes=5))
    return {"store": dist.PrefixStore(f"attempt_{restart}", store), "rank": rank,
            "world_size": world}


TIMED_OUT = re.compile(r"timed out|timeout", re.I)
PEER_LEFT = re.compile(r"connection (closed|reset) by peer", re.I)  # a peer that timed out first


def timed_out(error):
    """Whether an error is a collective timeout, or a peer lost to one (gloo's or NCCL's words)."""
    return isinstance(error, RuntimeError) and bool(TIMED_OUT.search(str(error)) or
                                                    PEER_LEFT.search(str(error)))


def name_the_hang(mesh, step, error, grace_s=6.0):
    """(One line for a timed-out collective, the ranks that posted nothing: frozenset, or None
    when the store does not answer). The line names the step, the collective, its group, its
    late ranks, and, past a late rank that waits in a collective of its own, the silent ones.

    Each rank that times out posts its collective and that collective's ranks to the store. A
    member that posts nothing in grace_s, or another collective, had not arrived; the ranks it
    waits for are followed until those that posted nothing. Rank 0 may host the store, so it
    leaves last, once every rank it read has read (grace_s at most)."""
    stats = mesh.stats
    waiting = stats.in_flight()
    if not waiting:
        return f"step {step + 1}: a collective timed out outside the counted ones", frozenset()
    index = waiting[0]
    kind, name, _ = stats.log[index]
    group = getattr(mesh, f"{name}_group", None)
    nth = sum(g == name for _, g, _ in stats.log[:index]) + 1  # the same on every member
    mine = f"{nth} {kind} {name}"
    members = list(group.ranks) if group else []
    where = f"step {step + 1}: {kind} #{nth} of the step on group {name}"
    how = "timed out" if TIMED_OUT.search(str(error)) else "lost a peer that timed out"
    try:
        store = dist.distributed_c10d._get_default_store()
        store.set(f"hang/{step}/{mesh.global_rank}", f"{mine} {','.join(map(str, members))}")
        posted = read_posts(store, step, members, grace_s)
        absent = [r for r in members if posted[r] is None or posted[r][0] != mine]
        silent = follow_to_silent(store, step, absent, posted, grace_s)
        store.set(f"hang/{step}/{mesh.global_rank}/read", "1")
        if mesh.global_rank == 0:
            wait_for(store, [f"hang/{step}/{r}/read" for r, p in posted.items() if p], grace_s)
    except (RuntimeError, ValueError):  # the store itself does not answer
        return (f"{where} {how}; the store does not answer, so which ranks are late is unknown",
                None)
    ranks = f"ranks {members[0]}..{members[-1]}" if len(members) > 2 else \
        f"ranks {members}" if group else "its ranks"
    late = ", ".join(f"{r}" if posted[r] is None else waiting_in(r, posted[r][0])
                     for r in absent) or "none (all arrived: look at the network)"
    beyond = sorted(silent - set(absent))
    return (f"{where} ({ranks}) {how}; had not arrived: rank {late}"
            + (f"; no word from rank {', '.join(map(str, beyond))}" if beyond else ""), silent)


def waiting_in(rank, post):
    nth, kind, group = post.split()
    return f"{rank} (waiting in {kind} #{nth} on group {group})"


def read_posts(store, step, ranks, grace_s):
    """{rank: (its collective, its collective's ranks), or None if it posted nothing in grace_s}."""
    keys = {r: f"hang/{step}/{r}" for r in ranks}
    wait_for(store, keys.values(), grace_s)
    posted = {}
    for r, k in keys.items():
        what, _, members = store.get(k).decode().rpartition(" ") if store.check([k]) else ("",) * 3
        posted[r] = (what, [int(m) for m in members.split(",") if m]) if what else None
    return posted


def follow_to_silent(store, step, late, posted, grace_s):
    """The ranks that posted nothing, found from `late` through the collectives each late rank
    waits in (a stopped rank keeps its tp peer waiting, which keeps the next stage waiting)."""
    silent, todo = set(), list(late)
    while todo:
        r = todo.pop()
        if posted[r] is None:
            silent.add(r)
            continue
        new = [m for m in posted[r][1] if m not in posted]
        posted.update(read_posts(store, step, new, grace_s))
        todo += new
    return frozenset(silent)


def wait_for(store, keys, seconds):
    """Until every key is in the store, or the seconds are up."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and not all(store.check([k]) for k in keys):
        time.sleep(0.05)
