"""Tensor parallel's communication overlap (parallel/tp_overlap.py), read from the collective layer.

A TorchDispatchMode records every matmul and every p2p send of one forward and backward, each stamped with how many
entries the comm layer's timeline (launches and waits) had then, so a collective's window (launch to wait) holds
the matmuls that ran while it was in flight. Checked on 2 and 4 gloo ranks against overlap=False and one process.
"""
from collections import namedtuple

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import model
from bench.ranks import run_ranks
from parallel import ckpt, has_tp_partial_grad, tp, tp_overlap, tp_shard_of
from parallel.materialize import init_weights
from parallel.mesh import Mesh
from tests.jobs import Failed, run_jobs

CFG = model.ModelConfig(n_layer=2, d_model=64, n_head=8, n_kv_head=4, ffn_dim=96, vocab_size=257, seq_len=16)
B = 2
MATMULS = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default}
Event = namedtuple("Event", "kind at storages shape")  # at: len(timeline) when it ran


def storages(args):
    tensors = [t for a in args for t in (a if isinstance(a, (list, tuple)) else [a]) if isinstance(t, torch.Tensor)]
    return frozenset(t.untyped_storage().data_ptr() for t in tensors)


class Recorder(TorchDispatchMode):
    """Matmuls (with the storages they read and the shape they make) and p2p sends (the storages they send)."""

    def __init__(self, stats):
        super().__init__()
        self.stats, self.events = stats, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in MATMULS:
            self.events.append(Event("matmul", len(self.stats.timeline), storages(args), tuple(out.shape)))
        elif func is torch.ops.c10d.send.default:
            self.events.append(Event("send", len(self.stats.timeline), storages(args[:1]), None))
        return out


def _gpt(mesh, sp, overlap, policy="none"):
    with torch.device("meta"):
        m = model.GPT(CFG)
    if mesh.tp > 1:  # as train.py builds it; the ring as with --sp-ring
        tp.parallelize(m, mesh, sequence_parallel=sp)
        tp_overlap.fuse_columns(m, overlap=overlap)
        if sp and overlap:
            tp_overlap.rings(m)
    return init_weights(ckpt.apply(m, policy), 0, "cpu")


def _ids():
    return torch.randint(0, CFG.vocab_size, (B, CFG.seq_len + 1), generator=torch.Generator().manual_seed(1))


def _timeline_rank(rank, world, sp, overlap):
    """One forward and backward under the Recorder: the comm log and timeline, the events, where forward ended."""
    mesh = Mesh(rank, world, tp=world)
    m, ids = _gpt(mesh, sp, overlap), _ids()
    mesh.stats.reset()
    with Recorder(mesh.stats) as recorder:
        loss = m(ids[:, :-1], ids[:, 1:])
        forward_end = len(mesh.stats.timeline)
        loss.backward()
    return dict(log=mesh.stats.log, timeline=mesh.stats.timeline, events=recorder.events, forward_end=forward_end,
                calls=dict(mesh.stats.calls), bytes=dict(mesh.stats.bytes), loss=loss.item())


class MatmulFlops(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.flops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default):
            self.flops += 2 * args[-2].shape[0] * args[-2].shape[1] * args[-1].shape[1]
        return func(*args, **(kwargs or {}))


def _recompute_rank(rank, world):
    """Under --sp with activation checkpointing: the collectives and matmul FLOPs of a forward and backward."""
    out = {}
    for policy in ("full", "selective"):
        for overlap in (True, False):
            mesh = Mesh(rank, world, tp=world)
            m, ids = _gpt(mesh, True, overlap, policy), _ids()
            mesh.stats.reset()
            with MatmulFlops() as counter:
                m(ids[:, :-1], ids[:, 1:]).backward()
            out[policy, overlap] = dict(calls=dict(mesh.stats.calls), bytes=dict(mesh.stats.bytes), flops=counter.flops)
    return out


def _grads_rank(rank, world):
    """Loss and every gradient, tp (sp and overlap on and off) against one process, as relative errors."""
    ids = _ids()
    one = _gpt(Mesh(), False, True)
    ref = one(ids[:, :-1], ids[:, 1:])
    ref.backward()
    out = {}
    for sp in (False, True):
        for overlap in (True, False):
            mesh = Mesh(rank, world, tp=world)
            m = _gpt(mesh, sp, overlap)
            loss = m(ids[:, :-1], ids[:, 1:])
            loss.backward()
            errors = {}
            for name, p in m.named_parameters():
                expected, grad = one.get_parameter(name).grad, p.grad.clone()
                if tp_shard_of(p):
                    dim, r, n = tp_shard_of(p)
                    expected = expected.chunk(n, dim)[r]
                elif has_tp_partial_grad(p):
                    mesh.tp_group.all_reduce(grad)  # each rank holds its tokens' share
                errors[name] = ((grad - expected).abs().max() / expected.abs().max()).item()
            out[sp, overlap] = dict(loss=loss.item(), ref=ref.item(), errors=errors)
    return out


@pytest.fixture(scope="module")
def runs():
    jobs = [(("timeline", sp, on), _timeline_rank, (sp, on)) for sp in (False, True) for on in (True, False)]
    jobs += [("grads", _grads_rank, ()), ("recompute", _recompute_rank, ())]
    return {world: run_ranks(run_jobs, world, args=(jobs,), timeout=600) for world in (2, 4)}


def result(runs, world, key):
    per_rank = [r[key] for r in runs[world]]
    for rank, r in enumerate(per_rank):
        if isinstance(r, Failed):
            pytest.fail(f"rank {rank} of {world} failed in {key}:\n{r}")
    return per_rank


def windows(r, kinds, part=None):
    """For each logged collective of one of `kinds` (in launch order), the events recorded while it was in flight.
    part: "forward" or "backward" keeps those launched there."""
    span = {}  # log index -> [launch, wait] positions in the timeline
    for position, (event, index) in enumerate(r["timeline"]):
        span.setdefault(index, [None, None])[event == "wait"] = position
    keep = {None: lambda launch: True, "forward": lambda launch: launch < r["forward_end"],
            "backward": lambda launch: launch >= r["forward_end"]}[part]
    return [[e for e in r["events"] if launch < e.at <= wait] for index, (launch, wait) in sorted(span.items())
            if r["log"][index][0] in kinds and keep(launch)]


def matmuls(window):
    return [e for e in window if e.kind == "matmul"]


def sends_multiplied(window):
    """The hop's sent tensor is multiplied while the hop is in flight (it was launched before that matmul)."""
    sent = frozenset().union(*(e.storages for e in window if e.kind == "send"))
    return any(e.storages & sent for e in matmuls(window))


# ---------------------------------------------------------------- --sp: the rings

@pytest.mark.parametrize("world", [2, 4])
def test_sp_ring_sends_each_chunk_before_multiplying_it(world, runs):
    """Forward: each of the t-1 hops of every column-parallel gather (2L+1 of them) sends the chunk in hand, then
    that chunk is multiplied, then the hop is waited for; backward, every row-parallel gradient gather (2L) does
    the same. Every hop has a matmul under it. Without overlap: no hops."""
    L = CFG.n_layer
    for r in result(runs, world, ("timeline", True, True)):
        hops = windows(r, {"hop"})
        assert hops, "no ring hops"
        assert all(matmuls(w) for w in hops), "a hop with no matmul under it"
        assert sum(map(sends_multiplied, windows(r, {"hop"}, "forward"))) == (2 * L + 1) * (world - 1)
        assert sum(map(sends_multiplied, windows(r, {"hop"}, "backward"))) == 2 * L * (world - 1)
    for r in result(runs, world, ("timeline", True, False)):
        assert not windows(r, {"hop"})


@pytest.mark.parametrize("world", [2, 4])
def test_sp_collectives_travel_under_matmuls_with_the_same_bytes_and_losses(world, runs):
    """Every sequence all-gather and reduce-scatter next to a matmul is in flight under matmuls; only the
    embedding's (its reduce-scatter forward, all-gather backward) and the loss's all-gather are not. The comm
    layer counts the same calls and bytes as without overlap, and the loss is the same."""
    on = result(runs, world, ("timeline", True, True))
    for r in on:
        alone = [w for w in windows(r, {"all_gather", "reduce_scatter"}) if not matmuls(w)]
        assert len(alone) == 3, f"{len(alone)} of {len(windows(r, {'all_gather', 'reduce_scatter'}))} with no matmul"
    for r, r_off in zip(on, result(runs, world, ("timeline", True, False))):
        assert all(not matmuls(w) for w in windows(r_off, {"all_gather", "reduce_scatter"}))
        assert r["calls"] == r_off["calls"]
        assert r["bytes"] == pytest.approx(r_off["bytes"], rel=1e-12)
        assert r["loss"] == pytest.approx(r_off["loss"], rel=1e-6)


# ---------------------------------------------------------------- without --sp: f's all-reduce

@pytest.mark.parametrize("world", [2, 4])
def test_input_grad_all_reduce_runs_under_the_weight_grad_matmuls(world, runs):
    """Backward of each column-parallel group: the all-reduce of the summed input gradient is launched before
    the group's weight-gradient matmuls ((out/t, d) each: lm_head; gate, up; q, k, v, layer by layer from the
    top) and waited for after them, with nothing else under it. overlap=False: it blocks."""
    d, hd, t = CFG.d_model, CFG.head_dim, world
    attention = [(CFG.n_head * hd // t, d)] + [(CFG.n_kv_head * hd // t, d)] * 2
    expected = [[(CFG.padded_vocab // t, d)]] + [[(CFG.ffn_dim // t, d)] * 2, attention] * CFG.n_layer
    for r in result(runs, world, ("timeline", False, True)):
        assert [[e.shape for e in matmuls(w)] for w in windows(r, {"all_reduce"}, "backward")] == expected
    for r, r_on in zip(result(runs, world, ("timeline", False, False)), result(runs, world, ("timeline", False, True))):
        assert all(not w for w in windows(r, {"all_reduce"}))
        assert (r["calls"], r["loss"]) == (r_on["calls"], pytest.approx(r_on["loss"], rel=1e-6))
        assert r["bytes"] == pytest.approx(r_on["bytes"], rel=1e-12)


# ---------------------------------------------------------------- the same numbers

@pytest.mark.parametrize("world", [2, 4])
def test_every_mode_matches_one_process(world, runs):
    """Loss and every gradient (this rank's block of it; sequence-parallel norm weights summed over tp) equal one
    process, with and without --sp, overlap on and off."""
    for r in result(runs, world, "grads"):
        assert len(r) == 4
        for mode, got in r.items():
            assert got["loss"] == pytest.approx(got["ref"], rel=1e-5), mode
            worst = max(got["errors"].items(), key=lambda kv: kv[1])
            assert worst[1] < 1e-5, (mode, worst)


@pytest.mark.parametrize("world", [2, 4])
def test_checkpointed_blocks_recompute_what_they_did_without_overlap(world, runs):
    """A recomputed block (--ckpt full, selective) stops once its last saved tensor is back: with the rings too,
    before the last row-parallel matmul and its reduce-scatter, so recompute repeats the same collectives and
    matmul FLOPs as without overlap (the planner's count, and ckpt.recomputed_layers)."""
    for r in result(runs, world, "recompute"):
        for policy in ("full", "selective"):
            on, off = r[policy, True], r[policy, False]
            assert (on["calls"], on["flops"]) == (off["calls"], off["flops"]), policy
            assert on["bytes"] == pytest.approx(off["bytes"], rel=1e-12), policy
