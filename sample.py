"""Generate text from a saved run.

    python sample.py --run out/tiny --prompt "def " --max-new-tokens 200 \
        --temperature 0.8 --top-k 40

It uses the tokenizer the run was trained with. A .tiktoken file is read again from the path
its data recorded, and must still have the same SHA-256. Temperature 0 is greedy decoding.
Any positive temperature, however small, samples without overflow; a tiny one is greedy in effect.
An empty prompt starts from the end-of-text token. Only ids the tokenizer can decode are sampled.
A model with more ids than its tokenizer (started --init-from a checkpoint of a larger vocabulary)
has the others masked, as the loss masks the padded rows, and a note on stderr says so.
Bad input is one line on stderr and exit status 2: a negative number, a seed torch cannot take,
a missing GPU, a prompt that is not UTF-8 or holds an id past the model's vocabulary, a save that
is not train.py's or whose model config is incomplete or does not fit its tensors, or a changed
tokenizer file.
"""
import argparse
import math
import sys

import torch

import model
from config import OneLineParser, UsageError, nonnegative_int
from data import SaveError
from data.ending import exit_status
from data.saves import read_model


@torch.no_grad()
def generate(gpt, ids, max_new_tokens, temperature, top_k, vocab_size, eot=None, decodable=None):
    """ids: (1, T) prompt. Appends up to max_new_tokens sampled tokens; stops early at eot.

    decodable: a (vocab_size,) bool tensor, False for ids the tokenizer cannot decode.
    Those are never sampled. None means all can be."""
    allowed = vocab_size if decodable is None else int(decodable.sum())
    for _ in range(max_new_tokens):
        context = ids[:, -gpt.cfg.seq_len:]
        logits = gpt(context)[:, -1, :vocab_size].float()  # padded vocab entries are never sampled
        if decodable is not None:
            logits = logits.masked_fill(~decodable.to(logits.device), float("-inf"))
        if temperature == 0:
            nxt = logits.argmax(-1, keepdim=True)
        else:  # shifted so the largest is 0, in fp64: a tiny temperature gives -inf and 0, no nan
            logits = (logits.double() - logits.max(-1, keepdim=True).values) / temperature
            if top_k:
                kth = torch.topk(logits, min(top_k, allowed)).values[:, -1:]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            nxt = torch.multinomial(torch.softmax(logits, -1), 1)
        ids = torch.cat([ids, nxt], dim=1)
        if eot is not None and nxt.item() == eot:
            break
    return ids


def decodable_ids(enc, vocab_size):
    """(vocab_size,) bool: the ids the tokenizer can decode (its ranks and special tokens)."""
    ok = torch.zeros(vocab_size, dtype=torch.bool)
    for i in range(min(vocab_size, enc.n_vocab)):
        try:
            enc.decode_single_token_bytes(i)
            ok[i] = True
        except KeyError:  # a gap between a tokenizer's ranks and its special tokens
            pass
    return ok


def seed(text):
    """--seed: an integer torch.manual_seed takes, in [-2^63, 2^64)."""
    value = int(text)
    if not -2 ** 63 <= value < 2 ** 64:
        raise ValueError
    return value


# argparse then says "invalid integer in [-2^63, 2^64) value: '...'"
seed.__name__ = "integer in [-2^63, 2^64)"


def temperature(text):
    """--temperature: a finite number >= 0. A negative one would favour the least likely tokens."""
    value = float(text)
    if not math.isfinite(value) or value < 0:
        raise ValueError
    return value


temperature.__name__ = "non-negative number"  # argparse: "invalid non-negative number value: '-1'"


def device(text):
    """--device: cpu, cuda or cuda:N, and a CUDA device must be there."""
    try:
        dev = torch.device(text)
    except RuntimeError:
        dev = None
    if dev is None or dev.type not in ("cpu", "cuda"):
        raise argparse.ArgumentTypeError(f"unknown device {text!r}; expected cpu, cuda or cuda:N")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise argparse.ArgumentTypeError(f"{text}: "
                                         "no CUDA device is visible here (use --device cpu)")
    if dev.type == "cuda" and dev.index is not None and dev.index >= torch.cuda.device_count():
        raise argparse.ArgumentTypeError(f"{text}: only {torch.cuda.device_count()} "
                                         "CUDA device(s) are visible")
    return dev


def utf8_text(text):
    """--prompt: text that is valid UTF-8.

    Undecodable bytes on the command line reach sys.argv as lone surrogates.
    The tokenizer would silently replace them, so they are refused instead."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        bad = ord(e.object[e.start])
        what = f"byte 0x{bad - 0xDC00:02x}" if 0xDC80 <= bad <= 0xDCFF else f"U+{bad:04X}"
        raise argparse.ArgumentTypeError(f"not valid UTF-8 ({what} at character {e.start})"
                                         ) from None
    return text


def run_folder(text):
    if text == "":
        raise argparse.ArgumentTypeError("an empty path: "
                                         "name a run folder written by train.py --out")
    return text


def parse_args(argv=None):
    p = OneLineParser(description=__doc__.split("\n")[0])
    p.add_argument("--run", required=True, type=run_folder,
                   help="run folder written by train.py --out (or one save in it)")
    p.add_argument("--prompt", default="\n", type=utf8_text,
                   help="empty: start from the end-of-text token")
    p.add_argument("--max-new-tokens", type=nonnegative_int, default=200)
    p.add_argument("--temperature", type=temperature, default=0.8, help="0: greedy")
    p.add_argument("--top-k", type=nonnegative_int, default=40, help="0: no top-k filter")
    p.add_argument("--seed", type=seed, default=0)
    p.add_argument("--device", type=device,
                   default="cuda" if torch.cuda.is_available() else "cpu")
    return p.parse_args(argv)


def read_save(run):
    """(model config, tokenizer, {name: LazyTensor}, save folder) of `run`'s newest save, or of
    `run`, a save: SaveError names its meta.json unless it is a whole model of its config."""
    return read_model(run)


def build(cfg, tensors, save, device):
    """The model of `cfg` on `device`, the saved weights read one full tensor at a time."""
    with torch.device(device):
        gpt = model.GPT(cfg)
    with torch.no_grad():
        for name, p in gpt.named_parameters():
            p.copy_(tensors[name]())
    return gpt.eval()


def encode_prompt(enc, text, vocab_size):
    """The prompt's ids (end-of-text for an empty one); UsageError if one is past the vocabulary."""
    ids = enc.encode(text, allowed_special="all") or [enc.eot_token]
    if max(ids) >= vocab_size:
        raise UsageError(f"--prompt: it encodes to id {max(ids)}, "
                         f"past the {vocab_size} ids of the model "
                         f"(its tokenizer has {enc.n_vocab})"
                         f"{'; the empty prompt is end-of-text' * (text == '')}")
    return ids


def main(argv=None):
    try:
        args = parse_args(argv)
        cfg, enc, tensors, save = read_save(args.run)
        ids = encode_prompt(enc, args.prompt, cfg.vocab_size)
        gpt = build(cfg, tensors, save, args.device)
    except (UsageError, SaveError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    decodable = decodable_ids(enc, cfg.vocab_size)
    if not decodable.all():
        print(f"note: the model has {cfg.vocab_size} ids, "
              f"its tokenizer decodes {int(decodable.sum())} of them: the others are never sampled",
              file=sys.stderr)
    torch.manual_seed(args.seed)
    # an empty prompt starts from end-of-text (the model needs one token), which is not shown
    start = 0 if args.prompt else 1
    out = generate(gpt, torch.tensor([ids], device=args.device), args.max_new_tokens,
                   args.temperature, args.top_k, cfg.vocab_size, enc.eot_token, decodable)
    print(enc.decode(out[0, start:].tolist()))
    return 0


if __name__ == "__main__":
    sys.exit(exit_status(main))
