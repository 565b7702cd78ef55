"""Activation checkpointing (--ckpt): keep fewer activations in forward, recompute them in backward.

Split:    nothing across ranks: a chunk's blocks are grouped into checkpointed segments; only a segment's input
          (the (b, s, d) residual stream at the boundary) is kept, and backward re-runs its forward from there.
Policies: full      every block alone: N boundaries stored, N blocks recomputed;
          every:K   the blocks whose global index is a multiple of K alone; the others keep everything;
          segment:C C consecutive blocks per segment: ceil(N/C) boundaries, plus one segment's activations
                    while it is recomputed: O(N/C + C); sqrt is C = ceil(sqrt N), O(sqrt N) (L18 sweeps C);
          selective every block, saving matmul and attention outputs (torch's selective checkpointing policy):
                    only elementwise ops (norms, rope, silu·up, dropout) are recomputed, no matmul FLOPs.
Costs:    one more forward of each recomputed block: counted in HFU, not in MFU (L20, L23); under tp it repeats
          the block's collectives. Nothing is communicated by this file; nothing overlaps.
RNG:      torch.utils.checkpoint(preserve_rng_state=True) restores the CPU and CUDA generators, so dropout
          draws the same masks again (L19). Memory: see bench/results/ckpt_memory.md (L17).
"""
import math
from functools import partial

import torch
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

import model as M
from parallel.mesh import LayoutError

POLICIES = "none, full, every:K, segment:C, sqrt or selective"
_aten = torch.ops.aten
_SAVED_BY_SELECTIVE = {getattr(_aten, name).default for name in (
    "mm", "addmm", "bmm", "_scaled_mm", "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
    "_scaled_dot_product_flash_attention_for_cpu")
    if hasattr(_aten, name)}


def parse(policy):
    """'every:4' -> ('every', 4); 'full' -> ('full', None). Raises LayoutError('--ckpt') otherwise."""
    if policy in ("none", "full", "sqrt", "selective"):
        return policy, None
    kind, _, k = str(policy).partition(":")
    if kind in ("every", "segment"):
        if k.isdigit() and int(k) >= 1:
            return kind, int(k)
        raise LayoutError("--ckpt", f"{kind}:{'K' if kind == 'every' else 'C'} needs a positive integer, got {k!r}")
    raise LayoutError("--ckpt", f"unknown policy {policy!r}; choose {POLICIES}")


def segments(keys, policy):
    """The plan for one chunk's blocks (their global indices as ModuleDict keys, in order):
    a list of (keys of consecutive blocks, checkpointed?)."""
    kind, k = parse(policy)
    if kind == "none":
        return [(list(keys), False)] if keys else []
    if kind in ("sqrt", "segment"):
        c = k if kind == "segment" else math.ceil(math.sqrt(len(keys)))
        return [(list(keys[i:i + c]), True) for i in range(0, len(keys), c)]
    if kind == "every":
        return [([key], int(key) % k == 0) for key in keys]
    return [([key], True) for key in keys]  # full, selective


def recomputed_layers(cfg, policy):
    """How many layers' forwards run a second time per step, over the whole model (the HFU term of
    M.flops_per_token). torch's checkpoint stops recomputing once the last tensor backward needs is back, so
    each segment's final down_proj matmul (and what follows it) is not repeated: that share is subtracted.
    Exact without pp; under pp, sqrt/segment:C count segments per stage, a little more than assumed here."""
    kind, k = parse(policy)
    n = cfg.n_layer
    layers = {"none": 0, "full": n, "sqrt": n, "segment": n, "selective": 0, "every": -(-n // (k or 1))}[kind]
    n_segments = {"sqrt": -(-n // math.ceil(math.sqrt(n))), "segment": -(-n // (k or 1))}.get(kind, layers)
    return layers - n_segments * 2 * cfg.d_model * cfg.ffn_dim / M.layer_flops_per_token(cfg)


def _save_matmuls_and_attention(ctx, op, *args, **kwargs):
    return CheckpointPolicy.MUST_SAVE if op in _SAVED_BY_SELECTIVE else CheckpointPolicy.PREFER_RECOMPUTE


def run_blocks(blocks, x, cos, sin):
    for block in blocks:
        x = block(x, cos, sin)  # (B, T, d) -> (B, T, d)
    return x


class CheckpointedLayers:
    """A drop-in for GPT.run_layers(layers, x, cos, sin) that runs the blocks under a policy."""

    def __init__(self, policy):
        self.policy = policy
        self.selective = parse(policy)[0] == "selective"

    def __repr__(self):
        return f"CheckpointedLayers({self.policy!r})"

    def __call__(self, layers, x, cos, sin):
        for keys, checkpointed in segments(list(layers.keys()), self.policy):
            blocks = [layers[key] for key in keys]
            if not checkpointed or not torch.is_grad_enabled():
                x = run_blocks(blocks, x, cos, sin)
                continue
            extra = {}
            if self.selective:
                extra["context_fn"] = partial(create_selective_checkpoint_contexts, _save_matmuls_and_attention)
            # Only x (B, T, d) and cos/sin are kept; everything inside is recomputed in backward.
            x = checkpoint(run_blocks, blocks, x, cos, sin, use_reentrant=False, preserve_rng_state=True, **extra)
        return x


def apply(chunk, policy):
    """Swaps the chunk's run_layers for the checkpointed one; modules and parameter names are untouched."""
    if parse(policy)[0] != "none":
        chunk.run_layers = CheckpointedLayers(policy)
    return chunk
