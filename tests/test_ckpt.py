"""Activation checkpointing (parallel/ckpt.py): same losses as no checkpointing, with and without tp; what is
stored (sqrt keeps ceil(N/C) boundaries); what is recomputed (matches recomputed_layers, the HFU term;
selective repeats no matmul); dropout recomputes the same mask (L19); bad policies exit 2."""
import contextlib
import io
import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import config
import model
import train
from bench.labs.ckpt_memory import heap_reader, measure_memory
from bench.ranks import run_ranks
from data.metrics import read_metrics
from parallel import ckpt
from parallel.materialize import init_weights
from parallel.mesh import LayoutError
from tests.layouts import BASE, assert_same_losses

FAST = ["--peak-tflops", "1"]
POLICIES = ["full", "every:2", "sqrt", "segment:3", "op", "selective"]
TP_RUNS = {  # name: flags, on 2 ranks
    "tp2 full": ["--tp", "2", "--ckpt", "full"],
    "tp2-sp every:2": ["--tp", "2", "--sp", "--ckpt", "every:2"],
    "tp2 sqrt": ["--tp", "2", "--ckpt", "sqrt"],
    "tp2-sp selective": ["--tp", "2", "--sp", "--ckpt", "selective"],
    "tp2-sp op": ["--tp", "2", "--sp", "--ckpt", "op"],
    "tp2 dropout none": ["--tp", "2", "--dropout", "0.2"],
    "tp2 dropout full": ["--tp", "2", "--dropout", "0.2", "--ckpt", "full"],
}


def _argv(out_dir, flags):
    return BASE + FAST + ["--out", str(out_dir)] + flags


def _train_each(rank, world, argvs):
    return [train.main(argv) for argv in argvs]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("ckpt_runs")
    losses = {"none": train.main(_argv(out / "none", []))}
    for policy in POLICIES:
        losses[policy] = train.main(_argv(out / policy, ["--ckpt", policy, "--metrics", str(out / f"{policy}.jsonl")]))
    tp_losses = run_ranks(_train_each, 2, args=([_argv(out / n, f) for n, f in TP_RUNS.items()],), timeout=600)[0]
    losses.update(zip(TP_RUNS, tp_losses))
    return losses, out


@pytest.mark.parametrize("name", POLICIES + [n for n in TP_RUNS if "dropout" not in n])
def test_ckpt_layout_matches_one_process(name, runs):
    losses, _ = runs
    assert_same_losses(losses[name], losses["none"], rtol=1e-5)


def test_tp_dropout_recomputes_identically_in_training(runs):
    losses, _ = runs
    assert_same_losses(losses["tp2 dropout full"], losses["tp2 dropout none"], rtol=1e-6)
    assert losses["tp2 dropout none"] != losses["none"]  # dropout is really on


@pytest.mark.parametrize("policy", POLICIES)
def test_hfu_counts_the_recomputed_layers(policy, runs):
    _, out = runs
    rows = read_metrics(out / f"{policy}.jsonl")[0]
    cfg = train.model_config(config.parse_args(_argv(out, [])), 257)
    recomputed = ckpt.recomputed_layers(cfg, policy)
    ratio = model.flops_per_token(cfg, recomputed_layers=recomputed) / model.flops_per_token(cfg)
    assert all(r["hfu"] / r["mfu"] == pytest.approx(ratio) for r in rows)
    assert (ratio > 1) == (policy not in ("selective",))


# ---------------------------------------------------------------- what is stored and what is recomputed

CFG = model.ModelConfig(n_layer=4, d_model=32, n_head=4, n_kv_head=2, ffn_dim=64, vocab_size=64, seq_len=16)


def build(cfg, policy, seed=0):
    with torch.device("meta"):
        m = model.GPT(cfg)
    ckpt.apply(m, policy)
    return init_weights(m, seed, "cpu")


def stored_hidden_states(cfg, policy):
    """How many distinct (B, T, d) tensors (or (B·T, d) views, as linears save them) autograd keeps from
    run_layers' forward for backward; weights are not counted."""
    m = build(cfg, policy)
    x = torch.randn(2, cfg.seq_len, cfg.d_model, requires_grad=True)
    cos, sin = model.rope_angles(torch.arange(cfg.seq_len), cfg.head_dim, cfg.rope_theta)
    saved, weights = {}, {p.untyped_storage().data_ptr() for p in m.parameters()}

    def pack(t):
        if t.numel() == x.numel() and t.untyped_storage().data_ptr() not in weights:
            saved[t.untyped_storage().data_ptr()] = t
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        m.run_layers(m.layers, x, cos, sin)
    return len(saved)


@pytest.mark.parametrize("n_layer", [1, 4, 5, 10, 16])
def test_sqrt_stores_only_segment_boundaries(n_layer):
    cfg = model.ModelConfig(**{**CFG.__dict__, "n_layer": n_layer})
    c = math.ceil(math.sqrt(n_layer))
    assert stored_hidden_states(cfg, "sqrt") == math.ceil(n_layer / c)
    assert stored_hidden_states(cfg, "full") == n_layer
    assert stored_hidden_states(cfg, "segment:2") == math.ceil(n_layer / 2)
    assert stored_hidden_states(cfg, "none") > 3 * n_layer  # norms, residuals, attention inputs, ...


def saved_bytes(cfg, policy, autocast):
    """Bytes of the distinct storages a GPT's forward saves for backward, seen by a last saved-tensor rule (after
    selective's own), and the parameters' gradients."""
    m = build(cfg, policy)
    ids = torch.randint(0, cfg.vocab_size, (2, cfg.seq_len + 1), generator=torch.Generator().manual_seed(0))
    seen = {}

    def count(t):
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    ckpt.keep_saved(m, count, None)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        loss = m(ids[:, :-1], ids[:, 1:])
    kept = sum(seen.values())
    loss.backward()
    return kept, [p.grad for p in m.parameters()]


@pytest.mark.parametrize("autocast", [False, True])
def test_selective_keeps_no_norm_or_swiglu_output(autocast):
    """Selective keeps exactly the norms' outputs (in the compute dtype: fp32, or bf16 under autocast, one tensor
    that q, k, v, gate, up and the head read as it is) and SwiGLU's product fewer, and its gradients are bit-identical
    to keeping them."""
    (none, none_grads), (selective, grads) = (saved_bytes(CFG, p, autocast) for p in ("none", "selective"))
    d, f, tokens = CFG.d_model, CFG.ffn_dim, 2 * CFG.seq_len
    per_layer = (2 * d + f) * (2 if autocast else 4)
    assert none - selective == tokens * (CFG.n_layer * per_layer + d * (2 if autocast else 4))
    for a, b in zip(grads, none_grads):
        assert torch.equal(a, b)


class ForwardFlops(TorchDispatchMode):
    """Counts matmul calls and the FLOPs of forward matmuls and forward attention that run inside it."""

    def __init__(self):
        super().__init__()
        self.mm_calls, self.attention_calls, self.mm_flops, self.attention_flops = 0, 0, 0, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name == "mm":
            (m, k), n = args[0].shape, args[1].shape[1]
            self.mm_calls += 1
            self.mm_flops += 2 * m * k * n
        elif name.startswith("_scaled_dot_product") and not name.endswith("backward"):
            B, H, T, hd = args[0].shape
            self.attention_calls += 1
            self.attention_flops += 4 * B * H * T * T * hd  # QK^T and AV, no causal discount (PaLM)
        return func(*args, **(kwargs or {}))


def backward_counts(cfg, policy, batch=2):
    m = build(cfg, policy)
    ids = torch.randint(0, cfg.vocab_size, (batch, cfg.seq_len + 1), generator=torch.Generator().manual_seed(0))
    loss = m(ids[:, :-1], ids[:, 1:])
    with ForwardFlops() as counter:
        loss.backward()
    return counter


@pytest.mark.parametrize("policy", POLICIES)
def test_recomputed_flops_match_recomputed_layers(policy):
    """The forward work that backward repeats, counted op by op, equals recomputed_layers x one layer's forward
    FLOPs (the HFU term): each checkpointed layer's 7 matmuls and attention, less each segment's final
    down_proj (torch stops recomputing once backward has what it needs). Selective repeats no matmul; op repeats
    each layer's k, o and up matmuls and not attention."""
    cfg = model.ModelConfig(**{**CFG.__dict__, "n_layer": 5})
    batch = 2
    base, got = backward_counts(cfg, "none", batch), backward_counts(cfg, policy, batch)
    layers = ckpt.recomputed_layers(cfg, policy)
    tokens = batch * cfg.seq_len
    layer_flops = model.flops_per_token(cfg, recomputed_layers=1) - model.flops_per_token(cfg)
    executed = (got.mm_flops - base.mm_flops) + got.attention_flops
    assert executed == pytest.approx(layers * layer_flops * tokens, rel=0.01)  # norm weights: not matmuls
    matmuls, attentions = {"full": (7 * 5 - 5, 5), "every:2": (7 * 3 - 3, 3), "sqrt": (7 * 5 - 2, 5),
                           "segment:3": (7 * 5 - 2, 5), "op": (3 * 5, 0), "selective": (0, 0)}[policy]
    assert (got.mm_calls - base.mm_calls, got.attention_calls) == (matmuls, attentions)


@pytest.mark.parametrize("policy", POLICIES)
def test_recompute_reproduces_dropout(policy):
    cfg = model.ModelConfig(**{**CFG.__dict__, "dropout": 0.3})
    ids = torch.randint(0, cfg.vocab_size, (2, cfg.seq_len + 1), generator=torch.Generator().manual_seed(0))
    grads = {}
    for p in ("none", policy):
        m = build(cfg, p)
        torch.manual_seed(7)
        m(ids[:, :-1], ids[:, 1:]).backward()
        grads[p] = {n: q.grad for n, q in m.named_parameters()}
    for name, g in grads["none"].items():
        torch.testing.assert_close(grads[policy][name], g, rtol=0, atol=0, msg=name)


def test_peak_memory_falls_from_none_through_sqrt_to_full():
    """The bench's exact malloc-counted peak (bench/labs/ckpt_memory.py, L17), on 9 layers: none > sqrt > full. The heap
    count is the process's, so the sizes keep the gaps (MBs) well above what another thread frees meanwhile."""
    read = heap_reader(torch.device("cpu"))
    if read is None:
        pytest.skip("needs glibc's mallinfo2 to count allocated bytes")
    cfg = model.ModelConfig(**{**CFG.__dict__, "n_layer": 9, "d_model": 128, "seq_len": 128})
    ids = torch.randint(0, cfg.vocab_size, (2, cfg.seq_len + 1), generator=torch.Generator().manual_seed(0))
    peak = {p: measure_memory(cfg, p, ids[:, :-1], ids[:, 1:], torch.device("cpu"), read)[2]
            for p in ("none", "sqrt", "full")}
    assert peak["none"] > 1.5 * peak["sqrt"] and peak["sqrt"] > 1.2 * peak["full"], peak


def test_checkpointing_keeps_parameter_names():
    names = [n for n, _ in build(CFG, "sqrt").named_parameters()]
    assert names == [n for n, _ in build(CFG, "none").named_parameters()]


# ---------------------------------------------------------------- bad input

@pytest.mark.parametrize("policy", ["bogus", "every:0", "every:x", "segment:", "every"])
def test_bad_ckpt_policy_exits_2(policy):
    err = io.StringIO()
    with contextlib.redirect_stderr(err), pytest.raises(SystemExit) as e:
        train.main(_argv("/nonexistent-never-written", ["--ckpt", policy]))
    assert e.value.code == 2
    lines = err.getvalue().strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: --ckpt: "), lines


def test_parse():
    assert ckpt.parse("every:3") == ("every", 3) and ckpt.parse("sqrt") == ("sqrt", None)
    with pytest.raises(LayoutError, match="--ckpt: unknown policy"):
        ckpt.parse("sometimes")
