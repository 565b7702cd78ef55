"""sample.py on hostile input: each bad flag or save is one line on stderr and exit status 2 (a save whose model
config lacks a field too: it is never filled with a default), an empty prompt starts from end-of-text, a prompt that
is not UTF-8 is refused rather than altered, and a tiny temperature samples as greedy decoding does."""
import contextlib
import dataclasses
import io
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import sample
import train
from data.loader import write_shard

REPO = Path(__file__).resolve().parent.parent
TINY = ["--model", "tiny", "--n-layer", "1", "--d-model", "32", "--n-head", "2", "--n-kv-head", "1", "--ffn-dim", "64",
        "--seq-len", "16", "--steps", "1", "--global-batch", "2", "--micro-batch", "2", "--device", "cpu",
        "--dtype", "fp32", "--eval-every", "0", "--log-every", "0", "--save-every", "1"]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A run folder holding one save of a one-layer model trained one step on random bytes."""
    root = tmp_path_factory.mktemp("sample")
    data = root / "data"
    data.mkdir()
    rng = np.random.default_rng(0)
    for split, n in (("train", 4000), ("val", 1000)):
        write_shard(data / f"toy_{split}_000000.bin", rng.integers(0, 257, n))
    (data / "meta.json").write_text(json.dumps({"tokenizer": "bytes", "vocab_size": 257, "eot": 256}))
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        train.main(TINY + ["--data", str(data), "--out", str(root / "run")])
    return root / "run"


def refused(capsys, *argv):
    """stderr of sample.py refusing argv: exit status 2 and one line `error: ...`, nothing on stdout."""
    code = sample.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    assert code == 2 and err.startswith("error: ") and err.count("\n") == 1 and out == "", (code, out, err)
    return err


@pytest.mark.parametrize("flag, value", [("--temperature", "-0.5"), ("--temperature", "nan"),
                                         ("--max-new-tokens", "-1"), ("--top-k", "-3")])
def test_negative_numbers_are_refused(run, capsys, flag, value):
    err = refused(capsys, "--run", run, "--max-new-tokens", "3", flag, value)
    assert err.startswith(f"error: {flag}: invalid non-negative") and repr(value) in err


def test_cuda_without_a_gpu_is_refused(run, capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    err = refused(capsys, "--run", run, "--device", "cuda", "--max-new-tokens", "3")
    assert err == "error: --device: cuda: no CUDA device is visible here (use --device cpu)\n"


def edit_save(run, tmp_path, edit):
    """A copy of the run's save whose meta.json went through edit(meta)."""
    save = tmp_path / "copy"
    shutil.copytree(next(run.glob("step_*")), save)
    meta = json.loads((save / "meta.json").read_text())
    edit(meta)
    (save / "meta.json").write_text(json.dumps(meta))
    return save


@pytest.mark.parametrize("edit, message", [
    (lambda meta: meta.pop("config"), "'config'"),
    (lambda meta: meta["config"].update(tokenizer="klingon"), "unknown tokenizer 'klingon'"),
    (lambda meta: meta["config"]["model"].update(n_layer=2), "model has n_layer 2, the save holds tensors of 1 layer"),
    (lambda meta: meta["config"]["model"].update(d_model=48), "of shape [320, 48], the save has shape [320, 32]"),
    (lambda meta: meta["config"]["model"].pop("n_layer"), "meta.json: model.n_layer is missing"),
    (lambda meta: meta["config"]["model"].update(rope_theta=-1.0), "model.rope_theta: must be a finite positive"),
    (lambda meta: meta["config"]["model"].update(tie_embeddings=True), "the save has lm_head.weight, which its")])
def test_a_save_sample_cannot_use_is_refused(run, tmp_path, capsys, edit, message):
    save = edit_save(run, tmp_path, edit)
    err = refused(capsys, "--run", save, "--max-new-tokens", "3")
    assert str(save / "meta.json") in err and message in err, err


def test_a_config_claiming_a_million_layers_is_refused_before_any_model_is_built(run, tmp_path):
    """Was: building a model of 10^6 layers, even on the meta device, ran for hours. A child process with a timeout,
    so that a spin fails the test instead of the suite."""
    save = edit_save(run, tmp_path, lambda meta: meta["config"]["model"].update(n_layer=10 ** 6))
    try:
        out = subprocess.run([sys.executable, "sample.py", "--run", str(save), "--max-new-tokens", "3"], cwd=REPO,
                             capture_output=True, text=True, timeout=90)
    except subprocess.TimeoutExpired:
        pytest.fail("sample.py built a model of 10^6 layers")
    assert out.returncode == 2 and out.stderr == f"error: {save / 'meta.json'}: its config's model has n_layer " \
                                                 "1000000, the save holds tensors of 1 layer\n", out.stderr


@pytest.fixture(scope="module")
def wide_run(tmp_path_factory, run):
    """A run of the same data whose model has 320 ids (as --init-from a checkpoint of a larger vocabulary gives):
    the byte tokenizer decodes 257 of them."""
    root = tmp_path_factory.mktemp("wide")
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        train.main(TINY + ["--data", str(run.parent / "data"), "--vocab-size", "320", "--out", str(root / "run")])
    return root / "run"


def test_ids_the_tokenizer_cannot_decode_are_never_sampled(wide_run, capsys, monkeypatch):
    """Was: KeyError: 'Invalid token for decoding: 258', a traceback. The head here favours ids 257-319 above all
    others: they are masked, as the loss masks padded rows, and one note says so."""
    build = sample.build

    def favouring_the_undecodable(*args):
        gpt = build(*args)
        with torch.no_grad():
            gpt.lm_head.weight[257:] = gpt.lm_head.weight[257:].sign() * 10
            gpt.lm_head.weight[:257] *= 0.01
        return gpt
    monkeypatch.setattr(sample, "build", favouring_the_undecodable)
    for flags in (["--temperature", "0"], ["--temperature", "1", "--top-k", "0"], ["--top-k", "300"]):
        assert sample.main(["--run", str(wide_run), "--prompt", "def ", "--max-new-tokens", "20", *flags]) == 0
        out, err = capsys.readouterr()
        assert out.startswith("def ") and err == "note: the model has 320 ids, its tokenizer decodes 257 of them: " \
                                                 "the others are never sampled\n", err


def test_a_prompt_past_the_models_vocabulary_is_one_line(run, capsys, monkeypatch):
    """A tokenizer with more ids than the model (its end-of-text, 256, past a model of 200 ids)."""
    read_save = sample.read_save

    def narrow(path):
        cfg, enc, tensors, save = read_save(path)
        return dataclasses.replace(cfg, vocab_size=200), enc, tensors, save
    monkeypatch.setattr(sample, "read_save", narrow)
    err = refused(capsys, "--run", run, "--prompt", "", "--max-new-tokens", "3")
    assert err == "error: --prompt: it encodes to id 256, past the 200 ids of the model (its tokenizer has 257); the " \
                  "empty prompt is end-of-text\n"


@pytest.mark.parametrize("value", [str(2 ** 70), str(2 ** 64), str(-2 ** 63 - 1), "x"])
def test_a_seed_torch_cannot_take_is_one_line(run, capsys, value):
    """Was: RuntimeError: Overflow when unpacking long, a traceback."""
    err = refused(capsys, "--run", run, "--seed", value, "--max-new-tokens", "1")
    assert err == f"error: --seed: invalid integer in [-2^63, 2^64) value: '{value}'\n"
    assert sample.main(["--run", str(run), "--seed", str(2 ** 64 - 1), "--max-new-tokens", "1"]) == 0


def test_an_empty_run_path_is_one_line(capsys):
    """Was: --run '' read the current folder. (A FIFO where meta.json should be: test_save_integrity.py.)"""
    assert refused(capsys, "--run", "", "--max-new-tokens", "1") == \
        "error: --run: an empty path: name a run folder written by train.py --out\n"


@pytest.mark.parametrize("temperature", ["1e-300", "5e-324", "1e-30"])
def test_a_tiny_temperature_samples_as_greedy_decoding(run, capsys, temperature):
    """logits / 1e-300 overflows to inf and nan; shifted by their maximum, in fp64, they never do, and the most
    likely token takes all the probability."""
    assert sample.main(["--run", str(run), "--prompt", "def ", "--max-new-tokens", "12", "--temperature", "0"]) == 0
    greedy = capsys.readouterr().out
    assert sample.main(["--run", str(run), "--prompt", "def ", "--max-new-tokens", "12", "--temperature",
                        temperature, "--top-k", "0", "--seed", "5"]) == 0
    out, err = capsys.readouterr()
    assert out == greedy and err == ""


def test_empty_prompt_starts_from_end_of_text(run, capsys):
    assert sample.main(["--run", str(run), "--prompt", "", "--max-new-tokens", "0", "--temperature", "0",
                        "--top-k", "0"]) == 0
    assert capsys.readouterr().out == "\n"  # nothing generated, and the end-of-text it started from is not shown
    assert sample.main(["--run", str(run), "--prompt", "", "--max-new-tokens", "4", "--seed", "3"]) == 0
    out = capsys.readouterr().out
    assert out.endswith("\n") and len(out) > 1


def test_a_prompt_that_is_not_utf8_is_refused(run, capsys):
    """Bytes that are not UTF-8 reach sys.argv as lone surrogates (os.fsdecode, as Python decodes the command line);
    the tokenizer would replace them silently."""
    prompt = os.fsdecode(b"def \xff(x):")
    assert prompt == "def \udcff(x):"
    err = refused(capsys, "--run", run, "--prompt", prompt, "--max-new-tokens", "1")
    assert err == "error: --prompt: not valid UTF-8 (byte 0xff at character 4)\n"
