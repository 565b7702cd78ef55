"""The memory one rank holds at the peak of a training step, estimated from the shapes, per stage.

One model of this code serves the check before a run starts (config.check_fits refuses a step
over the device's memory less MARGIN), the dry run's expected column and the planner's --code ours.
Measured against it: fake-CUDA rehearsals at full world size (tests/test_dry_run.py), fp32 CPU runs
of every layout family (tests/test_plan_measured.py) and whole CPU runs (tests/test_runs.py).
"""
import os
import weakref
from functools import lru_cache

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import model
from parallel import ckpt
from parallel import pp_schedule as S
from parallel.mesh import LayoutError
from parallel.pp import layer_counts

# What fake tensors cannot see, kept free of every device: the CUDA context and NCCL's buffers
# (about 1-2 GB on an H100), and what the caching allocator reserves above the live peak. The
# evidence: torchtitan's published Llama 3 8B step (8 H100s, FSDP) reserved 82.4 GiB where the
# same code counted on fake tensors holds 66.7-68.5 GiB live, 20-24% more: 1 / 0.8 = 1.25.
MARGIN = 0.20


def expandable_segments(environ):
    """CUDA's caching allocator grows its segments in place unless the user configured it: less
    memory reserved above the live peak (fragmentation) than with fixed-size segments."""
    if not any(name in environ for name in ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")):
        environ["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"


def check_fits(cfg, run):
    """Refuses a step over the device's memory less MARGIN, naming its largest part's flag."""
    if cfg.vocab_size >= 2 ** 31:
        raise LayoutError("--vocab-size", f"{cfg.vocab_size} is past 2^31")
    parts, (limit, where) = step_bytes(cfg, run), device_memory(run)
    need = sum(parts.values())
    if need > (1 - MARGIN) * limit:
        largest = max(parts, key=parts.get)
        flag = {"activations": "--micro-batch", "logits": "--micro-batch",
                "token ids": "--global-batch"}.get(largest, "--model")
        shown = ", ".join(f"{k} {v / 1e9:.3g}" for k, v in parts.items())
        raise LayoutError(flag, f"a step needs about {need / 1e9:.3g} GB per rank ({shown}), "
                                f"more than {1 - MARGIN:.0%} of the {limit / 1e9:.3g} GB of "
                                f"{where}; shard the model (--dp-mode fsdp, --tp, --pp), "
                                "checkpoint (--ckpt), or shrink --micro-batch")


def step_bytes(cfg, run):
    """{part: bytes} of the fullest pipeline stage (every rank's, without pp)."""
    stages = [stage_bytes(cfg, run, rank) for rank in range(run.pp)]
    return max(stages, key=lambda parts: sum(parts.values()))


def stage_bytes(cfg, run, pp_rank):
    """{part: bytes} one rank of pipeline rank `pp_rank` holds at its step's peak.

    model state     fp32 weights, gradients and Adam's two moments: 16 bytes a parameter, sharded.
                    FSDP's gradients only once a unit is reduced (none at the loss with M = 1).
                    --accumulate unsharded also keeps every unit's flat gradient all step.
    weights in use  FSDP: the largest unit gathered; in a layer's backward, the flat gradient of
                    the unit reducing (none apart under --accumulate unsharded). Under pp the
                    stage's units stay gathered all step.
                    DDP under autocast: the matmul weights' compute-dtype copies, one per set.
    activations     per layer and token, what autograd saves in the compute dtype (norms' inputs
                    and outputs; q, k, v after RoPE; attention's output; gate, up and product),
                    and fp32 1/rms. As many sets as the schedule keeps. zb1, zbv: a deferred
                    norm's fp32 x-hat too. From B to W: each matmul's input and output gradient,
                    each norm's x-hat and output gradient, whatever --ckpt (B remade the set).
    logits          on the last stage: each set's logits and final norm's input and output (zb1,
                    zbv, B to W: x-hat, output, its gradient), one loss chunk. The logits' gradient
                    is written over them.
    token ids       the step's inputs and targets.
    A layer's backward (peak_moment) holds SwiGLU's gradients of the product, gate and up,
    silu(gate) remade, and the residual's gradient. Checkpointed: its remade activations. FSDP:
    the weight gradient in the compute dtype and, without pp, the next unit. sp: three whole
    (tokens, d) tensors, the input and the output's gradient gathered, the input's gradient."""
    e = 4 if run.dtype == "fp32" else 2
    r = 4 if run.reduce_dtype == "fp32" else 2
    d, f, t = cfg.d_model, cfg.ffn_dim, run.tp
    sh = t if run.sp else 1  # the residual stream's split under sequence parallel
    shard = {"ddp": 1, "fsdp": run.dp * run.cp, "hsdp": (run.dp_shard or 1) * run.cp}[run.dp_mode]
    chunks, first, last = stage_layout(cfg, run, pp_rank)
    block = model.layer_param_count(cfg) / t
    embed, head = cfg.padded_vocab * d / t, (cfg.padded_vocab * d + d) / t
    params = sum(chunks) * block + first * embed + last * head  # this rank's, after tp
    unit = max([block] + [embed] * first + [head] * last)  # FSDP's largest unit
    tokens = run.micro_batch * cfg.seq_len / run.cp
    kv = 2 * d * cfg.n_kv_head / cfg.n_head  # k and v per token
    per_layer = e * (4 * d / sh + (2 * d + kv + 3 * f) / t) + 8 / sh  # per token
    kind = ckpt.parse(run.ckpt)[0]
    split = run.pp > 1 and run.pp_schedule in S.SPLIT_BACKWARD
    # a layer's backward at its fullest (SwiGLU's); the product is freed by then (split: W holds it)
    layer = e * ((2 + split) * f / t + d / sh)
    if kind == "selective" and not split:  # the product was never kept; a norm's output is remade
        layer += e * (f / t + d / sh)
    held = per_layer + e * (2 * d / sh + 2 * d) - 8 / sh if split else 0  # from B to W
    if kind == "selective":  # split: the deferred norms are not what selective remakes
        per_layer -= e * (f / t if split else 2 * d / sh + f / t)
    elif kind == "none" and split:
        per_layer += 8 * d / sh
    checkpointed = kind not in ("none", "selective")
    kept = e * d / sh if checkpointed else per_layer  # what a layer of a set in flight keeps
    recomputed = per_layer * checkpointed  # what the recompute of a layer makes again
    if kind == "op":  # its input; q, v, attention's output and lse, gate; down's (partial) output
        op_kept = e * ((2 * d + kv / 2 + f) / t + d) + 4 * cfg.n_head / t
        kept, recomputed = kept + op_kept, per_layer - op_kept
    (sets, waiting), last_sets = sets_in_flight(run, pp_rank, tuple(chunks), kept, held)
    vocab = cfg.padded_vocab / t
    if run.dp_mode == "ddp":  # autocast's copies (none in fp32), one per set in flight
        in_use = e * (block * sets + head * last * last_sets) * (e < 4)
    else:  # under pp the stage's units stay gathered, and a unit's flat gradient
        in_use = (e * params + r * unit * (run.accumulate != "unsharded")) * (run.pp > 1)
    fsdp_alone = run.dp_mode != "ddp" and run.pp == 1
    # FSDP in a layer's backward (SwiGLU's): alone, down's weight gradient in the compute dtype, the
    # block and the next gathered, the flat gradient of the unit reducing (the head's, the largest);
    # under pp, the block's weight gradients before they are flattened
    layer_weights = 0 if run.dp_mode == "ddp" else e * block if run.pp > 1 else (
        e * (d * f / t + 2 * block) + r * unit * (run.accumulate != "unsharded"))
    regather = 3 * e * d * (t > 1 and run.sp)
    summed = r * params if run.accumulate == "unsharded" else 0  # fsdp_accumulate's flat gradients
    # the final norm of each set on the head's chunk
    norm = last * e * tokens * (2 + split) * d / sh
    moment = peak_moment(tokens * (sets * kept + waiting * held),
                         tokens * (layer + recomputed + regather), layer_weights,
                         last * e * tokens * vocab, last_sets, last * 4 * loss_chunk(tokens, vocab),
                         norm, e * unit * fsdp_alone)  # at the loss, the head gathered
    # FSDP makes a unit's gradient shard when its first reduce-scatter lands: with one backward a
    # step, the peak (the loss's, or the first block's backward) holds the head's at most
    grads = params if run.dp_mode == "ddp" or run.pp > 1 or run.accum_steps > 1 else head * last
    ids = 16 * run.global_batch / run.dp * cfg.seq_len
    parts = {"model state": (12 * params + 4 * grads) / shard + summed,
             "weights in use": in_use + moment.pop("weights in use"), **moment, "token ids": ids}
    end = {"model state": 16 * params / shard + summed, "weights in use": r * unit,
           "token ids": ids}
    fuller = grads != params and sum(end.values()) > sum(parts.values())
    return end if fuller else parts  # backward's end: every shard made


def peak_moment(kept, layer_backward, layer_weights, logits, sets, chunk, norm, loss_weights):
    """{weights in use beyond the step's, activations, logits} at the fuller moment: the loss's
    backward, or a layer's while the other sets' logits and final norms stay."""
    loss = logits * sets + chunk  # the logits' gradient is written over them
    if loss + norm + loss_weights >= layer_backward + layer_weights + (logits + norm) * (sets - 1):
        return {"weights in use": loss_weights, "activations": kept + norm * sets, "logits": loss}
    return {"weights in use": layer_weights,
            "activations": kept + layer_backward + norm * (sets - 1),
            "logits": logits * (sets - 1)}


def loss_chunk(tokens, vocab):
    """Elements of the loss's fp32 chunk (model.loss_chunks)."""
    return min(tokens * vocab, 2 ** 25)


def stage_layout(cfg, run, pp_rank):
    """(layers of each of this rank's chunks, holds the embedding, holds the head)."""
    if run.pp == 1:
        return [cfg.n_layer], True, True
    V = S.chunks_per_rank(run.pp_schedule, run.pp_virtual)
    counts = layer_counts(cfg, run.pp, V, run.accum_steps, run.pp_split, run.pp_schedule)
    stages = [S.stage_of(pp_rank, c, run.pp, run.pp_schedule in S.VSHAPED) for c in range(V)]
    return [counts[v] for v in stages], 0 in stages, len(counts) - 1 in stages


def sets_in_flight(run, pp_rank, chunks, kept=1.0, held=0.0):
    """((forward layer-sets, layer-sets between B and W) at the fullest moment, the most
    micro-batches alive on the head's chunk). A forward keeps `kept` bytes a layer until its
    backward. Under zb1 and zbv: until its B, then `held` bytes a layer until its W."""
    if run.pp == 1:
        return (chunks[0], 0), 1
    return schedule_peak(run.pp_schedule, run.pp, run.accum_steps, run.pp_virtual, pp_rank, chunks,
                         kept, held)


def schedule_peak(schedule, P, M, V, rank, chunks, kept=1.0, held=0.0):
    moments, head_peak = schedule_moments(schedule, P, M, V)[rank]

    def layers(counts):
        return sum(n * layer_count for n, layer_count in zip(counts, chunks))
    alive, waiting = max(moments, key=lambda m: layers(m[0]) * kept + layers(m[1]) * held)
    return (layers(alive), layers(waiting)), head_peak


@lru_cache(maxsize=256)  # the planner prices thousands of layouts on a few schedules
def schedule_moments(schedule, P, M, V):
    """Per rank: its fullest moments and the most micro-batches on the head's chunk. A moment:
    (micro-batches alive in forward, micro-batches between B and W) per chunk."""
    n, split = S.chunks_per_rank(schedule, V), schedule in S.SPLIT_BACKWARD
    vshape, end, out = schedule in S.VSHAPED, P * n - 1, []
    for rank, actions in enumerate(S.build(schedule, P, M, V)):
        head = next((c for c in range(n) if S.stage_of(rank, c, P, vshape) == end), None)
        alive, waiting, moments, head_peak = [0] * n, [0] * n, set(), 0
        for a in actions:
            if a.op == "F":
                alive[a.chunk] += 1
            elif a.op == "B" and split:
                alive[a.chunk] -= 1
                waiting[a.chunk] += 1
            elif a.op == "B":
                alive[a.chunk] -= 1
            elif a.op == "W":
                waiting[a.chunk] -= 1
            moments.add((tuple(alive), tuple(waiting)))
            if head is not None:
                head_peak = max(head_peak, alive[head] + waiting[head])
        out.append((fullest(moments), max(head_peak, 1)))
    return out


def fullest(moments):
    """The moments no other moment holds at least as much as in every chunk."""
    flat = {m: m[0] + m[1] for m in moments}

    def covers(a, b):
        return a != b and all(x >= y for x, y in zip(flat[a], flat[b]))
    return tuple(m for m in moments if not any(covers(o, m) for o in moments))


# ---------------------------------------------------------------- the device, and measured memory

def device_memory(run):
    """(bytes one rank may use, what): the GPU's memory, or the free RAM / ranks on this machine."""
    if run.backend == "nccl":
        name = torch.cuda.get_device_name(run.device)
        return torch.cuda.get_device_properties(run.device).total_memory, name
    available = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
    return available / run.ranks_here, f"this machine's available RAM / {run.ranks_here} rank(s)"


class CPUMemory:
    """mem_gb on CPU: the tensors the run keeps (weights, gradients, Adam's state) plus the peak
    a step allocates, counted in the first, as all are alike. Compiled (count=False): None."""

    def __init__(self, trainer, count=True):
        self.trainer, self.peak, self.counting = trainer, None, LiveBytes() if count else None
        if count:
            self.counting.__enter__()

    def gb(self):
        if self.counting is None:
            return {"mem_gb": None, "mem_reserved_gb": None}
        if self.peak is None:
            self.counting.__exit__(None, None, None)
            t = self.trainer
            params = list(t.wrapper.optim_params())
            kept = params + [p.grad for p in params if p.grad is not None]
            kept += [v for s in t.opt.state.values() for v in s.values()
                     if isinstance(v, torch.Tensor)]
            self.peak = (storage_bytes(kept) + self.counting.peak) / 1e9
        return {"mem_gb": self.peak, "mem_reserved_gb": None}


def storage_bytes(tensors):
    """Bytes of the distinct storages behind the tensors: views of one buffer count once."""
    storages = {}
    for t in tensors:
        if isinstance(t, torch.Tensor) and not t.is_meta:
            storage = t.untyped_storage()
            storages[id(storage)] = storage  # held here, so ids stay distinct
    return sum(s.nbytes() for s in storages.values())


class StorageMode(TorchDispatchMode):
    """A dispatch mode that hears of every UntypedStorage.resize_ too: resized(storage, before).
    The pipeline frees what it sent that way (pp.py). No finalizer sees it."""

    def __enter__(self):
        self.resize = resize = torch.UntypedStorage.resize_

        def counted(storage, n):
            before = storage.nbytes()
            out = resize(storage, n)
            self.resized(storage, before)
            return out
        torch.UntypedStorage.resize_ = counted
        return super().__enter__()

    def __exit__(self, *exc):
        torch.UntypedStorage.resize_ = self.resize
        return super().__exit__(*exc)

    def resized(self, storage, before):
        raise NotImplementedError


class LiveBytes(StorageMode):
    """Bytes of the storages ops create while active, until freed or resized; `peak`, the most."""

    def __init__(self):
        super().__init__()
        self.live, self.now, self.peak = {}, 0, 0

    def _free(self, key):
        self.now -= self.live.pop(key)

    def resized(self, storage, before):
        key = id(storage)
        if key in self.live:
            self.live[key] = storage.nbytes()
            self.now += storage.nbytes() - before
            self.peak = max(self.peak, self.now)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {id(t.untyped_storage()) for t in tree_leaves((args, kwargs))
                  if isinstance(t, torch.Tensor)}
        for t in tree_leaves(out):
            if not isinstance(t, torch.Tensor) or t.device.type == "meta":
                continue
            storage = t.untyped_storage()
            key, n = id(storage), storage.nbytes()
            if n and key not in inputs and key not in self.live:  # not a view, not in place
                self.live[key] = n
                self.now += n
                weakref.finalize(storage, self._free, key)
        self.peak = max(self.peak, self.now)
        return out
