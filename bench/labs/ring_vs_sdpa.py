"""Ring attention's own cost at cp = 1: forward+backward time against plain SDPA on the full sequence (L25).

    python -m bench.labs.ring_vs_sdpa               # GPU: seq 8192, bf16, Llama-3-8B heads (32 q, 8 kv, hd 128)
    python -m bench.labs.ring_vs_sdpa --cpu-smoke   # CPU: a small size, to check the script (no result file)

With one block the difference is what every cp > 1 step also pays: the flash kernel call that returns the
log-sum-exp, the fp32 online-softmax merge and fp32 dQ/dK/dV accumulators. Also checks both give the same output and
gradients. Needs a GPU (bf16 flash kernels): on CPU it says so and exits 0.
"""

import torch

from bench import common
from bench.gpu.checks import inputs, with_grads
from model import causal_attention
from parallel.comm import CommStats, Group
from parallel.ring_attention import RingAttention, pick_kernel


def fwd_bwd(attend, q, k, v, dout):
    def step():
        for t in (q, k, v):
            t.grad = None
        attend(q, k, v).backward(dout)
    return step


@common.command
def main(argv=None):
    p = common.parser(__doc__)
    p.add_argument("--seq", type=int, default=8192)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--cpu-smoke", action="store_true", help="run a small size on CPU (no result file)")
    args = p.parse_args(argv)
    if not common.has_cuda() and not args.cpu_smoke:
        print("ring_vs_sdpa: needs a GPU (bf16 flash attention); skipped on this CPU-only machine.")
        return 0
    device = torch.device("cuda" if common.has_cuda() and not args.cpu_smoke else "cpu")
    if args.cpu_smoke:
        args.seq, args.heads, args.kv_heads, args.head_dim = 512, 4, 2, 32
    q, k, v, dout = inputs((args.batch, args.heads, args.kv_heads, args.seq, args.head_dim), device)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    ring = RingAttention(Group("cp", [0], None, 0, CommStats()))  # cp = 1: a group of one, nothing is sent
    results = {}
    for name, attend in (("sdpa", causal_attention), ("ring", ring)):
        results[name] = [t.float() for t in with_grads(attend, q, k, v, dout)]
        results[name + "_s"] = common.time_it(fwd_bwd(attend, q, k, v, dout), device, min_s=1.0, min_reps=5, warmup=2)
    errors = [(a - b).abs().max().item() for a, b in zip(results["ring"], results["sdpa"])]
    flops = 4 * args.batch * args.heads * args.seq ** 2 * args.head_dim * 0.5 * 3.5  # causal, fwd 1 + bwd 2.5
    sdpa_ms, ring_ms = results["sdpa_s"] * 1e3, results["ring_s"] * 1e3
    tflops = {name: flops / results[name + "_s"] / 1e12 for name in ("sdpa", "ring")}
    rows = [["SDPA (is_causal, full sequence)", f"{sdpa_ms:.2f}", f"{tflops['sdpa']:.3g}", "1.00"],
            [f"ring attention, cp = 1 ({pick_kernel(q)})", f"{ring_ms:.2f}", f"{tflops['ring']:.3g}",
             f"{ring_ms / sdpa_ms:.2f}"]]
    notes = [f"batch {args.batch}, seq {args.seq}, {args.heads} q heads, {args.kv_heads} kv heads, head dim "
             f"{args.head_dim}, bf16; forward + backward, median of >= 5 after 2 warmup.",
             "TFLOP/s counts the causal half: 4·b·H·T²·hd·0.5 per forward, x3.5 for forward + backward.",
             f"max |ring - sdpa| over dQ, dK, dV, out: {max(errors):.3g} (bf16)."]
    print("\n".join(notes))
    if args.cpu_smoke:
        print(common.markdown_table(["attention", "fwd+bwd ms", "TFLOP/s", "x SDPA"], rows))
        return 0
    common.write_result(args.out, "ring_vs_sdpa", "Ring attention overhead at cp = 1 vs SDPA (fwd+bwd)",
                        ["attention", "fwd+bwd ms", "TFLOP/s", "x SDPA"], rows, notes=notes)
    return 0
