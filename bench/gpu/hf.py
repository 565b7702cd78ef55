"""Hugging Face's LlamaForCausalLM of our shapes, trained for the GPU run's part 2 as a child process: one JSON line per
step (seconds, peak memory) flushed to OUT as it ends, so a run stopped at its deadline keeps the steps it finished.
A step: bf16 autocast (or fp32), fp32 cross-entropy, clip 1.0, AdamW, random ids; torch.compile'd when compiled.

    python -m bench.gpu.hf '{"cfg": {...}, "micro": 16, "steps": 30, "compiled": true, "device": "cuda",
                             "dtype": "bf16"}' OUT.jsonl
"""
import json
import sys
import time
from contextlib import nullcontext

import torch
import torch.nn.functional as F

import model
from data.export import hf_config

try:  # a bench-only dependency (requirements-dev.txt): without it the GPU run says so and never starts this
    import transformers
except ImportError:
    transformers = None


def run(spec, out):
    cfg, micro, device = model.ModelConfig(**spec["cfg"]), spec["micro"], torch.device(spec["device"])
    fields = {k: v for k, v in hf_config(cfg).items() if k not in ("architectures", "model_type", "torch_dtype")}
    torch.manual_seed(0)
    with device:
        net = transformers.LlamaForCausalLM(transformers.LlamaConfig(**fields, attn_implementation="sdpa")).train()
    forward = torch.compile(net) if spec["compiled"] else net
    opt = torch.optim.AdamW(net.parameters(), 3e-4, (0.9, 0.95), weight_decay=0.1, fused=device.type == "cuda")
    amp = torch.autocast(device.type, dtype=torch.bfloat16) if spec["dtype"] == "bf16" else nullcontext()
    cuda = device.type == "cuda"
    with open(out, "a") as log:
        for _ in range(spec["steps"]):
            x = torch.randint(0, cfg.vocab_size, (micro, cfg.seq_len + 1), device=device)
            t0 = time.perf_counter()
            with amp:
                logits = forward(input_ids=x[:, :-1], use_cache=False).logits
                loss = F.cross_entropy(logits.float().flatten(0, 1), x[:, 1:].flatten())
            loss.backward()
            torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            loss.item()
            if cuda:
                torch.cuda.synchronize()
            log.write(json.dumps({"dt": time.perf_counter() - t0, "attn": net.config._attn_implementation,
                                  "mem": torch.cuda.max_memory_allocated() / 1e9 if cuda else None,
                                  "reserved": torch.cuda.max_memory_reserved() / 1e9 if cuda else None}) + "\n")
            log.flush()


if __name__ == "__main__":
    run(json.loads(sys.argv[1]), sys.argv[2])
