"""Pipeline parallel. Pure: each schedule runs every (chunk, micro-batch) once with its forward before its
backward, sends match receives, no deadlock under NCCL-like in-order streams, bubble = theory, the
cost-balanced split and its bad inputs. On gloo ranks: every schedule equals one process over 10 steps
(M = 1, P, 2P), composition with ddp, fsdp, tp, cp and ckpt, at most P activation sets in flight on
stage 0 under 1F1B (M under GPipe), and a rank that raises mid-schedule ends every rank with an error.
The layout runs share four launches (module fixtures); each test asserts one property."""
import time
from contextlib import nullcontext
from types import SimpleNamespace

import pytest
import torch

import config
import model
import train
from bench.labs import pp_draw
from bench.labs.pp_bubble import TimedPipeline
from bench.planner.layout import in_flight
from bench.ranks import run_ranks
from config import UsageError
from data.metrics import read_metrics
from parallel import pp
from parallel import pp_schedule as S
from parallel.ddp import DDP
from parallel.materialize import init_weights
from parallel.mesh import LayoutError, Mesh
from tests.counting import InFlight
from tests.layouts import BASE, assert_same_losses, exit_and_stderr
from tests.pp_deadlock import check_no_deadlock

GRID = [(s, P, M, V) for s, Vs in (("gpipe", [1]), ("1f1b", [1]), ("interleaved", [2, 3]), ("zb1", [1]),
                                    ("zbv", [2]))
        for P in (2, 3, 4) for M in (1, 2, 3, 4, 8, 12) for V in Vs if s != "interleaved" or M <= P or M % P == 0]


def argv(*flags):
    return BASE + ["--peak-tflops", "1"] + list(flags)


# ---------------------------------------------------------------- pure schedules

@pytest.mark.parametrize("schedule,P,M,V", GRID)
def test_each_chunk_and_micro_batch_runs_once_forward_before_backward(schedule, P, M, V):
    ops = "FBW" if schedule in S.SPLIT_BACKWARD else "FB"  # zb1, zbv: the weight gradient W after its B
    for rank, actions in enumerate(S.build(schedule, P, M, V)):
        computes = [(a.op, a.chunk, a.mb) for a in actions if a.op in S.COMPUTE]
        assert sorted(computes) == sorted((op, c, i) for op in ops for c in range(V) for i in range(M)), rank
        for _, c, i in computes:
            assert computes.index(("F", c, i)) < computes.index(("B", c, i))
            assert "W" not in ops or computes.index(("B", c, i)) < computes.index(("W", c, i))


@pytest.mark.parametrize("schedule,P,M,V", GRID)
def test_sends_match_receives_in_order_between_neighbouring_stages(schedule, P, M, V):
    actions, vshape = S.build(schedule, P, M, V), schedule in S.VSHAPED
    for src in range(P):
        for dst in range(P):
            sent = []  # what src sends to dst, as the receive it must meet: (op, chunk on dst, mb)
            for a in actions[src]:
                if a.op in S.SENDS and a.peer == dst:
                    v = S.stage_of(src, a.chunk, P, vshape) + (1 if a.op == "SEND_F" else -1)
                    assert S.place(v, P, vshape)[0] == dst != src, f"{a} goes to the wrong rank"
                    sent.append(("RECV_" + a.op[-1], S.place(v, P, vshape)[1], a.mb))
            received = [(a.op, a.chunk, a.mb) for a in actions[dst] if a.op in S.RECVS and a.peer == src]
            assert sent == received, (src, dst)


@pytest.mark.parametrize("schedule,P,M,V", GRID)
def test_no_deadlock_when_every_stream_runs_its_batches_in_order(schedule, P, M, V):
    vshape = schedule in S.VSHAPED
    check_no_deadlock(S.build(schedule, P, M, V), P, V, vshape)
    check_no_deadlock(S.forward_only(P, M, V, vshape), P, V, vshape)


def test_the_deadlock_check_catches_a_receive_posted_out_of_order():
    actions = S.build("1f1b", 2, 4)
    receives = [k for k, a in enumerate(actions[1]) if a.op == "RECV_F"]
    actions[1][receives[1]], actions[1][receives[2]] = actions[1][receives[2]], actions[1][receives[1]]
    with pytest.raises(S.DeadlockError):
        check_no_deadlock(actions, 2, 1)


@pytest.mark.parametrize("schedule,V", [("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("interleaved", 4),
                                        ("zb1", 1), ("zbv", 2)])
@pytest.mark.parametrize("P,M", [(2, 2), (4, 4), (4, 8), (4, 16), (8, 16)])
def test_simulated_bubble_equals_theory(schedule, V, P, M):
    timeline = S.simulate(S.SCHEDULES[schedule](P, M, V), P, V, schedule in S.VSHAPED)
    end = max(e for row in timeline for _, e, _ in row)
    for row in timeline:
        assert sum(e - s for s, e, _ in row) / end == pytest.approx(S.theoretical_utilization(P, M, V, schedule))


def test_the_timeline_command_draws_every_stage_and_the_utilization(capsys):
    assert pp_draw.main(["--pp", "4", "--microbatches", "8", "--schedule", "1f1b"]) == 0
    out = capsys.readouterr().out
    assert out.count("stage ") == 4 and "M/(M+P-1) = 8/11 = 0.727" in out
    assert "stage 3 |.. .. .. F0 B0 -- F1" in out
    assert pp_draw.main(["--pp", "4", "--microbatches", "8", "--schedule", "interleaved", "--virtual", "2"]) == 0
    assert "VM/(VM+P-1) = 16/19 = 0.842" in capsys.readouterr().out


# ---------------------------------------------------------------- the split and its bad inputs

def meta_gpt(n_layer=8, **kw):
    cfg = model.ModelConfig(**{**dict(n_layer=n_layer, d_model=64, n_head=4, n_kv_head=2, ffn_dim=128, vocab_size=100,
                                  seq_len=32), **kw})
    with torch.device("meta"):
        return model.GPT(cfg)


def fake_mesh(P, rank, dp=1):
    return SimpleNamespace(pp=P, dp=dp, coord={"pp": rank})


def test_split_keeps_each_stage_its_layers_the_embedding_first_and_the_head_last():
    full = meta_gpt(8)
    stages = [pp.split(full, fake_mesh(2, r), n_micro=8, layer_split=(3, 5)) for r in range(2)]
    (first,), (last,) = stages
    assert list(first.layers) == ["0", "1", "2"] and list(last.layers) == ["3", "4", "5", "6", "7"]
    assert first.embed_tokens is not None and first.lm_head is None and first.norm is None
    assert last.embed_tokens is None and last.lm_head is not None and last.norm is not None
    assert len(full.layers) == 8  # the full model is untouched


def test_interleaved_chunks_go_round_robin():
    chunks = pp.split(meta_gpt(8), fake_mesh(2, 1), n_micro=8, schedule="interleaved", n_virtual=2)
    assert [list(c.layers) for c in chunks] == [["2", "3"], ["6", "7"]]  # virtual stages 1 and 3 of 4
    assert chunks[1].lm_head is not None and chunks[0].lm_head is None


def test_default_split_balances_the_head_against_the_layers():
    cfg = meta_gpt(8).cfg
    assert pp.balanced_counts(cfg, 2) == [4, 4]  # the head costs about one layer: 4 vs 4 + head
    big_vocab = meta_gpt(8, vocab_size=4000).cfg  # head = 2·d·V ≈ 4.7 layers: the last stage gets fewer layers
    counts = pp.balanced_counts(big_vocab, 2)
    assert counts[0] > counts[1] and sum(counts) == 8
    costs = pp.cost_model(big_vocab)
    stage_flops = [counts[0] * costs["layer"][0], counts[1] * costs["layer"][0] + costs["head"][0]]
    assert max(stage_flops) < 8 * costs["layer"][0]  # better than no balancing at all


@pytest.mark.parametrize("flag,kwargs,n_layer,P", [
    ("--pp-split", dict(layer_split=(3, 4)), 8, 2),  # does not sum to the layers
    ("--pp-split", dict(layer_split=(2, 2, 4)), 8, 2),  # one count per stage
    ("--pp", dict(), 3, 4),  # more stages than layers
    ("--pp-virtual", dict(schedule="interleaved", n_virtual=2), 6, 2),  # 6 layers, P·V = 4
    ("--micro-batch", dict(schedule="interleaved", n_virtual=2, n_micro=3), 8, 2),  # M=3, P=2
])
def test_bad_pipeline_layouts_raise_a_layout_error_naming_the_flag(flag, kwargs, n_layer, P):
    with pytest.raises(LayoutError) as err:
        pp.split(meta_gpt(n_layer), fake_mesh(P, 0), **{"n_micro": 8, **kwargs})
    assert err.value.flag == flag and "\n" not in str(err.value)


@pytest.mark.parametrize("flag,flags", [
    ("--pp-split", ["--pp-split", "8,0"]),  # an empty stage
    ("--pp-split", ["--pp-split", "4,x"]),
    ("--pp-virtual", ["--pp-virtual", "2"]),  # chunks need the interleaved schedule
    ("--pp-virtual", ["--pp-virtual", "0"]),
    ("--pp-schedule", ["--pp-schedule", "zigzag"]),
])
def test_bad_pipeline_flags_are_refused_by_the_command_line(flag, flags):
    with pytest.raises(UsageError) as err:
        config.parse_args(["--pp", "2"] + flags)
    assert str(err.value).startswith(flag) and "\n" not in str(err.value)


def test_pp_not_dividing_the_world_is_one_line_and_exit_2(capsys, tmp_path):
    with pytest.raises(SystemExit) as exit_info:
        train.main(argv("--pp", "2", "--out", str(tmp_path)))
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "does not divide the world size 1" in err and "\n" not in err


def _exit_and_stderr(rank, world, argvs):
    return [exit_and_stderr(a) for a in argvs]


def test_bad_pipeline_flags_through_train_are_one_line_and_exit_2(tmp_path):
    cases = [argv("--out", str(tmp_path), *flags) for flags in (
        ["--pp", "2", "--pp-split", "1,2"], ["--pp", "2", "--n-layer", "1"],
        ["--pp", "2", "--pp-schedule", "interleaved", "--pp-virtual", "2", "--n-layer", "6"])]
    results = run_ranks(_exit_and_stderr, 2, args=(cases,), timeout=120)
    for (code, err), expected in zip(results[0], ["--pp-split", "--pp:", "--pp-virtual"]):
        assert code == 2 and err.startswith(f"error: {expected}") and err.count("\n") == 1, err
    assert all(code == 2 and err == "" for code, err in results[1])  # rank 1 exits 2 too, silently


# ---------------------------------------------------------------- layout equivalence on gloo ranks

def _train_many(rank, world, runs, folder):
    """Each run's (losses, final val loss): one evaluation after the last step, through pp.eval_step."""
    out = []
    for i, a in enumerate(runs):
        metrics = f"{folder}/run{i}.jsonl"
        losses = train.main(a + ["--eval-every", "10", "--eval-batches", "1", "--metrics", metrics,
                                 "--out", f"{folder}/run{i}"])
        out.append((losses, read_metrics(metrics)[0][-1]["val_loss"] if rank == 0 else None))
    return out


SCHEDULE_RUNS = {  # name: (world, reference layers, flags); global batch 8, so M = 8 / micro-batch
    f"pp{P}-{s}-M{m}": (P, n, ["--pp", str(P), "--pp-schedule", s, "--micro-batch", str(8 // m)] + extra)
    for P in (2, 4) for m in (1, P, 2 * P)
    for s, n, extra in (("gpipe", 4, []), ("1f1b", 4, []),
                        ("interleaved", 8, ["--n-layer", "8", "--pp-virtual", "2"]))}
SCHEDULE_RUNS.update({  # the zero-bubble schedules at M = 2P (other M: tests/test_pp_zero_bubble.py)
    f"pp{P}-{s}-M{2 * P}": (P, n, ["--pp", str(P), "--pp-schedule", s, "--micro-batch", str(8 // (2 * P))] + extra)
    for P in (2, 4) for s, n, extra in (("zb1", 4, []), ("zbv", 4 * P // 2, ["--n-layer", str(4 * P // 2)]))})
COMPOSED_RUNS = {  # all on 4 ranks
    "pp2xdp2-ddp": ["--pp", "2", "--dp", "2", "--micro-batch", "2"],
    "pp2xdp2-fsdp": ["--pp", "2", "--dp", "2", "--micro-batch", "2", "--dp-mode", "fsdp"],
    "pp2xdp2-ddp-interleaved": ["--pp", "2", "--dp", "2", "--micro-batch", "1", "--n-layer", "8",
                                "--pp-schedule", "interleaved", "--pp-virtual", "2"],
    "pp2xdp2-fsdp-interleaved": ["--pp", "2", "--dp", "2", "--micro-batch", "1", "--n-layer", "8",
                                 "--pp-schedule", "interleaved", "--pp-virtual", "2", "--dp-mode", "fsdp"],
    "pp2xdp2-fsdp-interleaved-unsharded": ["--pp", "2", "--dp", "2", "--micro-batch", "1", "--n-layer", "8",
                                           "--pp-schedule", "interleaved", "--pp-virtual", "2", "--dp-mode", "fsdp",
                                           "--accumulate", "unsharded"],
    "pp2xtp2": ["--pp", "2", "--tp", "2"],
    "pp2xtp2-sp": ["--pp", "2", "--tp", "2", "--sp"],
    "pp2xcp2": ["--pp", "2", "--cp", "2"],
    "pp4-ckpt-full": ["--pp", "4", "--micro-batch", "2", "--ckpt", "full"],
    **{f"pp2xdp2-fsdp-{s}": ["--pp", "2", "--dp", "2", "--micro-batch", "1", "--dp-mode", "fsdp", "--pp-schedule", s]
       for s in ("zb1", "zbv")},
    **{f"pp2xtp2-sp-{s}": ["--pp", "2", "--tp", "2", "--sp", "--pp-schedule", s] for s in ("zb1", "zbv")},
    "pp4-ckpt-full-zb1": ["--pp", "4", "--micro-batch", "2", "--ckpt", "full", "--pp-schedule", "zb1"],
    "pp4-ckpt-full-zbv": ["--pp", "4", "--micro-batch", "1", "--ckpt", "full", "--pp-schedule", "zbv",
                          "--n-layer", "8"],
}


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    runs = [argv(), argv("--n-layer", "8")]
    a, b = run_ranks(_train_many, 1, args=(runs, str(tmp_path_factory.mktemp("ref"))), timeout=300)[0]
    return {4: a, 8: b}


@pytest.fixture(scope="module")
def schedule_losses(tmp_path_factory):
    out = {}
    for world in (2, 4):
        names = [k for k, (w, _, _) in SCHEDULE_RUNS.items() if w == world]
        runs = [argv(*SCHEDULE_RUNS[k][2]) for k in names]
        folder = str(tmp_path_factory.mktemp(f"pp{world}"))
        out.update(zip(names, run_ranks(_train_many, world, args=(runs, folder), timeout=400)[0]))
    return out


@pytest.fixture(scope="module")
def composed_losses(tmp_path_factory):
    runs = [argv(*flags) for flags in COMPOSED_RUNS.values()]
    folder = str(tmp_path_factory.mktemp("composed"))
    return dict(zip(COMPOSED_RUNS, run_ranks(_train_many, 4, args=(runs, folder), timeout=400)[0]))


@pytest.mark.parametrize("name", list(SCHEDULE_RUNS))
def test_every_schedule_matches_one_process(name, schedule_losses, references):
    assert_same_losses(schedule_losses[name][0], references[SCHEDULE_RUNS[name][1]][0], rtol=1e-5)


@pytest.mark.parametrize("name", [k for k in SCHEDULE_RUNS if k.startswith("pp4")])
def test_the_pipelined_evaluation_matches_one_process(name, schedule_losses, references):
    assert schedule_losses[name][1] == pytest.approx(references[SCHEDULE_RUNS[name][1]][1], rel=1e-5)


@pytest.mark.parametrize("name", list(COMPOSED_RUNS))
def test_pipeline_composed_with_other_axes_matches_one_process(name, composed_losses, references):
    n_layer = 8 if "--n-layer" in COMPOSED_RUNS[name] else 4
    assert_same_losses(composed_losses[name][0], references[n_layer][0], rtol=1e-5)


# ---------------------------------------------------------------- the executor's records and failures

TINY = model.ModelConfig(n_layer=4, d_model=32, n_head=4, n_kv_head=2, ffn_dim=64, vocab_size=50, seq_len=16)


def tiny_pipeline(mesh, schedule, n_micro, virtual=1):
    with torch.device("meta"):
        full = model.GPT(TINY)
    chunks = pp.split(full, mesh, n_micro, schedule, virtual)
    for chunk in chunks:
        init_weights(chunk, 0, "cpu")
    gen = torch.Generator().manual_seed(0)
    batches = [(torch.randint(0, 50, (1, 16), generator=gen), torch.randint(0, 50, (1, 16), generator=gen))
               for _ in range(n_micro)]
    return chunks, batches


def _in_flight(rank, world):
    mesh = Mesh(rank, world, pp=world)
    out = {}
    for schedule in ("gpipe", "1f1b"):
        chunks, batches = tiny_pipeline(mesh, schedule, 8)
        wrapper = DDP(torch.nn.ModuleList(chunks), mesh)
        mesh.stats.reset()
        _, record = pp.execute(chunks, mesh, batches, None, nullcontext(), torch.float32, 1.0, wrapper,
                               runner=TimedPipeline)
        out[schedule] = (record.max_in_flight, len(record.events), record.busy_s <= record.wall_s,
                         mesh.stats.bytes["send"], mesh.stats.calls["send"])
    return out


@pytest.fixture(scope="module")
def stage_records():
    return run_ranks(_in_flight, 4, timeout=120)


def test_1f1b_keeps_at_most_P_activation_sets_in_flight_on_stage_0_and_gpipe_M(stage_records):
    assert stage_records[0]["1f1b"][0] == 4 and stage_records[0]["gpipe"][0] == 8
    assert [r["1f1b"][0] for r in stage_records] == [4, 3, 2, 1]  # stage r holds P - r
    assert all(r[s][1] == 16 and r[s][2] for r in stage_records for s in r)  # 8 forwards + 8 backwards recorded


def _interleaved_in_flight(rank, world):
    mesh = Mesh(rank, world, pp=world)
    chunks, batches = tiny_pipeline(mesh, "interleaved", 4, virtual=2)
    return pp.execute(chunks, mesh, batches, None, nullcontext(), torch.float32, 1.0,
                      DDP(torch.nn.ModuleList(chunks), mesh), runner=InFlight)[1].max_in_flight


def test_interleaved_keeps_the_activation_sets_the_planner_counts():
    """P = 2, V = 2, M = 4: rank r keeps P·V + P - 2r - 1 chunk sets (P + (P-2r-1)/V stage sets, as
    bench/planner/layout.in_flight counts them): 5 on rank 0, 3 on rank 1."""
    want = [2 * in_flight("interleaved", 4, 2, 2, rank=r)[0] for r in range(2)]
    assert run_ranks(_interleaved_in_flight, 2, timeout=120) == want == [5, 3]


def test_each_boundary_sends_one_activation_forward_and_one_gradient_back_per_micro_batch(stage_records):
    activation = 1 * 16 * TINY.d_model * 4  # (b, T, d) fp32 bytes
    for rank, r in enumerate(stage_records):
        messages = 8 * ((rank < 3) + (rank > 0))  # forward to the next stage, backward to the previous
        for schedule in r:
            assert r[schedule][3:] == (messages * activation, messages)


class Broken(RuntimeError):
    pass


def _one_rank_raises(rank, world):
    mesh = Mesh(rank, world, pp=world)
    chunks, batches = tiny_pipeline(mesh, "1f1b", 8)
    wrapper = DDP(torch.nn.ModuleList(chunks), mesh)
    if rank == 2:
        forward = chunks[0].forward
        calls = []

        def fails_on_the_third_micro_batch(*args):
            calls.append(1)
            if len(calls) == 3:
                raise Broken("stage 2 is broken on purpose")
            return forward(*args)
        chunks[0].forward = fails_on_the_third_micro_batch
    t0 = time.time()
    try:
        pp.execute(chunks, mesh, batches, None, nullcontext(), torch.float32, 1.0, wrapper)
    except Exception as e:
        return f"{type(e).__name__}: {e}", time.time() - t0
    return "finished", time.time() - t0


def test_a_rank_that_raises_mid_schedule_ends_every_rank_with_an_error():
    results = run_ranks(_one_rank_raises, 4, timeout=90)
    assert results[2][0].startswith("PipelineError: pipeline stage 2 failed at F(c0,m2)")
    assert "stage 2 is broken on purpose" in results[2][0]
    for rank in (0, 1, 3):  # their peers went away: an error, long before any process-group timeout
        message, seconds = results[rank]
        assert message.startswith("PipelineError: pipeline stage"), message
        assert seconds < 60
