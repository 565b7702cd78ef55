"""Tokenizers, both as tiktoken Encodings so prepare.py and sample.py treat them alike.

bytes  one token per UTF-8 byte (0..255) plus <|endoftext|> = 256; built in code, works offline.
gpt2   GPT-2 BPE (50257 tokens, <|endoftext|> = 50256). tiktoken downloads its files on first
       use into TIKTOKEN_CACHE_DIR; offline machines need that cache seeded from a machine
       with network access (run tiktoken.get_encoding("gpt2") there, copy the folder).
"""
import tiktoken

from data.loader import DataError


def bytes_tokenizer():
    # A single regex piece for any run of characters: nothing is split, and since there
    # are no merges every byte becomes its own token, so decode(encode(text)) == text.
    return tiktoken.Encoding(
        name="bytes",
        pat_str=r"[\s\S]+",
        mergeable_ranks={bytes([i]): i for i in range(256)},
        special_tokens={"<|endoftext|>": 256},
    )


def get_tokenizer(name):
    """Return the tiktoken Encoding called `name` ("bytes" or "gpt2")."""
    if name == "bytes":
        return bytes_tokenizer()
    if name == "gpt2":
        try:
            return tiktoken.get_encoding("gpt2")
        except (OSError, ValueError) as e:  # no network and no cache (requests errors are OSErrors)
            raise DataError(
                f"cannot load the GPT-2 tokenizer ({type(e).__name__}): tiktoken needs network "
                "access once, or TIKTOKEN_CACHE_DIR pointing at a pre-seeded cache"
            ) from None
    raise ValueError(f"unknown tokenizer {name!r} (expected 'bytes' or 'gpt2')")
