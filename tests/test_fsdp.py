"""FSDP/HSDP internals on 4 gloo ranks: sharded memory (L13), prefetch and reduce-scatter ordering (L14, L16),
the embedding and head units' prefetch and HSDP's replica all-reduce under backward (the collective timeline),
shard-by-shard init equal to one process (no rank builds the whole model), state round trip, bf16 traffic,
grad-norm replica counts.
One set of ranks runs every check (module fixture); each test asserts one property."""
import gc
import warnings
import weakref

import numpy as np
import pytest
import torch
from torch import nn

import model
import train
from bench.ranks import run_ranks
from parallel import ckpt
from parallel.comm import global_grad_norm
from parallel.fsdp import FSDP
from parallel.hsdp import HSDP
from parallel.materialize import init_weights, local_init
from parallel.mesh import Mesh
from tests.counting import fsdp_gathers
from tests.memory import storage_bytes
from tests.wrapper_state import full_state, load_full_state

# sizes chosen so units do not divide by 4 (padding) and one rank's shard straddles matrices and vectors
CFG = model.ModelConfig(n_layer=4, d_model=18, n_head=3, n_kv_head=1, ffn_dim=31, vocab_size=64, seq_len=16)
SEED = 5


def tiny_gpt(mark=None):
    with torch.device("meta"):
        gpt = model.GPT(CFG)
    for name, p in gpt.named_parameters():
        if mark:
            mark(name, p)
    return nn.ModuleList([gpt])


def init_param(name, p, flat=None, out=None):
    return local_init(name, p, CFG, SEED, flat, out)


def batch(rank):
    x = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(rank))
    return x, x.roll(-1, 1)




def memory_check(rank, world, mesh):
    fsdp = FSDP(tiny_gpt(), mesh, mesh.dp_cp_group, init_param, "cpu")
    opt = train.make_adamw(fsdp.optim_params(), 1e-3, 0.1, "cpu")
    gathered_peak = [0]

    def count_gathered(*_):
        gathered_peak[0] = max(gathered_peak[0], sum(u.full is not None or u.pending is not None for u in fsdp.units))
    for block in fsdp.module[0].layers.values():
        block.register_forward_hook(count_gathered)
        block.register_full_backward_hook(count_gathered)
    fsdp.module[0](*batch(rank)).backward()
    fsdp.finish_grad_sync()
    opt.step()
    params = fsdp.optim_params()
    state = [v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    gc.collect()
    with warnings.catch_warnings():  # isinstance() on some module objects warns about deprecations
        warnings.simplefilter("ignore")
        everything = storage_bytes(o for o in gc.get_objects() if isinstance(o, torch.Tensor))
    return dict(param=storage_bytes(params), grad=storage_bytes(p.grad for p in params),
                optim=storage_bytes(s for s in state if s.numel() > 1), steps=storage_bytes(s for s in state
                                                                                         if s.numel() == 1),
                everything=everything, padded=sum(u.padded for u in fsdp.units), gathered_peak=gathered_peak[0],
                gathered_left=[u.name for u in fsdp.units if u.full is not None or u.pending is not None])


def order_check(rank, world, mesh, overlap, policy="none"):
    """The collective log with markers: when each block's forward and backward finished. policy: --ckpt's."""
    chunks = tiny_gpt()
    ckpt.apply(chunks[0], policy)
    fsdp = FSDP(chunks, mesh, mesh.dp_cp_group, init_param, "cpu", overlap=overlap)
    gpt, stats = fsdp.module[0], mesh.stats
    for name, block in gpt.layers.items():
        block.register_forward_hook(lambda m, i, o, n=name: stats.log.append((f"forward done {n}", "", 0)))
        block.register_full_backward_hook(lambda m, gi, go, n=name: stats.log.append((f"backward done {n}", "", 0)))
    mesh.stats.reset()
    with fsdp_gathers() as all_gathers:
        gpt(*batch(rank)).backward()
    in_flight = len(stats.in_flight())
    fsdp.finish_grad_sync()
    return dict(log=[kind for kind, _, _ in mesh.stats.log], in_flight_after_backward=in_flight,
                all_gathers=dict(all_gathers))


def overlap_check(rank, world, cls, mesh, micro_batches=2):
    """Two micro-batches stepped as train.py does; the timeline gets a ("mark", "<micro-batch> fwd|bwd <block>")
    event as each block's forward and backward is done. Returns the timeline, the log it indexes, what was in flight
    as backward ended, and each unit's padded size by the names of its params."""
    wrapper = cls(tiny_gpt(), mesh, mesh.shard_group, init_param, "cpu")
    gpt, stats = wrapper.module[0], mesh.stats
    mb = [0]
    for name, block in gpt.layers.items():
        block.register_forward_hook(lambda m, i, o, n=name: stats.timeline.append(("mark", f"{mb[0]} fwd {n}")))
        block.register_full_backward_hook(lambda m, gi, go, n=name: stats.timeline.append(("mark", f"{mb[0]} bwd {n}")))
    stats.reset()
    for mb[0] in range(micro_batches):
        wrapper.sync_grads = mb[0] == micro_batches - 1
        (gpt(*batch(rank * micro_batches + mb[0])) / micro_batches).backward()
    in_flight = [stats.log[i][:2] for i in stats.in_flight()]
    wrapper.finish_grad_sync()
    return dict(timeline=list(stats.timeline), log=list(stats.log), in_flight=in_flight, calls=dict(stats.calls),
                padded={s[2]: u.padded for u in wrapper.units for s in u.slots}, shard=wrapper.group.size)


def init_and_state_check(rank, world, mesh):
    live, peak = [], [0]

    def tracked_init(name, p, flat=None, out=None):
        t = init_param(name, p, flat)  # a new tensor, so its size is seen; FSDP asks for it in place
        live.append(weakref.ref(t))
        peak[0] = max(peak[0], sum(r().numel() for r in live if r() is not None))
        return t if out is None else out.copy_(t)
    fsdp = FSDP(tiny_gpt(), mesh, mesh.dp_cp_group, tracked_init, "cpu")
    left = [n for n, _ in fsdp.module.named_parameters() if "fsdp_shard" not in n]
    state = full_state(fsdp)
    full = init_weights(tiny_gpt()[0], SEED, "cpu").state_dict()
    load_full_state(fsdp, {k: v + 1 for k, v in full.items()})  # every rank loads the full state
    reloaded = full_state(fsdp)
    as_numpy = lambda d: {k: v.numpy() for k, v in d.items()}  # tensors cannot outlive their rank's process
    return dict(state=as_numpy(state), reloaded=as_numpy(reloaded), full=as_numpy(full),
                peak_live=peak[0], local_numel=sum(p.numel() for p in fsdp.module.parameters()),
                largest_shard=max(unit.shard_numel for unit in fsdp.units),
                original_params_left=left)


def bf16_check(rank, world, mesh, reduce_dtype):
    fsdp = FSDP(tiny_gpt(), mesh, mesh.dp_cp_group, init_param, "cpu", compute_dtype=torch.bfloat16,
                reduce_dtype=reduce_dtype)
    gpt = fsdp.module[0]
    seen = []
    gpt.layers["0"].mlp.up_proj.register_forward_pre_hook(lambda m, i: seen.append(m.weight.dtype))
    mesh.stats.reset()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = gpt(*batch(rank))
    loss.backward()
    fsdp.finish_grad_sync()
    return dict(bytes=dict(mesh.stats.bytes), padded=sum(u.padded for u in fsdp.units), weight_dtype=str(seen[0]),
                edges=sum(u.padded for u in fsdp.units if not u.name.startswith("layers.")),
                grad_dtypes={str(p.grad.dtype) for p in fsdp.optim_params()})


def norm_check(rank, world):
    """Unit grads set to ones: the global norm must count every distinct element once."""
    tp_mesh = Mesh(rank, world, dp=2, tp=2)  # pretend tp: matrices carry tp_shard, norms are tp-replicated
    tp_rank = tp_mesh.coord["tp"]

    def mark(name, p):
        if p.dim() == 2:
            p.tp_shard = (0, tp_rank, 2)
        else:
            p.tp_partial_grad = True  # as sequence-parallel norms
    results = {}
    for label, mesh, cls, group, module in (("tp", tp_mesh, FSDP, tp_mesh.dp_cp_group, tiny_gpt(mark)),
                                            ("hsdp", Mesh(rank, world, dp=4, dp_shard=2), HSDP, None, tiny_gpt())):
        wrapper = cls(module, mesh, group or mesh.shard_group, init_param, "cpu")
        for p in wrapper.optim_params():
            p.grad = torch.full_like(p, float(tp_rank + 1 if label == "tp" else 1))
        if label == "tp":
            wrapper.finish_grad_sync()  # all-reduces the tp_partial_grad pieces over tp: 1 + 2
            vectors = [s[3].numel() for u in wrapper.units for s in u.slots if s[3].dim() == 1]
            matrices = [s[3].numel() for u in wrapper.units for s in u.slots if s[3].dim() == 2]
            # grads: matrices tp_rank + 1 on each tp rank's distinct slice, vectors 3 everywhere (replicated)
            results["tp_expected"] = (1 + 4) * sum(matrices) + 9 * sum(vectors)
        else:
            results["hsdp_expected"] = sum(p.numel() for p in model.GPT(CFG).parameters())
        results[label] = global_grad_norm(wrapper.grads_for_norm(), mesh.world_group).item() ** 2
    return results


def _all_checks(rank, world):
    mesh = Mesh(rank, world)
    return dict(memory=memory_check(rank, world, mesh),
                order={overlap: order_check(rank, world, mesh, overlap) for overlap in (True, False)},
                recompute=order_check(rank, world, mesh, True, "full"),
                overlap={"fsdp": overlap_check(rank, world, FSDP, mesh),
                         "hsdp": overlap_check(rank, world, HSDP, Mesh(rank, world, dp=4, dp_shard=2))},
                init=init_and_state_check(rank, world, mesh),
                bf16={d: bf16_check(rank, world, mesh, d) for d in (torch.float32, torch.bfloat16)},
                norm=norm_check(rank, world))


@pytest.fixture(scope="module")
def ranks():
    return run_ranks(_all_checks, 4, timeout=150)


def test_fsdp_persistent_state_is_one_mth_per_rank(ranks):
    P = sum(p.numel() for p in model.GPT(CFG).parameters())
    for r in ranks:
        m = r["memory"]
        padding_per_rank = (m["padded"] - P) / 4
        assert m["gathered_left"] == []  # no full unit survives the step
        assert m["gathered_peak"] <= 2  # while a block runs: the block and the prefetched neighbour
        assert m["param"] == m["grad"] == 4 * m["padded"] / 4
        assert m["optim"] == 8 * m["padded"] / 4  # Adam's two moments
        assert m["param"] + m["grad"] + m["optim"] <= 16 * P / 4 + 16 * padding_per_rank
        # every live tensor in the process: the shards, the 0-d Adam steps and a small batch
        assert m["everything"] <= 16 * m["padded"] / 4 + m["steps"] + 4096, m
    print(f"\nFSDP M=4, P={P}: per rank param {m['param']} B, grad {m['grad']} B, Adam {m['optim']} B "
          f"(16P/M = {16 * P / 4:.0f} B); all live tensors {m['everything']} B")


def test_fsdp_prefetches_next_unit_and_reduce_scatters_during_backward(ranks):
    for overlap in (True, False):
        r = ranks[0]["order"][overlap]
        log = r["log"]
        short = [k.replace("all_gather", "AG").replace("reduce_scatter", "RS") for k in log]
        print(f"\noverlap={overlap}: {', '.join(short)}")
        done0 = log.index("forward done 0")
        # forward: the embedding + layers.0, and with prefetch layers.1 too, gathered before layers.0 finished
        assert log[:done0].count("all_gather") == (3 if overlap else 2)
        backward = log[log.index(f"forward done {CFG.n_layer - 1}") + 1:]
        last = CFG.n_layer - 1
        # backward: the head stays gathered from its forward; with prefetch, the next-to-last block's gather starts
        # before the last block's backward is done (without, the head's forward gather comes after layers.3's)
        assert backward[:backward.index(f"backward done {last}")].count("all_gather") == 2
        # reduce-scatters of the later blocks launch while backward is still running
        assert backward[:backward.index("backward done 0")].count("reduce_scatter") >= last
        units = CFG.n_layer + 2  # the embedding, the blocks, norm + head
        # one unit's reduce-scatter (and its flat gradient) is in flight at a time, and none outlives the backward
        # into the next forward (was: the embedding's, with its flat gradient)
        assert r["in_flight_after_backward"] == 0
        # backward gathers the blocks only: the embedding's needs no weights, the head is still gathered
        assert r["all_gathers"] == {"forward": units, "backward": CFG.n_layer}
        assert log.count("reduce_scatter") == units


def test_fsdp_prefetches_under_recompute_too(ranks):
    """--ckpt full: backward recomputes each block's forward, which gathers the block again. Nothing is unpacked then,
    so the prefetch starts from the recomputed forward: before block k's backward is done, the gathers of blocks
    last..k-1 have all started (the one it waits for next is in flight under it); without that, only last..k."""
    log, last = ranks[0]["recompute"]["log"], CFG.n_layer - 1
    backward = log[log.index(f"forward done {last}") + 1:]
    for k in range(last, 0, -1):
        gathers = backward[:backward.index(f"backward done {k}")].count("all_gather")
        assert gathers == last - k + 2, (k, gathers, backward)


def test_fsdp_init_is_shard_by_shard_and_equals_one_process(ranks):
    r0 = ranks[0]["init"]
    full = r0["full"]
    assert r0["state"].keys() == full.keys()
    for k in full:
        np.testing.assert_array_equal(r0["state"][k], full[k], err_msg=k)
        np.testing.assert_array_equal(r0["reloaded"][k], full[k] + 1, err_msg=k)
    biggest_param = max(v.size for v in full.values())
    total = sum(v.size for v in full.values())
    for r in ranks:
        assert r["init"]["original_params_left"] == []
        assert r["init"]["peak_live"] <= r["init"]["largest_shard"] < biggest_param  # a shard's part, no more
        assert r["init"]["local_numel"] <= total / 4 + 8


def test_fsdp_bf16_gathers_half_the_bytes(ranks):
    for reduce_dtype, r in ranks[0]["bf16"].items():
        g, padded = 4, r["padded"]
        assert r["weight_dtype"] == "torch.bfloat16" and r["grad_dtypes"] == {"torch.float32"}
        # fwd + bwd, 2 B each; backward gathers no embedding or norm + head
        assert r["bytes"]["all_gather"] == pytest.approx((g - 1) / g * 2 * (2 * padded - r["edges"]))
        assert r["bytes"]["reduce_scatter"] == pytest.approx((g - 1) / g * padded * reduce_dtype.itemsize)


def test_fsdp_grad_norm_counts_each_element_once(ranks):
    for r in ranks:
        n = r["norm"]
        assert n["tp"] == pytest.approx(n["tp_expected"], rel=1e-6)
        assert n["hsdp"] == pytest.approx(n["hsdp_expected"], rel=1e-6)


# ---------------------------------------------------------------- the collective timeline of two micro-batches

def lifetimes(r):
    """{log index: [launch position, wait position]} of the timeline's collectives, and {marker: position}."""
    life, marks = {}, {}
    for pos, (event, x) in enumerate(r["timeline"]):
        if event == "mark":
            marks[x] = pos
        else:
            life.setdefault(x, [None, None])[event == "wait"] = pos
    return life, marks


def gathers_of(r, param):
    """[launch, wait] of the all-gathers of the unit holding `param` (told apart by their bytes)."""
    life, _ = lifetimes(r)
    K = r["shard"]
    nbytes = (K - 1) / K * 4 * r["padded"][param]
    return [life[i] for i, (kind, _, b) in enumerate(r["log"]) if kind == "all_gather" and b == pytest.approx(nbytes)]


@pytest.mark.parametrize("mode", ["fsdp", "hsdp"])
def test_embedding_and_head_gathers_are_prefetched(ranks, mode):
    """norm + head: launched under the last block's forward, waited for as the head's forward starts, kept for its
    backward. The embedding: the second micro-batch's launched under the first one's layers.0 backward."""
    last = CFG.n_layer - 1
    for r in (rank["overlap"][mode] for rank in ranks):
        _, marks = lifetimes(r)
        head, embed = gathers_of(r, "lm_head.weight"), gathers_of(r, "embed_tokens.weight")
        assert len(head) == 2 and len(embed) == 2, "one all-gather per micro-batch, none for their backward"
        for mb, (launch, wait) in enumerate(head):
            assert launch < marks[f"{mb} fwd {last}"] < wait
        launch, wait = embed[1]
        assert launch < marks["0 bwd 0"] < wait


def test_hsdp_replica_all_reduce_runs_under_backward_once_per_step(ranks):
    """Launched once per unit and step (not per micro-batch), as the unit's last reduce-scatter is in and before
    the next reduce-scatter, waited for after another block's backward; as backward ends, only the last unit's
    all-reduce is in flight (its reduce-scatter was finished at once: no block's backward is left to hide it)."""
    for r in (rank["overlap"]["hsdp"] for rank in ranks):
        life, marks = lifetimes(r)
        units = CFG.n_layer + 2
        log = r["log"]
        replica = [i for i, (_, group, _) in enumerate(log) if group == "replicate"]
        assert r["calls"]["all_reduce"] == len(replica) == units
        rs_launches = [life[i][0] for i, (kind, _, _) in enumerate(log) if kind == "reduce_scatter"]
        bwd_marks = [pos for name, pos in marks.items() if " bwd " in name]
        in_backward = [i for i in replica if life[i][0] < marks["1 bwd 0"]]
        # the head's and layers n-1..2: launched while blocks' backward runs. Layer 1's is launched as block 0's
        # backward ends, just after this test's backward hook marks it (that hook's node runs first)
        assert len(in_backward) == CFG.n_layer - 1
        for i in replica:
            launch, wait = life[i]
            assert launch > marks[f"1 fwd {CFG.n_layer - 1}"]  # in the last micro-batch's backward or after
            if i in in_backward:
                assert any(launch < p < wait for p in rs_launches), "waited for after the next reduce-scatter"
                assert any(launch < p < wait for p in bwd_marks), "in flight under a block's backward"
        assert sorted(r["in_flight"]) == [("all_reduce", "replicate")]
