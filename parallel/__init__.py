"""The contracts between the parallel modules, the optional layers, train.py and the saves.

1. The data-parallel wrapper (ddp.DDP, fsdp.FSDP, hsdp.HSDP), built by each module's `wrap(...)`,
   owns this rank's materialized weights. train.py asks only it about gradients:
     sync_grads          True on a chunk's last backward of the step. DDP all-reduces then, and
                         HSDP sums over replicas. FSDP reduce-scatters every backward.
     finish_grad_sync()  after the last backward: wait for every reduction, average over dp x cp.
     optim_params()      the tensors the optimizer steps (whole params, or fp32 shards).
     grads_for_norm()    [(gradient, replicas)]: each element counts once, divided by `replicas`.
     owned_pieces()      [Piece]: where each element this rank holds sits in the global tensors.
     zero_grad()         zeroes the buffers the .grads are views of.

2. Parameter tags, set by tp.py on meta parameters, read by materialize.py, wrappers and planner.
     p.tp_shard = (dim, rank, world)   p is block `rank` of `world` equal blocks along `dim`.
     p.tp_partial_grad = True          p's gradient is a partial sum over tp (sp's norms).
   An untagged parameter is replicated over tp.

3. A Piece: elements [start, end) of the flat optimizer param `param` (Adam's state alike) are
   elements [offset, offset + end - start) of this rank's tp block of tensor `name`. `shape` is
   its global shape. `writer`: this rank writes them in a save. Each element has exactly one.

4. Hooks for the optional layers. The plain algorithm runs when a hook is None.
     matmul        on model.Linear (tp's too): (x, weight) -> x·Wᵀ instead of F.linear (fp8.py).
     weight_grads  on model.Linear and model.RMSNorm: backward returns the input's gradient and
                   calls store.defer(weights, compute). compute() gives their gradients later.
     gather        on each FSDP unit: (unit) -> (full, handle, kept), an all-gather of its own
                   into `full`, a (padded,) compute-dtype buffer. fp8.py gathers in e4m3.
   tp_overlap.py swaps the classes of tp.py's modules instead: same parameters, other kernels.

5. Saved-tensor rules (keep_saved). pack(t) returns t, or what to keep instead; unpack(kept)
   remakes t. FSDP keeps a gathered weight as (unit, offset) and gathers it again. --ckpt
   selective keeps a norm's or SwiGLU's output as its recipe. A chunk's rules share one context,
   tried in order.

6. Precision, the same in every layout. fp32: master weights and gradients, Adam's moments,
   gradient reductions (unless --reduce-dtype bf16), the insides of norms, softmax and the loss.
   bf16, the compute dtype: matmul inputs and outputs, FSDP's gathered weights, embedding rows,
   norm outputs and the residual stream. So every activation that tp, sp, pp and cp send is bf16.
   A bf16 residual stream trains as an fp32 one does (bench/README.md).
"""
from collections import namedtuple

import torch
from torch.autograd.graph import saved_tensors_hooks

Piece = namedtuple("Piece", "name param start end shape tp_shard offset writer")


def tag_tp_shard(param, dim, rank, world):
    param.tp_shard = (dim, rank, world)
    return param


def tp_shard_of(param):
    """(dim, rank, world) of a tp-sharded parameter, None for a replicated one."""
    return getattr(param, "tp_shard", None)


def has_tp_partial_grad(param):
    return getattr(param, "tp_partial_grad", False)


def global_name(name):
    """Wrappers hold a ModuleList of pipeline chunks: '0.layers.3.mlp...' -> 'layers.3.mlp...'."""
    return name.split(".", 1)[1]


def keep_saved(chunk, pack, unpack):
    """Adds a saved-tensor rule (5. above) to the chunk's forward. All rules share one hooks
    context, as such contexts do not nest. They run eagerly, outside any compiled part."""
    if "saved_rules" not in vars(chunk):
        chunk.saved_rules, forward = [], chunk.forward

        @torch.compiler.disable
        def pack_saved(t):
            for i, (rule_pack, _) in enumerate(chunk.saved_rules):
                kept = rule_pack(t)
                if kept is not t:
                    return i, kept
            return t

        @torch.compiler.disable
        def unpack_saved(saved):
            return chunk.saved_rules[saved[0]][1](saved[1]) if isinstance(saved, tuple) else saved

        def run_chunk(*args, **kwargs):
            with saved_tensors_hooks(pack_saved, unpack_saved):
                return forward(*args, **kwargs)
        chunk.forward = run_chunk
    chunk.saved_rules.append((pack, unpack))
