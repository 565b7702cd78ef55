"""Tensor parallel (parallel/tp.py) against one process: losses (overlap on and off), the column-then-row MLP
(L27), the vocab-parallel loss, communication volume, and bad layouts. The overlap itself: tests/test_tp_overlap.py.

Starting a set of gloo ranks costs seconds on a shared 2-core CPU, so every check that needs a given
world size runs in one set of ranks (the `runs` fixture); each test then reads its own result. The
single-process reference runs in this process.
"""
import contextlib
import io
from functools import partial

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import model
import train
from bench.ranks import run_ranks
from parallel import tp, tp_overlap
from parallel.comm import ALL_GATHER
from parallel.ddp import DDP
from parallel.materialize import init_weights
from parallel.mesh import LayoutError, Mesh
from tests.jobs import Failed, run_jobs
from tests.layouts import BASE, assert_same_losses

FAST = ["--peak-tflops", "1"]  # skip the CPU matmul-rate measurement
CFG = model.ModelConfig(n_layer=2, d_model=64, n_head=8, n_kv_head=4, ffn_dim=96, vocab_size=257, seq_len=16)
LAYOUTS = {  # name: (world, flags)
    "tp2": (2, ["--tp", "2"]),
    "tp2-sp": (2, ["--tp", "2", "--sp"]),
    "tp4": (4, ["--tp", "4"]),
    "tp4-sp": (4, ["--tp", "4", "--sp"]),
    "tp2-no-overlap": (2, ["--tp", "2", "--no-overlap"]),
    "tp2-sp-no-overlap": (2, ["--tp", "2", "--sp", "--no-overlap"]),
    "tp4-no-overlap": (4, ["--tp", "4", "--no-overlap"]),
    "tp4-sp-no-overlap": (4, ["--tp", "4", "--sp", "--no-overlap"]),
    "tp2-dp2-ddp-accum": (4, ["--tp", "2", "--micro-batch", "2"]),
    "tp2-dp2-fsdp-sp": (4, ["--tp", "2", "--sp", "--dp-mode", "fsdp"]),
    "tp2-dp4-hsdp2x2-sp": (8, ["--tp", "2", "--sp", "--dp-mode", "hsdp", "--dp-shard", "2", "--micro-batch", "1"]),
}


def _argv(out_dir, flags):
    return BASE + FAST + ["--out", str(out_dir)] + flags


def _train(rank, world, argv):
    return train.main(argv)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """{world: [rank 0's results, rank 1's, ...]}; world 1 is the in-process reference run."""
    out = tmp_path_factory.mktemp("tp_runs")
    jobs = {2: [("mlp", _sharded_mlp_rank, ()), ("vocab", _vocab_loss_rank, ()), ("comm", _comm_rank, (3,))],
            3: [("bad", _bad_flags_rank, ([flags for flags, _ in BAD_TP.values()],))],
            4: [("comm", _comm_rank, (3,))], 8: []}
    for name, (world, flags) in LAYOUTS.items():
        jobs[world].append((name, _train, (_argv(out / name, flags),)))
    results = {1: [{"ref": train.main(_argv(out / "ref", []))}]}
    for world, world_jobs in jobs.items():
        results[world] = run_ranks(run_jobs, world, args=(world_jobs,), timeout=600)
    return results


def result(runs, world, key):
    """Every rank's result of one job; fails the test with the rank's traceback if a job raised."""
    per_rank = [r[key] for r in runs[world]]
    for rank, r in enumerate(per_rank):
        if isinstance(r, Failed):
            pytest.fail(f"rank {rank} of {world} failed in {key}:\n{r}")
    return per_rank


@pytest.mark.parametrize("name", LAYOUTS)
def test_tp_layout_matches_one_process(name, runs):
    assert_same_losses(result(runs, LAYOUTS[name][0], name)[0], runs[1][0]["ref"], rtol=1e-5)


# ---------------------------------------------------------------- column then row (L27)

def _sharded_mlp_rank(rank, world):
    mesh = Mesh(rank, world, tp=world)
    torch.manual_seed(0)
    full = model.MLP(CFG)  # the same weights on every rank
    x = torch.randn(2, CFG.seq_len, CFG.d_model, requires_grad=True)
    upstream = torch.randn(2, CFG.seq_len, CFG.d_model)
    (full(x) * upstream).sum().backward()
    with torch.device("meta"):
        mlp = model.MLP(CFG)
    tp.parallelize_mlp(mlp, CFG, mesh.tp_group, sequence_parallel=False)
    dims = {name: p.tp_shard[0] for name, p in mlp.named_parameters()}  # 0: column-, 1: row-parallel
    mlp.to_empty(device="cpu")
    with torch.no_grad():
        for name, p in mlp.named_parameters():
            p.copy_(full.get_parameter(name).chunk(world, dims[name])[rank])
    x_local = x.detach().clone().requires_grad_()
    mesh.stats.reset()
    y = mlp(tp.EnterTP.apply(x_local, mesh.tp_group, False))  # f, gate/up column, down row, g
    forward_calls = dict(mesh.stats.calls)
    mesh.stats.reset()
    (y * upstream).sum().backward()
    backward_calls = dict(mesh.stats.calls)
    weight_err = max((p.grad - full.get_parameter(n).grad.chunk(world, dims[n])[rank]).abs().max().item()
                     for n, p in mlp.named_parameters())
    return dict(out_err=(y - full(x)).abs().max().item(), x_grad_err=(x_local.grad - x.grad).abs().max().item(),
                weight_err=weight_err, forward_calls=forward_calls, backward_calls=backward_calls)


def test_column_then_row_mlp_is_one_all_reduce(runs):
    """φ(X·[A_1 A_2])·[B_1; B_2] = φ(X·A_1)·B_1 + φ(X·A_2)·B_2: the sum is the only communication."""
    for r in result(runs, 2, "mlp"):
        assert r["out_err"] < 1e-6 and r["x_grad_err"] < 1e-6 and r["weight_err"] < 1e-6, r
        assert r["forward_calls"] == {"all_reduce": 1}, r["forward_calls"]
        assert r["backward_calls"] == {"all_reduce": 1}, r["backward_calls"]


# ---------------------------------------------------------------- vocab-parallel cross-entropy

class VocabWatcher(TorchDispatchMode):
    """Records the shape of every tensor an op produces that has the full (padded) vocab as a dimension."""

    def __init__(self, vocab):
        super().__init__()
        self.vocab, self.seen = vocab, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in (out if isinstance(out, (tuple, list)) else [out]):
            if isinstance(t, torch.Tensor) and t.dim() >= 2 and self.vocab in t.shape:
                self.seen.append((str(func), tuple(t.shape)))
        return out


def _tp_gpt(mesh, cfg, sequence_parallel, seed=0, overlap=True):
    with torch.device("meta"):
        m = model.GPT(cfg)
    if mesh.tp > 1:
        tp.parallelize(m, mesh, sequence_parallel=sequence_parallel)
        tp_overlap.fuse_columns(m, overlap=overlap)  # as train.py
        if sequence_parallel and overlap:
            tp_overlap.rings(m)  # as train.py with --sp-ring: --sp's collectives as ring hops
    return init_weights(m, seed, "cpu")


def _vocab_loss_rank(rank, world):
    mesh = Mesh(rank, world, tp=world)
    V = CFG.padded_vocab
    torch.manual_seed(0)
    logits = (3 * torch.randn(4, CFG.seq_len, V)).requires_grad_()  # the same on every rank
    targets = torch.randint(0, CFG.vocab_size, (4, CFG.seq_len))
    local = logits.detach().chunk(world, dim=-1)[rank].clone().requires_grad_()  # (B, T, V/t)
    loss = tp.VocabParallelLoss(mesh.tp_group, V // world)(local, targets)
    loss.backward()
    gathered = torch.empty(world * local.shape[0], *local.shape[1:])  # a test-side gather, for the check
    ALL_GATHER(gathered, local.detach().contiguous())
    gathered = torch.cat(gathered.chunk(world), dim=-1)  # (B, T, V) in vocab order
    ref = F.cross_entropy(gathered.flatten(0, 1), targets.flatten())
    ref_logits = logits
    F.cross_entropy(ref_logits.flatten(0, 1), targets.flatten()).backward()
    grad_err = (local.grad - ref_logits.grad.chunk(world, dim=-1)[rank]).abs().max().item()

    watched = {}  # a whole training forward/backward, with and without tp
    for name, m in (("tp", _tp_gpt(mesh, CFG, sequence_parallel=True)), ("one", _tp_gpt(Mesh(), CFG, False))):
        ids = torch.randint(0, CFG.vocab_size, (4, CFG.seq_len + 1))
        with VocabWatcher(V) as watcher:
            m(ids[:, :-1], ids[:, 1:]).backward()
        watched[name] = watcher.seen
    return dict(loss=loss.item(), ref=ref.item(), grad_err=grad_err, watched=watched)


def test_vocab_parallel_cross_entropy_matches_and_never_builds_full_vocab_logits(runs):
    for r in result(runs, 2, "vocab"):
        assert r["loss"] == pytest.approx(r["ref"], rel=1e-6)
        assert r["grad_err"] < 1e-7
        assert r["watched"]["tp"] == [], r["watched"]["tp"][:5]
        assert r["watched"]["one"], "the watcher must see the (tokens, V) logits of the unsharded model"


# ---------------------------------------------------------------- communication volume

def _comm_rank(rank, world, b):
    out = {}
    for sp, overlap in ((False, True), (True, True), (False, False), (True, False)):
        mesh = Mesh(rank, world, tp=world)
        m = _tp_gpt(mesh, CFG, sp, overlap=overlap)
        wrapper = DDP(torch.nn.ModuleList([m]), mesh)
        torch.manual_seed(1)
        ids = torch.randint(0, CFG.vocab_size, (b, CFG.seq_len + 1))
        mesh.stats.reset()
        saved = []  # the shapes of the activations autograd keeps for backward
        with torch.autograd.graph.saved_tensors_hooks(partial(_record_activation, saved), lambda t: t):
            loss = m(ids[:, :-1], ids[:, 1:])
        loss.backward()
        wrapper.finish_grad_sync()
        full = ((b, CFG.seq_len, CFG.d_model), (b * CFG.seq_len, CFG.d_model))  # matmuls save 3-d inputs flattened
        out[sp, overlap] = dict(calls=dict(mesh.stats.calls), bytes=dict(mesh.stats.bytes),
                                full_activations_saved=sum(shape in full for shape in saved))
    return out


def _record_activation(saved, t):
    if not isinstance(t if t._base is None else t._base, torch.nn.Parameter):  # weights and their transposes
        saved.append(tuple(t.shape))
    return t


def expected_tp_traffic(cfg, b, t, sequence_parallel):
    """Calls and bytes per rank for one micro-batch's forward + backward and the grad sync, fp32.

    Each layer: forward 2 all-reduces of the (b, s, d) activation (after o_proj, down_proj), backward 2 (the f
    before q/k/v and gate/up). Outside the layers: the embedding's all-reduce (forward), lm_head's input f
    (backward), the loss's all-gather of (2, b·s) floats. --sp splits each all-reduce into a reduce-scatter
    and an all-gather of the same total bytes, gathers each of the 2L+1 norm outputs again in backward for the
    weight grads (instead of saving them), and adds one all-reduce of each of the 2L+1 norm weights' grads. With
    overlap, a ring of t-1 p2p hops counts as the one collective it replaces: the same calls and bytes."""
    A, L, ring = 4 * b * cfg.seq_len * cfg.d_model, cfg.n_layer, (t - 1) / t
    loss_gather = ring * t * 2 * b * cfg.seq_len * 4
    if not sequence_parallel:
        n = 4 * L + 2
        return {"all_reduce": n, "all_gather": 1}, {"all_reduce": n * 2 * ring * A, "all_gather": loss_gather}
    n, regathers = 4 * L + 2, 2 * L + 1
    calls = {"all_gather": n + regathers + 1, "reduce_scatter": n, "all_reduce": 2 * L + 1}
    sent = {"all_gather": (n + regathers) * ring * A + loss_gather, "reduce_scatter": n * ring * A,
            "all_reduce": (2 * L + 1) * 2 * ring * 4 * cfg.d_model}
    return calls, sent


@pytest.mark.parametrize("world", [2, 4])
def test_tp_communication_matches_theory(world, runs):
    b = 3
    for r in result(runs, world, "comm"):
        for sp, overlap in r:
            calls, sent = expected_tp_traffic(CFG, b, world, sp)
            assert r[sp, overlap]["calls"] == calls, (sp, overlap, r[sp, overlap]["calls"], calls)
            for kind, expected in sent.items():
                assert r[sp, overlap]["bytes"][kind] == pytest.approx(expected, rel=0.01), (sp, overlap, kind)
        # --sp moves the same activation bytes, as reduce-scatters + all-gathers instead of all-reduces, plus
        # the backward's 2L+1 re-gathers, each half of one of the 4L+2 all-reduces: a quarter more in all
        for overlap in (True, False):
            tp_only, sp = r[False, overlap]["bytes"], r[True, overlap]["bytes"]
            sp_activations = sp["all_gather"] - tp_only["all_gather"] + sp["reduce_scatter"]
            assert sp_activations == pytest.approx(1.25 * tp_only["all_reduce"], rel=1e-9)


def test_sp_saves_no_full_sequence_activation(runs):
    """Sequence parallel's memory promise: every (b, s, d) activation kept for backward is a 1/t sequence shard.
    The gathered norm outputs the column-parallel weight grads need are gathered again in backward."""
    for r in result(runs, 2, "comm"):
        for overlap in (True, False):
            assert r[False, overlap]["full_activations_saved"] >= 2 * CFG.n_layer + 1  # tp alone: norms' outputs...
            assert r[True, overlap]["full_activations_saved"] == 0


# ---------------------------------------------------------------- bad layouts

def _bad_flags_rank(rank, world, cases):
    codes = []
    for flags in cases:
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            try:
                train.main(_argv("/nonexistent-never-written", flags))
                codes.append((None, err.getvalue()))
            except SystemExit as e:
                codes.append((e.code, err.getvalue()))
    return codes


BAD_TP = {  # tp 3, so that the padded vocab (a multiple of 64) can fail too
    "heads": (["--tp", "3"], "--tp: n_head 8 is not divisible by tp 3"),
    "kv heads": (["--tp", "3", "--d-model", "96", "--n-head", "6", "--n-kv-head", "2"],
                 "--tp: n_kv_head 2 is not divisible by tp 3"),
    "ffn": (["--tp", "3", "--d-model", "96", "--n-head", "6", "--n-kv-head", "3", "--ffn-dim", "200"],
            "--tp: ffn_dim 200 is not divisible by tp 3"),
    "vocab": (["--tp", "3", "--d-model", "96", "--n-head", "6", "--n-kv-head", "3"],
              "--tp: the vocab 257, padded to 320, is not divisible by tp 3"),
    "sp seq": (["--tp", "3", "--d-model", "96", "--n-head", "6", "--n-kv-head", "3", "--vocab-size", "384",
                "--sp", "--seq-len", "64"], "--sp: seq_len 64 is not divisible by cp x tp = 1 x 3"),
}


def test_bad_tp_layouts_exit_2(runs):
    results = result(runs, 3, "bad")
    for (name, (_, message)), (code, text) in zip(BAD_TP.items(), results[0]):
        assert code == 2, (name, code, text)
        lines = text.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: " + message), (name, text)
    assert all(code == 2 for rank in results[1:] for code, _ in rank)


def test_validate_names_the_flag():
    with pytest.raises(LayoutError, match="--tp: n_head 8 is not divisible by tp 16"):
        tp.validate(CFG, 16)
