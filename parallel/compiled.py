"""A layer on every layout (--compile, on by default on CUDA): each part that holds math, compiled.

Compiled: every block's forward, the embedding, the final norm and the loss (forward and backward).
Eager: what joins the parts, as RoPE's cache, the head's matmul and the pipeline's hand-offs. Every
collective stays eager too: a compiled part breaks its graph around one (parallel/comm.py). This
runs before the data-parallel wrapper, so FSDP's gathers and frees stay eager. No compiled part
reads the device back to the host: a step keeps its one host read.
"""
import torch

from parallel import ckpt


def apply(chunk, selective=False):
    """Compiles the chunk's parts in place.

    selective (--ckpt selective): ckpt.selective_in_graph steers what compiled blocks save. The
    final norm stays eager: the rule takes its output only from eager autograd.
    """
    if selective:
        ckpt.selective_in_graph(chunk)
    for block in chunk.layers.values():
        block.forward = torch.compile(block.forward)
    # Lambdas give the embedding and the loss frames of their own: compile cannot start in
    # torch.nn's forward or a partial, and a shared frame would recompile with dynamic shapes
    if chunk.embed_tokens is not None:  # the first pipeline stage
        embed = chunk.embed_tokens.forward
        chunk.embed_tokens.forward = torch.compile(lambda ids: embed(ids))
    if chunk.lm_head is not None:  # the last
        if not selective:
            chunk.norm.forward = torch.compile(chunk.norm.forward)
        loss = chunk.loss_fn
        chunk.loss_fn = torch.compile(lambda logits, targets: loss(logits, targets))
    return chunk
