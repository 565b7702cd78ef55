"""Export a save to a Hugging Face Llama folder: config.json and model.safetensors (fp32).

    python -m saves.export RUN_DIR OUT_DIR      # the newest complete save of a run made in any layout

The parameter names are the Hugging Face ones already (model.py), so this is a rename plus the file format.
Both files are written atomically: an interrupted or failed export leaves no truncated file behind, and a folder it
created for them is removed again. Each tensor's pieces are checked against their CRC-32 as they are read
(load.py): a corrupt save stops the export with one line naming the file, exit status 2.
"""
import json
import math
import sys
from pathlib import Path

import torch

from model import GPT, config_from_dict
from saves import SaveError
from saves.files import atomic_write
from saves.load import model_tensors

SAFETENSORS_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}


def write_safetensors(path, tensors, dtype=None):
    """The safetensors format: 8-byte header length, a JSON header, then the raw little-endian bytes.
    tensors: {name: tensor, or a function returning it that has .shape and .dtype (load.LazyTensor)};
    the header needs only shapes, so the tensors are then fetched, converted to `dtype` and written one at a time."""
    header, offset = {}, 0
    for name, t in tensors.items():
        out_dtype = dtype or t.dtype
        size = math.prod(t.shape) * out_dtype.itemsize
        header[name] = {"dtype": SAFETENSORS_DTYPES[out_dtype], "shape": list(t.shape),
                        "data_offsets": [offset, offset + size]}
        offset += size
    head = json.dumps(header).encode()
    head += b" " * (-len(head) % 8)
    with atomic_write(path) as f:
        f.write(len(head).to_bytes(8, "little"))
        f.write(head)
        for t in tensors.values():
            t = (t() if callable(t) else t).detach().to("cpu", dtype or t.dtype).contiguous()
            f.write(t.view(torch.uint8).numpy().data)
            del t  # before the next one is read


def hf_config(cfg):
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "hidden_size": cfg.d_model, "intermediate_size": cfg.ffn_dim, "num_hidden_layers": cfg.n_layer,
        "num_attention_heads": cfg.n_head, "num_key_value_heads": cfg.n_kv_head, "head_dim": cfg.head_dim,
        "vocab_size": cfg.padded_vocab, "max_position_embeddings": cfg.seq_len, "rms_norm_eps": cfg.norm_eps,
        "rope_theta": cfg.rope_theta, "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
        "tie_word_embeddings": False, "attention_bias": False, "mlp_bias": False, "hidden_act": "silu",
        "torch_dtype": "float32",
    }


def export_hf(cfg, state_dict, out_dir):
    """Writes config.json and model.safetensors (fp32) that LlamaForCausalLM.from_pretrained loads, the tensors in
    the model's order, so that every layout exports the same bytes. state_dict values may be lazy
    (load.model_tensors): then one full tensor is in memory at a time."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    with torch.device("meta"):  # the model's own order, whatever order the save's layout listed the tensors in
        order = {name: i for i, (name, _) in enumerate(GPT(cfg).named_parameters())}
    state_dict = dict(sorted(state_dict.items(), key=lambda item: order.get(item[0], len(order))))
    renamed = {(k if k == "lm_head.weight" else "model." + k): v for k, v in state_dict.items()}
    write_safetensors(out / "model.safetensors", renamed, dtype=torch.float32)
    with atomic_write(out / "config.json", "w") as f:  # last: its presence marks a finished export
        f.write(json.dumps(hf_config(cfg), indent=2))


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2:
        print("usage: python -m saves.export RUN_DIR OUT_DIR", file=sys.stderr)
        return 2
    created = not Path(argv[1]).exists()
    try:
        run_config, state = model_tensors(argv[0], verify=False)  # any layout, read (and checked) tensor by tensor
        export_hf(config_from_dict(run_config["model"]), state, argv[1])
    except (SaveError, OSError) as e:  # OSError: a full or unwritable disk; nothing half-written is left
        if created and Path(argv[1]).is_dir() and not any(Path(argv[1]).iterdir()):
            Path(argv[1]).rmdir()
        print(f"error: {e}" if isinstance(e, SaveError) else f"error: cannot write {argv[1]}: {e.strerror or e}",
              file=sys.stderr)
        return 2
    print(f"wrote {argv[1]}/config.json and model.safetensors")
    return 0


if __name__ == "__main__":
    sys.exit(main())
