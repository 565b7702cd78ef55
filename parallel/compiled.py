"""A layer on every layout (--compile, the default on CUDA): torch.compile of each part that holds math.

Compiled: every block's forward, the embedding, the final norm and the loss (forward and backward).
Eager: what joins the parts (RoPE's cache, the head's matmul, the pipeline's hand-offs) and every
collective: a compiled part breaks its graph around one (parallel/comm.py). Applied before the
data-parallel wrapper, so FSDP's gathers and frees stay eager. No compiled part reads the device
back to the host: a step keeps its one host read.
"""
import torch

from parallel import ckpt


def apply(chunk, selective=False):
    """Compiles the chunk's parts in place. selective (--ckpt selective) steers what compiled blocks
    save (ckpt.selective_in_graph) and leaves the final norm eager: only eager autograd lets the
    rule take its output, which feeds the head's eager matmul."""
    if selective:
        ckpt.selective_in_graph(chunk)
    for block in chunk.layers.values():
        block.forward = torch.compile(block.forward)
    # Lambdas give the embedding and the loss frames of their own: compile cannot start in torch.nn's
    # forward or in a partial, and one shared frame would recompile and turn shapes dynamic
    if chunk.embed_tokens is not None:  # the first pipeline stage
        embed = chunk.embed_tokens.forward
        chunk.embed_tokens.forward = torch.compile(lambda ids: embed(ids))
    if chunk.lm_head is not None:  # the last
        if not selective:
            chunk.norm.forward = torch.compile(chunk.norm.forward)
        loss = chunk.loss_fn
        chunk.loss_fn = torch.compile(lambda logits, targets: loss(logits, targets))
    return chunk
