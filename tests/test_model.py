"""model.py: shapes, causality, GQA, presets, layout-independent init, FLOP accounting, Hugging Face export, Llama 3's
RoPE scaling, the loss's padding mask, tied embeddings, and the checks on a saved model config."""
import re

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

import model
from data import integrity
from data.export import export_hf
from parallel.materialize import init_weights, local_init
from parallel.memory import LiveBytes
from parallel.tp import VocabParallelCrossEntropy

try:  # transformers is a test requirement; the tests that need it skip without it
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
except ImportError:
    ROPE_INIT_FUNCTIONS = None

CFG = model.ModelConfig(n_layer=2, d_model=64, n_head=4, n_kv_head=2, ffn_dim=96, vocab_size=100, seq_len=32)


def make(cfg=CFG, seed=0):
    with torch.device("meta"):
        gpt = model.GPT(cfg)
    return init_weights(gpt, seed, "cpu")


def test_shapes_and_padded_vocab():
    gpt = make()
    x = torch.randint(0, 100, (3, 16))
    assert gpt(x).shape == (3, 16, 128)  # vocab 100 padded to a multiple of 64
    assert gpt(x, x).dim() == 0


def test_causal_a_later_token_never_changes_earlier_logits():
    gpt = make()
    x = torch.randint(0, 100, (1, 16))
    y = x.clone()
    y[0, 10] = (y[0, 10] + 1) % 100
    a, b = gpt(x), gpt(y)
    torch.testing.assert_close(a[:, :10], b[:, :10])
    assert not torch.allclose(a[:, 10:], b[:, 10:])


def test_gqa_equals_multi_head_attention_with_repeated_kv_heads():
    gqa = make()
    mha_cfg = model.ModelConfig(**{**CFG.__dict__, "n_kv_head": CFG.n_head})
    mha = model.GPT(mha_cfg)
    state = gqa.state_dict()
    hd, repeat = CFG.head_dim, CFG.n_head // CFG.n_kv_head
    for k in list(state):
        # (Hkv*hd, d) -> (H*hd, d): each kv head serves `repeat` consecutive q heads
        if k.endswith(("k_proj.weight", "v_proj.weight")):
            state[k] = state[k].view(CFG.n_kv_head, hd, -1).repeat_interleave(repeat, 0).reshape(CFG.n_head * hd, -1)
    mha.load_state_dict(state)
    x = torch.randint(0, 100, (2, 16))
    torch.testing.assert_close(gqa(x), mha(x))
    assert gqa.layers["0"].self_attn.k_proj.weight.shape == (CFG.n_kv_head * hd, CFG.d_model)


def test_llama3_presets_have_the_published_parameter_counts():
    published = {"llama3-8b": 8.03e9, "llama3-70b": 70.6e9, "llama3-405b": 405.9e9}
    for name, n in published.items():
        total, _ = model.param_counts(model.PRESETS[name])
        assert abs(total - n) / n < 0.002, (name, total)


def test_param_counts_match_the_module():
    gpt = make()
    total, non_embedding = model.param_counts(CFG)
    assert total == sum(p.numel() for p in gpt.parameters())
    assert total - non_embedding == gpt.embed_tokens.weight.numel()


def test_init_depends_on_seed_and_name_only_and_slices_reproduce_the_full_tensor():
    a, b = make(seed=3), make(seed=3)
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(p, q), name
    assert not torch.equal(make(seed=4).lm_head.weight, a.lm_head.weight)
    w = a.layers["1"].mlp.down_proj.weight  # (d, ffn): a row-parallel weight, split along dim 1
    meta = torch.empty(w.shape[0], w.shape[1] // 2, device="meta")
    for rank in range(2):
        meta.tp_shard = (1, rank, 2)
        torch.testing.assert_close(local_init("layers.1.mlp.down_proj.weight", meta, CFG, 3), w.chunk(2, 1)[rank])


def test_flops_per_token_matches_torch_flop_counter():
    """FlopCounterMode counts matmuls (and attention, under the math SDPA backend that decomposes into bmm).
    PaLM's 6·N counts every parameter; the norm gains are elementwise, not matmuls, so the counter misses
    exactly 6·(norm params) per token. The embedding lookup is in neither. No other gap."""
    gpt = make()
    B, T = 2, CFG.seq_len
    x = torch.randint(0, 100, (B, T))
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        gpt(x, x).backward()
    norm_params = (2 * CFG.n_layer + 1) * CFG.d_model
    expected = (model.flops_per_token(CFG, T) - 6 * norm_params) * B * T
    assert counter.get_total_flops() == expected


def test_hfu_adds_one_forward_per_recomputed_layer():
    base = model.flops_per_token(CFG)
    full = model.flops_per_token(CFG, recomputed_layers=CFG.n_layer)
    layer_params = (model.param_counts(CFG)[1] - CFG.d_model - CFG.padded_vocab * CFG.d_model) / CFG.n_layer
    assert full - base == CFG.n_layer * (2 * layer_params + 4 * CFG.d_model * CFG.seq_len)


LLAMA3_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 16}  # a short original context: most frequencies scaled


@pytest.mark.parametrize("fields", [{}, {"rope_scaling": LLAMA3_SCALING, "tie_embeddings": True}],
                         ids=["plain", "llama3-scaled-tied"])
def test_export_loads_in_transformers_with_the_same_logits(tmp_path, fields):
    """The true vocabulary's logits (100 of the 128 rows); tied and scaled, config.json says so."""
    transformers = pytest.importorskip("transformers")
    cfg = model.ModelConfig(**{**CFG.__dict__, **fields})
    gpt = make(cfg)
    export_hf(cfg, dict(gpt.named_parameters()), tmp_path)
    hf = transformers.LlamaForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    hf.eval()
    x = torch.randint(0, 100, (2, 32))
    with torch.no_grad():
        torch.testing.assert_close(hf(x).logits, gpt(x)[..., :100], rtol=1e-5, atol=1e-5)


def test_llama3_rope_frequencies_equal_transformers():
    """Within an ulp or two of transformers' own, and far from the unscaled ones."""
    transformers = pytest.importorskip("transformers")
    for head_dim, theta, scaling in ((16, 10000.0, LLAMA3_SCALING),
                                     (64, 500000.0, {**LLAMA3_SCALING, "factor": 32.0,
                                                     "original_max_position_embeddings": 8192})):
        config = transformers.LlamaConfig(hidden_size=4 * head_dim, num_attention_heads=4, rope_theta=theta,
                                          max_position_embeddings=2 * scaling["original_max_position_embeddings"],
                                          rope_scaling=dict(scaling))
        expected, attention_factor = ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")
        ours = model.rope_frequencies(head_dim, theta, scaling)
        torch.testing.assert_close(ours, expected, rtol=3e-7, atol=0)
        assert attention_factor == 1.0
        plain = model.rope_frequencies(head_dim, theta)
        assert (ours < plain * 0.99).sum() >= head_dim // 4 and ours[0] > plain[0] / scaling["factor"]


def test_padded_vocabulary_columns_take_no_part_in_the_loss():
    """vocab_size 100 of 128 columns: the loss is the cross-entropy over the first 100, the padding gets a zero
    gradient; with vocab_size a multiple of 64 (or None) nothing changes, bit for bit."""
    torch.manual_seed(0)
    logits = (3 * torch.randn(40, 128)).requires_grad_()
    targets = torch.randint(0, 100, (40,))
    loss = model.CrossEntropy.apply(logits, targets, 100)
    loss.backward()
    real = logits.detach()[:, :100].requires_grad_()
    expected = F.cross_entropy(real, targets)
    expected.backward()
    torch.testing.assert_close(loss, expected, rtol=1e-6, atol=0)
    torch.testing.assert_close(logits.grad[:, :100], real.grad, rtol=1e-5, atol=1e-7)
    assert not logits.grad[:, 100:].any()
    whole = model.CrossEntropy.apply(logits.detach(), targets)
    assert model.CrossEntropy.apply(logits.detach(), targets, 128) == whole
    assert (whole - expected).abs() > 1e-3  # unmasked, the padding columns' logits would move the loss
    gpt = make()  # vocab_size 100: GPT's own loss is masked too
    x = torch.randint(0, 100, (2, 16))
    torch.testing.assert_close(gpt(x, x), F.cross_entropy(gpt(x)[..., :100].flatten(0, 1), x.flatten()))


def test_the_models_loss_holds_one_logits_sized_tensor_in_backward():
    """The GPT's loss writes the logits' gradient over its logits (made for it alone): from the loss to the head's
    input gradient one (N, V) tensor lives, not two; the gradients are the same bits as a fresh buffer's. Was: two
    (8.8 GB, not 4.2, at Llama 3 8B's local batch of 2 x 8,192 tokens)."""
    torch.manual_seed(0)
    h, w = torch.randn(512, 64, requires_grad=True), torch.randn(256, 64, requires_grad=True)
    targets = torch.randint(0, 256, (1, 512))
    grads, peaks = {}, {}
    for overwrite in (False, True):
        with LiveBytes() as live:
            logits = (h @ w.T)[None]  # (1, N, V), made for the loss
            model.cross_entropy_loss(logits, targets, overwrite=overwrite).backward()
            del logits
        peaks[overwrite], grads[overwrite] = live.peak, (h.grad.clone(), w.grad.clone())
        h.grad = w.grad = None
    assert all(torch.equal(a, b) for a, b in zip(grads[False], grads[True]))
    nv = 512 * 256 * 4  # the logits' bytes (fp32)
    assert peaks[False] - peaks[True] == nv and peaks[True] < 2 * nv, (peaks, nv)


def test_vocabulary_shards_mask_their_own_padding():
    """Under tp each rank holds a shard [vocab_start, vocab_start + 16) of the 128 columns: with vocab_size 100,
    shard 6 has 4 real columns and shard 7 none (its log-sum-exp is -inf, which the combine over shards ignores).
    Each shard's share of the statistics, combined, is the cross-entropy over the 100 columns."""
    torch.manual_seed(1)
    logits, targets = 3 * torch.randn(40, 128), torch.randint(0, 100, (40,))
    stats = []  # per shard: (lse, target logit) over its own columns
    for start in range(0, 128, 16):
        VocabParallelCrossEntropy.apply(logits[:, start:start + 16], targets, start,
                                        lambda lse, t: stats.append((lse, t)) or (lse, t), 100)
    lse = torch.logsumexp(torch.stack([s[0] for s in stats]), dim=0)
    assert torch.isneginf(stats[7][0]).all() and not torch.isnan(lse).any()
    loss = (lse - sum(s[1] for s in stats)).mean()
    torch.testing.assert_close(loss, F.cross_entropy(logits[:, :100], targets), rtol=1e-6, atol=0)
    shard = logits[:, 96:112].clone().requires_grad_()  # backward with the global statistics: padding gets none
    combine = lambda lse, t: (torch.logsumexp(logits[:, :100], 1), t)
    VocabParallelCrossEntropy.apply(shard, targets, 96, combine, 100).backward()
    assert shard.grad[:, :4].abs().sum() > 0 and not shard.grad[:, 4:].any()


def test_a_tied_head_is_the_embedding_one_parameter_through_init():
    """One Parameter after materializing on the meta device, listed once; its gradient is the sum of the head's and
    the embedding's (an untied model with the same weights)."""
    tied_cfg = model.ModelConfig(**{**CFG.__dict__, "tie_embeddings": True})
    tied = make(tied_cfg)
    assert tied.lm_head.weight is tied.embed_tokens.weight
    assert "lm_head.weight" not in dict(tied.named_parameters())
    assert model.param_counts(tied_cfg)[0] == sum(p.numel() for p in tied.parameters())
    untied = model.GPT(CFG)
    untied.load_state_dict({**tied.state_dict(), "lm_head.weight": tied.embed_tokens.weight.detach().clone()})
    x = torch.randint(0, 100, (2, 16))
    tied(x, x).backward()
    untied(x, x).backward()
    torch.testing.assert_close(tied.embed_tokens.weight.grad,
                               untied.embed_tokens.weight.grad + untied.lm_head.weight.grad)


@pytest.mark.parametrize("edit, message", [
    (lambda d: d.pop("n_layer"), "model.n_layer is missing"),
    (lambda d: d.update(n_layer="6"), "model.n_layer must be an integer, got '6'"),
    (lambda d: d.update(rope_theta=float("nan")), "model.rope_theta: must be a finite positive number"),
    (lambda d: d.update(norm_eps=-1e-5), "model.norm_eps: must be a finite positive number"),
    (lambda d: d.update(n_head=3), "model.d_model: d_model 64 is not divisible by n_head 3"),
    (lambda d: d.update(rope_scaling={**LLAMA3_SCALING, "factor": -8.0}), "model.rope_scaling.factor: must be"),
    (lambda d: d.update(tie_embeddings="yes"), "model.tie_embeddings must be true, false or null"),
    (lambda d: d.update(layers=6), "model.layers is not a field")])
def test_a_saved_model_config_must_be_complete_and_consistent(edit, message):
    saved = dict(CFG.__dict__)
    assert integrity.config_from_dict(saved) == CFG
    for name in integrity.OPTIONAL_FIELDS:  # a save from before these fields: absent means None
        del saved[name]
    assert integrity.config_from_dict(saved) == CFG
    edit(saved)
    with pytest.raises(ValueError, match="^" + re.escape(message)):
        integrity.config_from_dict(saved)


def test_rope_is_computed_once_per_positions_and_dtype(monkeypatch):
    """Every layer and micro-batch of a step reuses cos/sin; new positions or a new dtype make them again."""
    calls = []
    angles = model.rope_angles
    monkeypatch.setattr(model, "rope_angles", lambda *a: calls.append(1) or angles(*a))
    gpt = init_weights(model.GPT(CFG), 0, "cpu")
    x = torch.randint(0, CFG.vocab_size, (2, 16))
    positions = torch.arange(16)
    gpt(x)
    gpt(x)
    assert len(calls) == 1
    gpt(x, positions=positions)
    gpt(x, positions=positions)
    assert len(calls) == 2
    gpt(x, positions=torch.arange(16))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        gpt(x)
    assert len(calls) == 4


def test_norm_and_swiglu_gradients_are_exact():
    x = torch.randn(2, 3, 16, dtype=torch.float64, requires_grad=True)
    w = torch.randn(16, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x, w: model.ScaledRMSNorm.apply(x, w, 1e-5), (x, w))
    gate, up = torch.randn(2, 8, dtype=torch.float64, requires_grad=True), torch.randn(2, 8, dtype=torch.float64)
    assert torch.autograd.gradcheck(model.SwiGLU.apply, (gate, up.requires_grad_()))


def saved_bytes(fn, *inputs):
    """Bytes of the tensors autograd keeps for backward, parameters and inputs excluded."""
    given, kept = {t.untyped_storage().data_ptr() for t in inputs}, {}

    def pack(t):
        if t.untyped_storage().data_ptr() not in given:
            kept[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(*inputs)
    return sum(kept.values())


def test_a_bf16_norm_keeps_only_its_input_and_one_fp32_scale_per_row():
    norm = model.RMSNorm(64, 1e-5).to(torch.bfloat16)
    x = torch.randn(8, 64, dtype=torch.bfloat16, requires_grad=True)
    assert saved_bytes(lambda x, w: norm(x), x, norm.weight) == 8 * 4  # 1/rms per row; x itself, no copy
    gate, up = (torch.randn(8, 64, requires_grad=True) for _ in range(2))
    assert saved_bytes(model.SwiGLU.apply, gate, up) == 0  # silu(gate) is recomputed in backward, not kept
