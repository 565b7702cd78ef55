"""The contracts between the parallel modules, the optional layers, train.py and the save package.

1. The data-parallel wrapper (ddp.DDP, fsdp.FSDP, hsdp.HSDP) built by each module's `wrap(...)`. It owns the
   materialized parameters of this rank's model chunks and is the only thing train.py asks about gradients:
     sync_grads            attribute; True on the step's last backward (of a chunk): DDP all-reduces then, HSDP
                           its replicas; FSDP reduce-scatters every backward into its shard gradients
     finish_grad_sync()    after the last backward: wait for every reduction, average over dp x cp
     optim_params()        the tensors the optimizer steps on (whole params, or fp32 shards)
     grads_for_norm()      [(gradient tensor, replicas)]: every element of the global gradient appears once after
                           dividing by `replicas`, the number of ranks holding an identical copy of it
     owned_pieces()        [Piece]: where each element this rank holds sits in the global tensors (for saves)
     zero_grad()           after the optimizer step: zeroes the buffers the .grads are views of (DDP's buckets,
                           FSDP's shard gradients)

2. Parameter tags, set by tp.py on meta parameters and read by model.local_init, the wrappers and the planner:
     p.tp_shard = (dim, rank, world)   p is block `rank` of `world` equal blocks of a global tensor along `dim`
     p.tp_partial_grad = True          p's gradient is a partial sum over the tp group (sequence-parallel norms)
   An untagged parameter is replicated over tp: its gradient is identical on every tp rank.

3. A Piece: one stretch of a global tensor held by this rank. Elements [start, end) of the flattened optimizer
   param `param` (Adam's state maps the same way) are elements [offset, offset + end - start) of this rank's
   tp block of global tensor `name` (the tp_shard chunk, or the whole tensor when tp_shard is None), of shape
   `shape`. `writer`: this rank writes these elements in a save (each element has exactly one writer).

4. Hooks for the optional layers. The plain algorithm runs when a hook is None; a layer sets it, nothing else:
     matmul        on model.Linear and tp.py's linears: (x, weight) -> x·Wᵀ, an op autograd differentiates, run
                   instead of F.linear (fp8.py). Under tp a column-parallel reader's matmul runs after f, a row-
                   parallel one's before g (tp.enter_tp, tp.RowParallelLinear).
     weight_grads  on model.Linear, model.RMSNorm and tp.py's layers: a store (pp_bw_split.WeightGrads) that defers
                   the weight's gradient. Backward returns only the input gradient and calls store.defer(weights,
                   compute); compute() later returns the gradients of `weights`, which the store hands to autograd
                   (the zero-bubble schedules' W). store.linear(x, W) and store.scale(W, x̂) are the deferred forms
                   of a linear and of a norm's gain.
     gather        on each FSDP/HSDP unit (the wrapper's `units`): (unit) -> (full, handle, kept): an all-gather of
                   its own (fp8.py's in e4m3), into `full`, a (padded,) buffer in the compute dtype, once
                   handle.wait() returns. What a unit offers it: name, group, local (this rank's fp32 shard of the
                   flat layout [matrices | vectors | padding]), start, shard_numel, numel, padded, matrix_ranges().
   tp_ring.py changes how tp.py's sequence-parallel modules run by swapping their class (same parameters).

5. The precision policy, the same in every layout (--dtype bf16; fp16 alike; fp8: bf16 and the block matmuls'
   operands in fp8, fp8.py). fp32: the master weights and their gradients, Adam's moments, the gradient reductions
   (DDP's buckets, FSDP's reduce-scatter unless --reduce-dtype bf16, HSDP's replicas, the clip's norm), and inside the
   norms (x̂ and 1/rms), softmax (the kernels' log-sum-exp) and the loss (its log-sum-exp, one chunk at a time).
   bf16: every matmul's inputs and output (autocast), the weights FSDP gathers, the embedding's rows, each norm's
   output, the residual stream, and so everything activations send: tp's all-reduces and sp's gathers and
   reduce-scatters, pp's activations and their gradients, cp's K, V (and ring attention's dK, dV accumulate in fp32).
   Measured choice: a bf16 residual stream halves those bytes and the saved activations, and trains as an fp32 one
   does (bench/README.md, "precision"); Megatron and torchtitan keep it in bf16 too.
"""
from collections import namedtuple

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
    """Wrappers hold an nn.ModuleList of pipeline chunks: '0.layers.3.mlp...' -> 'layers.3.mlp...'."""
    return name.split(".", 1)[1]
