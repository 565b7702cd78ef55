"""The torchtitan column: torchtitan 0.3.0's Llama 3 as its Trainer builds and steps it.

The settings of torchtitan's published 8B run (config_registry.llama3_8b) on the layout's model:
fp32 weights, bf16 in compute and fp32 gradient reduce (its MixedPrecisionPolicy), its
parallelize_llama (TP and SP under tp, SelectiveAC for --ckpt op or FullAC, fully_shard on its
device mesh), its ChunkedLossWrapper, grad-norm clipping, fused AdamW and its LR schedule.
Changed, and only where fake CUDA tensors cannot follow it: attention is its
ScaledDotProductAttention (FlexAttention, its default, needs compiled kernels), eager without
CUDA graphs (on by default), spmd_backend "partial_dtensor" (its default, spmd_types, fails in
fully_shard), and no values drawn into the weights.

torchtitan needs a newer torch than it may pull in, so it lives in a folder of its own on
PYTHONPATH beside .venv and runs on .venv's torch (`make vs-peers` installs it and runs):

    .venv/bin/python -m pip install --no-deps --target .torchtitan -r requirements-torchtitan.txt
    PYTHONPATH=.torchtitan .venv/bin/python -m bench.vs_peers --columns torchtitan
"""
from importlib.metadata import PackageNotFoundError, version
from types import SimpleNamespace

import torch
import torch.distributed as dist

from bench.vs_peers.fake import HostMeshes, SubclassesFirst, host_streams

try:  # requirements-torchtitan.txt, installed by make vs-peers; without it, the column says so
    from torchtitan.config import CompileConfig, ParallelismConfig
    from torchtitan.distributed import ParallelDims
    from torchtitan.distributed import utils as dist_utils
    from torchtitan.distributed.activation_checkpoint import FullAC, SelectiveAC
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.common.param_init import skip_param_init
    from torchtitan.models.llama3 import config_registry, model_registry
    from torchtitan.protocols.module import Module
    MISSING = None
except ImportError as e:
    MISSING = e.name

VERSION = "0.3.0"
FLAVORS = {"llama3-8b": "8B", "llama3-70b": "70B", "llama3-405b": "405B"}
NO_PP = ("torchtitan's pipelining cannot step on fake tensors: torch 2.13's PipelineStage reads "
         "its neighbours' answers to the host at its first step (result.item() of the warm-up "
         "vote in pipelining/schedules.py _warmup_p2p, dist.recv_object_list in stage.py "
         "_backward_metadata_inference), and the fake process group delivers no values")


def available():
    """None, or why this column cannot run (one line)."""
    if MISSING:
        return (f"torchtitan is not installed ({MISSING} does not import): make vs-peers installs "
                "it from requirements-torchtitan.txt")
    try:
        installed = version("torchtitan")
    except PackageNotFoundError:
        installed = "without its metadata"
    if installed != VERSION:
        return f"torchtitan {installed} is installed; this column runs {VERSION}"
    return None


def run_config(layout):
    """torchtitan's Trainer.Config of its published 8B run, set to the layout and its model."""

    config = config_registry.llama3_8b()
    config.model_spec = model_registry(FLAVORS[layout.model])
    for block in config.model_spec.model.layers:
        block.attention.inner_attention = ScaledDotProductAttention.Config()
    config.parallelism = ParallelismConfig(
        data_parallel_shard_degree=layout.dp_shard, tensor_parallel_degree=layout.tp,
        enable_sequence_parallel=layout.sp, pipeline_parallel_degree=layout.pp,
        pipeline_parallel_microbatch_size=layout.micro_batch, spmd_backend="partial_dtensor")
    config.training.local_batch_size = layout.micro_batch * layout.micro_batches
    config.training.seq_len = layout.seq_len
    config.training.disable_cuda_graphs = True
    config.compile = CompileConfig(enable=False)
    config.activation_checkpoint = (SelectiveAC if layout.ckpt == "op" else FullAC).Config()
    config.__post_init__()  # its own checks, of what was changed
    return config


def skip_values(model):
    """Every parameter's initializer made a no-op: fake tensors hold no values to draw."""

    for m in model.modules():
        if isinstance(m, Module):
            names = [name for name, _ in m.named_parameters(recurse=False)]
            m._param_init = dict.fromkeys(names, skip_param_init)


def made(config, dims):
    """The model as torchtitan's Trainer makes it without pp: built on meta, parallelized there,
    then on the device (fake CUDA), its buffers computed."""
    spec = config.model_spec
    spec.model.update_from_config(config=config)
    with torch.device("meta"):
        model = spec.model.build()
    model = spec.parallelize_fn(model, parallel_dims=dims, training=config.training,
                                parallelism=config.parallelism, compile_config=config.compile,
                                ac_config=config.activation_checkpoint,
                                dump_folder=config.dump_folder)
    model.to_empty(device=torch.device("cuda", torch.cuda.current_device()))
    skip_values(model)
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    return model.train()


def build(layout, rank, world):
    """The peer of `layout` on this rank (inside FakeGPUs, FakeWorld and FakeCUDA): its model,
    optimizers and one training step as torchtitan's Trainer.train_step takes it."""

    if layout.pp > 1:
        raise NotImplementedError(NO_PP)
    if (rank, world) != (dist.get_rank(), dist.get_world_size()):
        raise ValueError(f"rank {rank} of {world}: the process group is rank "
                         f"{dist.get_rank()} of {dist.get_world_size()}")
    config = run_config(layout)
    dist_utils.set_spmd_backend(config.parallelism.spmd_backend)
    dims = ParallelDims.from_config(config.parallelism, world)
    with HostMeshes():
        model = made(config, dims)
        loss_fn = config.loss.build(compile_config=config.compile)
        loss_fn.set_lm_head(model.lm_head)  # the chunked loss runs the head itself
        model._skip_lm_head = True
        optimizers = config.optimizer.build(model_parts=[model])
        schedulers = config.lr_scheduler.build(optimizers=optimizers,
                                               training_steps=config.training.steps)
    context = dist_utils.get_spmd_context(parallel_dims=dims)
    params = list(model.parameters())

    def step(x, y):
        """Trainer.train_step with its forward_backward_step, on tokens already on the device."""
        tokens = dist_utils.dist_sum_tensor((y != -100).sum(), dims.get_optional_mesh("batch"))
        with SubclassesFirst(), host_streams(), context():
            pred = model(x)
            loss, _ = loss_fn(pred, y, tokens)
            del pred
            loss.backward()
            dist_utils.clip_grad_norm_(params, config.training.max_norm, foreach=True)
            optimizers.step()
            schedulers.step()
            optimizers.zero_grad(set_to_none=True)

    return SimpleNamespace(model=[model], optimizers=list(optimizers), step=step,
                           vocab=config.model_spec.model.vocab_size // layout.tp)
