"""The zero-bubble schedules zb1 (ZB-H1) and zbv (V placement). Pure: the utilization formulas equal the simulation
for every M, the drawing, the V placement, a (P, M) pair the simulator refuses is a one-line layout error (exit 2
through train.py). On gloo ranks, one launch: the B/W split gives 1f1b's gradients for M = 1, 2, 5 at pp4 and at
dp2 x pp2 (DDP's buckets each launched once, in backward: after the chunk's last W), zb1 keeps at most 1f1b's peak
activation sets per stage, and a checkpointed block is recomputed once per micro-batch, not twice. Losses against
one process, resume and the other layouts: tests/test_pp.py and tests/test_checkpoint.py."""
from contextlib import nullcontext

import numpy as np
import pytest
import torch

import model
from bench.labs import pp_draw
from bench.ranks import run_ranks
from parallel import ckpt, pp, pp_bw_split
from parallel import pp_schedule as S
from parallel.ddp import DDP
from parallel.materialize import init_weights
from parallel.mesh import LayoutError, Mesh
from tests.counting import InFlight, all_reduces_launched
from tests.layouts import exit_and_stderr
from tests.test_pp import argv, fake_mesh, meta_gpt

TINY8 = model.ModelConfig(n_layer=8, d_model=32, n_head=4, n_kv_head=2, ffn_dim=64, vocab_size=50, seq_len=16)


# ---------------------------------------------------------------- pure

def test_the_utilization_formulas_equal_the_simulation_for_every_micro_batch_count():
    for schedule, V in (("zb1", 1), ("zbv", 2)):
        for P in (2, 3, 4, 5):
            for M_ in range(1, 13):
                timeline = S.simulate(S.SCHEDULES[schedule](P, M_, V), P, V, schedule in S.VSHAPED)
                end = max(e for row in timeline for _, e, _ in row)
                for row in timeline:
                    busy = sum(e - s for s, e, _ in row)
                    assert busy / end == pytest.approx(S.theoretical_utilization(P, M_, V, schedule)), (schedule, P, M_)
    assert S.theoretical_utilization(4, 8, 1, "zb1") == pytest.approx(24 / 27)  # 1f1b: 8/11; a third of its bubble
    assert S.theoretical_utilization(4, 8, 2, "zbv") == pytest.approx(48 / 51)


def test_the_drawing_shows_B_and_W_and_the_zero_bubble_utilization(capsys):
    assert pp_draw.main(["--pp", "4", "--microbatches", "8", "--schedule", "zb1"]) == 0
    out = capsys.readouterr().out
    assert "stage 3 |.. .. .. F0 B0 F1 B1 F2 B2 F3 B3 W0 F4" in out  # the last stage runs each W 3 micro-batches late
    assert "3M/(3M+max(P-1, 2P-1-M)) = 24/27 = 0.889" in out
    assert pp_draw.main(["--pp", "4", "--microbatches", "8", "--schedule", "zbv"]) == 0
    out = capsys.readouterr().out
    assert "stage 3 |... ... ... F0a F0b F1a" in out  # rank 3 runs stages 3 and 4 back to back
    assert "= 48/51 = 0.941" in out


def test_zbv_places_two_chunks_per_rank_in_a_v():
    stages = [pp.split(meta_gpt(8), fake_mesh(4, r), n_micro=8, schedule="zbv") for r in range(4)]
    assert [[c.pipeline.virtual_stage for c in chunks] for chunks in stages] == [[0, 7], [1, 6], [2, 5], [3, 4]]
    first, last = stages[0]  # rank 0 holds both ends: the embedding and the head
    assert first.embed_tokens is not None and last.lm_head is not None and list(last.layers) == ["7"]
    with pytest.raises(LayoutError) as err:  # 4 stages x 2 chunks need 8 layers
        pp.split(meta_gpt(6), fake_mesh(4, 0), n_micro=8, schedule="zbv")
    assert err.value.flag == "--pp"


def never_runs(P, M, V=1):
    """Every stage waits for its own backward before any forward: the simulator finds a deadlock."""
    return [[S.Action("B", 0, i) for i in range(M)] + [S.Action("F", 0, i) for i in range(M)] for _ in range(P)]


def test_a_pair_the_simulator_refuses_is_a_layout_error(monkeypatch):
    monkeypatch.setitem(S.SCHEDULES, "zb1", never_runs)
    pp.actions_for.cache_clear()
    with pytest.raises(LayoutError) as err:
        pp.split(meta_gpt(8), fake_mesh(2, 0), n_micro=3, schedule="zb1")
    pp.actions_for.cache_clear()
    assert err.value.flag == "--pp-schedule" and "deadlocks" in str(err.value) and "\n" not in str(err.value)


def _refused_by_train(rank, world, flags):
    S.SCHEDULES["zb1"] = never_runs  # in this rank's process only
    return exit_and_stderr(flags)


def test_train_refuses_a_pair_the_simulator_refuses_with_one_line_and_exit_2(tmp_path):
    results = run_ranks(_refused_by_train, 2, args=(argv("--pp", "2", "--pp-schedule", "zb1", "--out",
                                                         str(tmp_path)),), timeout=120)
    code, err = results[0]
    assert code == 2 and err.startswith("error: --pp-schedule: zb1 cannot run") and err.count("\n") == 1, err
    assert results[1] == (2, "")


# ---------------------------------------------------------------- the executor on gloo ranks

def one_step(mesh, schedule, n_micro, policy="none"):
    """One step of an 8-layer tiny pipeline, DDP over dp: (this rank's gradients by global name, its Pipeline's
    peak activation sets, DDP buckets launched inside backward / buckets, block forward calls)."""
    with torch.device("meta"):
        full = model.GPT(TINY8)
    chunks, calls = pp.split(full, mesh, n_micro, schedule), []
    for chunk in chunks:
        ckpt.apply(chunk, policy)
        if schedule in S.SPLIT_BACKWARD:
            pp_bw_split.apply(chunk)
        init_weights(chunk, 0, "cpu")
        for block in chunk.layers.values():
            block.register_forward_pre_hook(lambda *_: calls.append(1))  # again when checkpointing recomputes
    wrapper = DDP(torch.nn.ModuleList(chunks), mesh)
    gen = torch.Generator().manual_seed(mesh.coord["dp"])
    batches = [(torch.randint(0, 50, (1, 16), generator=gen), torch.randint(0, 50, (1, 16), generator=gen))
               for _ in range(n_micro)]
    mesh.stats.reset()
    _, record = pp.execute(chunks, mesh, batches, None, nullcontext(), torch.float32, 1.0, wrapper, runner=InFlight)
    launched = (all_reduces_launched(mesh), len(wrapper.buckets))
    wrapper.finish_grad_sync()
    grads = {name.split(".", 1)[1]: p.grad.numpy().copy() for name, p in wrapper.module.named_parameters()}
    return grads, record.max_in_flight, launched, len(calls) / (n_micro * sum(len(c.layers) for c in chunks))


def _steps(rank, world):
    out = {}
    for layout, mesh in (("pp4", Mesh(rank, world, pp=4)), ("dp2xpp2", Mesh(rank, world, dp=2, pp=2))):
        for schedule in ("1f1b", "zb1", "zbv"):
            for n_micro in (1, 2, 5):
                out[(layout, schedule, n_micro)] = one_step(mesh, schedule, n_micro)
            out[(layout, schedule, "ckpt")] = one_step(mesh, schedule, 3, "full")
    return out


@pytest.fixture(scope="module")
def steps():
    return run_ranks(_steps, 4, timeout=300)


def merged(steps, key):
    """The global gradient of every weight, from every rank's part (dp replicas hold the same after sync)."""
    return {name: g for rank in steps for name, g in rank[key][0].items()}


@pytest.mark.parametrize("layout", ["pp4", "dp2xpp2"])
@pytest.mark.parametrize("schedule", ["zb1", "zbv"])
@pytest.mark.parametrize("n_micro", [1, 2, 5, "ckpt"])
def test_the_split_backward_gives_1f1b_s_gradients(steps, layout, schedule, n_micro):
    ours, ref = merged(steps, (layout, schedule, n_micro)), merged(steps, (layout, "1f1b", n_micro))
    assert ours.keys() == ref.keys() and len(ref) == 3 + 9 * 8
    for name in ref:
        np.testing.assert_allclose(ours[name], ref[name], rtol=1e-5, atol=1e-7, err_msg=name)


@pytest.mark.parametrize("schedule", ["1f1b", "zb1", "zbv"])
def test_ddp_launches_each_bucket_once_inside_backward_after_the_last_w(steps, schedule):
    for rank in steps:
        for n_micro in (1, 2, 5):
            launched, buckets = rank[("dp2xpp2", schedule, n_micro)][2]
            assert launched == buckets > 0


def test_zb1_keeps_at_most_1f1b_s_peak_activation_sets_on_every_stage(steps):
    for n_micro in (2, 5):
        one_f_one_b = [rank[("pp4", "1f1b", n_micro)][1] for rank in steps]  # [P - r] capped by M
        zb1 = [rank[("pp4", "zb1", n_micro)][1] for rank in steps]
        assert one_f_one_b == [min(n_micro, 4 - r) for r in range(4)]
        assert zb1 == [min(n_micro, 4)] * 4 and max(zb1) <= max(one_f_one_b) + 1, zb1
        zbv = [rank[("pp4", "zbv", n_micro)][1] / 2 for rank in steps]  # chunk sets, half a stage's each
        assert max(zbv) <= 4, zbv


@pytest.mark.parametrize("schedule", ["1f1b", "zb1", "zbv"])
def test_a_checkpointed_block_runs_twice_per_micro_batch_forward_and_one_recompute(steps, schedule):
    for rank in steps:
        assert rank[("pp4", schedule, "ckpt")][3] == 2 and rank[("pp4", schedule, 1)][3] == 1
