"""Grouped-query attention on every context-parallel path hands K,V to the fused kernel with their own kv head
count: a dispatch mode records each fused attention call (forward and backward) and every op that could repeat
K,V to the query heads; and each path still equals one-process SDPA in output and gradients."""
import math

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from bench.ranks import run_ranks
from parallel import cp as CP
from parallel.mesh import Mesh
from parallel.ring_attention import RingAttention

HEADS = ((8, 2), (8, 4))  # (H, Hkv): groups of 4 and of 2 query heads per kv head
MODES = ("ring", "ring_math", "ulysses", "allgather")
HEAD_DIM = 8

# fused attention ops -> (index of k, index of v, dim of heads) in their positional arguments
_FORWARD = {"_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention",
            "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
            "_scaled_dot_product_fused_attention_overrideable"}
FUSED = {**{name: (1, 2, 1) for name in _FORWARD}, **{f"{name}_backward": (2, 3, 1) for name in _FORWARD},
         "_flash_attention_forward": (1, 2, 2), "_efficient_attention_forward": (1, 2, 2),
         "_flash_attention_backward": (2, 3, 2), "_efficient_attention_backward": (2, 3, 2)}
COPIES = {"repeat_interleave", "repeat", "expand", "index_select", "gather"}  # may copy K,V to more heads


class AttentionRecorder(TorchDispatchMode):
    """fused: [(op, k heads, v heads, got a mask)]; copies: [(op, in shape, out shape)] of the COPIES ops that
    grow a tensor shaped like attention heads (4+ dims, head_dim last) - the way a K,V repeat shows up."""

    def __init__(self, head_dim):
        super().__init__()
        self.head_dim, self.fused, self.copies = head_dim, [], []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = func.overloadpacket.__name__
        if name in FUSED:
            k_at, v_at, heads_at = FUSED[name]
            self.fused.append((name, args[k_at].shape[heads_at], args[v_at].shape[heads_at],
                               kwargs.get("attn_mask") is not None))
        elif name in COPIES:
            x, y = args[0], out
            if x.dim() >= 4 and x.shape[-1] == self.head_dim and y.numel() > x.numel():
                self.copies.append((name, tuple(x.shape), tuple(y.shape)))
        return out


def full_attention(q, k, v):
    repeat = q.shape[1] // k.shape[1]
    return F.scaled_dot_product_attention(q, k.repeat_interleave(repeat, 1), v.repeat_interleave(repeat, 1),
                                          is_causal=True)


def _heads_rank(rank, world):
    """Each mode on this rank's zigzag tokens, recorded: {(mode, H, Hkv): (fused calls, copies, errors)}."""
    mesh = Mesh(rank, world, dp=1, cp=world)
    B, T = 2, 4 * world
    mine = CP.local_positions(T, rank, world)
    out = {}
    for H, Hkv in HEADS:
        g = torch.Generator().manual_seed(H * 10 + Hkv)
        q, do = torch.randn(B, H, T, HEAD_DIM, generator=g), torch.randn(B, H, T, HEAD_DIM, generator=g)
        k, v = torch.randn(B, Hkv, T, HEAD_DIM, generator=g), torch.randn(B, Hkv, T, HEAD_DIM, generator=g)
        full = [t.clone().requires_grad_() for t in (q, k, v)]
        y = full_attention(*full)
        y.backward(do)
        for mode in MODES:
            attend = RingAttention(mesh.cp_group, kernel="math") if mode == "ring_math" else CP.make_attend(mesh, mode)
            local = [t[:, :, mine].clone().requires_grad_() for t in (q, k, v)]
            with AttentionRecorder(HEAD_DIM) as recorder:
                y_local = attend(*local)
                y_local.backward(do[:, :, mine])
            errors = [(y_local - y[:, :, mine]).abs().max().item()] + [
                (a.grad - b.grad[:, :, mine]).abs().max().item() for a, b in zip(local, full)]
            out[(mode, H, Hkv)] = recorder.fused, recorder.copies, errors
    return out


@pytest.fixture(scope="module", params=[2, 4], ids=["cp2", "cp4"])
def runs(request):
    return request.param, run_ranks(_heads_rank, request.param, timeout=120)


def local_kv_heads(mode, kv_heads, cp):
    """The kv heads a rank's kernel should see: all of them, or for ulysses its share of lcm(Hkv, cp) - the
    minimal repeat that lets cp split too few kv heads."""
    return math.lcm(kv_heads, cp) // cp if mode == "ulysses" else kv_heads


def each_run(runs, mode):
    cp, results = runs
    for rank, result in enumerate(results):
        for (name, H, Hkv), (fused, copies, errors) in result.items():
            if name == mode:
                yield f"cp {cp} rank {rank} {mode} H {H} Hkv {Hkv}", cp, Hkv, fused, copies, errors


@pytest.mark.parametrize("mode", ["ring", "ulysses", "allgather"])
def test_fused_kernels_get_kv_with_the_local_kv_heads(runs, mode):
    """Forward and backward fused calls on every fused path (all-gather included), with is_causal rather than a
    mask, and K,V with the local kv head count - not repeated to the query heads."""
    for where, cp, Hkv, fused, _, _ in each_run(runs, mode):
        names = {name for name, *_ in fused}
        assert any(n.endswith("_backward") for n in names) and any(not n.endswith("_backward") for n in names), (
            f"{where}: not on a fused kernel forward and backward: {names}")
        expected = local_kv_heads(mode, Hkv, cp)
        wrong = [call for call in fused if call[1:] != (expected, expected, False)]
        assert not wrong, f"{where}: expected k/v with {expected} heads and no mask, got {wrong}"


@pytest.mark.parametrize("mode", MODES)
def test_no_kv_copy_to_the_query_heads(runs, mode):
    """No repeat_interleave, repeat, index_select, gather or expand that grows a head-shaped tensor (K,V repeated
    per query head, or broadcast by a batched matmul), math fallback included. The one exception: ulysses with
    fewer kv heads than cp can split (Hkv 2 at cp 4) repeats K and V to lcm(Hkv, cp) heads, and no further."""
    for where, cp, Hkv, _, copies, _ in each_run(runs, mode):
        if mode == "ulysses" and Hkv % cp:
            assert len(copies) == 2 and all(math.prod(out[1:-2]) == math.lcm(Hkv, cp) for _, _, out in copies), (
                f"{where}: expected K and V repeated to lcm(Hkv, cp) = {math.lcm(Hkv, cp)} heads, got {copies}")
        else:
            assert not copies, f"{where}: copies of K,V to more heads: {copies}"


@pytest.mark.parametrize("mode", MODES)
def test_outputs_and_grads_equal_one_process_sdpa(runs, mode):
    for where, *_, errors in each_run(runs, mode):
        assert max(errors) < 1e-5, f"{where}: out, dq, dk, dv err {errors}"
