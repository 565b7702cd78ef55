"""The GPU run's in-process checks: 3. the attention kernels the profiler sees, 4. ring attention (cp = 1) and its
block kernels against SDPA on the same bf16 inputs. Each takes measure.py's Run (sizes, device, its table writer)."""
import gc
import traceback
from collections import Counter

import torch
import torch.nn.functional as F
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

import model
from bench import common
from parallel.comm import CommStats, Group
from parallel.ring_attention import KERNELS, RingAttention, pick_kernel

TOL = 2 ** -5  # bf16: max |diff| <= TOL x max(1, max |reference|), about 4 ulps of the tensor's largest element
CLASSES = {"cudnn": ("cudnn",), "flash": ("flash",), "efficient": ("fmha", "memeff", "efficientatt"),  # by name
           "math": ("attentionmath", "softmax", "logsumexp", "gemm", "bmm", "matmul", "nvjet", "xmma", "aten::mm")}
OOM = getattr(torch, "OutOfMemoryError", torch.cuda.OutOfMemoryError)


def attempt(fn, *args):
    """(fn(*args), "ok"), or (None, what went wrong): an OOM or any failure is its row's status, not the end. Frees
    what the run before left (compiled graphs, cached blocks) and resets the peak-memory counters first."""
    gc.collect()
    if hasattr(torch, "compiler") and hasattr(torch.compiler, "reset"):
        torch.compiler.reset()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    try:
        return fn(*args), "ok"
    except OOM:
        return None, "OOM"
    except SystemExit as e:
        return None, f"train.py exited with status {e.code}"
    except Exception as e:  # the row says what failed; the traceback goes to stderr
        traceback.print_exc()
        return None, "OOM" if "out of memory" in str(e) else f"error: {type(e).__name__}: {str(e)[:120]}".split("\n")[0]


def inputs(shape, device, q_rows=None):
    B, H, Hkv, T, hd = shape
    g = torch.Generator(device=device).manual_seed(0)
    make = lambda h, t: torch.randn((B, h, t, hd), generator=g, device=device, dtype=torch.bfloat16)  # noqa: E731
    return make(H, q_rows or T), make(Hkv, T), make(Hkv, T), make(H, q_rows or T)


def with_grads(attend, q, k, v, dout):
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out = attend(q, k, v)
    out.backward(dout)
    return [out.detach(), q.grad, k.grad, v.grad]


def kernels_seen(attend, shape, device):
    """{name: calls} in one forward+backward after a warm-up one: CUDA kernels, or on CPU the profiler's aten ops."""
    q, k, v, dout = inputs(shape, device)
    with_grads(attend, q, k, v, dout)
    common.sync(device)
    cuda = device.type == "cuda"
    with profile(activities=[ProfilerActivity.CPU] + [ProfilerActivity.CUDA] * cuda) as prof:
        with_grads(attend, q, k, v, dout)
        common.sync(device)
    return Counter(e.name for e in prof.events() if (e.device_type == DeviceType.CUDA if cuda else
                                                     e.device_type == DeviceType.CPU and e.name.startswith("aten::")))


def kind(name):
    return next((c for c, words in CLASSES.items() if any(w in name.lower().replace("_", "") for w in words)), "other")


def kernel_part(r):
    rows, ran = [], []
    for label, attend in (("model.causal_attention", model.causal_attention),
                          (f"ring attention, cp = 1 ({pick_kernel(inputs(r.attn, r.device)[0])})",
                           RingAttention(Group("cp", [0], None, 0, CommStats())))):
        seen, status = attempt(kernels_seen, attend, r.attn, r.device)
        if not seen:
            rows.append([label, "-", status if seen is None else "the profiler saw no kernel", "-"])
            continue
        others = [n for n in seen if kind(n) == "other"]
        rows += [[label, kind(n), n[:110], seen[n]] for n in seen if kind(n) != "other"]
        rows.append([label, "other", f"{len(others)} kinds, e.g. {', '.join(n[:40] for n in others[:3])}",
                     sum(seen[n] for n in others)])
        ran.append(f"{label}: {', '.join(sorted({kind(n) for n in seen} - {'other'})) or 'no attention kernel'}")
        r.log(ran[-1])
    what = "CUDA kernels" if r.device.type == "cuda" else "aten ops from the CPU profiler (no GPU: no CUDA kernels)"
    r.table("3. Attention kernels that actually ran", ["attention path", "class", "kernel", "calls"], rows,
            [f"{what} in one forward+backward after a warm-up one, bf16, (batch, heads, kv heads, seq, head dim) = "
             f"{r.attn}; classed by name: {', '.join(CLASSES)}, else other."] + ran)


def ring_check(r, kernel, ring, causal, q_rows):
    """[(max |diff|, tolerance)] of out, dq, dk, dv: RingAttention (ring) or the block kernel, against SDPA on the kv
    heads repeated to the query heads."""
    q, k, v, dout = inputs(r.attn, r.device, q_rows)
    repeat = q.shape[1] // k.shape[1]
    ref = with_grads(lambda q, k, v: F.scaled_dot_product_attention(
        q, k.repeat_interleave(repeat, 1), v.repeat_interleave(repeat, 1), is_causal=causal), q, k, v, dout)
    if ring:
        got = with_grads(RingAttention(Group("cp", [0], None, 0, CommStats()), kernel=kernel), q, k, v, dout)
    else:
        (fwd, bwd), scale = KERNELS[kernel], q.shape[-1] ** -0.5
        out, lse, aux = fwd(q, k, v, causal, scale)
        got = [out, *bwd(dout, q, k, v, out, lse, causal, scale, aux)]
    return [((a.float() - b.float()).abs().max().item(), TOL * max(1.0, b.float().abs().max().item()))
            for a, b in zip(got, ref)]


def ring_part(r):
    B, H, Hkv, T, hd = r.attn
    fused = "flash_cuda" if r.device.type == "cuda" else pick_kernel(inputs(r.attn, r.device)[0])
    kernels = list(dict.fromkeys([fused, "math"]))
    checks = [("RingAttention cp = 1, causal", k, True, True, None) for k in kernels]
    checks += [(f"KERNELS[{k!r}], {what} block", k, False, causal, rows) for k in kernels
               for what, causal, rows in (("causal", True, None), (f"full ({T // 2} q x {T} k)", False, T // 2))]
    rows = []
    for label, kernel, ring, causal, q_rows in checks:
        diffs, status = attempt(ring_check, r, kernel, ring, causal, q_rows)
        bad = [f"{n} {d:.3g} > {t:.3g}" for n, (d, t) in zip(("out", "dq", "dk", "dv"), diffs or []) if d > t]
        verdict = status if diffs is None else ("FAIL: " + ", ".join(bad) if bad else "pass")
        rows.append([label, kernel, *([f"{d:.3g}" for d, _ in diffs] if diffs else ["-"] * 4), verdict])
        r.log(f"{label} ({kernel}): {verdict}")
    r.table("4. Ring attention vs SDPA (bf16)", ["check", "kernel", "max abs d out", "max abs d dq", "max abs d dk",
                                                 "max abs d dv", "bf16 tolerance"], rows,
            [f"against F.scaled_dot_product_attention (kv heads repeated) on the same bf16 q, k, v, dout; (batch, "
             f"heads, kv heads, seq, head dim) = {r.attn}, GQA {H}/{Hkv}; pass: each max abs diff <= 2^-5 x "
             "max(1, max abs reference), about 4 bf16 ulps of the tensor's largest element."])
