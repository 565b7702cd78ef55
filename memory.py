"""The memory one rank holds at the peak of a training step, estimated from the shapes.

Used before a run starts (config.check_fits): a step that would not fit the device less MARGIN is
refused, naming the flag that moves the largest part.
"""
import model
from parallel import ckpt

MARGIN = 0.10  # of the device's memory kept free: fragmentation, NCCL's buffers, the CUDA context


def step_bytes(cfg, run):
    """{part: bytes} one rank holds at a step's peak.

    model state     fp32 weights, gradients and Adam's two moments: 16 bytes a parameter, sharded;
                    --accumulate unsharded adds every unit's flat gradient, unsharded, in the
                    reduce dtype, which it keeps all step.
    weights in use  FSDP's two gathered units, or autocast's copy of the stage's weights.
    activations     what backward keeps per layer and token, in the compute dtype: the norms' inputs
                    and outputs, q, k, v, attention's output, the MLP's gate, up and product. A
                    checkpointed layer keeps its input; one layer is remade at a time. A pipeline
                    stage keeps up to P micro-batches' sets (GPipe: M).
    logits          the logits and their gradient, and one fp32 chunk of the loss.
    token ids       the step's inputs and targets.
    """
    e = 4 if run.dtype == "fp32" else 2
    d, f, params = cfg.d_model, cfg.ffn_dim, model.param_counts(cfg)[0]
    sh = run.tp if run.sp else 1  # the residual stream's split under sequence parallel
    shard = {"ddp": 1, "fsdp": run.dp * run.cp, "hsdp": (run.dp_shard or 1) * run.cp}[run.dp_mode]
    stage = params / (run.tp * run.pp)
    block = model.layer_param_count(cfg) / run.tp
    tokens = run.micro_batch * cfg.seq_len / run.cp
    kv = 2 * d * cfg.n_kv_head / cfg.n_head  # k and v per token
    per_token = e * (4 * d / sh + (4 * d + kv + 3 * f) / run.tp) + 8 / sh
    layers = -(-cfg.n_layer // run.pp)
    kind = ckpt.parse(run.ckpt)[0]
    if kind in ("none", "selective"):
        kept = layers * per_token
    else:  # boundaries, and one layer remade at a time
        kept = layers * e * d / sh + per_token
    if kind == "selective":
        kept -= layers * e * (2 * d / sh + f / run.tp)
    sets = 1
    if run.pp > 1:
        sets = run.accum_steps if run.pp_schedule == "gpipe" else min(run.pp, run.accum_steps)
    vocab = cfg.padded_vocab / run.tp
    r = 4 if run.reduce_dtype == "fp32" else 2
    summed = r * stage if run.accumulate == "unsharded" else 0  # fsdp_accumulate's flat gradients
    return {"model state": 16 * stage / shard + summed,
            "weights in use": 2 * e * block if run.dp_mode != "ddp" else e * stage * (e < 4),
            "activations": sets * tokens * kept,
            "logits": 2 * e * tokens * vocab + 4 * min(tokens, 2 ** 25 / vocab) * vocab,
            "token ids": 16 * run.global_batch / run.dp * cfg.seq_len}
