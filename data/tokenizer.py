"""Tokenizers, all as tiktoken Encodings so prepare.py, text.py and sample.py treat them alike.

bytes  one token per UTF-8 byte (0..255), plus <|endoftext|> = 256; works offline.
NAME   any tiktoken encoding (gpt2, cl100k_base, o200k_base, ...). tiktoken downloads its files
       on first use into TIKTOKEN_CACHE_DIR; an offline machine needs that cache copied to it.
FILE   a local .tiktoken BPE file (`base64-of-the-token rank` lines), as Llama 3's
       tokenizer.model, with cl100k_base's pre-tokenizer and <|endoftext|> after the largest
       rank. It is named "sha256:<hex of its bytes>": sample.py refuses it once its bytes change.
"""
import base64
import binascii
import hashlib
from pathlib import Path

import tiktoken

from data import DataError
from data.files import read_bytes

EOT = "<|endoftext|>"
# A file tokenizer's pieces before the merges, as cl100k_base's and Llama 3's: contractions; letters
# with one leading non-letter; up to 3 digits; symbols; newlines; other whitespace
FILE_PIECES = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"""
               r"""| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+""")
MAX_RANK = 2**32 - 2  # ids are 32-bit (tiktoken's, uint32 shards); <|endoftext|> takes the next


class TokenizerUnavailable(DataError):
    """A tiktoken encoding that cannot be loaded here: no network, and no cache of its files."""


def bytes_tokenizer():
    # One regex piece for any run of characters: nothing is split. With no merges,
    # every byte is its own token, so decode(encode(text)) == text.
    return tiktoken.Encoding(
        name="bytes",
        pat_str=r"[\s\S]+",
        mergeable_ranks={bytes([i]): i for i in range(256)},
        special_tokens={EOT: 256},
    )


def file_tokenizer(path, expected=None):
    """The Encoding of a local .tiktoken file, named "sha256:<hex of its bytes>" (or `expected`)."""
    path = Path(path)
    try:
        data = read_bytes(path)
    except OSError as e:
        raise DataError(f"tokenizer file {path}: cannot read: {e.strerror or e}") from None
    name = "sha256:" + hashlib.sha256(data).hexdigest()
    if expected is not None and name != expected:
        raise DataError(f"tokenizer file {path} has changed: its {name[:23]}... "
                        f"is not the {expected[:23]}... the data was prepared with")
    ranks = {}
    for number, line in enumerate(data.splitlines(), 1):
        try:
            token, rank = line.split()
            ranks[base64.b64decode(token, validate=True)] = int(rank)
        except (ValueError, binascii.Error):
            raise DataError(f"tokenizer file {path}: "
                            f"line {number} is not `base64-token rank`") from None
    missing = [i for i in range(256) if bytes([i]) not in ranks]
    if missing:  # a byte-level BPE must spell any text, one byte at a time if need be
        raise DataError(f"tokenizer file {path}: byte 0x{missing[0]:02x} has no token "
                        f"({len(missing)} of the 256 single bytes are missing): "
                        "not a byte-level BPE")
    if len(set(ranks.values())) != len(ranks) or min(ranks.values()) < 0:
        raise DataError(f"tokenizer file {path}: its ranks are not distinct non-negative integers")
    if max(ranks.values()) > MAX_RANK:
        raise DataError(f"tokenizer file {path}: its largest rank {max(ranks.values())} "
                        "leaves no 32-bit id for <|endoftext|> "
                        f"(ranks must stay at or below {MAX_RANK})")
    return tiktoken.Encoding(name=name, pat_str=FILE_PIECES, mergeable_ranks=ranks,
                             special_tokens={EOT: max(ranks.values()) + 1})


def get_tokenizer(name, file=None):
    """The Encoding called `name`: "bytes", a tiktoken encoding, or a .tiktoken file's path.

    A file tokenizer's "sha256:..." name comes with its `file`, whose bytes must not change."""
    if name == "bytes":
        return bytes_tokenizer()
    if name.startswith("sha256:"):
        if not file:
            raise DataError(f"tokenizer {name[:23]}... is a BPE file, and its path is not recorded")
        return file_tokenizer(file, expected=name)
    if name in tiktoken.list_encoding_names():
        try:
            return tiktoken.get_encoding(name)
        except (OSError, ValueError) as e:  # no network and no cache (requests errors are OSErrors)
            raise TokenizerUnavailable(
                f"cannot load the {name} tokenizer ({type(e).__name__}): tiktoken needs network "
                "access once, or TIKTOKEN_CACHE_DIR pointing at a pre-seeded cache"
            ) from None
    if Path(name).is_file():
        return file_tokenizer(name)
    raise ValueError(f"unknown tokenizer {name!r} (expected 'bytes', a tiktoken encoding: "
                     f"{', '.join(tiktoken.list_encoding_names())}, or a .tiktoken file)")
