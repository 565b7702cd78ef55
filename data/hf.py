"""Starting a run from a Hugging Face Llama folder (`train.py --init-from DIR`), as export.py
and save_pretrained write one: config.json and model.safetensors, or an index and its files.

Before anything is built, config.json is held against the run's model. Every shape field must
equal its flag; what this model cannot be (another model_type, biases, an activation other than
SiLU, a RoPE scaling other than Llama 3's, a field of the wrong type or out of range) is one line
naming the field, exit 2. rope_theta, rms_norm_eps, Llama 3's rope scaling, vocab_size and
tie_word_embeddings, which have no flags, are taken from it. Every tensor the model needs must
be there with its shape, and nothing else. The folder is then read as a save of its tensors
(saves.load, the path of --resume): each rank reads its own pieces, starting at step 0.

The two sides agree: the model's own names under "model."; RoPE rotating the pairs (i, i +
head_dim/2), so q_proj and k_proj load as they are; config.json's vocab_size, between the run's
and that rounded up to a multiple of 64, whose padded rows are zero and take no part in the loss;
tied embeddings as one tensor, which --tp, --pp and --dp-mode fsdp/hsdp would hold apart (refused,
naming the flag); F32, F16, BF16 or F64 tensors, which become fp32 master weights.
"""
import json
import math
import os
from dataclasses import replace
from pathlib import Path

import torch

from data import SaveError
from data.files import open_regular, read_json
from data.saves import Saved, load, model_shapes
from model import ROPE_SCALING_KEYS, is_number, rope_scaling_problem
from parallel.mesh import LayoutError

SAFETENSORS_TYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                     "F64": torch.float64}
SHAPE_FIELDS = (("num_hidden_layers", "n_layer"), ("hidden_size", "d_model"),
                ("num_attention_heads", "n_head"), ("num_key_value_heads", "n_kv_head"),
                ("intermediate_size", "ffn_dim"))
IGNORED = ("rotary_emb.inv_freq",)  # buffers older transformers saved: recomputed from rope_theta
ROPE_SOURCES = ("rope_parameters", "rope_scaling")  # transformers 5's field, and the one before it


def read_object(path):
    """The JSON object in `path`; SaveError if it is unreadable, not JSON, or not an object."""
    value = read_json(path, SaveError, "--init-from: ")
    if not isinstance(value, dict):
        raise SaveError(f"--init-from: {path} is not a JSON object "
                        f"(it holds a {type(value).__name__})")
    return value


def read_header(path):
    """({tensor name: its header entry}, the byte where the data starts) of a safetensors file,
    whose tensors' byte ranges must tile its data exactly."""
    try:
        with open_regular(path) as f:
            size, length = (os.fstat(f.fileno()).st_size,
                            int.from_bytes(f.read(8), "little"))
            if length > size - 8:
                raise SaveError(f"--init-from: {path} is truncated or not a safetensors file")
            header = json.loads(f.read(length))
    except OSError as e:
        raise SaveError(f"--init-from: cannot read {path}: {e.strerror or e}") from None
    except ValueError:
        raise SaveError(f"--init-from: {path} is not a safetensors file "
                        "(its header is not JSON)") from None
    if not isinstance(header, dict):
        raise SaveError(f"--init-from: {path} is not a safetensors file "
                        "(its header is not an object)")
    header.pop("__metadata__", None)
    for name, entry in header.items():
        try:
            dtype, shape, (start, end) = (entry["dtype"], list(entry["shape"]),
                                          entry["data_offsets"])
            if not all(is_number(n, integer=True) and n >= 0 for n in (*shape, start, end)):
                raise ValueError
            numel = math.prod(shape)
        except (KeyError, TypeError, ValueError):
            raise SaveError(f"--init-from: {path}: "
                            f"the header entry of {name} is malformed") from None
        if dtype not in SAFETENSORS_TYPES:
            raise SaveError(f"--init-from: {path}: {name} is {dtype}; "
                            f"readable: {', '.join(SAFETENSORS_TYPES)}")
        if end - start != numel * SAFETENSORS_TYPES[dtype].itemsize or 8 + length + end > size:
            raise SaveError(f"--init-from: {path} is truncated or malformed at tensor {name}")
    expected, previous = 0, None  # where the next tensor must start; the tensor before it
    for name, entry in sorted(header.items(), key=lambda item: tuple(item[1]["data_offsets"])):
        start, end = entry["data_offsets"]
        if start < expected:
            raise SaveError(f"--init-from: {path}: tensors {previous} and {name} overlap "
                            f"(their data_offsets share bytes {start} to {expected})")
        if start > expected:
            raise SaveError(f"--init-from: {path}: bytes {expected} to {start} of the data, "
                            f"before tensor {name}, belong to no tensor")
        expected, previous = end, name
    if 8 + length + expected != size:
        raise SaveError(f"--init-from: {path} has {size - 8 - length - expected} bytes "
                        "after its last tensor")
    return header, 8 + length


def check_config(folder, cfg, args):
    """(config.json, cfg with its vocab_size, rope_theta, rms_norm_eps, rope scaling and tying).

    SaveError names the first field the model disagrees with, LayoutError a flag a tied one
    cannot run under."""
    path = folder / "config.json"
    config = read_object(path)

    def refuse(field, why):
        raise SaveError(f"--init-from: {path}: {field} {why}")

    def positive(field, value, integer=False):
        if not is_number(value, integer) or not math.isfinite(value) or value <= 0:
            refuse(field, f"is {value!r}; "
                          f"it must be a finite positive {'integer' if integer else 'number'}")
        return value

    if config.get("model_type") != "llama":
        refuse("model_type", f"is {config.get('model_type')!r}; "
                             "only Llama checkpoints load into this model")
    shape = {}
    for field, ours in SHAPE_FIELDS:
        value = config.get(field, config.get("num_attention_heads")
                           if field == "num_key_value_heads" else None)
        if not is_number(value, integer=True):
            refuse(field, f"is {value!r}; it must be an integer")
        shape[ours] = value
    differ = [(field, ours) for field, ours in SHAPE_FIELDS if shape[ours] != getattr(cfg, ours)]
    if differ:  # advice the next run takes: every flag to change, or why none can help
        field, ours = differ[0]
        flag = lambda name: f"--{name.replace('_', '-')}"  # noqa: E731
        problem = replace(cfg, **shape).validate()
        refuse(field, f"is {shape[ours]}, this run has {flag(ours)} {getattr(cfg, ours)} " + (
            f"(and no run can take the checkpoint's shape: {problem[1]})" if problem else
            "(pass " + " ".join(f"{flag(o)} {shape[o]}" for _, o in differ) + ")"))
    if (config.get("head_dim") not in (None, cfg.head_dim)
            or isinstance(config.get("head_dim"), bool)):
        refuse("head_dim", f"is {config['head_dim']!r}; "
                           f"this model's is hidden_size / num_attention_heads = {cfg.head_dim}")
    vocab = config.get("vocab_size")
    if not is_number(vocab, integer=True) or vocab < 1:
        refuse("vocab_size", f"is {vocab!r}; it must be a positive integer")
    if vocab < cfg.vocab_size:  # the data has ids the checkpoint has no row for: no flag can help
        refuse("vocab_size", f"is {vocab}, fewer than the {cfg.vocab_size} ids "
                             "of this run's data (or --vocab-size): "
                             "prepare the data with the checkpoint's own tokenizer")
    if vocab > cfg.padded_vocab:
        refuse("vocab_size", f"is {vocab}, this run's model has {cfg.vocab_size} rows "
                             f"padded to {cfg.padded_vocab} (pass --vocab-size {vocab})")
    if config.get("hidden_act", "silu") != "silu":
        refuse("hidden_act", f"is {config['hidden_act']!r}; this model's MLP is SwiGLU (silu)")
    for field in ("attention_bias", "mlp_bias"):
        if config.get(field) not in (None, False):
            refuse(field, f"is {config[field]!r}; this model has no biases")
    theta, scaling = rope_settings(config, refuse, positive)
    eps = positive("rms_norm_eps", config.get("rms_norm_eps", 1e-6))
    tied = config.get("tie_word_embeddings", False)
    if not isinstance(tied, bool):
        refuse("tie_word_embeddings", f"is {tied!r}; it must be true or false")
    if tied:
        check_tied_layout(path, args)
    return config, replace(cfg, vocab_size=vocab, rope_theta=float(theta), norm_eps=float(eps),
                           rope_scaling=scaling,
                           tie_embeddings=True if tied else None)  # None: untied, as a fresh run


def rope_settings(config, refuse, positive):
    """(rope_theta, ModelConfig.rope_scaling or None) of config.json's rope_parameters,
    rope_scaling and rope_theta, merged key by key; two that give one key different values are
    refused. original_max_position_embeddings defaults to max_position_embeddings."""
    rope = {}  # key -> (the field it came from, its value)
    given = [(field, config[field]) for field in ROPE_SOURCES if config.get(field) is not None]
    given += [("", {"rope_theta": config["rope_theta"]})] if "rope_theta" in config else []
    for field, values in given:
        if not isinstance(values, dict):
            refuse(field, f"is {values!r}; it must be an object")
        for key, value in values.items():
            key = "rope_type" if key == "type" else key
            if key in rope and not same(rope[key][1], value):
                refuse(f"{field}.{key}".lstrip("."),
                       f"is {value!r}, but {rope[key][0] or 'rope_theta'} gives "
                       f"{rope[key][1]!r}")
            rope.setdefault(key, (field, value))
    # to name a field in an error
    name = {key: f"{field}.{key}".lstrip(".") for key, (field, _) in rope.items()}
    kind = rope.get("rope_type", ("", "default"))[1]
    if kind not in ("default", "llama3"):
        refuse(name["rope_type"],
               f"is {kind!r}; this model's RoPE has Llama 3's frequency scaling ('llama3') or none")
    known = {"rope_type", "rope_theta"} | (set(ROPE_SCALING_KEYS) if kind == "llama3" else set())
    for key in sorted(set(rope) - known):
        refuse(name[key], f"is {rope[key][1]!r}; this model's {kind} RoPE has no such setting")
    theta = positive(name.get("rope_theta", "rope_theta"), rope.get("rope_theta", ("", 10000.0))[1])
    if kind == "default":
        return theta, None
    scaling = {"rope_type": "llama3",
               **{key: value for key, (_, value) in rope.items() if key in ROPE_SCALING_KEYS}}
    if "original_max_position_embeddings" not in scaling:
        scaling["original_max_position_embeddings"] = config.get("max_position_embeddings")
        name["original_max_position_embeddings"] = "max_position_embeddings"
    problem = rope_scaling_problem(scaling)
    if problem:  # a key that is not there is named in the field that chose llama3
        refuse(name.get(problem[0], f"{rope['rope_type'][0]}.{problem[0]}"), problem[1])
    return theta, {key: float(value) if key in ("factor", "low_freq_factor", "high_freq_factor")
                   else value for key, value in scaling.items()}


def same(a, b):
    """Two JSON values that say the same: 500000 and 500000.0; NaN and NaN (later refused)."""
    return a == b or (is_number(a) and is_number(b) and math.isnan(a) and math.isnan(b))


def check_tied_layout(path, args):
    """LayoutError naming the flag of a layout that holds the embedding and head apart."""
    for apart, flag, why in ((args.tp > 1, "--tp",
                              "tensor parallelism swaps them for two sharded modules"),
                             (args.pp > 1, "--pp", "pipeline stages hold them on different ranks"),
                             (args.dp_mode != "ddp", "--dp-mode",
                              f"{args.dp_mode} shards them in different units")):
        if apart:
            raise LayoutError(flag, f"{path} has tie_word_embeddings true: "
                                    f"lm_head is embed_tokens, one tensor, which {why}; "
                                    "a tied checkpoint trains in one process or with --dp-mode ddp "
                                    "(--cp too), without --tp or --pp")


def read_index(folder):
    """{tensor name: file}: model.safetensors.index.json's weight_map, or every tensor of
    model.safetensors; a folder holding both, or neither, is refused."""
    index, single = folder / "model.safetensors.index.json", folder / "model.safetensors"
    # exists, not is_file: a FIFO there is named, not taken for no file
    if index.exists() and single.exists():
        raise SaveError(f"--init-from: {folder} holds both model.safetensors and "
                        "model.safetensors.index.json: one of them is left from another checkpoint "
                        "(transformers reads model.safetensors); remove it")
    if single.exists():
        header, _ = read_header(single)
        return {tensor: "model.safetensors" for tensor in header}
    if not index.exists():
        raise SaveError(f"--init-from: {folder} has neither model.safetensors "
                        "nor model.safetensors.index.json")
    weight_map = read_object(index).get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise SaveError(f"--init-from: {index}: weight_map is {weight_map!r}; "
                        "it must be an object of tensor names and their files")
    for tensor, name in weight_map.items():
        if not isinstance(name, str) or Path(name).name != name or name in ("", ".", ".."):
            raise SaveError(f"--init-from: {index} puts {tensor} in {name!r}, "
                            f"not a file in {folder}")
    return weight_map


def hf_weights(folder, cfg):
    """The folder's weights as a Saved of format 1 (no checksums, "param" the only kind): one
    piece per tensor, in the file's dtype; rows past the file's (the padded vocabulary) are 0."""
    weight_map = read_index(folder)
    files = sorted(set(weight_map.values()))
    sources = {}  # file's tensor name -> (file, header entry, data start)
    for name in files:
        header, start = read_header(folder / name)
        sources.update({t: (name, entry, start) for t, entry in header.items()})
    for tensor, name in weight_map.items():  # an index and its files must agree
        if sources.get(tensor, (name,))[0] != name:
            raise SaveError(f"--init-from: {folder}: model.safetensors.index.json "
                            f"puts {tensor} in {name}, which does not hold it")
    if not cfg.tie_embeddings and "lm_head.weight" not in sources:
        raise SaveError(f"--init-from: {folder} has no lm_head.weight "
                        "and config.json's tie_word_embeddings is false")
    tensors, used = {}, {"lm_head.weight"} if cfg.tie_embeddings else set()
    for name, shape in model_shapes(cfg).items():
        shape = list(shape)
        source = name if name == "lm_head.weight" else "model." + name
        if source not in sources:
            raise SaveError(f"--init-from: {folder} has no tensor {source}")
        file, entry, start = sources[source]
        padded_rows = name in ("embed_tokens.weight", "lm_head.weight") and \
            entry["shape"] == [cfg.vocab_size, *shape[1:]]  # vocab_size rows, then the padding
        if entry["shape"] != shape and not padded_rows:
            raise SaveError(f"--init-from: {folder}: {source} has shape {entry['shape']}, "
                            f"this model needs {shape}")
        piece = {"file": file, "tp": None, "start": 0, "numel": math.prod(entry["shape"]),
                 "offsets": {"param": start + entry["data_offsets"][0]}}
        tensors[name] = {"shape": shape, "pieces": [piece],
                         "dtype": str(SAFETENSORS_TYPES[entry["dtype"]]).split(".")[1]}
        used.add(source)
    unused = sorted(t for t in set(sources) - used if not t.endswith(IGNORED))
    if unused:
        raise SaveError(f"--init-from: {folder} has {len(unused)} tensor(s) "
                        f"this model has no place for, such as {unused[0]}")
    return Saved(folder, {"format": 1, "step": 0, "optimizer": {"kinds": ["param"]},
                          "files": {name: (folder / name).stat().st_size for name in files},
                          "tensors": tensors})


def init_from(folder, cfg, args, check=lambda cfg: None):
    """--init-from: (cfg updated from config.json, the weights to load); (cfg, None) without.

    args are the run's flags; check(cfg) the run's own checks of the model, made before the
    folder's tensors are listed. Everything is checked before anything is built or written."""
    if folder is None:
        check(cfg)
        return cfg, None
    folder = Path(folder)
    if not folder.is_dir():
        raise SaveError(f"--init-from: {folder} is not a folder")
    _, cfg = check_config(folder, cfg, args)
    check(cfg)
    return cfg, hf_weights(folder, cfg)


def start_from(weights, wrapper, opt, rank):
    """Fills this rank's parameters from the checkpoint, in any layout; returns step 0."""
    load(weights, wrapper, opt, flag="--init-from")
    if rank == 0:
        print(f"initialized from {weights.path} (step 0, fresh optimizer)", flush=True)
    return 0
