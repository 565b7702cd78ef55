"""Data pipeline: tokenizer, shard files, prepare (offline and from a local HTTP server), loader."""
import ast
import functools
import http.server
import json
import os
import subprocess
import sys
import sysconfig
import threading
from pathlib import Path

import numpy as np
import pytest
import tiktoken
import torch

from data import loader as data_loader
from data import prepare as data_prepare
from data.loader import DataError, TokenLoader, read_shard, write_shard
from data.prepare import prepare, python_files
from data.tokenizer import get_tokenizer

REPO = Path(__file__).resolve().parent.parent
TEXT = "def f(x):\n    return 'héllo → 世界 🐍'\r\n\n\ttabs  and <|endoftext|> as plain text\n"


def gpt2_available():
    try:
        tiktoken.get_encoding("gpt2")
        return True
    except Exception:  # noqa: BLE001 - any failure means: not available here
        return False


# ---- tokenizer ---------------------------------------------------------------------------

def test_bytes_tokenizer_round_trips_text():
    enc = get_tokenizer("bytes")
    ids = enc.encode_ordinary(TEXT)
    assert ids == list(TEXT.encode("utf-8"))  # one token per byte, special text not special
    assert enc.decode(ids) == TEXT
    assert enc.n_vocab == 257 and enc.eot_token == 256
    assert enc.decode(ids + [enc.eot_token]) == TEXT + "<|endoftext|>"


def test_gpt2_tokenizer_error_names_the_cache_variable():
    if gpt2_available():
        pytest.skip("the GPT-2 tokenizer loads here")
    with pytest.raises(DataError, match="TIKTOKEN_CACHE_DIR"):
        get_tokenizer("gpt2")


# ---- shard files -------------------------------------------------------------------------

@pytest.mark.parametrize("top, dtype, magic", [(65535, np.uint16, 20240520),
                                               (70000, np.uint32, 20240801)])
def test_shard_round_trip(tmp_path, top, dtype, magic):
    tokens = np.array([0, 1, 2, top, 7], dtype=np.int64)
    path = tmp_path / "x_train_000000.bin"
    write_shard(path, tokens)
    header = np.fromfile(path, dtype="<i4", count=256)
    assert list(header[:3]) == [magic, 1, 5] and not header[3:].any()
    got = read_shard(path)
    assert got.dtype == dtype and np.array_equal(got, tokens)
    assert path.stat().st_size == 1024 + 5 * np.dtype(dtype).itemsize
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # no temp file left


def test_bad_shards_raise_data_error_naming_the_file(tmp_path):
    path = tmp_path / "x_train_000000.bin"
    write_shard(path, np.arange(100))
    path.write_bytes(path.read_bytes()[:-2])
    with pytest.raises(DataError, match=f"{path.name}.*truncated: expected 1224 bytes got 1222"):
        read_shard(path)
    header = np.zeros(256, dtype="<i4")
    header[:3] = 12345, 1, 0
    path.write_bytes(header.tobytes())
    with pytest.raises(DataError, match=f"{path.name}.*bad magic 12345"):
        read_shard(path)
    with pytest.raises(DataError, match="nothing.bin.*missing"):
        read_shard(tmp_path / "nothing.bin")


# ---- prepare: pystdlib (offline) ---------------------------------------------------------

def write_sources(root, n_kept):
    """n_kept .py files that pystdlib keeps, plus test and package files it must leave out."""
    kept = {}
    for i in range(n_kept):
        kept[f"mod{i:03d}.py" if i % 2 else f"pkg/sub{i:03d}.py"] = f"# file {i} é\nx = {i}\n"
    left_out = ["test/a.py", "tests/b.py", "pkg/test_c.py", "testing/d.py",
                "idlelib/idle_test/e.py", "site-packages/f.py"]
    for rel, text in [*kept.items(), *((rel, "LEFT OUT\n") for rel in left_out)]:
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text, encoding="utf-8")
    (root / "notes.txt").write_text("not python")
    return [kept[k] for k in sorted(kept, key=lambda rel: Path(rel).parts)]


def test_prepare_pystdlib(tmp_path):
    texts = write_sources(tmp_path / "src", 120)
    out = prepare("pystdlib", tmp_path / "out", src_dir=tmp_path / "src")
    meta = json.loads((out / "meta.json").read_text())
    assert meta["tokenizer"] == "bytes" and meta["vocab_size"] == 257 and meta["eot"] == 256
    enc = get_tokenizer("bytes")
    train = read_shard(out / "pystdlib_train_000000.bin")
    val = read_shard(out / "pystdlib_val_000000.bin")
    assert train.dtype == np.uint16 and len(val) > 0
    assert (meta["train_tokens"], meta["val_tokens"]) == (len(train), len(val))
    # every 100th file is val; each file is followed by one EOT
    val_texts = [t for i, t in enumerate(texts) if i % 100 == 0]
    train_texts = [t for i, t in enumerate(texts) if i % 100]
    assert enc.decode(val.tolist()) == "".join(t + "<|endoftext|>" for t in val_texts)
    assert enc.decode(train.tolist()) == "".join(t + "<|endoftext|>" for t in train_texts)
    assert (train == 256).sum() == len(train_texts) and train[-1] == 256
    # each shard's largest id is recorded (the loader trusts it instead of scanning), and the overall one
    assert meta["max_token_id"] == 256 and data_loader.read_meta(out) == meta
    assert meta["shards"] == {p.name: {"bytes": p.stat().st_size, "fingerprint": data_loader.fingerprint(p),
                                       "max_token_id": int(read_shard(p).max())} for p in out.glob("*.bin")}


def test_python_files_of_the_real_stdlib_leave_out_tests():
    root = Path(sysconfig.get_paths()["stdlib"])
    files = [p.relative_to(root) for p in python_files(root)]
    assert Path("os.py") in files and Path("json/decoder.py") in files
    assert not [p for p in files if any(part.startswith("test") or part == "site-packages"
                                        for part in p.parts)]


def test_prepare_run_as_a_file_says_in_one_line_how_to_run_it():
    """`python data/prepare.py`, the old way: one line naming `python -m data.prepare`, exit 2, no traceback."""
    out = subprocess.run([sys.executable, "data/prepare.py", "pystdlib"], cwd=REPO, capture_output=True, text=True,
                         timeout=60, check=False)
    assert out.returncode == 2 and out.stderr.count("\n") == 1 and "python -m data.prepare" in out.stderr, out.stderr


def test_prepare_runs_as_a_module_and_the_arrow_points_from_data_to_parallel():
    """`python -m data.prepare`, with no edit of sys.path; the arrow between the packages points one way: data/
    (saves, the run folder) reads parallel/'s pieces and collectives; parallel/ and model.py import nothing of data/."""
    out = subprocess.run([sys.executable, "-m", "data.prepare", "--help"], cwd=REPO, capture_output=True, text=True,
                         timeout=60, check=False)
    assert out.returncode == 0, out.stderr
    assert "pystdlib" in out.stdout and "--shards" in out.stdout
    for path in sorted((REPO / "parallel").glob("*.py")) + [REPO / "model.py"]:
        tree = ast.parse(path.read_text())
        names = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
        names += [n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module]
        assert not [m for m in names if m.split(".")[0] == "data"], path.name
    for path in sorted((REPO / "data").glob("*.py")):
        assert "sys.path" not in path.read_text(), path.name


# ---- prepare: downloads from a local HTTP server -----------------------------------------

class QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


@pytest.fixture
def server(tmp_path):
    """(folder served, base url) of an HTTP server on 127.0.0.1."""
    root = tmp_path / "www"
    root.mkdir()
    handler = functools.partial(QuietHandler, directory=str(root))
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=httpd.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    yield root, f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


def test_prepare_shakespeare_downloads(server, tmp_path):
    root, url = server
    text = "First Citizen:\nBefore we proceed any further, hear me speak. é\n" * 40
    (root / "input.txt").write_text(text, encoding="utf-8")
    enc = get_tokenizer("bytes")  # GPT-2 BPE needs the network; the download path is the same
    out = prepare("shakespeare", tmp_path / "out", base_url=url, tokenizer=enc)
    meta = json.loads((out / "meta.json").read_text())
    train = read_shard(out / "shakespeare_train_000000.bin")
    val = read_shard(out / "shakespeare_val_000000.bin")
    n = len(text.encode("utf-8"))
    assert (meta["train_tokens"], meta["val_tokens"]) == (int(0.9 * n), n - int(0.9 * n))
    assert enc.decode(train.tolist() + val.tolist()) == text
    assert (out / "input.txt").read_text(encoding="utf-8") == text
    if not gpt2_available():
        with pytest.raises(DataError, match="TIKTOKEN_CACHE_DIR"):
            prepare("shakespeare", tmp_path / "out2", base_url=url)


def test_prepare_fineweb_downloads_validates_and_skips(server, tmp_path):
    root, url = server
    rng = np.random.default_rng(0)
    shards = {"fineweb_val_000000.bin": rng.integers(0, 50257, 3000),
              "fineweb_train_000001.bin": rng.integers(0, 50257, 5000),
              "fineweb_train_000002.bin": rng.integers(0, 50257, 4000)}
    for name, tokens in shards.items():
        write_shard(root / name, tokens)
    out = tmp_path / "out"
    prepare("fineweb10b", out, shards=1, base_url=url)
    assert sorted(p.name for p in out.iterdir()) == [
        "fineweb_train_000001.bin", "fineweb_val_000000.bin", "meta.json"]
    meta = json.loads((out / "meta.json").read_text())
    kept = {n: {"bytes": 1024 + 2 * len(shards[n]), "fingerprint": data_loader.fingerprint(root / n),
                "max_token_id": int(shards[n].max())} for n in ("fineweb_val_000000.bin", "fineweb_train_000001.bin")}
    assert meta == {"tokenizer": "gpt2", "vocab_size": 50257, "eot": 50256, "train_tokens": 5000,
                    "val_tokens": 3000, "max_token_id": max(r["max_token_id"] for r in kept.values()), "shards": kept}
    name = "fineweb_train_000001.bin"
    assert (out / name).read_bytes() == (root / name).read_bytes()

    # files already present and valid are not fetched again
    (root / "fineweb_train_000001.bin").unlink()
    (root / "fineweb_val_000000.bin").unlink()
    prepare("fineweb10b", out, shards=2, base_url=url)
    assert json.loads((out / "meta.json").read_text())["train_tokens"] == 9000

    # a truncated download is rejected before it takes the real name
    truncated = (root / "fineweb_train_000002.bin").read_bytes()[:-10]
    (root / "fineweb_train_000003.bin").write_bytes(truncated)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    with pytest.raises(DataError, match=f"{url}/fineweb_train_000003.bin.*truncated"):
        prepare("fineweb10b", out, shards=3, base_url=url)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before  # the previous set, whole (was: no meta.json)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # nothing left beside it

    # HTTP 404
    missing = f"{url}/nowhere/fineweb_val_000000.bin"
    with pytest.raises(DataError, match=f"{missing} failed: HTTP Error 404"):
        prepare("fineweb10b", tmp_path / "other", base_url=url + "/nowhere")


def test_prepare_refuses_a_download_with_ids_outside_the_vocabulary(server, tmp_path):
    root, url = server
    write_shard(root / "fineweb_val_000000.bin", np.arange(100))
    write_shard(root / "fineweb_train_000001.bin", np.array([5, 50257, 7]))  # GPT-2 ids end at 50256
    with pytest.raises(DataError, match="fineweb_train_000001.bin: token id 50257 is outside the vocabulary"):
        prepare("fineweb10b", tmp_path / "out", base_url=url)
    assert not (tmp_path / "out" / "meta.json").exists()  # the folder stays incomplete


def assert_one_line(err, *needles):
    assert err.startswith("error: ") and err.count("\n") == 1 and all(n in err for n in needles), err


def test_prepare_refuses_bad_flags_before_creating_anything(tmp_path, monkeypatch, capsys):
    a_file, locked = tmp_path / "a_file", tmp_path / "locked"
    a_file.write_text("x")
    locked.mkdir(mode=0o555)
    if os.geteuid() == 0:  # root writes anyway: let access() answer as it does for everyone else
        real_access = os.access
        monkeypatch.setattr(os, "access", lambda path, mode, *a, **kw: (
            False if Path(path) == locked and mode & os.W_OK else real_access(path, mode, *a, **kw)))
    for argv, needles in [(["fineweb10b", "--shards", "0", "--out", str(tmp_path / "new")], ["--shards", "1..103"]),
                          (["pystdlib", "--out", str(a_file)], ["--out", f"{a_file} is a file"]),
                          (["pystdlib", "--out", str(a_file / "sub")], ["--out", f"{a_file} is a file"]),
                          (["pystdlib", "--out", str(locked)], ["--out", f"{locked} is not writable"]),
                          (["pystdlib", "--out", str(locked / "a" / "b")], ["--out", f"{locked} is not writable"])]:
        assert data_prepare.main(argv) == 2, argv
        assert_one_line(capsys.readouterr().err, *needles)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a_file", "locked"] and not any(locked.iterdir())
    out = subprocess.run([sys.executable, "-m", "data.prepare", "fineweb10b", "--shards", "0", "--out",
                          str(tmp_path / "cli")], cwd=REPO, capture_output=True, text=True, timeout=60, check=False)
    assert out.returncode == 2 and out.stdout == "" and not (tmp_path / "cli").exists(), out  # was: 1, created
    assert_one_line(out.stderr, "--shards")


def test_unreachable_host_is_a_data_error(tmp_path):
    with pytest.raises(DataError, match="http://127.0.0.1:9/input.txt"):
        prepare("shakespeare", tmp_path, base_url="http://127.0.0.1:9",
                tokenizer=get_tokenizer("bytes"))


# ---- loader ------------------------------------------------------------------------------

@pytest.fixture
def data_dir(tmp_path):
    """Two train shards of distinct consecutive ids (a window is a run +1), one val shard."""
    d = tmp_path / "toy"
    d.mkdir()
    write_shard(d / "toy_train_000000.bin", np.arange(0, 1000))
    write_shard(d / "toy_train_000001.bin", np.arange(100_000, 100_400))  # uint32
    write_shard(d / "toy_val_000000.bin", np.arange(500_000, 500_300))
    (d / "meta.json").write_text(json.dumps({"tokenizer": "bytes", "vocab_size": 600_000, "eot": 0,
                                             "train_tokens": 1400, "val_tokens": 300}))
    return d


def make(data_dir, **kw):
    args = {"split": "train", "seq_len": 16, "global_batch": 8, "seed": 0, **kw}
    return TokenLoader(data_dir, **args)


def test_batches_are_a_function_of_seed_and_step(data_dir):
    a, b = make(data_dir), make(data_dir, prefetch=False)
    for step in (0, 1, 5, 5, 2):
        xa, ya = a.get(step)
        xb, yb = b.get(step)
        assert torch.equal(xa, xb) and torch.equal(ya, yb)
    assert not torch.equal(a.get(0)[0], a.get(1)[0])
    assert not torch.equal(a.get(0)[0], make(data_dir, seed=1).get(0)[0])
    a.close()


def test_windows_are_contiguous_and_y_is_x_shifted(data_dir):
    loader = make(data_dir, seq_len=32, global_batch=64)
    x, y = loader.get(3)
    assert x.shape == y.shape == (64, 32) and x.dtype == y.dtype == torch.int64
    assert torch.equal(y, x + 1)  # the data are runs of +1: next-token targets, no shard straddled
    assert torch.equal(x[:, 1:], x[:, :-1] + 1)
    assert ((x[:, -1] < 1000 - 1) | (x[:, 0] >= 100_000)).all()


def test_shards_are_sampled_by_length(data_dir):
    loader = make(data_dir, prefetch=False)  # windows: 984 in shard 0, 384 in shard 1
    first = np.concatenate([loader.global_rows(s)[:, 0] for s in range(300)])
    share = (first >= 100_000).mean()
    assert abs(share - 384 / 1368) < 0.03


@pytest.mark.parametrize("dp_size", [1, 2, 4])
def test_rank_slices_make_up_the_global_batch(data_dir, dp_size):
    ref = make(data_dir, prefetch=False)
    ranks = [make(data_dir, dp_rank=r, dp_size=dp_size) for r in range(dp_size)]
    for step in range(4):
        whole = torch.from_numpy(ref.global_rows(step))
        xs, ys = zip(*(loader.get(step) for loader in ranks))
        assert torch.equal(torch.cat(xs), whole[:, :-1])
        assert torch.equal(torch.cat(ys), whole[:, 1:])
        assert torch.equal(torch.cat(xs), ref.get(step)[0])
    for loader in ranks:
        loader.close()


def test_val_split_and_wait_time(data_dir):
    loader = make(data_dir, split="val", global_batch=4)
    x, _ = loader.get(0)
    assert (x >= 500_000).all() and loader.wait_s >= 0
    loader.close()
    assert torch.equal(loader.get(0)[0], x)  # still works after close, without the thread


def test_prefetch_thread_errors_reach_the_caller(data_dir, monkeypatch):
    loader = make(data_dir)
    load = loader._load

    def load_fails_in_the_thread(step):
        if threading.current_thread() is not threading.main_thread():
            raise RuntimeError(f"boom at {step}")
        return load(step)

    monkeypatch.setattr(loader, "_load", load_fails_in_the_thread)
    loader.get(0)  # synchronous, then step 1 is requested from the thread
    with pytest.raises(RuntimeError, match="boom at 1"):
        loader.get(1)
    loader.close()


def test_loader_errors(data_dir, tmp_path):
    with pytest.raises(ValueError, match="--global-batch 6"):
        make(data_dir, global_batch=6, dp_size=4)
    with pytest.raises(DataError, match="missing_set not found; run python -m data.prepare"):
        make(tmp_path / "missing_set")
    with pytest.raises(DataError, match="seq_len\\+1 = 1001"):
        make(data_dir, seq_len=1000)
    (data_dir / "toy_train_000001.bin").write_bytes(b"\0" * 1000)
    with pytest.raises(DataError, match="toy_train_000001.bin: truncated"):
        make(data_dir)
    (data_dir / "meta.json").unlink()
    with pytest.raises(DataError, match="meta.json missing"):
        make(data_dir)


def test_loader_refuses_ids_outside_the_vocabulary(data_dir):
    meta = json.loads((data_dir / "meta.json").read_text())  # no recorded maxima: each shard is scanned
    (data_dir / "meta.json").write_text(json.dumps({**meta, "vocab_size": 100_399}))
    with pytest.raises(DataError, match=r"toy_train_000001.bin: token id 100399 is outside the vocabulary "
                                        r"\(vocab_size 100399 in .*meta.json\)"):
        make(data_dir)
    (data_dir / "meta.json").write_text(json.dumps({**meta, "vocab_size": 100_400}))
    assert make(data_dir, prefetch=False).max_token_id == 100_399  # fits: the largest train id is 100_399
    # a recorded maximum is not trusted: what the loader reads is what it checks
    records = {p.name: {"bytes": p.stat().st_size, "max_token_id": 999_999} for p in data_dir.glob("*.bin")}
    (data_dir / "meta.json").write_text(json.dumps({**meta, "shards": records}))
    assert make(data_dir, prefetch=False).max_token_id == 100_399


@pytest.mark.parametrize("text, message", [
    ("{not json", "not valid JSON"), ("[1]", "expected a JSON object"), ('{"vocab_size": 257}', "tokenizer missing"),
    ('{"tokenizer": "bytes"}', "vocab_size missing"), ('{"tokenizer": "bytes", "vocab_size": "7"}', "integer, got '7'"),
    ('{"tokenizer": "bytes", "vocab_size": 257, "max_token_id": 300}', "max_token_id 300 is not an integer below")])
def test_bad_meta_is_one_data_error_naming_the_file(data_dir, text, message):
    (data_dir / "meta.json").write_text(text)
    for call in (lambda: make(data_dir), lambda: data_loader.read_meta(data_dir)):
        with pytest.raises(DataError, match=message) as e:
            call()
        assert str(e.value).startswith(f"{data_dir / 'meta.json'}: ") and "\n" not in str(e.value)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_batches_match_cpu(data_dir):
    cpu, gpu = make(data_dir), make(data_dir, device="cuda")
    for step in range(3):
        x, y = gpu.get(step)
        assert x.is_cuda and y.is_cuda
        assert torch.equal(x.cpu(), cpu.get(step)[0]) and torch.equal(y.cpu(), x.cpu() + 1)
    cpu.close()
    gpu.close()
