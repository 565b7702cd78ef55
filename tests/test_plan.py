"""The layout planner (bench/planner/): its byte and memory formulas, the Llama 3 405B runs it must
reproduce, and the notes' scaling recipe it must rediscover. Closed formulas only: fast, no GPU."""
import subprocess
import sys
from dataclasses import replace
from functools import lru_cache
from pathlib import Path

import pytest

import config
from bench.planner import plan, step_time
from bench.planner.factors import FACTORS
from model import PRESETS, flops_per_token, param_counts
from parallel.pp import layer_counts
from parallel.pp_schedule import theoretical_utilization

ROOT = Path(__file__).resolve().parent.parent
TINY = replace(PRESETS["tiny"], vocab_size=50257)
FP32 = dict(w_bytes=4, g_bytes=4, a_bytes=4)


# ---------------------------------------------------------------- bytes per rank, ring terms

def test_ddp_all_reduces_every_gradient_once():
    total, _ = param_counts(TINY)
    got = plan.comm_bytes(TINY, plan.Layout(dp=4, micro=2), 256, 16, **FP32)  # M = 2: still one all-reduce
    assert got == {"tp": 0.0, "cp": 0.0, "pp": 0.0, "dp": pytest.approx(2 * 3 / 4 * 4 * total)}


def test_fsdp_sends_three_halves_of_ddp_per_gather_round():
    ddp = plan.comm_bytes(TINY, plan.Layout(dp=8, micro=1), 256, 8, **FP32)["dp"]
    fsdp = plan.comm_bytes(TINY, plan.Layout(dp=8, dp_mode="fsdp", micro=1), 256, 8, **FP32)["dp"]
    assert fsdp == pytest.approx(1.5 * ddp)  # notes: ~3P vs 2P
    accum = plan.comm_bytes(TINY, plan.Layout(dp=8, dp_mode="fsdp", micro=1), 256, 32, **FP32)["dp"]
    assert accum == pytest.approx(4 * fsdp)  # ZeRO-3 gathers again for each of the M = 4 microbatches


def test_hsdp_is_fsdp_in_the_shard_plus_an_all_reduce_across_replicas():
    total, _ = param_counts(TINY)
    got = plan.comm_bytes(TINY, plan.Layout(dp=8, dp_mode="hsdp", shard=4), 256, 8, **FP32)["dp"]
    assert got == pytest.approx(3 * 4 * 3 / 4 * total + 2 * 1 / 2 * 4 * total / 4)


def test_tp_cp_pp_bytes():
    d, hd, t = TINY.d_model, TINY.head_dim, 256
    tp = plan.comm_bytes(TINY, plan.Layout(tp=2), 256, 1, **FP32)["tp"]
    assert tp == pytest.approx((4 * 10 + 3) * 1 / 2 * t * d * 4)  # SP collectives of t x d fp32
    ring = plan.comm_bytes(TINY, plan.Layout(cp=4), 256, 1, **FP32)["cp"]
    kv = 2 * hd * TINY.n_kv_head * 4 * t / 4  # this rank's K and V
    assert ring == pytest.approx(4 * 3 * 3 * kv)  # 4 layers, 3 passes of (cp - 1) blocks
    pp = plan.comm_bytes(TINY, plan.Layout(pp=4, micro=1), 256, 8, **FP32)["pp"]
    assert pp == pytest.approx(8 * 2 * t * d * 4)  # M = 8: an activation out and a gradient back



def test_ours_fsdp_gathers_blocks_again_and_reduces_every_microbatch():
    """parallel/fsdp.py: per microbatch forward gathers every unit, backward the blocks again (not the embedding,
    norm and head), and every backward reduce-scatters its unit; under pp a unit is gathered once per step."""
    total, _ = param_counts(TINY)
    ends = 2 * TINY.padded_vocab * TINY.d_model + TINY.d_model
    got = plan.comm_bytes(TINY, plan.Layout(dp=2, dp_mode="fsdp", micro=1), 256, 8, code="ours", **FP32)["dp"]  # M = 4
    assert got == pytest.approx(1 / 2 * 4 * ((2 * total - ends) * 4 + total * 4))
    lay = plan.Layout(dp=2, pp=2, dp_mode="fsdp", micro=1)
    got = plan.comm_bytes(TINY, lay, 256, 8, code="ours", **FP32)["dp"]
    assert got == pytest.approx(1 / 2 * plan.Shape(TINY, lay, 256, 8, "ours").p_last * (4 + 4 * 4))


def test_ours_tp_overlap_hides_the_backward_and_the_rings(monkeypatch):
    """parallel/tp.py: without sp the forward all-reduces still block (4 of a layer's 8 collectives); with sp
    every collective next to a matmul runs under it in ring hops; overlap=0 (train.py --no-overlap) blocks on all of
    them. What the rings cost besides (chunks of t/tp rows, the host's dispatches per hop: tests/test_plan_factors.py)
    set aside, they expose less than half of what blocking does."""
    cl, cfg = plan.Cluster(8), PRESETS["llama3-8b"]

    def tp(cluster=cl, **kw):
        return plan.step_time(cfg, cluster, plan.Layout(tp=8, micro=1, **kw), 8192, 8, code="ours")["tp"]
    assert 0.5 * tp(sp=False, overlap=False) < tp(sp=False) < tp(sp=False, overlap=False)
    free = replace(cl, factors=replace(FACTORS["ours"], launch_us=0.0))
    monkeypatch.setattr(step_time, "MM_ROWS0", 0)  # a chunk as efficient as the whole
    assert tp(free, sp=True) < 0.5 * tp(free, sp=True, overlap=False)


# ---------------------------------------------------------------- memory

def test_memory_shards_model_state_and_checkpointing_shrinks_activations():
    total, _ = param_counts(TINY)
    bare = dict(overhead_gb=0, frag=0, w_bytes=0, a_bytes=4)
    ddp = plan.memory(TINY, plan.Layout(dp=8), 256, 8, **bare)
    assert ddp["master"] + ddp["grads"] + ddp["adam"] == pytest.approx(16 * total)
    fsdp = plan.memory(TINY, plan.Layout(dp=8, dp_mode="fsdp"), 256, 8, **bare)
    assert fsdp["master"] + fsdp["adam"] == pytest.approx(12 * total / 8)
    hsdp = plan.memory(TINY, plan.Layout(dp=8, dp_mode="hsdp", shard=2), 256, 8, **bare)
    assert hsdp["adam"] == pytest.approx(8 * total / 2)
    acts = [plan.memory(TINY, plan.Layout(dp=8, ckpt=c), 256, 8, **bare)["activations"] for c in plan.CKPTS]
    assert acts[0] > acts[1] > acts[2] > acts[3]  # none, selective, op, full
    none = acts[0]
    assert plan.memory(TINY, plan.Layout(tp=2, dp=4), 256, 8, **bare)["activations"] < none  # SP shards them
    assert plan.memory(TINY, plan.Layout(cp=2, dp=4), 256, 8, **bare)["activations"] == pytest.approx(none / 2)
    small_vocab = replace(TINY, vocab_size=64)  # so that stage 0, not the head's stage, is the fuller
    gpipe, onef = (plan.memory(small_vocab, plan.Layout(pp=4, micro=1, schedule=s), 256, 16, **bare)["activations"]
                   for s in ("gpipe", "1f1b"))
    assert gpipe == pytest.approx(4 * onef)  # stage 0 holds M = 16 microbatches vs P = 4
    zb1 = plan.memory(TINY, plan.Layout(pp=4, micro=1, schedule="zb1"), 256, 16, **bare)
    onef = plan.memory(TINY, plan.Layout(pp=4, micro=1), 256, 16, **bare)  # the head's stage is the fuller one
    assert zb1["activations"] == pytest.approx(4 * onef["activations"])  # its sets live until W: P, not 1


def test_pipeline_bubble_matches_the_notes():
    """Utilization M / (M + P - 1): 4/7 at P = M = 4 (the notes); interleaving divides the bubble by V; the zero-bubble
    schedules follow parallel/pp_schedule.py: zb1 12/15, zbv 24/29 (its warmup is not filled at M = 4)."""
    cl = plan.Cluster(4)
    interleaved = plan.Layout(pp=4, micro=1, schedule="interleaved", V=2)
    zb1, zbv = (plan.parse_layout(f"pp=4,micro=1,schedule={s}") for s in ("zb1", "zbv"))
    for lay, want in ((plan.Layout(pp=4, micro=1), 4 / 7), (interleaved, 4 / 5.5), (zb1, 12 / 15), (zbv, 24 / 29)):
        t = plan.step_time(replace(TINY, n_layer=8), cl, lay, 256, 4)
        busy = t["total"] - t["pp"] - t["dp"]
        assert (busy - t["bubble"]) / busy == pytest.approx(want)


def test_zb1_bubble_is_1f1b_s_by_the_theory_ratio():
    """P = 4, M = 8: zb1's bubble (P-1 passes of F, B or W) over 1F1B's (P-1 forward-and-backwards), as the utilization
    formulas of parallel/pp_schedule.py give it: (1/u - 1) per schedule, a third."""
    cfg, cl = replace(TINY, n_layer=8), plan.Cluster(4)
    bubble = {s: plan.step_time(cfg, cl, plan.Layout(pp=4, micro=1, schedule=s), 256, 8)["bubble"]
              for s in ("1f1b", "zb1")}
    idle = {s: 1 / theoretical_utilization(4, 8, 1, s) - 1 for s in bubble}
    assert bubble["zb1"] < bubble["1f1b"]
    assert bubble["zb1"] / bubble["1f1b"] == pytest.approx(idle["zb1"] / idle["1f1b"])


def test_search_proposes_zero_bubble_schedules_only_where_train_py_runs_them():
    """Few micro-batches on many stages: the zero-bubble schedules lead the pipelined meshes under --code ours. The
    reference (Llama 3, Megatron) has none, and no search proposes one in fp8, which train.py refuses. Every zb layout
    the search tries is one train.py accepts: at 6 layers zbv runs on 2 stages, not on 4 (2P chunks > L)."""
    cfg, cl = replace(PRESETS["tiny"], n_layer=8), plan.Cluster(4)
    ours = [p.layout.schedule for p in plan.plan(cfg, cl, 256, 8, top=100, code="ours") if p.layout.pp > 1]
    assert {"zb1", "zbv"} <= set(ours) and ours[0] in ("zb1", "zbv")
    for code, fp8 in (("reference", False), ("ours", True)):
        found = {p.layout.schedule for p in plan.plan(cfg, cl, 256, 8, top=100, code=code, fp8=fp8)}
        assert not found & {"zb1", "zbv"}, (code, fp8)
    assert "fp8" in plan.invalid(cfg, cl, plan.Layout(pp=4, micro=1, schedule="zb1", fp8=True), 256, 8)
    cfg = replace(cfg, n_layer=6)
    tried = [lay for family in plan.candidates(cfg, cl, 256, 8, code="ours") for lays in family for lay in lays
             if lay.schedule in ("zb1", "zbv")]
    assert {(lay.schedule, lay.pp) for lay in tried} == {("zb1", 2), ("zb1", 4), ("zbv", 2)}
    for lay in tried:
        args = config.parse_args(["--pp", str(lay.pp), "--tp", str(lay.tp), "--dp-mode", lay.dp_mode, "--micro-batch",
                                  str(lay.micro), "--global-batch", "8", "--pp-schedule", lay.schedule]
                                 + ["--dp-shard", str(lay.shard)] * (lay.dp_mode == "hsdp"))
        layer_counts(cfg, lay.pp, lay.V, 8 // (lay.dp * lay.micro), schedule=args.pp_schedule)  # or LayoutError


def test_mfu_is_model_flops_over_peak_time():
    cl = plan.Cluster(8)
    t = plan.step_time(TINY, cl, plan.Layout(dp=8, ckpt="full"), 256, 64)
    flops = flops_per_token(TINY, 256) * 64 * 256
    assert t["mfu"] == pytest.approx(flops / (8 * 989e12 * t["total"]))
    assert t["hfu"] > t["mfu"]  # full checkpointing recomputes the forward


# ---------------------------------------------------------------- Llama 3 405B, paper Table 4

LLAMA3 = [  # (gpus, seq, published (dp, tp, pp, cp), reported BF16 MFU); 16M tokens per batch
    (8192, 8192, (64, 8, 16, 1), 0.43),
    (16384, 8192, (128, 8, 16, 1), 0.41),
    (16384, 131072, (8, 8, 16, 16), 0.38),
]
CFG405 = PRESETS["llama3-405b"]


@lru_cache(maxsize=None)
def plans405(gpus, seq):
    return plan.plan(CFG405, plan.Cluster(gpus), seq, 2**24 // seq, top=10)


def published(gpus, seq, mesh):
    """The best fitting variant of the published layout: FSDP-style sharding over dp, interleaved 1F1B,
    one sequence per microbatch, no full checkpointing. The paper leaves V and the CP kernel open."""
    dp, tp, pp, cp = mesh
    cl, batch, best = plan.Cluster(gpus), 2**24 // seq, None
    for V in (2, 4, 8):
        for ckpt in ("none", "selective"):
            for cp_mode in ("ring", "allgather") if cp > 1 else ("ring",):
                lay = plan.Layout(dp, tp, pp, cp, "fsdp", 0, 1, ckpt, "interleaved", V, cp_mode)
                if plan.invalid(CFG405, cl, lay, seq, batch):
                    continue
                p = plan.evaluate(CFG405, cl, lay, seq, batch)
                if p.fits and (best is None or p.mfu > best.mfu):
                    best = p
    return best


@pytest.mark.parametrize("gpus,seq,mesh,reported", LLAMA3)
def test_llama3_405b_published_layout_fits_and_matches_reported_mfu(gpus, seq, mesh, reported):
    p = published(gpus, seq, mesh)
    assert p is not None, "the published layout must fit in 80 GB"
    assert abs(p.mfu - reported) <= 0.06, plan.bill(p, plan.Cluster(gpus))


@pytest.mark.parametrize("gpus,seq,mesh,reported", LLAMA3)
def test_llama3_405b_published_layout_is_in_the_top_10(gpus, seq, mesh, reported):
    meshes = [(p.layout.dp, p.layout.tp, p.layout.pp, p.layout.cp) for p in plans405(gpus, seq)]
    assert mesh in meshes, meshes


# ---------------------------------------------------------------- the notes' scaling recipe

def winner(model, gpus, seq=None, cfg=None):
    cfg = cfg or PRESETS[model]
    seq = seq or cfg.seq_len
    return plan.plan(cfg, plan.Cluster(gpus), seq, max(1, plan.default_batch_tokens(cfg) // seq), top=1)[0].layout


@pytest.mark.parametrize("gpus", [8, 32, 128])
def test_ddp_wins_for_a_1b_model_up_to_128_gpus(gpus):
    lay = winner("1b", gpus)
    assert (lay.dp_mode, lay.tp, lay.pp, lay.cp) == ("ddp", 1, 1, 1), lay


@pytest.mark.parametrize("gpus", [64, 256])
def test_fsdp_wins_once_the_model_state_does_not_fit(gpus):
    cfg, cl, seq = PRESETS["llama3-8b"], plan.Cluster(gpus), 8192
    batch = plan.default_batch_tokens(cfg) // seq
    ddp = plan.evaluate(cfg, cl, plan.Layout(dp=gpus, ckpt="full"), seq, batch)
    assert not ddp.fits  # 8B params x 18 B > 80 GB
    lay = winner("llama3-8b", gpus)
    assert lay.dp_mode in ("fsdp", "hsdp") or lay.dist_opt, lay  # sharded: FSDP, HSDP or Megatron's dist. optimizer


def test_model_parallelism_appears_past_50b_params_and_1000_gpus():
    lay = winner("llama3-70b", 1024)
    assert lay.tp * lay.pp * lay.cp > 1, lay


def test_context_parallelism_appears_for_long_sequences():
    assert winner("llama3-8b", 256, seq=131072).cp > 1


# ---------------------------------------------------------------- command line

def run_cli(*args):
    return subprocess.run([sys.executable, "-m", "bench.planner", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)


def test_cli_prints_the_top_10_for_405b_at_128k_tokens():
    r = run_cli("--model", "llama3-405b", "--gpus", "16384", "--gpus-per-node", "8", "--seq-len", "131072")
    assert r.returncode == 0, r.stderr
    rows = [line for line in r.stdout.splitlines() if line[:3].strip().isdigit() and "dp=" in line]
    assert len(rows) == 10 and "MFU" in r.stdout and "memory" in r.stdout, r.stdout


def test_cli_bills_one_layout_and_rejects_a_bad_one(capsys):
    assert plan.main(["--model", "llama3-405b", "--gpus", "8192", "--layout",
                      "dp=64,tp=8,pp=16,dp_mode=fsdp,ckpt=selective,V=4"]) == 0
    out = capsys.readouterr().out
    assert "MFU" in out and "bubble" in out and "fits" in out, out
    assert plan.main(["--model", "llama3-405b", "--gpus", "8192", "--layout", "dp=64,tp=16,pp=8"]) == 2
    assert "tp must divide" in capsys.readouterr().err


def test_cli_compares_fsdp_inside_and_across_nodes(capsys):
    """L15: the same mesh with its FSDP group spread over 8 nodes vs inside each node (hsdp)."""
    assert plan.main(["--model", "llama3-8b", "--gpus", "64", "--top", "3", "--compare-fsdp-scope"]) == 0
    l15 = capsys.readouterr().out.split("L15")[1]
    shard = l15.split("shard=")[1].split(")")[0]  # the winner's dp ranks on one node
    assert "dp_mode=fsdp" in l15 and f"dp_mode=hsdp,shard={shard}," in l15 and l15.count("MFU") == 2, l15


@pytest.mark.parametrize("flags,named", [
    (["--gpus", "0"], "--gpus"), (["--gpus", "-3"], "--gpus"), (["--gpus-per-node", "0"], "--gpus-per-node"),
    (["--peak-tflops", "0"], "--peak-tflops"), (["--inter-gbs", "0"], "--inter-gbs"),
    (["--layout", "foo"], "--layout"), (["--gpus", "12"], "--gpus"),
    (["--n-head", "7", "--d-model", "2048"], "--d-model"), (["--seq-len", "0"], "--seq-len"),
])
def test_cli_refuses_bad_input_with_one_line_and_exit_2(flags, named, capsys):
    assert plan.main(["--model", "llama3-8b"] + flags) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"error: {named}") and "\n" not in err, err
