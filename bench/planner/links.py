"""Links: which link a group of a layout gets, how long its bytes take, and what hiding them costs
(notation: layout.py; the factors: factors.py).

Ranks are ordered tp fastest, then cp, pp, dp (Llama 3; order=interleaved: rank r on node r % nodes, the ablation that
puts tp across nodes). A group inside one node uses NVLink (--intra-gbs, 450 GB/s per direction); a group with k
members per node drives k NICs: min(intra, k*inter), --inter-gbs 50 GB/s per GPU (400 Gb/s); gloo's single ring
crosses a node boundary on one NIC: min(intra, inter). Collectives reach the factor `bus` of that (1 with --measured:
the bandwidths are measured bus bandwidths) and pay the cluster's latency per ring step (--lat-intra-us 1,
--lat-inter-us 5; g-1 steps for all-gather, reduce-scatter, all-to-all; 2*log2 g for an all-reduce, NCCL's tree; 1
per send). On gloo a reduce-scatter takes as long as an all-reduce of its whole input: twice its ring bytes, an
all-reduce's steps.
Hidden communication still costs compute: the factor `tax` of its duration on NCCL (its kernels take SMs and HBM
bandwidth); on gloo a rank's own threads copy its bytes on its own cores at the loopback rate, so all of an
intra-node collective's time and intra/inter of an inter-node one's (tax()). An overlap no test or emulated run has
measured hidden is credited only the factor `credit` of what it would hide (hide()).
"""
import math
from functools import lru_cache

from bench.planner.factors import REFERENCE
from bench.planner.layout import GB, shard_size


def factors(cl):
    """The cluster's efficiency factors (step_time.py sets them per code), the reference's if none."""
    return cl.factors or REFERENCE


@lru_cache(maxsize=None)
def members_per_node(gpus_per_node, tp, cp, pp, dp, S, group, order="node"):
    """How many members of rank 0's `group` (tp, cp, pp, dp = dp x cp, shard, replica) share its node: ranks
    0..gpus_per_node-1, or every (world / gpus_per_node)-th rank under the interleaved order."""
    def key(r):  # rank -> (tp, cp, pp, dp) coordinates, tp fastest; equal keys share a group
        t, r = r % tp, r // tp
        c, r = r % cp, r // cp
        p, d = r % pp, r // pp
        pos = c + cp * d  # position in the dp x cp group
        return {"tp": (c, p, d), "cp": (t, p, d), "pp": (t, c, d), "dp": (t, p),
                "shard": (t, p, pos // S), "replica": (t, p, pos % S)}[group]
    world = tp * cp * pp * dp
    nodes = max(world // gpus_per_node, 1)
    mine = range(0, world, nodes) if order == "interleaved" else range(min(gpus_per_node, world))
    return sum(key(r) == key(0) for r in mine)


def link(cl, lay, group):
    """(bytes/s, seconds per ring step) one rank of `group` gets."""
    S = shard_size(lay)
    size = {"tp": lay.tp, "cp": lay.cp, "pp": lay.pp, "dp": lay.dp * lay.cp, "shard": S,
            "replica": lay.dp * lay.cp // S}[group]
    k = members_per_node(cl.gpus_per_node, lay.tp, lay.cp, lay.pp, lay.dp, S, group, lay.order)
    eff = 1.0 if cl.measured else factors(cl).bus
    if k == size:
        return eff * cl.intra_gbs * GB, cl.lat_intra_us * 1e-6
    nics = k if cl.backend == "nccl" else 1  # NCCL stripes a ring over the node's NICs; gloo's one ring uses one
    return eff * min(cl.intra_gbs, nics * cl.inter_gbs) * GB, cl.lat_inter_us * 1e-6


def seconds(cl, lay, group, nbytes, steps):
    """Time for one rank of `group` to send `nbytes` in `steps` dependent ring steps."""
    bw, lat = link(cl, lay, group)
    return nbytes / bw + steps * lat


def all_reduce_latency(cl, lay, group, size):
    """Seconds of one tiny blocking all-reduce over `size` ranks of `group`: 2*log2 of it latency steps."""
    return 2 * math.ceil(math.log2(size)) * link(cl, lay, group)[1] if size > 1 else 0.0


def tax(cl, lay, group):
    """Compute lost per second of `group`'s communication hidden under it. NCCL: the factor `tax` (its kernels take
    SMs). gloo: a rank's own threads copy its bytes, at the loopback rate, on its own cores: all of a collective
    inside a node, the loopback's share of one whose wire is slower."""
    if cl.backend == "nccl":
        return factors(cl).tax
    return min(1.0, link(cl, lay, group)[0] / (cl.intra_gbs * GB * (1.0 if cl.measured else factors(cl).bus)))


def hide(t_comm, window, lost, credit=1.0):
    """Exposed seconds of communication overlapped with `window` seconds of compute, `lost` per second hidden; an
    overlap credited only `credit` of what it would hide exposes the rest."""
    hidden = min(t_comm, window)
    return max(t_comm - window, 0.0) + hidden * (lost + (1.0 - credit) * (1.0 - lost))


def gloo_rs(cl, S):
    """(bytes on the wire, ring steps) of a reduce-scatter over S ranks, each over its ring terms': on gloo, whose
    reduce-scatter is an all-reduce of its whole input, 2 and an all-reduce's 2*log2 S steps over S-1
    (bench/results/cluster.md: at half the ring bytes, half the bus bandwidth; its smallest as slow as an
    all-reduce's); else 1, 1."""
    return (2, 2 * math.ceil(math.log2(S)) / (S - 1)) if cl.backend == "gloo" and S > 1 else (1, 1)


def clip_norm(cl, lay):
    """The clip's all-reduce of two floats over the world, blocking, once per step (optim.global_grad_norm): 2*log2
    of the world latency steps, over the network once the world spans nodes."""
    world = lay.tp * lay.cp * lay.pp * lay.dp
    lat = cl.lat_intra_us if world <= cl.gpus_per_node else cl.lat_inter_us
    return 2 * math.ceil(math.log2(world)) * lat * 1e-6
