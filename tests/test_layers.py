"""The optional layers plug in through the hooks parallel/__init__.py documents, and touch nothing else: fp8.apply
sets `matmul`, pp_bw_split.apply `weight_grads`, tp_overlap.rings swaps the sp modules' class (adding `ring`), and
fp8.gather_in_fp8 sets each block unit's `gather`. Checked on meta-device models, no process group needed."""
import pytest
import torch
from torch import nn

import model
from parallel import fp8, fsdp, pp_bw_split, tp, tp_overlap
from parallel.materialize import local_init
from parallel.mesh import Mesh

CFG = model.ModelConfig(n_layer=2, d_model=64, n_head=4, n_kv_head=2, ffn_dim=128, vocab_size=257, seq_len=32)


def meta_gpt(tp_size=1, sp=False):
    """A meta-device GPT, tp-parallelized over a mesh that only describes its groups (no process group)."""
    with torch.device("meta"):
        gpt = model.GPT(CFG)
    if tp_size > 1:
        tp.parallelize(gpt, Mesh(0, tp_size, tp=tp_size), sequence_parallel=sp)
    return gpt


def state(gpt):
    """Every module's class and plain attributes (what a layer could change), by module name."""
    skip = {"_parameters", "_buffers", "_modules", "training"}
    return {name: (type(m), {k: v for k, v in vars(m).items() if k not in skip and not k.startswith("_")})
            for name, m in gpt.named_modules()}


def changes(before, after):
    """{(module name, attribute or "class")} that differ."""
    out = set()
    for name, (cls, attrs) in after.items():
        old_cls, old_attrs = before[name]
        out |= {(name, "class")} if cls is not old_cls else set()
        out |= {(name, k) for k in set(attrs) | set(old_attrs) if attrs.get(k, None) is not old_attrs.get(k, None)}
    return out


LAYERS = {
    "fp8 (one process)": (1, False, lambda gpt: fp8.apply(gpt), {"matmul"}),
    "fp8 (tp 2, sp)": (2, True, lambda gpt: fp8.apply(gpt), {"matmul"}),
    "zero-bubble split (one process)": (1, False, pp_bw_split.apply, {"weight_grads"}),
    "zero-bubble split (tp 2, sp)": (2, True, pp_bw_split.apply, {"weight_grads"}),
    "tp ring (tp 2, sp)": (2, True, tp_overlap.rings, {"class", "ring"}),
}


@pytest.mark.parametrize("name", list(LAYERS))
def test_an_optional_layer_sets_its_hook_and_nothing_else(name):
    tp_size, sp, apply, allowed = LAYERS[name]
    gpt = meta_gpt(tp_size, sp)
    before = state(gpt)
    apply(gpt)
    changed = changes(before, state(gpt)) - {("", "weight_grads")}  # the chunk keeps its store (the executor's)
    assert changed, "the layer changed nothing"
    assert {attr for _, attr in changed} <= allowed, sorted(changed)
    assert dict(gpt.named_parameters()).keys() == dict(meta_gpt(tp_size, sp).named_parameters()).keys()


def test_the_ring_layer_switches_only_sequence_parallel_modules():
    gpt = meta_gpt(2, sp=False)
    before = state(gpt)
    tp_overlap.rings(gpt)
    assert changes(before, state(gpt)) == set()


def test_fp8_all_gather_sets_the_units_gather_hook_and_nothing_else():
    mesh = Mesh()
    wrapper = fsdp.wrap(nn.ModuleList([meta_gpt()]), mesh, torch.device("cpu"),
                        lambda name, meta, flat=None, out=None: local_init(name, meta, CFG, 0, flat, out),
                        compute_dtype=torch.bfloat16)
    before = [dict(vars(u)) for u in wrapper.units]
    fp8.gather_in_fp8(wrapper, mesh.tp_group)
    for unit, old in zip(wrapper.units, before):
        changed = {k for k in vars(unit) if vars(unit)[k] is not old.get(k)}
        assert changed == ({"gather"} if unit.name.startswith("layers.") else set()), (unit.name, changed)
