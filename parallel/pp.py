"""Pipeline parallel: the layers are split into stages, and micro-batches flow through them.

Split:    the blocks into P·V chunks by cost (cost_model) or --pp-split. Rank r holds virtual stages
          r, r+P, ... (V = --pp-virtual); under zbv, r and 2P-1-r (a V).
Sends:    p2p per micro-batch and boundary: an activation, then its gradient, b·T·d elements each
          (b·T/tp·d under sp). Per step: 2·M·(P·V-1)·b·T·d (zbv: 2·M·(2P-2)·..., P-1 keeps its own).
Overlap:  batch_isend_irecv is async: a send leaves while the next micro-batch computes.
Memory:   1/P of the weights, grads and Adam state; at most P activation sets (1F1B, stage 0).
Bubble:   utilization M/(M+P-1) (GPipe, 1F1B), VM/(VM+P-1) interleaved; zb1, zbv: pp_schedule.py.
"""
import copy
import math
import time
from dataclasses import dataclass
from functools import lru_cache

import torch

import model
from parallel import pp_schedule as S
from parallel.comm import Requests
from parallel.mesh import LayoutError


@dataclass(frozen=True)
class Stage:
    """Attached to each chunk as `chunk.pipeline`."""
    virtual_stage: int
    n_virtual: int
    schedule: str
    layers: tuple  # global layer indices


# ---------------------------------------------------------------- the split

def cost_model(cfg):
    """(FLOPs per token, params) of a layer (2·N_layer + 4·d·T), the head (2·d·vocab), embedding."""
    d, vocab = cfg.d_model, cfg.padded_vocab
    return {"layer": (model.layer_flops_per_token(cfg), model.layer_param_count(cfg)),
            "head": (2 * d * vocab, d * vocab + d), "embed": (0, d * vocab)}


def min_max_partition(n, parts, cost):
    """Counts (each >= 1, summing to n) minimizing max_k cost(k, count_k). Dynamic programming."""
    best = {(0, 0): (0, [])}  # (parts used, layers used) -> (max cost so far, counts)
    for k in range(parts):
        for used in range(k + 1, n - (parts - k - 1) + 1):
            options = [(max(best[(k, used - m)][0], cost(k, m)), best[(k, used - m)][1] + [m])
                       for m in range(1, used - k + 1) if (k, used - m) in best]
            best[(k + 1, used)] = min(options, key=lambda o: o[0])
    return best[(parts, n)]


def balanced_counts(cfg, parts):
    """Minimizes the slowest chunk's FLOPs, then, among those splits, the largest chunk's memory."""
    return list(balanced_split(cfg.n_layer, parts, *cost_model(cfg).values()))  # layer, head, embed


@lru_cache(maxsize=4096)  # the planner asks for the same splits across thousands of layouts
def balanced_split(n, parts, layer, head, embed):
    """balanced_counts of n layers, each cost a (FLOPs, params) pair."""
    def flops(k, m):
        return m * layer[0] + (head[0] if k == parts - 1 else 0) + (embed[0] if k == 0 else 0)

    def memory(k, m):
        if flops(k, m) > slowest:
            return math.inf
        return m * layer[1] + (head[1] if k == parts - 1 else 0) + (embed[1] if k == 0 else 0)

    slowest = min_max_partition(n, parts, flops)[0]
    return tuple(min_max_partition(n, parts, memory)[1])


def layer_counts(cfg, P, V, n_micro, layer_split=None, schedule="1f1b"):
    """Layers per virtual stage, by cost or the given split; checked against model and batch."""
    n, parts = cfg.n_layer, P * V
    if n < parts:
        raise LayoutError("--pp", f"{P} stages x {V} chunks need at least {parts} layers; "
                                  f"the model has {n}")
    try:
        actions_for(schedule, P, n_micro, V, 0)
    except S.DeadlockError as e:  # the simulator found no way to run it
        raise LayoutError("--pp-schedule", f"{schedule} cannot run M = {n_micro} micro-batches "
                                           f"on {P} stages: {e}") from None
    if schedule == "interleaved" and n_micro > P and n_micro % P:
        raise LayoutError("--micro-batch", f"interleaved needs the micro-batch count "
                          f"M = global-batch / (micro-batch·dp) = {n_micro} to be a multiple "
                          f"of pp = {P} (or at most {P})")
    if not layer_split:
        if schedule == "interleaved" and n % parts:
            raise LayoutError("--pp-virtual", f"interleaved needs n_layer {n} divisible by "
                              f"pp·V = {P}·{V} (or an explicit --pp-split)")
        return balanced_counts(cfg, parts)
    counts, shown = list(layer_split), ",".join(map(str, layer_split))
    if len(counts) != parts:
        raise LayoutError("--pp-split",
                          f"{len(counts)} counts given, pp·V = {P}·{V} = {parts} needed")
    if sum(counts) != n:
        raise LayoutError("--pp-split",
                          f"counts {shown} sum to {sum(counts)}, the model has {n} layers")
    return counts


def split(full, mesh, n_micro, schedule="1f1b", n_virtual=1, layer_split=None):
    """This rank's chunks (meta GPTs) by stage; only the first embeds, the last has the head."""
    P, V, rank = mesh.pp, S.chunks_per_rank(schedule, n_virtual), mesh.coord["pp"]
    counts = layer_counts(full.cfg, P, V, n_micro, layer_split, schedule)
    starts = [sum(counts[:v]) for v in range(P * V)]
    chunks = []
    for c in range(V):
        v = S.stage_of(rank, c, P, schedule in S.VSHAPED)
        keep = range(starts[v], starts[v] + counts[v])
        chunk = copy.deepcopy(full)  # meta tensors: no memory
        for name in list(chunk.layers):
            if int(name) not in keep:
                del chunk.layers[name]
        if v > 0:
            chunk.embed_tokens = None
        if v < P * V - 1:
            chunk.norm = chunk.lm_head = None
        chunk.pipeline = Stage(v, P * V, schedule, tuple(keep))
        chunks.append(chunk)
    return chunks


# ---------------------------------------------------------------- the executor

class PipelineError(RuntimeError):
    """An action failed on this stage. The message names the stage and the action."""


@lru_cache(maxsize=64)
def actions_for(schedule, P, M, V, rank, train=True):
    return (S.build(schedule, P, M, V) if train
            else S.forward_only(P, M, V, schedule in S.VSHAPED))[rank]


class Pipeline:
    """One rank's run of one action list. Tensors live in dicts keyed by (chunk, micro-batch)."""

    def __init__(self, chunks, mesh, batches, positions, autocast, loss_scale, wrapper,
                 activation_dtype):
        self.chunks, self.mesh, self.batches, self.autocast = chunks, mesh, batches, autocast
        self.loss_scale, self.wrapper = loss_scale, wrapper
        self.P, self.rank, self.group = mesh.pp, mesh.coord["pp"], mesh.pp_group
        self.vshape, self.last = chunks[0].pipeline.schedule in S.VSHAPED, self.P * len(chunks) - 1
        self.device = batches[0][0].device
        T = batches[0][0].shape[1]  # tokens per sequence on this rank (T/cp under cp)
        self.positions = positions if positions is not None else torch.arange(T, device=self.device)
        self.inputs, self.outputs, self.input_grads, self.alive = {}, {}, {}, set()
        self.receives, self.sends = {}, []  # (op, chunk, mb) -> (buffer, Posted); Posted in flight
        chunk = chunks[0]  # activations between stages: (b, T/tp under sp, d), in the compute dtype
        self.activation = ((batches[0][0].shape[0], T // chunk.seq_shards, chunk.cfg.d_model),
                           activation_dtype)
        self.loss = torch.zeros((), device=self.device)

    def run(self, actions):
        """Runs the actions. Returns the summed local loss (nonzero on the last stage)."""
        self.final = {(a.op, a.chunk): a for a in actions if a.op in "BW"}  # last ones sync grads
        self.split = any(a.op == "W" for a in actions)  # zb1, zbv: each backward is B, later W
        for step in S.batches(actions):
            try:
                if step[0].op in S.COMPUTE:
                    self.compute(step[0], self.wait_for_input(step[0]))  # idle until it arrives
                else:
                    self.post(step)
            except Exception as e:
                raise PipelineError(f"pipeline stage {self.rank} failed at {step[0]}: "
                                    f"{type(e).__name__}: {e}") from e
        for posted in self.sends:
            posted.wait()
        return self.loss

    def compute(self, a, received):
        {"F": self.forward, "B": self.backward, "W": self.weight}[a.op](a, received)

    def stage(self, chunk):
        return S.stage_of(self.rank, chunk, self.P, self.vshape)

    def wait_for_input(self, a):
        """The activation (F) or output gradient (B) a neighbour sent; at the V, this rank's own."""
        v = self.stage(a.chunk)
        if a.op == "W" or (a.op == "F" and v == 0) or (a.op == "B" and v == self.last):
            return None
        rank, chunk = S.place(v - 1 if a.op == "F" else v + 1, self.P, self.vshape)
        if rank != self.rank:
            return self.take("RECV_" + a.op, a.chunk, a.mb)
        if a.op == "B":
            return self.input_grads.pop((chunk, a.mb))
        key = (chunk, a.mb)
        return (self.outputs[key] if torch.is_grad_enabled() else self.outputs.pop(key)).detach()

    def forward(self, a, received):
        tokens, targets = self.batches[a.mb]
        v = self.stage(a.chunk)
        x = tokens if v == 0 else received  # (b, T, d), or (b, T/tp, d) under sp
        if v > 0 and torch.is_grad_enabled():
            x.requires_grad_(True)
        with self.autocast:
            out = self.chunks[a.chunk](x, targets if v == self.last else None, self.positions)
        if v == self.last:
            out = out / len(self.batches)  # local mean / M: the step sums to the batch mean
            self.loss += out.detach()
        self.outputs[(a.chunk, a.mb)] = out
        if torch.is_grad_enabled():
            self.inputs[(a.chunk, a.mb)] = x
            self.alive.add((a.chunk, a.mb))  # its graph (or, after B, what its W needs) is held
        elif v == self.last:
            del self.outputs[(a.chunk, a.mb)]

    def backward(self, a, received):
        """The full backward, or B under zb1/zbv: weight gradients wait in WeightGrads for W."""
        key, v = (a.chunk, a.mb), self.stage(a.chunk)
        self.wrapper.sync_grads = self.final[("B", a.chunk)] == a  # DDP/FSDP: once per chunk
        out, x = self.outputs.pop(key), self.inputs.pop(key)  # their last references: freed after
        if self.split:
            self.chunks[a.chunk].weight_grads.mb = a.mb
        else:
            self.alive.discard(key)
        if v == self.last:
            (out * self.loss_scale).backward()
        else:
            torch.autograd.backward(out, received)  # received: d loss / d out, the shape of out
        if v > 0:
            self.input_grads[key] = x.grad  # (b, T, d): sent by the SEND_B that follows

    def weight(self, a, received):
        """W: the weight gradients B deferred. A chunk's last W syncs its gradients."""
        self.wrapper.sync_grads = self.final[("W", a.chunk)] == a
        self.chunks[a.chunk].weight_grads.run(a.mb)
        self.alive.discard((a.chunk, a.mb))

    def post(self, batch):
        """One batch_isend_irecv for a run of consecutive sends and receives."""
        sends, receives, spent = [], [], []
        for a in batch:
            key = (a.chunk, a.mb)
            if a.op == "SEND_F":
                out = self.outputs[key] if torch.is_grad_enabled() else self.outputs.pop(key)
                sends.append((out.detach().contiguous(), a.peer))
                spent += [out] * torch.is_grad_enabled()  # backward needs its graph, not its bytes
            elif a.op == "SEND_B":
                sends.append((self.input_grads.pop(key).contiguous(), a.peer))
            else:
                receives.append((a, torch.empty(self.activation[0], dtype=self.activation[1],
                                                device=self.device)))
        works = self.group.send_recv(sends, [(buf, a.peer) for a, buf in receives])
        posted = Posted(Requests(works, self.group.p2p_timeout), [t for t, _ in sends], spent)
        for a, buf in receives:
            self.receives[(a.op, a.chunk, a.mb)] = (buf, posted)
        self.sends = [p for p in self.sends if not p.completed()]
        if sends:
            self.sends.append(posted)

    def take(self, op, chunk, mb):
        buf, posted = self.receives.pop((op, chunk, mb))
        t0 = time.perf_counter()
        posted.wait()  # the bubble: idle until the neighbour's send arrives
        self.mesh.stats.idle_s += time.perf_counter() - t0
        return buf


class Posted:
    """One batch_isend_irecv: its works and sent tensors. Done, it frees the sent outputs' bytes."""

    def __init__(self, requests, tensors, spent=()):
        self.requests, self.tensors, self.spent, self.done = requests, tensors, spent, False

    def wait(self):
        if not self.done:  # waits once: gloo blocks on a second wait
            self.requests.wait()
            self._finish()

    def completed(self):
        if not self.done and self.requests.is_completed():
            self._finish()
        return self.done

    def _finish(self):
        for out in self.spent:
            out.untyped_storage().resize_(0)
        self.done, self.tensors, self.spent = True, None, ()


def execute(chunks, mesh, batches, positions, autocast, activation_dtype, loss_scale=1.0,
            wrapper=None, train=True, runner=Pipeline):
    """Runs this rank's part of the chunks' schedule: (summed local loss, the Pipeline)."""
    schedule = chunks[0].pipeline.schedule
    actions = actions_for(schedule, mesh.pp, len(batches), len(chunks), mesh.coord["pp"], train)
    pipeline = runner(chunks, mesh, batches, positions, autocast, loss_scale, wrapper,
                      activation_dtype)
    return pipeline.run(actions), pipeline


def train_step(chunks, wrapper, mesh, batches, positions, autocast, loss_scale, dtype):
    """Forward and backward of each micro-batch: the summed local loss (last stage; 0 elsewhere)."""
    return execute(chunks, mesh, batches, positions, autocast, dtype, loss_scale, wrapper)[0]


def eval_step(chunks, wrapper, mesh, batches, positions, autocast, dtype):
    """The summed mean loss of the micro-batches, on the device (last stage; 0 elsewhere)."""
    with torch.no_grad():
        return execute(chunks, mesh, batches, positions, autocast, dtype, train=False)[0]
