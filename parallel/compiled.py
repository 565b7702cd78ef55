"""A layer on every layout (--compile, on by default on CUDA): each part that holds math, compiled.

Compiled: every block's forward, the embedding, the final norm and the loss (forward and backward).
Eager: what joins the parts, as RoPE's cache, the head's matmul and the pipeline's hand-offs. Every
collective stays eager too: a compiled part breaks its graph around one (parallel/comm.py). This
runs before the data-parallel wrapper, so FSDP's gathers and frees stay eager. No compiled part
reads the device back to the host: a step keeps its one host read.
"""
import torch
from torch.utils.checkpoint import checkpoint

import model


def apply(chunk, selective=False):
    """Compiles the chunk's parts in place. Under --ckpt selective the final norm stays eager."""
    if selective:
        selective_in_graph(chunk)
    for block in chunk.layers.values():
        block.forward = torch.compile(block.forward)
    # Lambdas: frames of their own. Compile cannot start in nn's forward; a shared frame recompiles
    if chunk.embed_tokens is not None:  # the first pipeline stage
        embed = chunk.embed_tokens.forward
        chunk.embed_tokens.forward = torch.compile(lambda ids: embed(ids))
    if chunk.lm_head is not None:  # the last
        if not selective:
            chunk.norm.forward = torch.compile(chunk.norm.forward)
        loss = chunk.loss_fn
        chunk.loss_fn = torch.compile(lambda logits, targets: loss(logits, targets))
    return chunk


# -------------------------------------------------------- --ckpt selective in compiled blocks

def norm_in_compute_dtype(norm, x):
    """A norm's output as the matmuls reading it take it, autocast's cast included."""
    y = model.RMSNorm.forward(norm, x)
    return y.to(model.compute_dtype(y))


class RecomputedNorm(model.RMSNorm):
    """A norm compiled with its readers as a checkpointed region: backward recomputes its output.
    Run eagerly (dynamo declined the frame), it is a plain norm under selective's rule."""

    def forward(self, x):
        if not torch.compiler.is_compiling():
            return super().forward(x)
        return checkpoint(norm_in_compute_dtype, self, x, use_reentrant=False)


def run_eagerly(cls):
    """cls with its forward outside any graph: a compiled block breaks its graph around it."""
    return type(cls.__name__, (cls,), {"forward": torch.compiler.disable(cls.forward)})


def recomputed_swiglu(gate, up):
    """MLP.activation compiled into one graph with down_proj: a region, as RecomputedNorm."""
    if not torch.compiler.is_compiling():
        return model.SwiGLU.apply(gate, up)
    return checkpoint(model.SwiGLU.apply, gate, up, use_reentrant=False)


eager_swiglu = torch.compiler.disable(model.SwiGLU.apply)  # MLP.activation, its reader eager


def how_compiled(module):
    """How a block's attention or MLP compiles. "apart": tp's or cp's collectives, or deferred
    weight gradients, break its graph. "fp8": fp8's matmul hook, traced whole when no group
    reduces its amaxes; left to the partitioner. "whole": model.py's linears and attention, one
    graph with the norm."""
    linears = [m for m in module.modules() if isinstance(m, model.Linear)]
    if (any(type(linear) is not model.Linear or linear.weight_grads is not None
            for linear in linears)
            or getattr(module, "attend", model.causal_attention) is not model.causal_attention):
        return "apart"
    return "fp8" if any(linear.matmul is not None for linear in linears) else "whole"


def selective_in_graph(chunk):
    """--ckpt selective for blocks about to be compiled, after every layer is applied.

    In a graph the partitioner, not autograd, decides what is saved: ckpt.py's rule sees nothing.
    So a norm compiled with its readers, and SwiGLU, become checkpointed regions. Where
    collectives break that graph, they and their readers run eagerly, under the rule."""
    eager = {}  # one eager class per class in this chunk: its blocks keep sharing compiled graphs

    def run_apart(*modules):
        for module in modules:
            if type(module) not in eager:
                eager[type(module)] = run_eagerly(type(module))
            module.__class__ = eager[type(module)]
    for block in chunk.layers.values():
        attn, mlp = block.self_attn, block.mlp
        for norm, module, readers in ((block.input_layernorm, attn,
                                       (attn.q_proj, attn.k_proj, attn.v_proj)),
                                      (block.post_attention_layernorm, mlp,
                                       (mlp.gate_proj, mlp.up_proj))):
            how = how_compiled(module)
            if how == "whole":
                norm.__class__ = RecomputedNorm
            elif how == "apart":
                run_apart(norm, *readers)
        how = how_compiled(mlp)
        if how == "whole":
            mlp.activation = recomputed_swiglu
        elif how == "apart":
            mlp.activation = eager_swiglu
            run_apart(mlp.down_proj)
