"""Generate text from a saved run.

    python sample.py --run out/tiny --prompt "def " --max-new-tokens 200 --temperature 0.8 --top-k 40

Uses the tokenizer the run was trained with. Temperature 0 is greedy decoding.
"""
import argparse
import sys

import torch

import model as M
from data.loader import DataError
from data.tokenizer import get_tokenizer
from saves import SaveError
from saves.load import model_tensors


@torch.no_grad()
def generate(gpt, ids, max_new_tokens, temperature, top_k, vocab_size, eot=None):
    """ids: (1, T) prompt. Appends up to max_new_tokens sampled tokens; stops early at eot."""
    for _ in range(max_new_tokens):
        context = ids[:, -gpt.cfg.seq_len:]
        logits = gpt(context)[:, -1, :vocab_size].float()  # the padded vocab entries are never sampled
        if temperature == 0:
            nxt = logits.argmax(-1, keepdim=True)
        else:
            logits = logits / temperature
            if top_k:
                kth = torch.topk(logits, min(top_k, vocab_size)).values[:, -1:]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            nxt = torch.multinomial(torch.softmax(logits, -1), 1)
        ids = torch.cat([ids, nxt], dim=1)
        if eot is not None and nxt.item() == eot:
            break
    return ids


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--run", required=True, help="run folder written by train.py --out")
    p.add_argument("--prompt", default="\n")
    p.add_argument("--max-new-tokens", type=int, default=200)
    p.add_argument("--temperature", type=float, default=0.8)
    p.add_argument("--top-k", type=int, default=40, help="0: no top-k filter")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = p.parse_args(argv)
    try:
        config, tensors = model_tensors(args.run)  # a save from any layout
        enc = get_tokenizer(config["tokenizer"])
    except (SaveError, DataError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    cfg = M.config_from_dict(config["model"])
    gpt = M.GPT(cfg).to(args.device)
    with torch.no_grad():
        for name, p in gpt.state_dict().items():
            p.copy_(tensors[name]())  # one full tensor read at a time
    gpt.eval()
    torch.manual_seed(args.seed)
    prompt = enc.encode(args.prompt, allowed_special="all")
    ids = torch.tensor([prompt], device=args.device)
    out = generate(gpt, ids, args.max_new_tokens, args.temperature, args.top_k, cfg.vocab_size, enc.eot_token)
    print(enc.decode(out[0].tolist()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
