"""Export a save to a Hugging Face Llama folder, as LlamaForCausalLM and AutoTokenizer load it.

--init-from reads the same folder back.

    python -m data.export RUN_DIR OUT_DIR            # the newest complete save, of any layout
    python -m data.export RUN_DIR OUT_DIR --replace  # OUT_DIR may hold files: replaced whole

OUT_DIR gets
    config.json             the model: its shapes, rope_theta and Llama 3's rope scaling,
                            rms_norm_eps, the true vocab_size, tie_word_embeddings, and the
                            end-of-text id as bos_token_id and eos_token_id
    model.safetensors       fp32, transformers' names. The embedding and the head keep the true
                            vocabulary's rows, not the padding to a multiple of 64. A tied model
                            has its embedding alone, as save_pretrained does.
    generation_config.json  the end-of-text id, where generation stops
    tokenizer.json, tokenizer_config.json
                            the run's tokenizer, which its data was made with: the tiktoken
                            encoding as a byte-level BPE that splits text into the same tokens

The parameter names are the Hugging Face ones already (model.py): export is a rename and a format.
Every file goes into a temporary folder beside OUT_DIR, which becomes OUT_DIR only when complete.
A failed or interrupted export leaves nothing behind (Ctrl-C, SIGTERM, SIGHUP: exit 128 + the
signal's number). No file of an older checkpoint is left beside the new one, such as a stale
model.safetensors.index.json and its shards: OUT_DIR must be new or empty, or --replace replaces
it whole. One export into OUT_DIR runs at a time. It is locked from the second check to the rename
(data.files, as training locks a run folder). A second export started meanwhile stops with one
line, exit 2, changing nothing; of two started together, exactly one wins whole.

Each tensor's pieces are checked against their CRC-32 as they are read (load.py). Exit status 2,
with one line naming it, for: a corrupt save; a model config that is incomplete or inconsistent
(model.config_from_dict); tensors that are not that model's (the layer count is checked before any
model is built); a tokenizer that cannot be loaded; a file that is not regular (a FIFO); or a
non-empty OUT_DIR without --replace.
"""
import json
import math
import os
import shutil
import signal
import sys
from pathlib import Path

import torch

from data import SaveError
from data.files import (
    Interrupted,
    atomic_write,
    fsync_dir,
    interruptible,
    lock_folder,
    make_folders,
    remove_created,
    unlock_folder,
)
from data.loader import DataError
from data.saves import check_layers, complete_saves, model_tensors
from data.tokenizer import EOT, get_tokenizer
from model import GPT, config_from_dict

SAFETENSORS_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}
USAGE = "usage: python -m data.export RUN_DIR OUT_DIR [--replace]"


def write_safetensors(path, tensors, dtype=None):
    """The safetensors format: 8-byte header length, a JSON header, then raw little-endian bytes.

    tensors maps a name to a tensor, or to a function returning it that has .shape and .dtype
    (load.LazyTensor, FirstRows). The header needs only shapes. So the tensors are then fetched,
    converted to `dtype` and written one at a time."""
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

    The RoPE settings are written twice: as rope_parameters (transformers 5),
    and as rope_theta and rope_scaling (earlier versions)."""
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
    """The printable character that spells each byte in a byte-level BPE vocabulary.

    This is GPT-2's convention, which the Hugging Face tokenizers library follows.
    The printable Latin-1 bytes stand for themselves; the others for chr(256), chr(257), ...
    in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    others = [b for b in range(256) if b not in printable]
    return {**{b: chr(b) for b in printable}, **{b: chr(256 + i) for i, b in enumerate(others)}}


def bpe_parts(ranks, token):
    """The parts byte-pair merging leaves of `token` when it may only build tokens ranked below it.

    As in tiktoken, each merge joins the adjacent pair whose union ranks lowest.
    A token that is a merge of two others leaves two parts."""
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

    It is a byte-level BPE whose ids are the ranks, split first by the same regex. Its merges are
    the tokens' last merges, in rank order. With ignore_merges, a piece that is a whole token is
    that token, as in tiktoken. The special tokens (end of text) are added tokens.
    tiktoken has no public accessor for an encoding's ranks, pattern and special tokens,
    so its attributes are read."""
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
    """SaveError unless OUT_DIR is new, an empty folder, or (replace) a folder to replace whole.

    A folder to replace must not hold any of the paths `keep`:
    the run being exported, the current folder."""
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


def check_tensors(cfg, state_dict, source="the state dict"):
    """The tensors, in the model's own order; SaveError naming `source` if they are not cfg's.

    They must be exactly the tensors of the model of cfg, with its shapes. The order is the model's,
    whatever order a save's layout listed them in, so every layout exports the same bytes."""
    with torch.device("meta"):
        # tied: no lm_head.weight
        shapes = {name: p.shape for name, p in GPT(cfg).named_parameters()}
    for name, shape in shapes.items():
        if name not in state_dict or state_dict[name].shape != shape:
            found = (f"shape {list(state_dict[name].shape)}" if name in state_dict
                     else "no such tensor")
            raise SaveError(f"{source}: its config's model needs {name} of shape {list(shape)}, "
                            f"it has {found}")
    extra = sorted(set(state_dict) - set(shapes))
    if extra:
        raise SaveError(f"{source} has {extra[0]}, which its config's model has no place for")
    return {name: state_dict[name] for name in shapes}


def export_hf(cfg, state_dict, out_dir, enc=None, replace=False, source="the state dict"):
    """Writes a folder LlamaForCausalLM.from_pretrained loads into OUT_DIR, as one step.

    It holds config.json and model.safetensors (fp32). With `enc`, the run's tiktoken Encoding,
    it holds the tokenizer and generation config too. state_dict values may be lazy
    (load.model_tensors): then one full tensor is in memory at a time. source is where
    state_dict came from, named in an error. The module's docstring says the rest."""
    out = Path(out_dir)
    check_target(out, replace)
    tensors = {}
    for name, t in check_tensors(cfg, state_dict, source).items():
        rows = name in ("embed_tokens.weight", "lm_head.weight")  # the true vocabulary, no padding
        tensors[name if name == "lm_head.weight" else "model." + name] = (
            FirstRows(t, cfg.vocab_size) if rows else t)
    try:
        created = make_folders(out)  # out too: the lock is on the folder itself
    except OSError as e:
        raise SaveError(f"cannot create {e.filename or out}: {e.strerror or e}") from None
    lock = None
    try:
        lock = lock_folder(out)
        if lock is None:
            raise SaveError(f"{out} is being written by another process (an export into it): "
                            "wait for it to end, or export into another folder "
                            "(nothing was changed)")
        check_target(out, replace)  # again, now that no other export can change it
        write_folder(cfg, tensors, out, enc, replace)
    except BaseException:
        remove_created(created)  # only folders this export made, and only while empty
        raise
    finally:
        unlock_folder(lock)


def write_folder(cfg, tensors, out, enc, replace):
    """Writes the files into a hidden folder beside out, which takes its place when complete.

    An empty out is replaced by one rename. One to be replaced whole is moved aside first,
    and removed once the new one is in."""
    stage, old = (out.parent / f".{out.name}.export-{os.getpid()}",
                  out.parent / f".{out.name}.replaced-{os.getpid()}")
    try:
        stage.mkdir()
        write_safetensors(stage / "model.safetensors", tensors, dtype=torch.float32)
        files = {"config.json": hf_config(cfg, None if enc is None else enc.eot_token)}
        files.update(tokenizer_files(enc, cfg.seq_len) if enc is not None else {})
        for name, content in files.items():
            with atomic_write(stage / name, "w") as f:
                f.write(json.dumps(content, indent=2))
        fsync_dir(stage)
        if any(out.iterdir()):  # replaced whole: moved aside, removed once the new folder is in
            os.rename(out, old)
        os.rename(stage, out)  # onto an empty folder: one step
        fsync_dir(out.parent)
    except BaseException:
        shutil.rmtree(stage, ignore_errors=True)
        if old.exists() and not out.exists():
            os.rename(old, out)
        raise
    shutil.rmtree(old, ignore_errors=True)


def newest_save(run_dir):
    """The save model_tensors reads: run_dir itself if it is one, else its newest complete save."""
    run_dir = Path(run_dir)
    return run_dir if (run_dir / "complete").exists() else complete_saves(run_dir)[-1]


def export(run_dir, out, replace):
    """python -m data.export RUN_DIR OUT_DIR [--replace], its checks first.

    SaveError names what is wrong."""
    check_target(Path(out), replace, keep=(run_dir, Path.cwd()))  # before anything is read
    # any layout, read (and checked) tensor by tensor
    run_config, state = model_tensors(run_dir, verify=False)
    where = newest_save(run_dir) / "meta.json"
    try:
        cfg = config_from_dict(run_config["model"])
        enc = get_tokenizer(run_config["tokenizer"], run_config.get("tokenizer_file"))
    except (KeyError, ValueError) as e:
        what = f"has no key {e}" if isinstance(e, KeyError) else str(e)
        raise SaveError(f"{where}: {what}".replace("\n", " ")) from None
    except DataError as e:
        raise SaveError(f"{where}: the run's tokenizer: {e}") from None
    check_layers(cfg, state, where)  # before a model of cfg is built, even on the meta device
    export_hf(cfg, state, out, enc, replace, source=where)


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
    try:
        with interruptible():  # SIGTERM, SIGHUP: raised here, so the staging folder is removed
            export(run_dir, out, replace)
    except SaveError as e:  # bad input: the run folder, the output folder
        print(f"error: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # a full or unwritable disk, as training's exit 3; nothing is half-written
        print(f"error: cannot write {out}: {e.strerror or e}", file=sys.stderr)
        return 3
    except (KeyboardInterrupt, Interrupted) as e:
        sig = e.args[0] if isinstance(e, Interrupted) else signal.SIGINT
        print(f"error: interrupted by {sig.name}: nothing was written to {out}", file=sys.stderr)
        return 128 + sig
    print(f"wrote {out}: config.json, model.safetensors, the tokenizer and generation_config.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
