"""What a model is, before any tensor exists: ModelConfig, its presets, the checks on a saved one.

ModelConfig holds the shape fields and the RoPE settings, with Llama 3's frequency scaling
(model.rope_frequencies applies it). validate() names the first problem of a config.
config_from_dict() rebuilds the config a save recorded. It refuses one that is incomplete or
inconsistent, and never fills a missing field with a default. model.py re-exports ModelConfig,
PRESETS and config_from_dict, the names the rest of the code uses.
"""
import math
from dataclasses import dataclass, fields
from typing import Optional


@dataclass
class ModelConfig:
    n_layer: int = 4
    d_model: int = 128
    n_head: int = 8
    n_kv_head: int = 4
    ffn_dim: int = 384
    vocab_size: int = 0  # 0: taken from the data set's tokenizer
    seq_len: int = 256
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    dropout: float = 0.0
    # Fields added later default to None, which is also what a save written before them means.
    # Such a save's config then compares equal on --resume, and loads in sample.py and export.
    # rope_scaling: Llama 3's {"rope_type": "llama3", "factor", "low_freq_factor",
    # "high_freq_factor", "original_max_position_embeddings"}. None: plain RoPE.
    rope_scaling: Optional[dict] = None
    tie_embeddings: Optional[bool] = None  # True: lm_head's weight is embed_tokens'. None: untied

    @property
    def head_dim(self):
        return self.d_model // self.n_head

    @property
    def padded_vocab(self):
        return -(-self.vocab_size // 64) * 64

    def validate(self):
        """The first problem as (flag, message), or None. A field with no flag goes by its name."""
        for name in ("n_layer", "d_model", "n_head", "n_kv_head", "ffn_dim", "vocab_size",
                     "seq_len"):
            if getattr(self, name) <= 0:
                return f"--{name.replace('_', '-')}", f"must be positive, got {getattr(self, name)}"
        if self.d_model % self.n_head:
            return "--d-model", f"d_model {self.d_model} is not divisible by n_head {self.n_head}"
        if self.n_head % self.n_kv_head:
            return "--n-kv-head", (f"n_head {self.n_head} is not divisible by "
                                   f"n_kv_head {self.n_kv_head}")
        if self.head_dim % 2:
            return "--d-model", f"head_dim {self.head_dim} must be even for rotary embeddings"
        if not 0.0 <= self.dropout < 1.0:
            return "--dropout", f"must be in [0, 1), got {self.dropout}"
        for name in ("rope_theta", "norm_eps"):
            if not math.isfinite(getattr(self, name)) or getattr(self, name) <= 0:
                return name, f"must be a finite positive number, got {getattr(self, name)}"
        if self.rope_scaling is not None:
            problem = rope_scaling_problem(self.rope_scaling)
            if problem:
                return f"rope_scaling.{problem[0]}", problem[1]
        return None


ROPE_SCALING_KEYS = ("factor", "low_freq_factor", "high_freq_factor",
                     "original_max_position_embeddings")


def rope_scaling_problem(scaling):
    """(key, what is wrong) of a rope_scaling dict, or None.

    rope_type must be "llama3". The three factors must be finite positive numbers, with
    high_freq_factor above low_freq_factor. original_max_position_embeddings: a positive integer."""
    if not isinstance(scaling, dict):
        return "", f"must be an object, got {scaling!r}"
    if scaling.get("rope_type") != "llama3":
        return "rope_type", (f"is {scaling.get('rope_type')!r}; "
                             "this model's only frequency scaling is 'llama3'")
    unknown = sorted(set(scaling) - {"rope_type", *ROPE_SCALING_KEYS})
    if unknown:
        return unknown[0], "is not a field of Llama 3's frequency scaling"
    for key in ROPE_SCALING_KEYS:
        value = scaling.get(key)
        integer = key == "original_max_position_embeddings"
        if not is_number(value, integer) or not math.isfinite(value) or value <= 0:
            return key, (f"must be a finite positive {'integer' if integer else 'number'}, "
                         f"got {value!r}")
    if scaling["high_freq_factor"] <= scaling["low_freq_factor"]:
        return "high_freq_factor", (f"{scaling['high_freq_factor']} must be above low_freq_factor "
                                    f"{scaling['low_freq_factor']}")
    return None


def is_number(value, integer=False):
    """A JSON number (an integer if asked), not a bool."""
    return isinstance(value, int if integer else (int, float)) and not isinstance(value, bool)


LLAMA3 = dict(vocab_size=128256, seq_len=8192, rope_theta=500000.0)
PRESETS = {
    "tiny": ModelConfig(n_layer=4, d_model=128, n_head=8, n_kv_head=4, ffn_dim=384, seq_len=256),
    "small": ModelConfig(n_layer=12, d_model=768, n_head=12, n_kv_head=12, ffn_dim=2048,
                         seq_len=1024),
    "medium": ModelConfig(n_layer=24, d_model=1024, n_head=16, n_kv_head=16, ffn_dim=2816,
                          seq_len=1024),
    "1b": ModelConfig(n_layer=16, d_model=2048, n_head=32, n_kv_head=8, ffn_dim=8192,
                      **{**LLAMA3, "seq_len": 2048}),
    "llama3-8b": ModelConfig(n_layer=32, d_model=4096, n_head=32, n_kv_head=8, ffn_dim=14336,
                             **LLAMA3),
    "llama3-70b": ModelConfig(n_layer=80, d_model=8192, n_head=64, n_kv_head=8, ffn_dim=28672,
                              **LLAMA3),
    "llama3-405b": ModelConfig(n_layer=126, d_model=16384, n_head=128, n_kv_head=8,
                               ffn_dim=53248, **LLAMA3),
}


OPTIONAL_FIELDS = ("rope_scaling", "tie_embeddings")  # added later: absent in older saves (None)
INTEGER_FIELDS = ("n_layer", "d_model", "n_head", "n_kv_head", "ffn_dim", "vocab_size", "seq_len")


def field_type_problem(name, value):
    """What a saved model field must be, if `value` is not that; else None."""
    if name in INTEGER_FIELDS:
        return None if is_number(value, integer=True) else "an integer"
    if name == "rope_scaling":
        return None if value is None or isinstance(value, dict) else "an object or null"
    if name == "tie_embeddings":
        return None if value is None or isinstance(value, bool) else "true, false or null"
    return None if is_number(value) else "a number"


def config_from_dict(d):
    """The ModelConfig a save recorded (its config's "model"). Else ValueError, naming the field.

    Every field must be there, with its type, and the whole must pass validate(). A missing shape
    field is never filled with a default: that would build another model than the one saved.
    Only OPTIONAL_FIELDS may be absent."""
    if not isinstance(d, dict):
        raise ValueError(f"the model config is not an object: {d!r}")
    names = [f.name for f in fields(ModelConfig)]
    unknown = sorted(set(d) - set(names))
    if unknown:
        raise ValueError(f"model.{unknown[0]} is not a field of this code's model")
    for name in names:
        if name not in d and name not in OPTIONAL_FIELDS:
            raise ValueError(f"model.{name} is missing")
        problem = field_type_problem(name, d.get(name))
        if problem:
            raise ValueError(f"model.{name} must be {problem}, got {d.get(name)!r}")
    cfg = ModelConfig(**d)
    problem = cfg.validate()
    if problem:
        raise ValueError(f"model.{problem[0].lstrip('-').replace('-', '_')}: {problem[1]}")
    return cfg
