"""Export a save to a Hugging Face Llama folder, as LlamaForCausalLM and AutoTokenizer load it.

    python -m data.export RUN_DIR OUT_DIR            # the newest complete save, of any layout
    python -m data.export RUN_DIR OUT_DIR --replace  # OUT_DIR may hold files: replaced whole

OUT_DIR gets config.json (the model, with the end-of-text id as bos and eos), model.safetensors
(fp32, transformers' names, which are model.py's own; the embedding and head keep the true
vocabulary's rows; a tied model has its embedding alone), generation_config.json, and the run's
tiktoken encoding as tokenizer.json and tokenizer_config.json. --init-from reads it back (hf.py).
OUT_DIR must be new or empty, or replaced whole, so no file of an older checkpoint stays beside
the new one. It is built beside OUT_DIR and swapped in when complete, one export at a time
(files.staged). Each piece is checked against its CRC-32 as it is read. Exit status 2 for bad
input, 3 for a failed write, 128 + the signal's number for Ctrl-C, SIGTERM or SIGHUP.
"""
import json
import math
import sys
from pathlib import Path

import torch

from data import SaveError
from data.ending import exit_status, run_command
from data.files import atomic_write, staged
from data.saves import check_tensors, read_model
from data.tokenizer import EOT

SAFETENSORS_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}
USAGE = "usage: python -m data.export RUN_DIR OUT_DIR [--replace]"


def write_safetensors(path, tensors, dtype=None):
    """An 8-byte header length, a JSON header, then the raw bytes of `tensors`: tensors or
    callables with .shape and .dtype (LazyTensor, FirstRows), fetched and written in turn."""
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


class FirstRows:
    """The first `rows` rows of a tensor or LazyTensor (read when called); has .shape and .dtype."""

    def __init__(self, tensor, rows):
        self.tensor, self.shape, self.dtype = (tensor, torch.Size([rows, *tensor.shape[1:]]),
                                               tensor.dtype)

    def __call__(self):
        return (self.tensor() if callable(self.tensor) else self.tensor)[:self.shape[0]]


def hf_config(cfg, eot=None):
    """config.json of a model of `cfg`; eot is the end-of-text id (bos and eos), if known.

    RoPE is written as rope_parameters (transformers 5) and as rope_theta and rope_scaling."""
    scaling = dict(cfg.rope_scaling or {"rope_type": "default"})
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "hidden_size": cfg.d_model, "intermediate_size": cfg.ffn_dim,
        "num_hidden_layers": cfg.n_layer, "num_attention_heads": cfg.n_head,
        "num_key_value_heads": cfg.n_kv_head, "head_dim": cfg.head_dim,
        "vocab_size": cfg.vocab_size, "max_position_embeddings": cfg.seq_len,
        "rms_norm_eps": cfg.norm_eps, "rope_theta": cfg.rope_theta,
        "rope_parameters": {**scaling, "rope_theta": cfg.rope_theta},
        "tie_word_embeddings": bool(cfg.tie_embeddings), "attention_bias": False,
        "mlp_bias": False, "hidden_act": "silu", "torch_dtype": "float32",
    }
    if cfg.rope_scaling:
        config["rope_scaling"] = scaling
    if eot is not None:
        config.update(bos_token_id=eot, eos_token_id=eot)
    return config


# ---------------------------------------------------------------- the tokenizer, as an HF fast one

def byte_alphabet():
    """The character that spells each byte in a byte-level BPE vocabulary (GPT-2's convention):
    printable Latin-1 bytes themselves, the others chr(256), chr(257), ... in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    others = [b for b in range(256) if b not in printable]
    return {**{b: chr(b) for b in printable}, **{b: chr(256 + i) for i, b in enumerate(others)}}


def bpe_parts(ranks, token):
    """The parts tiktoken's merging (the adjacent pair whose union ranks lowest first) leaves of
    `token` when it may only build tokens ranked below it: two for a merge of two others."""
    parts, limit = [token[i:i + 1] for i in range(len(token))], ranks[token]
    while len(parts) > 1:
        rank, i = min((ranks.get(a + b, limit), i)
                      for i, (a, b) in enumerate(zip(parts, parts[1:])))
        if rank >= limit:
            break
        parts[i:i + 2] = [parts[i] + parts[i + 1]]
    return parts


def tokenizer_files(enc, seq_len):
    """{file name: JSON} of a tiktoken Encoding as a Hugging Face fast tokenizer.

    A byte-level BPE whose ids are the ranks, split first by the same regex, its merges the
    tokens' last merges in rank order; ignore_merges keeps a whole-token piece whole, as tiktoken.
    tiktoken has no public accessor for the ranks, pattern and special tokens: its attributes."""
    ranks, alphabet = enc._mergeable_ranks, byte_alphabet()
    spell = lambda token: "".join(alphabet[b] for b in token)
    merges = []
    for token in sorted(ranks, key=ranks.get):
        parts = bpe_parts(ranks, token) if len(token) > 1 else []
        if len(parts) == 2:
            merges.append(f"{spell(parts[0])} {spell(parts[1])}")
    added = [{"id": i, "content": text, "single_word": False, "lstrip": False, "rstrip": False,
              "normalized": False, "special": True}
             for text, i in sorted(enc._special_tokens.items(), key=lambda item: item[1])]
    tokenizer = {
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": added,
        "normalizer": None,
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": enc._pat_str}, "behavior": "Isolated",
             "invert": False},
            {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True,
             "use_regex": False}]},
        "post_processor": None,
        "decoder": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True,
                    "use_regex": False},
        "model": {"type": "BPE", "dropout": None, "unk_token": None,
                  "continuing_subword_prefix": None, "end_of_word_suffix": None,
                  "fuse_unk": False, "byte_fallback": False, "ignore_merges": True,
                  "vocab": {spell(token): rank for token, rank in ranks.items()},
                  "merges": merges},
    }
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": EOT, "eos_token": EOT,
              "model_max_length": seq_len, "clean_up_tokenization_spaces": False}
    generation = {"bos_token_id": enc.eot_token, "eos_token_id": enc.eot_token}
    return {"tokenizer.json": tokenizer, "tokenizer_config.json": config,
            "generation_config.json": generation}


# ---------------------------------------------------------------- the folder

def check_target(out, replace, keep=()):
    """SaveError unless OUT_DIR is new, an empty folder, or (replace) a folder to replace whole,
    which must not hold any of the paths `keep` (the run being exported, the current folder)."""
    if out.exists() and not out.is_dir():
        raise SaveError(f"{out} is a file, not a folder to export into")
    for path in keep:
        if replace and Path(path).resolve().is_relative_to(out.resolve()):
            raise SaveError(f"--replace: {out} holds {path}, which replacing it whole would delete")
    held = sorted(p.name for p in out.iterdir()) if out.is_dir() else []
    if held and not replace:
        raise SaveError(f"{out} is not empty (it holds {len(held)} entries, such as {held[0]}): "
                        "an export beside them would mix two checkpoints; "
                        "export into a new or empty folder, or pass --replace to replace it whole")


def export_hf(cfg, state_dict, out_dir, enc=None, replace=False, source="the state dict"):
    """Writes a folder LlamaForCausalLM.from_pretrained loads into OUT_DIR, as one step; with
    `enc` (the run's tiktoken Encoding) the tokenizer too. Lazy tensors are read one at a time."""
    out, tensors = Path(out_dir), {}
    for name, t in check_tensors(cfg, state_dict, source).items():
        rows = name in ("embed_tokens.weight", "lm_head.weight")  # the true vocabulary, no padding
        tensors[name if name == "lm_head.weight" else "model." + name] = (
            FirstRows(t, cfg.vocab_size) if rows else t)
    with staged(out, lambda: check_target(out, replace), "an export into it",
                "export into another folder") as stage:
        write_safetensors(stage / "model.safetensors", tensors, dtype=torch.float32)
        files = {"config.json": hf_config(cfg, None if enc is None else enc.eot_token)}
        files.update(tokenizer_files(enc, cfg.seq_len) if enc is not None else {})
        for name, content in files.items():
            with atomic_write(stage / name, "w") as f:
                f.write(json.dumps(content, indent=2))


def export(run_dir, out, replace):
    """python -m data.export RUN_DIR OUT_DIR [--replace]; SaveError names what is wrong."""
    check_target(Path(out), replace, keep=(run_dir, Path.cwd()))  # before anything is read
    cfg, enc, tensors, save = read_model(run_dir, verify=False)  # checked as it is read
    export_hf(cfg, tensors, out, enc, replace, source=save / "meta.json")


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    replace = "--replace" in argv
    paths = [a for a in argv if a != "--replace"]
    if len(paths) != 2 or any(a.startswith("-") for a in paths):
        print(USAGE, file=sys.stderr)
        return 2
    run_dir, out = paths
    if "" in paths:
        print(f"error: {'RUN_DIR' if run_dir == '' else 'OUT_DIR'} is an empty path; {USAGE}",
              file=sys.stderr)
        return 2
    _, code = run_command(lambda: export(run_dir, out, replace), out)
    if not code:
        print(f"wrote {out}: config.json, model.safetensors, the tokenizer and "
              "generation_config.json")
    return code


if __name__ == "__main__":
    sys.exit(exit_status(main))
