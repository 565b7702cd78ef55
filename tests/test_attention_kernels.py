"""Which attention kernel each dtype gets. model.causal_attention hands grouped-query K/V as they are to a fused
kernel that takes them (flash: CUDA fp16/bf16, and the CPU's in any dtype) and repeats the kv heads only for CUDA's
fp32 kernel, which needs one per query head (else SDPA falls back to math and (T x T) scores). Ring attention's math
fallback, which fp32 on CUDA takes, bounds its fp32 scores by taking the query rows in chunks."""
import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils._python_dispatch import TorchDispatchMode

import model
from parallel import cp, ring_attention
from parallel.mesh import Mesh


def qkv(dtype, t=64, heads=8, kv_heads=2):
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, heads, t, 16, generator=gen).to(dtype)
    k, v = (torch.randn(2, kv_heads, t, 16, generator=gen).to(dtype) for _ in range(2))
    return q, k, v


def reference(q, k, v):
    """Plain fp64 causal attention, the kv heads repeated."""
    g = q.shape[1] // k.shape[1]
    k, v = k.double().repeat_interleave(g, 1), v.double().repeat_interleave(g, 1)
    s = q.double() @ k.transpose(-2, -1) / q.shape[-1] ** 0.5
    s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool).triu(1), float("-inf"))
    return s.softmax(-1) @ v


def test_which_kernels_take_grouped_query_kv_as_they_are():
    for dtype in (torch.float16, torch.bfloat16, torch.float32):
        assert model.fused_gqa("cpu", dtype)
    assert model.fused_gqa("cuda", torch.bfloat16) and model.fused_gqa("cuda", torch.float16)
    assert not model.fused_gqa("cuda", torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_the_cpu_flash_kernel_runs_grouped_query_attention_in_every_dtype(dtype):
    """With every backend but flash switched off, a math fallback would raise: the fused kernel ran."""
    q, k, v = qkv(dtype)
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
        out = model.causal_attention(q, k, v)
    torch.testing.assert_close(out.double(), reference(q, k, v), rtol=0, atol=1e-5 if dtype == torch.float32 else 2e-2)


def test_fp32_on_cuda_hands_the_kernel_one_kv_head_per_query_head(monkeypatch):
    """Where no fused kernel takes GQA (fp32 on CUDA, stood in for by the device rule), SDPA gets H kv heads and no
    enable_gqa, so that the memory-efficient kernel runs instead of math; where one does, the Hkv heads as they are."""
    calls = []
    sdpa = F.scaled_dot_product_attention
    monkeypatch.setattr(F, "scaled_dot_product_attention",
                        lambda q, k, v, **kw: calls.append((k.shape[1], kw.get("enable_gqa", False))) or sdpa(q, k, v,
                                                                                                              **kw))
    q, k, v = qkv(torch.float32)
    expected = reference(q, k, v)
    for takes_gqa, seen in ((True, (2, True)), (False, (8, False))):
        monkeypatch.setattr(model, "fused_gqa", lambda device_type, dtype, answer=takes_gqa: answer)
        calls.clear()
        torch.testing.assert_close(model.causal_attention(q, k, v).double(), expected, rtol=0, atol=1e-5)
        assert calls == [seen]


class LargestScores(TorchDispatchMode):
    """The most elements of any fp32 tensor an op made with one column per key (scores, probabilities)."""

    def __init__(self, keys):
        super().__init__()
        self.keys, self.largest = keys, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (list, tuple)) else [out]:
            if isinstance(t, torch.Tensor) and t.dtype == torch.float32 and t.dim() == 4 and t.shape[-1] == self.keys:
                self.largest = max(self.largest, t.numel())
        return out


def test_ring_attentions_math_kernel_takes_query_rows_in_chunks(monkeypatch):
    """cp = 1 ring attention on the math kernel: with a budget of 4,096 scores it never holds (heads x T x T) =
    32,768 of them, and its output and gradients equal the unchunked kernel's."""
    ring = ring_attention.RingAttention(Mesh().cp_group, kernel="math")
    results = {}
    for budget in (2 ** 26, 2 ** 12):
        monkeypatch.setattr(ring_attention, "MATH_SCORES", budget)
        q, k, v = (t.requires_grad_() for t in qkv(torch.float32))
        with LargestScores(64) as seen:
            out = ring(q, k, v)
            out.backward(torch.ones_like(out))
        results[budget] = (out.detach(), q.grad, k.grad, v.grad, seen.largest)
    big, small = results[2 ** 26], results[2 ** 12]
    assert big[-1] == 2 * 8 * 64 * 64 and small[-1] <= 2 ** 12, (big[-1], small[-1])
    for a, b in zip(big[:-1], small[:-1]):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(small[0].double(), reference(*qkv(torch.float32)), rtol=0, atol=1e-5)


class HostOps(TorchDispatchMode):
    """Ops that take data from the host (a tensor built from a Python list) or read a value back to it."""
    HOST = {"lift_fresh", "lift_fresh_copy", "_local_scalar_dense", "item"}

    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket.__name__ in self.HOST:
            self.seen.append(str(func))
        return func(*args, **(kwargs or {}))


def test_allgather_cp_attention_builds_nothing_on_the_host():
    """cp's allgather mode put the gathered K,V in position order with two index tensors made from Python lists in
    every layer's forward (a host-to-device copy each, uncompiled); now slices and a flip. Same output."""
    q, k, v = (t.requires_grad_() for t in qkv(torch.float32, t=32))
    with HostOps() as host:
        out = cp.allgather_attention(q, k, v, Mesh().cp_group)
        out.sum().backward()
    assert host.seen == []
    torch.testing.assert_close(out.double(), reference(*qkv(torch.float32, t=32)), rtol=0, atol=1e-5)


def test_the_position_order_of_gathered_kv():
    """Rank r holds chunks r and 2CP-1-r: gathered in rank order, position order is every rank's first chunk, then
    the second ones from the last rank back."""
    cp_size, c = 3, 2
    chunks = {r: (r, 2 * cp_size - 1 - r) for r in range(cp_size)}
    gathered = torch.tensor([[chunk] * c for r in range(cp_size) for _ in ("k", "v") for chunk in chunks[r]],
                            dtype=torch.float32).view(cp_size * 2, 1, 1, 2 * c, 1)  # each token tagged by its chunk
    ordered = cp._in_position_order(gathered, cp_size)
    assert ordered[0, 0, 0, :, 0].tolist() == [p for p in range(2 * cp_size) for _ in range(c)]
