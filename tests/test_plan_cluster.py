"""The planner's time terms that the emulated cluster (bench/cluster) checks: which link a group gets, what hidden
communication costs compute, the optimizer's update and the clip, gloo's reduce-scatter, hsdp's replica
all-reduces as parallel/fsdp.py chains them, the gradients' copies and the host's dispatches. Closed formulas and
one tiny model: fast, no cluster."""
from dataclasses import replace

import pytest
import torch

from bench.cluster.report import MODEL, misranked
from bench.cluster.worker import CountOps
from bench.planner import step_time
from bench.planner.layout import Cluster, Layout, Shape
from bench.planner.ours import fsdp_parts, replica_bytes
from config import parse_args
from model import GPT, PRESETS, param_counts
from train import model_config

TINY = PRESETS["tiny"]
# a 2-node CPU cluster as bench/cluster measures one: loopback 6x the NIC
GLOO = dict(gpus=4, gpus_per_node=2, hbm_gb=1000.0, peak_tflops=0.04, attn_tflops=0.015, hbm_tbs=0.005,
            intra_gbs=0.7, inter_gbs=0.12, lat_intra_us=1000.0, lat_inter_us=1700.0, backend="gloo", dtype_bytes=4,
            measured=True)


def bill(lay, batch=4, **cluster):
    return step_time.step_time(TINY, Cluster(**{**GLOO, **cluster}), lay, TINY.seq_len, batch, code="ours")


def test_ddp_updates_the_whole_replica_fsdp_and_hsdp_their_shard():
    no_clip = dict(lat_intra_us=0.0, lat_inter_us=0.0)
    ddp = bill(Layout(dp=4, micro=1), **no_clip)["optimizer"]
    fsdp = bill(Layout(dp=4, dp_mode="fsdp", micro=1), **no_clip)["optimizer"]
    hsdp = bill(Layout(dp=4, dp_mode="hsdp", shard=2, micro=1), **no_clip)["optimizer"]
    assert ddp == pytest.approx(step_time.OPT_BYTES * param_counts(TINY)[0] / (GLOO["hbm_tbs"] * 1e12), rel=0.01)
    assert (fsdp, hsdp) == (pytest.approx(ddp / 4), pytest.approx(ddp / 2))
    ref = step_time.step_time(TINY, Cluster(**GLOO), Layout(dp=4, micro=1), TINY.seq_len, 4, code="reference")
    assert ref["optimizer"] == 0.0  # Megatron's distributed optimizer: sharded, negligible


def test_the_clip_all_reduces_over_the_world_and_crosses_nodes_once_the_world_does():
    assert step_time.clip_norm(Cluster(**GLOO), Layout(dp=2)) == pytest.approx(2 * 1000e-6)  # 2 ranks inside a node
    assert step_time.clip_norm(Cluster(**GLOO), Layout(dp=4)) == pytest.approx(4 * 1700e-6)  # 4 ranks over 2 nodes
    assert step_time.clip_norm(Cluster(**GLOO), Layout()) == 0.0


def test_gloo_crosses_a_node_on_one_nic_nccl_stripes_over_the_nodes_nics():
    lay = Layout(dp=8, dp_mode="fsdp")  # 4 ranks of the group per node, 2 nodes
    wide = dict(gpus=8, gpus_per_node=4, intra_gbs=100.0, inter_gbs=1.0)
    gloo, nccl = Cluster(**{**GLOO, **wide}), Cluster(**{**GLOO, **wide, "backend": "nccl"})
    assert step_time.link(gloo, lay, "dp") == (pytest.approx(1e9), pytest.approx(1700e-6))
    assert step_time.link(nccl, lay, "dp") == (pytest.approx(4e9), pytest.approx(1700e-6))  # min(intra, 4 NICs)
    inside = Layout(dp=4, tp=2, dp_mode="hsdp", shard=2)  # tp and the shard group fill a node of 4
    assert (step_time.link(gloo, inside, "shard") == step_time.link(nccl, inside, "shard")
            == (pytest.approx(100e9), 1000e-6))


def test_gloo_hidden_communication_costs_its_copy_time_nccl_a_fixed_share():
    gloo, nccl = Cluster(**GLOO), Cluster(**{**GLOO, "backend": "nccl"})
    hsdp = Layout(dp=4, dp_mode="hsdp", shard=2)  # shard group inside a node, replicas across
    assert step_time.tax(gloo, hsdp, "shard") == 1.0  # loopback: the rank's own core copies every byte
    # the copies at loopback speed, the wire slower
    assert step_time.tax(gloo, hsdp, "replica") == pytest.approx(0.12 / 0.7)
    assert step_time.tax(nccl, hsdp, "shard") == step_time.tax(nccl, hsdp, "replica") == step_time.OVERLAP_TAX


def test_gloo_reduce_scatter_is_an_all_reduce_in_bytes_and_steps():
    assert step_time.gloo_rs(Cluster(**GLOO), 4) == (2, pytest.approx(4 / 3))  # 2 log2 4 steps for 3
    assert step_time.gloo_rs(Cluster(**{**GLOO, "backend": "nccl"}), 4) == (1, 1)


def replica_seconds(cl, lay, s):
    """Each unit's replica all-reduce in backward order: head, blocks, embedding."""
    d, S, R = TINY.d_model, lay.shard, lay.dp // lay.shard
    block = s.p_layer
    units = [s.p_embed + d] + [block] * TINY.n_layer + [s.p_embed]
    return [step_time.seconds(cl, lay, "replica", replica_bytes(n, S, R), 2) for n in units]


def test_hsdp_replica_all_reduces_chain_each_under_one_units_backward():
    cl, lay = Cluster(**GLOO), Layout(dp=4, dp_mode="hsdp", shard=2, micro=1)
    s = Shape(TINY, lay, TINY.seq_len, 4, "ours")
    (layers, params, embed, head, _), = s.stages()
    r = replica_seconds(cl, lay, s)
    lost = step_time.tax(cl, lay, "replica")

    def chain(t_layer):
        return step_time.replica_chain(s, cl, layers, params, embed, head, t_layer, h=0.5)
    assert chain(0.0) == pytest.approx(sum(r))  # no compute: all exposed
    # however long the backward, the last block's, the one before (under the embedding's index add) and the
    # embedding's are waited for with nothing left to hide under; each other one hides under one unit's backward
    assert chain(1e3) == pytest.approx(sum(r[-3:]) + lost * sum(r[:-3]))
    # one unit's backward a little shorter than a block's all-reduce: every block's shows its excess
    t = 1.5 * 0.9 * r[1]  # 2/3 of t_layer is 0.9 of a block's all-reduce
    assert chain(t) > sum(r[-3:]) + 2 * 0.1 * r[1]
    # through step_time: hsdp's dp term is the shard group's (an fsdp over 2 ranks with the same per-rank work)
    # plus the chain
    fsdp_in_a_node = bill(Layout(dp=2, dp_mode="fsdp", micro=1), batch=2)["dp"]
    assert bill(lay)["dp"] - fsdp_in_a_node > sum(r[-3:])


def test_a_ranking_miss_counts_only_where_every_round_measured_the_other_order():
    """cluster_report.misranked: predicted a < b but every round of b faster than every round of a is a miss; when
    the rounds' spreads overlap the run cannot order the pair, and it is not."""
    meas = {"a": (1.2, 0.0, (1.15, 1.25), 0.0), "b": (1.0, 0.0, (0.95, 1.05), 0.0), "c": (1.1, 0.0, (1.0, 1.3), 0.0)}
    preds = {"a": 0.9, "b": 1.0, "c": 1.05}
    assert misranked(meas, preds) == [("a", "b")]  # a vs c and b vs c overlap: ties


def dispatched_ops(n_layer):
    """Aten ops of one forward and backward of the cluster's model with n_layer blocks (its rope cache warm)."""
    torch.manual_seed(0)
    model = GPT(replace(model_config(parse_args(MODEL), 0), n_layer=n_layer))
    x, y = torch.randint(0, 256, (1, 16)), torch.randint(0, 256, (1, 16))
    model(x, y).backward()
    with CountOps() as counted:
        model(x, y).backward()
    return counted.n


def test_the_host_ops_the_planner_prices_are_the_ops_the_model_dispatches():
    one, three = dispatched_ops(1), dispatched_ops(3)
    assert (three - one) / 2 == step_time.HOST_OPS_LAYER
    assert one - step_time.HOST_OPS_LAYER == step_time.HOST_OPS_REST


def test_a_cpu_device_pays_every_dispatch_in_line_a_gpu_none():
    lay = Layout(micro=1)  # one process: no communication
    cpu, gpu = bill(lay, batch=3, host_us=10.0), bill(lay, batch=3)
    ops = 3 * (TINY.n_layer * step_time.HOST_OPS_LAYER + step_time.HOST_OPS_REST)  # 3 micro-batches
    assert cpu["total"] - gpu["total"] == pytest.approx(ops * 10e-6)


def test_gradients_are_copied_once_per_micro_batch_and_gloo_copies_the_reduce_scatters_input_again():
    fp32, bf16 = Cluster(**GLOO), Cluster(**{**GLOO, "dtype_bytes": 2, "backend": "nccl"})
    assert step_time.landing_bytes(fp32, Layout(dp=4), 3) == 3 * 12  # autograd adds into the bucket views
    assert step_time.landing_bytes(fp32, Layout(dp=4, dp_mode="fsdp"), 3) == 3 * (8 + 8)
    assert step_time.landing_bytes(fp32, Layout(dp=4, dp_mode="fsdp", accumulate="unsharded"), 3) == 3 * 12 + 8
    # bf16 into fp32, NCCL reads in place
    assert step_time.landing_bytes(bf16, Layout(dp=4, dp_mode="fsdp"), 3) == 3 * 6
    lay = Layout(dp=4, dp_mode="fsdp", micro=1)
    assert bill(lay)["grads"] == pytest.approx(16 * param_counts(TINY)[0] / (GLOO["hbm_tbs"] * 1e12), rel=0.01)


def test_fsdp_with_nothing_to_hide_under_exposes_each_collective_once():
    """The step's first gather and last reduce-scatter are exposed; they must not also be charged as hidden."""
    cl = Cluster(**{**GLOO, "peak_tflops": 1e9, "attn_tflops": 1e9, "hbm_tbs": 1e9})  # no compute to hide under
    for lay in (Layout(dp=4, dp_mode="fsdp", micro=1), Layout(dp=2, pp=2, dp_mode="fsdp", micro=1)):
        s = Shape(TINY, lay, TINY.seq_len, 4, "ours")
        wire, steps = step_time.gloo_rs(cl, lay.dp)  # the fsdp group: every dp rank
        comm = []
        for layers, params, embed, head, _ in s.stages():
            parts = fsdp_parts(s, layers, params, embed, head, w_bytes=4)[0]
            (gb, gs), (rb, rs) = parts["gather"], parts["reduce"]
            comm.append(step_time.seconds(cl, lay, "dp", gb, gs)
                        + step_time.seconds(cl, lay, "dp", rb * wire, rs * steps))
        assert step_time.step_time(TINY, cl, lay, TINY.seq_len, 4, code="ours")["dp"] == pytest.approx(max(comm))
