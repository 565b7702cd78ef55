"""Activation checkpointing (--ckpt): keep fewer activations in forward, recompute them in backward.

Split:    nothing across ranks. A checkpointed segment of blocks keeps only its input, the (b, s, d)
          residual stream at the boundary. Backward re-runs its forward.
Policies: full      every block alone: L boundaries stored, L blocks recomputed.
          every:K   blocks whose global index is a multiple of K, alone; the others keep all.
          segment:C C blocks a segment: ceil(L/C) boundaries, plus one segment's activations while
                    it is recomputed: O(L/C + C). sqrt: C = ceil(sqrt L).
          op        every block alone, at the level of torch ops: it keeps its input, attention's
                    output and log-sum-exp, and every second matmul's output (q, v, gate, down);
                    backward remakes the rest (the norms, k, RoPE, o, up, SwiGLU), redoing
                    2·d·(kv/2 + d + f)/t matmul FLOPs per token and layer (kv: k's and v's width).
          selective nothing checkpointed. The norms' and SwiGLU's outputs, read only by matmuls,
                    are remade from the norm's input and 1/rms and SwiGLU's gate and up. Per token
                    and layer that saves 2·d·r/sh + f·e/tp bytes (sh = tp under sp; r: residual
                    bytes, e: compute dtype's) for three elementwise passes. Under --compile,
                    compiled.py does it inside the compiled blocks.
Costs:    one more forward of each recomputed block, counted in HFU, not in MFU. Under tp it
          repeats the block's collectives. This file sends nothing; nothing overlaps.
RNG:      checkpoint restores the CPU and CUDA generators, so dropout draws the same masks again.
Memory, measured: bench/results/ckpt_memory.md.
"""
import math

import torch
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

import model
from parallel import keep_saved
from parallel.mesh import LayoutError

POLICIES = "none, full, every:K, segment:C, sqrt, op or selective"
RECOMPUTABLE = (model.ScaledRMSNorm, model.SwiGLU)  # Functions whose output(*saved) remakes it


def parse(policy):
    """'every:4' -> ('every', 4); 'full' -> ('full', None). Else raises LayoutError('--ckpt')."""
    if policy in ("none", "full", "sqrt", "op", "selective"):
        return policy, None
    kind, _, k = str(policy).partition(":")
    if kind in ("every", "segment"):
        if k.isdigit() and int(k) >= 1:
            return kind, int(k)
        raise LayoutError("--ckpt", f"{kind}:{'K' if kind == 'every' else 'C'} needs a positive "
                                    f"integer, got {k!r}")
    raise LayoutError("--ckpt", f"unknown policy {policy!r}; choose {POLICIES}")


def segments(keys, policy):
    """A chunk's blocks (keys: global indices, in order) as [(consecutive keys, checkpointed?)]."""
    kind, k = parse(policy)
    if kind in ("none", "selective"):
        return [(list(keys), False)] if keys else []
    if kind in ("sqrt", "segment"):
        c = k if kind == "segment" else math.ceil(math.sqrt(len(keys)))
        return [(list(keys[i:i + c]), True) for i in range(0, len(keys), c)]
    if kind == "every":
        return [([key], int(key) % k == 0) for key in keys]
    return [([key], True) for key in keys]  # full, op


def recomputed_layers(cfg, policy):
    """Layers whose forward runs twice per step: the HFU term of model.flops_per_token.

    Recomputing stops at backward's last tensor, so each segment's final down_proj matmul, and
    what follows, is not repeated. Under pp, sqrt and segment:C count a few more segments."""
    kind, k = parse(policy)
    n = cfg.n_layer
    if kind == "op":  # the k, o and up matmuls
        d, kv = cfg.d_model, cfg.d_model * cfg.n_kv_head / cfg.n_head
        return n * 2 * d * (kv + d + cfg.ffn_dim) / model.layer_flops_per_token(cfg)
    layers = {"none": 0, "full": n, "sqrt": n, "segment": n, "selective": 0,
              "every": -(-n // (k or 1))}[kind]
    n_segments = {"sqrt": -(-n // math.ceil(math.sqrt(n))),
                  "segment": -(-n // (k or 1))}.get(kind, layers)
    return layers - n_segments * 2 * cfg.d_model * cfg.ffn_dim / model.layer_flops_per_token(cfg)


def pack_recomputable(t):
    """A saved view of a norm's or SwiGLU's output (or its autocast cast), kept as its recipe."""
    base = t if t._base is None else t._base
    fn, cast = base.grad_fn, None
    if type(fn).__name__ == "ToCopyBackward0":  # autocast's copy of it in the compute dtype
        fn, cast = fn.next_functions[0][0], t.dtype
    if getattr(type(fn), "_forward_cls", None) not in RECOMPUTABLE:
        return t
    return fn, cast, t.size(), t.stride(), t.storage_offset() - base.storage_offset()


def unpack_recomputable(kept):
    """The output again, bit for bit, for one reader's backward (q, k and v: three times).

    Nothing is cached on the graph: the graph lives as long as the loss, past the backward."""
    fn, cast, size, stride, offset = kept
    out = type(fn)._forward_cls.output(*fn.saved_tensors)
    return (out if cast is None else out.to(cast)).as_strided(size, stride, offset)


def run_blocks(blocks, x, cos, sin):
    for block in blocks:
        x = block(x, cos, sin)  # (B, T, d) -> (B, T, d)
    return x


def keep_op_outputs():
    """--ckpt op's rule for one checkpointed block, fresh per call: the output of attention and of
    the 1st, 3rd, ... matmul is kept from forward; every other op runs again in backward."""
    matmuls = {False: 0, True: 0}  # counted apart in forward and in the recompute

    def policy(ctx, op, *args, **kwargs):
        if op is torch.ops.aten.mm.default:
            matmuls[ctx.is_recompute] += 1
            keep = matmuls[ctx.is_recompute] % 2 == 1
        else:
            keep = op.__name__.startswith("_scaled_dot_product")  # any SDPA kernel
        return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE
    return create_selective_checkpoint_contexts(policy)


class CheckpointedLayers:
    """A drop-in for GPT.run_layers(layers, x, cos, sin) that runs the blocks under a policy."""

    def __init__(self, policy):
        self.policy = policy
        self.options = {"context_fn": keep_op_outputs} if parse(policy)[0] == "op" else {}

    def __repr__(self):
        return f"CheckpointedLayers({self.policy!r})"

    def __call__(self, layers, x, cos, sin):
        for keys, checkpointed in segments(list(layers.keys()), self.policy):
            blocks = [layers[key] for key in keys]
            if not checkpointed or not torch.is_grad_enabled():
                x = run_blocks(blocks, x, cos, sin)
                continue
            x = checkpoint(run_blocks, blocks, x, cos, sin, use_reentrant=False,
                           preserve_rng_state=True, **self.options)
        return x


def apply(chunk, policy):
    """Swaps the chunk's run_layers for the checkpointed one; selective adds its rule instead."""
    kind = parse(policy)[0]
    if kind == "selective":
        keep_saved(chunk, pack_recomputable, unpack_recomputable)
    elif kind != "none":
        chunk.run_layers = CheckpointedLayers(policy)
    return chunk
