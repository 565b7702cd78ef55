"""Part 6 of the GPU run: this code's efficiency factors for the planner's --code ours (planner/factors.py), measured
at the 1b model's sizes into OUT/plan_factors.json (`python -m bench.planner --factors`): mm, a block's linears
(forward and both backward shapes) over the peak and the planner's rows loss; attn, causal SDPA fwd + bwd (12 d T
FLOPs per token) over the peak and the keys loss; elem, a bf16 add over HBM_TBS; launch_us, host time per tiny op;
fp8, _scaled_mm over bf16 on the forward shapes. --smoke: the same on CPU, tiny and fp32 (it checks the script).
"""
import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from bench import common

HBM_TBS = {"NVIDIA H100 80GB HBM3": 3.35, "NVIDIA H100 PCIe": 2.0, "NVIDIA H100 NVL": 3.9, "NVIDIA H200": 4.8,
           "NVIDIA H200 NVL": 4.8}  # memory bandwidth in TB/s by the name torch.cuda.get_device_name() reports
ROWS0, KEYS0 = 128, 512  # the planner's rows and keys losses (bench/planner/step_time.py: MM_ROWS0, ATTN_KEYS0)


def linears(cfg, rows, dtype, device):
    """(a, b) operand pairs of one block's linears over `rows` token rows: each weight's forward and both backward
    shapes; the first 7 are the forward ones."""
    d, f, hd = cfg.d_model, cfg.ffn_dim, cfg.head_dim
    shapes = [(d, cfg.n_head * hd), (d, cfg.n_kv_head * hd), (d, cfg.n_kv_head * hd), (cfg.n_head * hd, d), (d, f),
              (d, f), (f, d)]
    pairs = [((rows, i), (i, o)) for i, o in shapes]
    pairs += [p for i, o in shapes for p in (((rows, o), (o, i)), ((o, rows), (rows, i)))]
    return [(torch.randn(a, dtype=dtype, device=device), torch.randn(b, dtype=dtype, device=device)) for a, b in pairs]


def flops(pairs):
    return sum(2 * a.shape[0] * a.shape[1] * b.shape[1] for a, b in pairs)


def launch_us(device, n=2000):
    """Host microseconds per tiny op, launched back to back without waiting (synchronized before and after)."""
    x = torch.zeros(1, device=device)
    common.sync(device)
    t0 = time.perf_counter()
    for _ in range(n):
        x.add_(1)
    host = time.perf_counter() - t0
    common.sync(device)
    return host / n * 1e6


def fp8_speedup(pairs, device):
    """_scaled_mm over bf16 on the forward shapes, or None where fp8 matmuls are missing."""
    if device.type != "cuda" or torch.cuda.get_device_capability() < (8, 9) or not hasattr(torch, "_scaled_mm"):
        return None
    fwd = pairs[:7]
    one = torch.ones((), device=device)
    q = [(a.to(torch.float8_e4m3fn), b.t().contiguous().to(torch.float8_e4m3fn).t()) for a, b in fwd]
    fp8 = common.time_it(lambda: [torch._scaled_mm(a, b, one, one, out_dtype=torch.bfloat16) for a, b in q], device)
    bf16 = common.time_it(lambda: [a @ b for a, b in fwd], device)
    return bf16 / fp8


def measure(cfg, micro, device, smoke):
    """{"rates": what ran, "factors": the planner's factors, "sizes": at which sizes}."""
    rows, T, dtype = micro * cfg.seq_len, cfg.seq_len, torch.float32 if smoke else torch.bfloat16
    peak = (common.measured_cpu_peak_tflops(min_s=0.3) if smoke else common.gpu_peak_tflops()) * 1e12
    pairs = linears(cfg, rows, dtype, device)
    mm_rate = flops(pairs) / common.time_it(lambda: [a @ b for a, b in pairs], device, min_s=0.5)
    q = torch.randn(micro, cfg.n_head, T, cfg.head_dim, dtype=dtype, device=device, requires_grad=True)
    k, v = (torch.randn(micro, cfg.n_kv_head, T, cfg.head_dim, dtype=dtype, device=device, requires_grad=True)
            for _ in range(2))

    def attention():
        F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True).sum().backward()
    attn_rate = 12 * cfg.d_model * T * rows / common.time_it(attention, device, min_s=0.5)
    n = 2 ** 18 if smoke else 2 ** 28
    a, b = torch.randn(n, dtype=dtype, device=device), torch.randn(n, dtype=dtype, device=device)
    mem_rate = 3 * n * a.element_size() / common.time_it(lambda: a + b, device, min_s=0.5)
    hbm = None if smoke else HBM_TBS.get(torch.cuda.get_device_name())
    rates = {"matmul_tflops": mm_rate / 1e12, "attention_tflops": attn_rate / 1e12, "memory_gbs": mem_rate / 1e9,
             "launch_us": launch_us(device), "fp8_over_bf16": fp8_speedup(pairs, device), "peak_tflops": peak / 1e12,
             "hbm_tbs": hbm}
    factors = {"mm": mm_rate / peak * (rows + ROWS0) / rows, "attn": attn_rate / peak * (T + KEYS0) / T,
               "elem": hbm and mem_rate / (hbm * 1e12), "launch_us": rates["launch_us"], "fp8": rates["fp8_over_bf16"]}
    return {"rates": rates, "factors": {k: v for k, v in factors.items() if v},
            "sizes": {"rows": rows, "seq": T, "d_model": cfg.d_model, "ffn_dim": cfg.ffn_dim, "dtype": str(dtype)}}


def write(path, name, got):
    """The factors file `python -m bench.planner --factors` reads."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps({"device": name, "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"),
                                      **got}, indent=1) + "\n")
