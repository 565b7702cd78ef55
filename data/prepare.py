"""Build token shards: python data/prepare.py NAME [--out DIR] [--shards N]

pystdlib     the running Python's standard library, byte tokens, offline (~13M tokens, seconds)
shakespeare  tiny-shakespeare (1.1 MB download), GPT-2 tokens, 90/10 train/val
fineweb10b   FineWeb10B already tokenized with GPT-2: the val shard + N train shards
             (~98.5M tokens, ~200 MB each; at most 103)

The folder (default data/NAME/) gets NAME_train_000000.bin ... and NAME_val_000000.bin in
the llm.c shard format (loader.py), then meta.json, written last: it marks the folder complete.
Downloads stream to a temporary file and are renamed only when complete (and valid).
"""
import argparse
import http.client
import json
import sys
import sysconfig
import time
import urllib.request
from pathlib import Path

import numpy as np
from tqdm import tqdm

if __package__ in (None, ""):  # run as `python data/prepare.py`: make `import data.*` work
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from data.loader import DataError, read_shard, write_shard
from data.tokenizer import get_tokenizer
from saves.files import atomic_write, write_json

SOURCES = ("pystdlib", "shakespeare", "fineweb10b")
SHAKESPEARE_URL = "https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare"
FINEWEB_URL = "https://huggingface.co/datasets/kjj0/fineweb10B-gpt2/resolve/main"
FINEWEB_TRAIN_SHARDS = 103


def download(url, dest, check=None):
    """Stream url to dest via a temporary file; `check(tmp)` may reject it before the rename."""
    try:
        with urllib.request.urlopen(url, timeout=60) as r, atomic_write(dest) as f:
            total = int(r.headers.get("Content-Length") or 0) or None
            with tqdm(total=total, unit="B", unit_scale=True, desc=dest.name) as bar:
                while chunk := r.read(1 << 20):
                    f.write(chunk)
                    bar.update(len(chunk))
            f.flush()
            if check is not None:
                check(Path(f.name))
    except (OSError, http.client.HTTPException, ValueError, DataError) as e:  # URLError, HTTPError,
        # timeouts, cut connections, a bad url, a bad shard: one line naming the url
        raise DataError(f"download of {url} failed: {e}".replace("\n", " ")) from None


def python_files(src_dir):
    """The .py files under src_dir, sorted, leaving out tests and installed packages."""
    src_dir = Path(src_dir)
    files = []
    for path in sorted(src_dir.rglob("*.py")):
        parts = path.relative_to(src_dir).parts
        if any(p.startswith("test") or p in ("idle_test", "site-packages", "dist-packages")
               for p in parts):
            continue
        files.append(path)
    return files


def write_meta(out_dir, enc_name, vocab_size, eot):
    """Count the tokens the loader will see, then write meta.json atomically (last)."""
    counts = {split: sum(len(read_shard(p)) for p in out_dir.glob(f"*_{split}_*.bin"))
              for split in ("train", "val")}
    meta = {"tokenizer": enc_name, "vocab_size": vocab_size, "eot": eot,
            "train_tokens": counts["train"], "val_tokens": counts["val"]}
    write_json(out_dir / "meta.json", meta, indent=2)


def prepare_pystdlib(out_dir, src_dir=None):
    enc = get_tokenizer("bytes")
    src_dir = Path(src_dir or sysconfig.get_paths()["stdlib"])
    files = python_files(src_dir)
    splits = {"train": [], "val": []}
    for i, path in enumerate(tqdm(files, desc="pystdlib", unit="file")):
        tokens = enc.encode_ordinary(path.read_text(encoding="utf-8", errors="replace"))
        tokens.append(enc.eot_token)  # every file ends with <|endoftext|>
        splits["val" if i % 100 == 0 else "train"].append(np.array(tokens, dtype=np.uint16))
    for split, parts in splits.items():
        if not parts:
            raise DataError(f"{src_dir}: too few .py files ({len(files)}) for a {split} split")
        write_shard(out_dir / f"pystdlib_{split}_000000.bin", np.concatenate(parts))
    write_meta(out_dir, enc.name, enc.n_vocab, enc.eot_token)


def prepare_shakespeare(out_dir, base_url=None, tokenizer=None):
    enc = tokenizer or get_tokenizer("gpt2")  # first, so a missing tokenizer fails fast
    text_path = out_dir / "input.txt"
    if not text_path.exists():
        download(f"{base_url or SHAKESPEARE_URL}/input.txt", text_path)
    tokens = np.array(enc.encode_ordinary(text_path.read_text(encoding="utf-8")), dtype=np.uint32)
    n_train = int(0.9 * len(tokens))
    write_shard(out_dir / "shakespeare_train_000000.bin", tokens[:n_train])
    write_shard(out_dir / "shakespeare_val_000000.bin", tokens[n_train:])
    write_meta(out_dir, enc.name, enc.n_vocab, enc.eot_token)


def prepare_fineweb(out_dir, shards, base_url=None):
    if not 1 <= shards <= FINEWEB_TRAIN_SHARDS:
        raise ValueError(f"--shards {shards}: must be 1..{FINEWEB_TRAIN_SHARDS}")
    names = ["fineweb_val_000000.bin"]
    names += [f"fineweb_train_{i:06d}.bin" for i in range(1, shards + 1)]
    for name in names:
        try:
            read_shard(out_dir / name)
            continue  # already here and valid
        except DataError:
            pass
        download(f"{base_url or FINEWEB_URL}/{name}", out_dir / name, check=read_shard)
    write_meta(out_dir, "gpt2", 50257, 50256)


def prepare(name, out_dir=None, shards=1, base_url=None, src_dir=None, tokenizer=None):
    """Build data set `name` into out_dir (default data/NAME) and return that folder.

    base_url replaces the download host and path up to the file name (tests use a local server);
    src_dir replaces the standard library folder for pystdlib; tokenizer replaces GPT-2 for
    shakespeare. Failures raise DataError with a one-line message.
    """
    if name not in SOURCES:
        raise ValueError(f"unknown data set {name!r}; choose from {', '.join(SOURCES)}")
    out_dir = Path(out_dir) if out_dir else Path(__file__).resolve().parent / name
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "meta.json").unlink(missing_ok=True)  # the folder is incomplete until we finish
    if name == "pystdlib":
        prepare_pystdlib(out_dir, src_dir)
    elif name == "shakespeare":
        prepare_shakespeare(out_dir, base_url, tokenizer)
    else:
        prepare_fineweb(out_dir, shards, base_url)
    return out_dir


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("name", choices=SOURCES, help="data set to build")
    parser.add_argument("--out", help="output folder (default: data/NAME next to this file)")
    parser.add_argument("--shards", type=int, default=1,
                        help=f"fineweb10b: train shards, 1-{FINEWEB_TRAIN_SHARDS} (default 1)")
    args = parser.parse_args(argv)
    t0 = time.time()
    try:
        out_dir = prepare(args.name, args.out, args.shards)
    except (DataError, ValueError) as e:
        sys.exit(f"prepare.py: {e}")
    meta = json.loads((out_dir / "meta.json").read_text())
    print(f"{out_dir}: {meta['train_tokens']:,} train + {meta['val_tokens']:,} val tokens "
          f"({meta['tokenizer']}, vocab {meta['vocab_size']}) in {time.time() - t0:.1f}s")


if __name__ == "__main__":
    main()
