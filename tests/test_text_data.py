"""Your own data: `prepare.py text` over a folder of .txt and .jsonl files, with the byte tokenizer and with a
.tiktoken BPE file built here; shards that decode back to the documents, the same for any worker count and any
unit size; bad input as one line and exit 2; a run trained on it samples with the same tokenizer."""
import json
import os
import random
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from unittest.mock import ANY

import numpy as np
import pytest
import regex
import tiktoken
from tiktoken_ext import openai_public

import sample
import train
from bench.labs.prepare_speed import train_bpe, write_tiktoken
from data import prepare as data_prepare
from data.loader import read_shard
from data.text import CUT, UNIT_BYTES, Tokenizing, next_cut, prepare_text
from data.tokenizer import FILE_PIECES, get_tokenizer

REPO = Path(__file__).resolve().parent.parent
WORDS = ["the", "model", "data", "héllo", "世界", "🐍", "<|endoftext|>", "x1", "42", "it's", "-->", "é", "// x"]


def random_text(rng, lines):
    """Text with the whitespace a pre-tokenizer treats specially: blank lines, indentation, trailing spaces, tabs,
    CRLF, and lines that start with a letter after a line that ends with a symbol (where a unit may be cut)."""
    out = []
    for _ in range(lines):
        line = " ".join(rng.choice(WORDS) for _ in range(rng.randint(0, 8)))
        out.append(rng.choice(["", "    ", "\t", " "]) + line + rng.choice(["", ".", "  ", ":", "\r"]))
    return "\n".join(out) + rng.choice(["", "\n", "\n\n"])


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """(folder, documents in corpus order): .txt files, a .jsonl file, an ignored .md and an empty file."""
    rng, root = random.Random(7), tmp_path_factory.mktemp("corpus")
    (root / "sub" / "deeper").mkdir(parents=True)
    docs = []
    for name in ("a.txt", "b.txt"):
        docs.append(random_text(rng, 60))
        (root / name).write_bytes(docs[-1].encode())
    (root / "empty.txt").write_text("")  # no document
    (root / "notes.md").write_text("not matched by the default globs")
    lines = []
    for i in range(25):
        docs.append(random_text(rng, rng.randint(1, 6)))
        lines.append(json.dumps({"id": i, "text": docs[-1]}, ensure_ascii=i % 2 == 0))
        if i % 7 == 0:
            lines.append("")  # a blank line is skipped
    (root / "sub" / "c.jsonl").write_text("\n".join(lines) + "\n")
    docs.append(random_text(rng, 200))
    (root / "sub" / "deeper" / "d.txt").write_bytes(docs[-1].encode())
    return root, docs


@pytest.fixture(scope="module")
def bpe_ranks(corpus):
    return train_bpe("".join(corpus[1]), 120)


@pytest.fixture(scope="module")
def bpe_file(bpe_ranks, tmp_path_factory):
    return write_tiktoken(bpe_ranks, tmp_path_factory.mktemp("bpe") / "tiny.tiktoken")


@pytest.mark.parametrize("encoding", ["file-tokenizer", "gpt2", "cl100k_base", "o200k_base"])
def test_a_cut_never_changes_a_piece(bpe_ranks, encoding, monkeypatch):
    """The text between data/text.py's cuts splits into the pieces of the whole text (so any BPE gives the same
    tokens) under the pre-tokenizer of .tiktoken files and of each tiktoken encoding, read offline (their BPE files are
    not fetched): GPT-2's `\\s+(?!\\S)` keeps the last space of a run apart from what follows, o200k's symbols take
    a '/' after their newline. Cutting after any newline would change pieces (so the text can tell)."""
    monkeypatch.setattr(openai_public, "load_tiktoken_bpe", lambda *args, **kwargs: {})
    pattern = {"file-tokenizer": FILE_PIECES, "gpt2": openai_public.r50k_pat_str}.get(encoding) or \
        getattr(openai_public, encoding)()["pat_str"]
    data = random_text(random.Random(1), 600).encode()

    def split(cuts, encode=lambda text: regex.findall(pattern, text)):
        bounds = [0, *cuts, len(data)]
        return [piece for a, b in zip(bounds, bounds[1:]) for piece in encode(data[a:b].decode())]

    cuts = [m.start() + 2 for m in CUT.finditer(data)]
    assert len(cuts) > 20 and split(cuts) == split([])
    assert split([m.end() for m in re.finditer(rb"\n", data)]) != split([])
    enc = tiktoken.Encoding("test", pat_str=pattern, mergeable_ranks=bpe_ranks, special_tokens={})
    assert split(cuts, enc.encode_ordinary) == enc.encode_ordinary(data.decode())


def decoded_documents(out_dir, split, enc):
    tokens = np.concatenate([read_shard(p) for p in sorted(Path(out_dir).glob(f"text_{split}_*.bin"))])
    ends = np.flatnonzero(tokens == enc.eot_token)
    assert len(tokens) == 0 or ends[-1] == len(tokens) - 1  # every document ends with end-of-text
    pieces = np.split(tokens, ends + 1)[:-1]
    return [enc.decode_bytes(piece[:-1].tolist()).decode("utf-8") for piece in pieces]  # strict: exact bytes


def is_subsequence(part, whole):
    it = iter(whole)
    return all(any(d == w for w in it) for d in part)


def files_of(folder):
    return {p.name: p.read_bytes() for p in sorted(Path(folder).iterdir())}


@pytest.mark.parametrize("which", ["bytes", "bpe"])
def test_documents_decode_back_exactly(corpus, bpe_file, tmp_path, which):
    root, docs = corpus
    tokenizer = "bytes" if which == "bytes" else str(bpe_file)
    meta = prepare_text([root], tmp_path, tokenizer, val_fraction=0.25, workers=1, shard_tokens=500, unit_bytes=97)
    enc = get_tokenizer(meta["tokenizer"], meta.get("tokenizer_file"))
    train_docs, val_docs = decoded_documents(tmp_path, "train", enc), decoded_documents(tmp_path, "val", enc)
    assert sorted(train_docs + val_docs) == sorted(docs)  # every document once, exactly
    assert is_subsequence(train_docs, docs) and is_subsequence(val_docs, docs)  # each split in corpus order
    assert train_docs and val_docs and (meta["train_docs"], meta["val_docs"]) == (len(train_docs), len(val_docs))
    shards = meta["shards"]
    assert len([n for n in shards if "_train_" in n]) > 2  # several shards of 500 tokens
    assert meta["train_tokens"] == sum(s["tokens"] for n, s in shards.items() if "_train_" in n)
    assert meta["max_token_id"] == max(s["max_token_id"] for s in shards.values()) == enc.eot_token
    assert meta["vocab_size"] == enc.n_vocab and meta["source"]["invalid_utf8_replaced"] == 0
    if which == "bpe":  # named by the file's hash, and its merges are used
        assert meta["tokenizer"].startswith("sha256:") and meta["tokenizer_file"] == str(bpe_file.resolve())
        assert meta["train_tokens"] + meta["val_tokens"] < sum(len(d.encode()) + 1 for d in docs) * 0.8


def test_shards_do_not_depend_on_workers_or_unit_size(corpus, bpe_file, tmp_path):
    """1 and 4 workers write byte-identical shards; so do 61-byte and 1 MiB units, which cut the long text
    documents in many places: the cuts never change a token."""
    root, _ = corpus
    runs = {}
    for workers, unit in ((1, 61), (4, 61), (1, 1 << 20)):
        out = tmp_path / f"w{workers}_u{unit}"
        prepare_text([root], out, str(bpe_file), val_fraction=0.2, workers=workers, shard_tokens=300,
                     unit_bytes=unit)
        runs[workers, unit] = files_of(out)
    assert runs[1, 61] == runs[4, 61] == runs[1, 1 << 20]
    assert len(runs[1, 61]) > 4


def test_wide_vocabularies_write_uint32_shards(tmp_path):
    ranks = {bytes([i]): i for i in range(256)} | {b"ab": 70000}
    bpe = write_tiktoken(ranks, tmp_path / "wide.tiktoken")
    (tmp_path / "in.txt").write_text("abcab")
    meta = prepare_text([tmp_path / "in.txt"], tmp_path / "out", str(bpe), val_fraction=0)
    tokens = read_shard(tmp_path / "out" / "text_train_000000.bin")
    assert tokens.dtype == np.uint32 and tokens.tolist() == [70000, 99, 70000, 70001]
    assert meta["vocab_size"] == 70002 and meta["max_token_id"] == 70001


def messages(err):
    """stderr without the progress bar's lines."""
    lines = err.replace("\r", "\n").splitlines()
    return "\n".join(line for line in lines if line.strip() and not line.startswith("tokenizing ("))


def run_text(argv, capsys):
    code = data_prepare.main(["text", *map(str, argv)])
    return code, messages(capsys.readouterr().err)


def test_bad_input_is_one_line_and_exit_2(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "blank.txt").write_text("")
    (tmp_path / "nothing").mkdir()
    (tmp_path / "dangling").mkdir()
    (tmp_path / "dangling" / "gone.txt").symlink_to(tmp_path / "no-such-file")
    (tmp_path / "key.jsonl").write_text('{"text": "fine"}\n{"body": "no text field"}\n')
    (tmp_path / "bad.jsonl").write_text('{"text": "fine"}\n{"text": oops}\n')
    (tmp_path / "ok.txt").write_text("hello\n")
    out = tmp_path / "out"
    for argv, needle in [([tmp_path / "empty"], "empty corpus: the 1 file(s) hold no document"),
                         ([tmp_path / "nothing"], "empty corpus: no file in"),
                         ([tmp_path / "dangling"], "gone.txt: cannot read"),
                         ([tmp_path / "missing.txt"], "missing.txt: no such file or folder"),
                         ([tmp_path / "key.jsonl"], "key.jsonl: the line at byte 17 has no 'text' field"),
                         ([tmp_path / "bad.jsonl"], "bad.jsonl: the line at byte 17 is not JSON"),
                         ([tmp_path / "ok.txt", "--tokenizer", "klingon"], "unknown tokenizer 'klingon'"),
                         ([tmp_path / "ok.txt", "--tokenizer", tmp_path / "key.jsonl"], "line 1 is not"),
                         ([tmp_path / "ok.txt", "--workers", "0"], "--workers: '0': must be an integer"),
                         ([tmp_path / "ok.txt", "--val-fraction", "1"], "--val-fraction: '1': must be a number")]:
        try:
            code, err = run_text([*argv, "--out", out], capsys)
        except SystemExit as e:  # a bad flag: argparse's exit
            code, err = e.code, capsys.readouterr().err.strip()
        assert code == 2 and err.startswith("error: ") and "\n" not in err and needle in err, (argv, err)
        assert not out.exists(), argv  # nothing written
    cli = subprocess.run([sys.executable, "-m", "data.prepare", "text", str(tmp_path / "nothing"), "--out", str(out)],
                         cwd=REPO, capture_output=True, text=True, timeout=120, check=False)
    err = messages(cli.stderr)
    assert cli.returncode == 2 and err.startswith("error: empty corpus") and "\n" not in err, cli


def test_invalid_utf8_is_replaced_counted_and_reported(tmp_path, capsys):
    raw = b"caf\xc3\xa9 \xff ok \xe2\x82 end\n"  # a bad byte and a truncated sequence
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "bad.txt").write_bytes(raw)
    (tmp_path / "in" / "bad.jsonl").write_bytes(b'{"text": "x \xfe y \\ud800"}\n')  # a bad byte, a lone surrogate
    code, err = run_text([tmp_path / "in", "--out", tmp_path / "out", "--val-fraction", "0"], capsys)
    assert code == 0 and "warning: 4 invalid UTF-8 sequence(s) replaced by U+FFFD" in err, err
    meta = json.loads((tmp_path / "out" / "meta.json").read_text())
    assert meta["source"]["invalid_utf8_replaced"] == 4
    docs = decoded_documents(tmp_path / "out", "train", get_tokenizer("bytes"))
    assert docs == ["x \ufffd y \ufffd", raw.decode("utf-8", errors="replace")]


def test_a_run_on_text_data_samples_with_its_tokenizer(corpus, bpe_file, tmp_path, capsys):
    """train.py reads the prepared folder; sample.py decodes with the same .tiktoken file and refuses it changed."""
    bpe = tmp_path / "mine.tiktoken"
    bpe.write_bytes(bpe_file.read_bytes())
    prepare_text([corpus[0]], tmp_path / "data", str(bpe), val_fraction=0.1)
    run = tmp_path / "run"
    train.main(["--model", "tiny", "--n-layer", "1", "--seq-len", "32", "--steps", "1", "--global-batch", "2",
                "--micro-batch", "2", "--device", "cpu", "--data", str(tmp_path / "data"), "--out", str(run),
                "--log-every", "0"])
    capsys.readouterr()
    assert sample.main(["--run", str(run), "--prompt", "the model", "--max-new-tokens", "3", "--device", "cpu"]) == 0
    assert capsys.readouterr().out.startswith("the model")
    bpe.write_bytes(bpe.read_bytes() + b"\n")  # the same merges, other bytes: not the tokenizer of the data
    assert sample.main(["--run", str(run), "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"tokenizer file {bpe} has changed" in err, err


def test_prepare_text_help_runs():
    out = subprocess.run([sys.executable, "-m", "data.prepare", "text", "--help"], cwd=REPO, capture_output=True,
                         text=True, timeout=120, check=False, env={**os.environ, "COLUMNS": "120"})
    assert out.returncode == 0 and "--tokenizer" in out.stdout and "--text-key" in out.stdout, out


def test_skipped_files_are_counted_by_kind(tmp_path, capsys):
    """Was: files without an extension (README, LICENSE) were left out without a word."""
    (tmp_path / "in" / "sub").mkdir(parents=True)
    for name in ("a.txt", "README", "LICENSE", "sub/Makefile", "notes.md", "data.csv"):
        (tmp_path / "in" / name).write_text("text\n")
    code, err = run_text([tmp_path / "in", "--out", tmp_path / "out"], capsys)
    assert code == 0 and "note: skipped 5 files: 3 without an extension, 1 .csv, 1 .md" in err, err


def test_each_file_is_read_once(corpus, tmp_path, capsys):
    """Was: a .jsonl inside a folder and also named on the command line was read twice (its documents duplicated);
    so was a file reached through a symbolic link. Files are told apart by their resolved path."""
    root, _ = corpus
    code, _ = run_text([root, "--out", tmp_path / "once"], capsys)
    assert code == 0
    linked = tmp_path / "linked"
    linked.mkdir()
    (linked / "same.txt").symlink_to(root / "a.txt")
    code, err = run_text([root, root / "sub" / "c.jsonl", root, linked, "--out", tmp_path / "again"], capsys)
    assert code == 0 and "7 already read" in err, err
    once, again = (json.loads((tmp_path / n / "meta.json").read_text()) for n in ("once", "again"))
    assert (again["train_docs"], again["val_docs"]) == (once["train_docs"], once["val_docs"])
    assert files_of(tmp_path / "again") == {**files_of(tmp_path / "once"), "meta.json": ANY}


def test_an_offline_tiktoken_encoding_names_both_ways_out(tmp_path, monkeypatch, capsys):
    """Was: only TIKTOKEN_CACHE_DIR, not `--tokenizer bytes`, which works offline."""
    def offline(name):
        raise OSError(f"no network to fetch {name}")

    monkeypatch.setattr(tiktoken, "get_encoding", offline)
    (tmp_path / "in.txt").write_text("text\n")
    code, err = run_text([tmp_path / "in.txt", "--tokenizer", "cl100k_base", "--out", tmp_path / "out"], capsys)
    assert code == 2 and "\n" not in err and "TIKTOKEN_CACHE_DIR" in err and "--tokenizer bytes" in err, err


def test_a_rank_past_32_bits_is_one_line(tmp_path, capsys):
    """Was: an OverflowError traceback from tiktoken. End-of-text takes the id after the largest rank: 32 bits."""
    (tmp_path / "in.txt").write_text("text\n")
    for rank in (2**32, 2**32 - 1):
        bpe = write_tiktoken({bytes([i]): i for i in range(256)} | {b"ab": rank}, tmp_path / "big.tiktoken")
        code, err = run_text([tmp_path / "in.txt", "--tokenizer", bpe, "--out", tmp_path / "out"], capsys)
        assert code == 2 and "\n" not in err and f"rank {rank}" in err, err


class CountingFile:
    """A file that counts the bytes read from it."""

    def __init__(self, f):
        self.f, self.read_bytes = f, 0

    def seek(self, pos):
        return self.f.seek(pos)

    def tell(self):
        return self.f.tell()

    def read(self, n=-1):
        out = self.f.read(n)
        self.read_bytes += len(out)
        return out

    def readline(self):
        out = self.f.readline()
        self.read_bytes += len(out)
        return out


@pytest.mark.parametrize("suffix", [".txt", ".jsonl"])
def test_a_corpus_that_is_one_long_line_costs_linear_time(tmp_path, suffix):
    """Was: each unit of a one-line corpus read on to the line's end, quadratic in its length (80 MB: 47 s). A unit
    reads at most its own bytes and a few more; the shards stay the same for any number of workers, and no
    character is cut in two."""
    text = "word ü " * (3 * UNIT_BYTES // 8)  # about 3 units, no newline, two-byte characters
    path = tmp_path / f"long{suffix}"
    path.write_text(json.dumps({"text": text}) + "\n" if suffix == ".jsonl" else text, encoding="utf-8")
    size = path.stat().st_size
    with open(path, "rb") as f:
        for start in range(UNIT_BYTES, size, UNIT_BYTES):
            counted = CountingFile(f)
            if suffix == ".txt":
                cut = next_cut(counted, start, size)
                f.seek(cut)
                assert start <= cut and not 0x80 <= (f.read(1) or b"\0")[0] < 0xC0  # a character's start
            else:
                end = min(start + UNIT_BYTES, size)
                assert list(Tokenizing.json_lines(SimpleNamespace(text_key="text"), counted, path, start, end)) == []
            assert counted.read_bytes <= UNIT_BYTES + 8, (start, counted.read_bytes)
    tokens = []
    for workers in (1, 2):
        prepare_text([path], tmp_path / f"w{workers}", "bytes", workers=workers)
        tokens.append(np.concatenate([read_shard(p) for p in sorted((tmp_path / f"w{workers}").glob("*.bin"))]))
    assert np.array_equal(tokens[0], tokens[1])
    assert bytes(tokens[0][tokens[0] < 256].astype(np.uint8)).decode("utf-8") == text


def test_a_val_split_no_window_fits_is_said_when_it_is_written(tmp_path, capsys):
    """Was: a small corpus's 95-token val split was written without a word, and refused by training later."""
    (tmp_path / "small.jsonl").write_text("".join(json.dumps({"text": f"doc {i} says hello"}) + "\n"
                                                  for i in range(200)))
    code, err = run_text([tmp_path / "small.jsonl", "--val-fraction", "0.03", "--out", tmp_path / "out"], capsys)
    meta = json.loads((tmp_path / "out" / "meta.json").read_text())
    assert code == 0 and 0 < meta["val_tokens"] <= 257, meta
    assert f"warning: the val split holds {meta['val_tokens']:,} tokens, no window of the tiny model's 256" in err
