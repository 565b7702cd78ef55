"""Starting a run from a Hugging Face Llama folder: `train.py --init-from DIR`. The reader beside export.py's writer.

DIR holds config.json and model.safetensors, or model.safetensors.index.json and the files it names (what
save_pretrained and `python -m saves.export` write). Before anything is built, config.json is held against the run's
model: every shape field must equal its flag, and anything this model cannot be (another model_type, biases, an
activation other than SiLU, scaled RoPE, a head_dim other than hidden_size / num_attention_heads) is refused with one
line naming the field, exit 2; rope_theta and rms_norm_eps, which have no flags, are taken from it. Every tensor the
model needs must be there with its shape. Then each rank reads its own pieces only, one at a time, through load.load,
the path of --resume: a piece that lies in one stretch of the file (no tp split, or a split by rows) is read as that
byte range; a tp block of columns is cut from its full tensor, which is then dropped. The run starts at step 0 with a
fresh optimizer. The safetensors format is read with plain file reads: an 8-byte header length, a JSON header of
{name: dtype, shape, [start, end) byte offsets}, then the raw little-endian bytes.

What the two sides agree on, and what is converted:
- names: the model's own, under "model." (lm_head.weight aside), as export.py writes them;
- RoPE: both rotate the pairs (i, i + head_dim/2) (model.apply_rope), so q_proj and k_proj load as they are, as
  export.py writes them (a checkpoint in Meta's interleaved layout must first go through transformers' converter);
- vocabulary: the embedding and the head have vocab_size rounded up to a multiple of 64 rows. A file with fewer rows
  gets zero rows after its own: the data never feeds those ids, and their logits start at 0 (the file's own logits
  are unchanged). vocab_size must lie between the run's vocab_size and that rounded size;
- tied embeddings (tie_word_embeddings, usually with no lm_head.weight): embed_tokens initializes the head too; the
  two then train apart, and an export writes both;
- dtypes: F32, F16, BF16 and F64 tensors become fp32 master weights.
"""
import json
import math
import os
from dataclasses import replace
from pathlib import Path

import torch

import model as M
from saves import SaveError
from saves.load import FileError, cut, load
from saves.write import global_shape

SAFETENSORS_TYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "F64": torch.float64}
SHAPE_FIELDS = (("num_hidden_layers", "n_layer"), ("hidden_size", "d_model"), ("num_attention_heads", "n_head"),
                ("num_key_value_heads", "n_kv_head"), ("intermediate_size", "ffn_dim"))
IGNORED = ("rotary_emb.inv_freq",)  # buffers older transformers saved: recomputed from rope_theta


def read_json(path):
    try:
        return json.loads(Path(path).read_text())
    except OSError as e:
        raise SaveError(f"--init-from: cannot read {path}: {e.strerror or e}") from None
    except ValueError as e:
        raise SaveError(f"--init-from: {path} is not JSON ({e})") from None


def read_header(path):
    """({tensor name: its header entry}, the byte where the data starts) of a safetensors file, every entry checked
    against the file's size."""
    try:
        with open(path, "rb") as f:
            size, length = os.fstat(f.fileno()).st_size, int.from_bytes(f.read(8), "little")
            if length > size - 8:
                raise SaveError(f"--init-from: {path} is truncated or not a safetensors file")
            header = json.loads(f.read(length))
    except OSError as e:
        raise SaveError(f"--init-from: cannot read {path}: {e.strerror or e}") from None
    except ValueError:
        raise SaveError(f"--init-from: {path} is not a safetensors file (its header is not JSON)") from None
    if not isinstance(header, dict):
        raise SaveError(f"--init-from: {path} is not a safetensors file (its header is not an object)")
    header.pop("__metadata__", None)
    for name, entry in header.items():
        try:
            dtype, shape, (start, end) = entry["dtype"], list(entry["shape"]), entry["data_offsets"]
            numel = math.prod(shape)
        except (KeyError, TypeError, ValueError):
            raise SaveError(f"--init-from: {path}: the header entry of {name} is malformed") from None
        if dtype not in SAFETENSORS_TYPES:
            raise SaveError(f"--init-from: {path}: {name} is {dtype}; readable: {', '.join(SAFETENSORS_TYPES)}")
        if end - start != numel * SAFETENSORS_TYPES[dtype].itemsize or start < 0 or 8 + length + end > size:
            raise SaveError(f"--init-from: {path} is truncated or malformed at tensor {name}")
    return header, 8 + length


def check_config(folder, cfg):
    """(config.json, cfg with its rope_theta and rms_norm_eps); SaveError naming the first field this run's model
    disagrees with."""
    path = folder / "config.json"
    config = read_json(path)

    def refuse(field, why):
        raise SaveError(f"--init-from: {path}: {field} {why}")

    if config.get("model_type") != "llama":
        refuse("model_type", f"is {config.get('model_type')!r}; only Llama checkpoints load into this model")
    for field, ours in SHAPE_FIELDS:
        value = config.get(field, config.get("num_attention_heads") if field == "num_key_value_heads" else None)
        if value != getattr(cfg, ours):
            flag = f"--{ours.replace('_', '-')}"
            refuse(field, f"is {value}, this run has {flag} {getattr(cfg, ours)} (pass {flag} {value})")
    if config.get("head_dim") not in (None, cfg.head_dim):
        refuse("head_dim", f"is {config['head_dim']}; this model's is hidden_size / num_attention_heads = "
                           f"{cfg.head_dim}")
    vocab = config.get("vocab_size")
    if not isinstance(vocab, int) or not cfg.vocab_size <= vocab <= cfg.padded_vocab:
        refuse("vocab_size", f"is {vocab}, this run's model has {cfg.vocab_size} rows padded to {cfg.padded_vocab} "
                             f"(pass --vocab-size {vocab})")
    if config.get("hidden_act", "silu") != "silu":
        refuse("hidden_act", f"is {config['hidden_act']!r}; this model's MLP is SwiGLU (silu)")
    for field in ("attention_bias", "mlp_bias"):
        if config.get(field):
            refuse(field, "is true; this model has no biases")
    rope_field = "rope_scaling" if config.get("rope_scaling") else "rope_parameters"
    rope = config.get(rope_field) or {}
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind != "default":
        refuse(rope_field, f"has rope_type {kind!r}; this model's RoPE has no frequency scaling")
    theta, eps = rope.get("rope_theta", config.get("rope_theta", 10000.0)), config.get("rms_norm_eps", 1e-6)
    return config, replace(cfg, rope_theta=float(theta), norm_eps=float(eps))


class HFWeights:
    """A Hugging Face folder in the shape load.load reads a save in: path, meta (its files, and "param" as the only
    kind of tensor: no optimizer state), tensors (the model's names), read(piece, kind)."""

    def __init__(self, folder, cfg, config):
        self.path = folder
        index = folder / "model.safetensors.index.json"
        if index.is_file():
            weight_map = read_json(index).get("weight_map") or {}
            files = sorted(set(weight_map.values()))
        elif (folder / "model.safetensors").is_file():
            files = ["model.safetensors"]
        else:
            raise SaveError(f"--init-from: {folder} has neither model.safetensors nor model.safetensors.index.json")
        sources = {}  # file's tensor name -> (file, header entry, data start)
        for name in files:
            if Path(name).name != name:
                raise SaveError(f"--init-from: {index} names {name!r}, not a file in {folder}")
            header, start = read_header(folder / name)
            sources.update({t: (name, entry, start) for t, entry in header.items()})
        self.meta = {"files": {name: (folder / name).stat().st_size for name in files},
                     "optimizer": {"kinds": ["param"]}}
        tied = bool(config.get("tie_word_embeddings", False))
        if not tied and "lm_head.weight" not in sources:
            raise SaveError(f"--init-from: {folder} has no lm_head.weight and config.json's tie_word_embeddings is "
                            "false")
        with torch.device("meta"):
            shapes = {name: list(p.shape) for name, p in M.GPT(cfg).named_parameters()}
        self.tensors, used = {}, {"lm_head.weight"} if tied else set()
        for name, shape in shapes.items():
            source = "model.embed_tokens.weight" if name == "lm_head.weight" and tied else \
                name if name == "lm_head.weight" else "model." + name
            if source not in sources:
                raise SaveError(f"--init-from: {folder} has no tensor {source}")
            file, entry, start = sources[source]
            padded_rows = name in ("embed_tokens.weight", "lm_head.weight") and entry["shape"][1:] == shape[1:] \
                and cfg.vocab_size <= entry["shape"][0] <= shape[0]
            if entry["shape"] != shape and not padded_rows:
                raise SaveError(f"--init-from: {folder}: {source} has shape {entry['shape']}, this model needs {shape}")
            self.tensors[name] = {"shape": shape, "source": source, "file": file,
                                  "dtype": SAFETENSORS_TYPES[entry["dtype"]], "numel": math.prod(entry["shape"]),
                                  "offset": start + entry["data_offsets"][0]}
            used.add(source)
        unused = sorted(t for t in set(sources) - used if not t.endswith(IGNORED))
        if unused:
            raise SaveError(f"--init-from: {folder} has {len(unused)} tensor(s) this model has no place for, "
                            f"such as {unused[0]}")

    def elements(self, name, first, n):
        """Elements [first, first + n) of the flattened (row-padded) tensor, in fp32; rows past the file's are 0."""
        info, out = self.tensors[name], torch.zeros(n, dtype=torch.float32)
        have = max(0, min(n, info["numel"] - first))
        if have:
            raw = torch.empty(have, dtype=info["dtype"])
            try:
                with open(self.path / info["file"], "rb") as f:
                    f.seek(info["offset"] + first * raw.element_size())
                    got = f.readinto(raw.view(torch.uint8).numpy())
            except OSError as e:
                raise FileError(f"cannot read {self.path / info['file']}: {e.strerror or e}", info["file"], 1) from None
            if got != have * raw.element_size():
                raise FileError(f"{self.path / info['file']} is truncated", info["file"], 1)
            out[:have] = raw  # to fp32
        return out

    def read(self, piece, kind="param"):
        """The piece's elements: elements [offset, offset + end - start) of this rank's tp block (load.py's Piece)."""
        shape = self.tensors[piece.name]["shape"]
        if shape != global_shape(piece):
            raise SaveError(f"{self.path}: {piece.name} has shape {shape}, this model has {global_shape(piece)}")
        dim, rank, _ = piece.tp_shard or (0, 0, 1)
        if dim != 0:  # a block of columns: strided in the file
            full = self.elements(piece.name, 0, math.prod(shape)).view(shape)
            return cut(full, piece)
        block_start = rank * math.prod(piece.shape)  # a block of rows starts where its first row does
        return self.elements(piece.name, block_start + piece.offset, piece.end - piece.start)


def init_from(folder, cfg):
    """--init-from: (cfg with config.json's rope_theta and rms_norm_eps, the HFWeights to load); (cfg, None) without.
    Everything is checked here, on every rank alike, before anything is built or written."""
    if folder is None:
        return cfg, None
    folder = Path(folder)
    if not folder.is_dir():
        raise SaveError(f"--init-from: {folder} is not a folder")
    config, cfg = check_config(folder, cfg)
    return cfg, HFWeights(folder, cfg, config)


def start_from(weights, wrapper, opt, rank):
    """Fills this rank's parameters from the checkpoint (any layout; optimizer state stays fresh); returns step 0."""
    load(weights, wrapper, opt, flag="--init-from")
    if rank == 0:
        print(f"initialized from {weights.path} (step 0, fresh optimizer)", flush=True)
    return 0
