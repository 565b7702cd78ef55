"""The FSDP2 column: transformers' LlamaForCausalLM under torch's own fully_shard.

What a user of torch and Hugging Face would write: one FSDP unit per decoder layer and the root,
MixedPrecisionPolicy (bf16 weights in compute, fp32 reduce), SDPA's causal kernel, each layer in
torch's checkpoint_wrapper (full, or op-level selective with the same rule as our --ckpt op), DTensor's
tensor parallel plan under tp (colwise q, k, v, gate, up, lm_head; rowwise o, down; no sequence
parallel: transformers' norms and rotary embedding would need rewriting), AdamW, and the model's
own loss (logits upcast to fp32; under tp, loss_parallel). Built on meta, made on fake CUDA.
"""
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    loss_parallel,
    parallelize_module,
)

import model
from bench.vs_peers.fake import HostMeshes, SubclassesFirst, host_streams
from parallel.ckpt import keep_op_outputs

try:  # requirements-dev.txt; without it, this column says so
    from transformers import AttentionInterface, LlamaConfig, LlamaForCausalLM
except ImportError:
    AttentionInterface = LlamaConfig = LlamaForCausalLM = None

TP_PLAN = {"self_attn.q_proj": ColwiseParallel(), "self_attn.k_proj": ColwiseParallel(),
           "self_attn.v_proj": ColwiseParallel(), "self_attn.o_proj": RowwiseParallel(),
           "mlp.gate_proj": ColwiseParallel(), "mlp.up_proj": ColwiseParallel(),
           "mlp.down_proj": RowwiseParallel()}


def available():
    """None, or why this column cannot run (one line)."""
    if LlamaForCausalLM is None:
        return "transformers is not installed (make install-dev installs requirements-dev.txt)"
    return None


def llama_config(cfg):
    AttentionInterface.register("causal_sdpa", causal_sdpa)
    return LlamaConfig(vocab_size=cfg.vocab_size, hidden_size=cfg.d_model,
                       intermediate_size=cfg.ffn_dim, num_hidden_layers=cfg.n_layer,
                       num_attention_heads=cfg.n_head, num_key_value_heads=cfg.n_kv_head,
                       max_position_embeddings=cfg.seq_len, rope_theta=cfg.rope_theta,
                       rms_norm_eps=cfg.norm_eps, tie_word_embeddings=False,
                       attn_implementation="causal_sdpa", use_cache=False)


def causal_sdpa(module, q, k, v, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers' sdpa attention without its mask: SDPA's causal kernel (FlashAttention in
    bf16), the one torch picks for a causal batch with no padding."""
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scaling, enable_gqa=True)
    return out.transpose(1, 2).contiguous(), None


def build(layout, rank, world):
    """The peer of `layout` on this rank: its model, optimizer and one training step."""
    if layout.pp > 1:
        raise NotImplementedError("torch's pipelining needs a model cut into stages by hand; "
                                  "transformers' Llama is not, so this column has no pp layout")
    cfg = model.PRESETS[layout.model]
    with HostMeshes():
        net, opt = made(cfg, layout, world)

    def step(x, y):
        with SubclassesFirst(), host_streams():
            if layout.tp == 1:
                net(input_ids=x, labels=y).loss.backward()  # the model's own loss
            else:
                with loss_parallel():  # the logits stay split over the vocabulary
                    logits = net(input_ids=x).logits
                    F.cross_entropy(logits.flatten(0, 1).float(), y.flatten()).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    return SimpleNamespace(model=[net], optimizers=[opt], step=step,
                           vocab=cfg.vocab_size // layout.tp)


def made(cfg, layout, world):
    """(model, optimizer) on fake CUDA, sharded and checkpointed as the layout says."""
    mesh = init_device_mesh("cuda", (world // layout.tp, layout.tp), mesh_dim_names=("dp", "tp"))
    with torch.device("meta"):
        net = LlamaForCausalLM(llama_config(cfg))
    if layout.tp > 1:
        for layer in net.model.layers:
            parallelize_module(layer, mesh["tp"], TP_PLAN)
        parallelize_module(net, mesh["tp"], {"lm_head": ColwiseParallel(use_local_output=False)})
    options = {"context_fn": keep_op_outputs} if layout.ckpt == "op" else {}
    for i, layer in enumerate(net.model.layers):
        net.model.layers[i] = checkpoint_wrapper(layer, **options)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in net.model.layers:
        fully_shard(layer, mesh=mesh["dp"], mp_policy=policy)
    fully_shard(net, mesh=mesh["dp"], mp_policy=policy)
    net.to_empty(device="cuda")
    return net, torch.optim.AdamW(net.parameters(), lr=3e-4, weight_decay=0.1)
