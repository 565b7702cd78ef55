"""Continuing a Hugging Face Llama and exporting it back, as one continues Llama 3.1 8B (Llama 3's RoPE scaling,
untied) or Llama 3.2 1B (scaled and tied), with a vocabulary that is not a multiple of 64 (300: 20 padding rows).

The step-1 loss of `train.py --init-from` equals transformers' on the same batch: in one process, tp 2 and pp 2
(untied), in one process and ddp 2 (tied). After two steps the run's export is a complete Hugging Face model:
transformers' greedy continuation of it equals sample.py's of the save; the vocabulary is the true one; tied stays
tied; the run's tokenizer and end-of-text id come along. A tied checkpoint is refused, in one line naming the flag,
where the layout cannot keep it tied. The export's target must be empty or is replaced whole.
"""
import json
import shutil
import sysconfig
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import transformers

import sample
import train
from bench.labs.prepare_speed import train_bpe, write_tiktoken
from bench.ranks import run_ranks
from data import export
from data.loader import TokenLoader
from data.prepare import prepared_folder
from data.tokenizer import bytes_tokenizer, file_tokenizer
from tests.jobs import Failed, run_jobs
from tests.layouts import BASE, exit_and_stderr

VOCAB = 300  # the pystdlib data's 257 ids fit; padded to 320
TINY = dict(vocab_size=VOCAB, hidden_size=128, intermediate_size=384, num_hidden_layers=4, num_attention_heads=8,
            num_key_value_heads=4, max_position_embeddings=256, rms_norm_eps=1e-6, rope_theta=5000.0)
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 16}  # a short original context: most frequencies are scaled
STEPS = ["--steps", "2"]  # on tests.layouts.BASE: seq 64, global batch 8, seed 1337
RUNS = {"scaled, one process": ("scaled", 1, []), "scaled, tp 2": ("scaled", 2, ["--tp", "2"]),
        "scaled, pp 2": ("scaled", 2, ["--pp", "2"]), "tied, one process": ("tied", 1, []),
        "tied, ddp 2": ("tied", 2, [])}


def hf_checkpoint(folder, tied, seed):
    """A random LlamaForCausalLM with Llama 3's RoPE scaling, saved by transformers, with weights large enough that
    attention is far from uniform (test_init_from.py); returns the model as transformers reads it back."""
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(tie_word_embeddings=tied, rope_scaling=dict(LLAMA3), **TINY)
    model = transformers.LlamaForCausalLM(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1 + 0.1 * torch.randn_like(p) if "norm" in name else 0.15 * torch.randn_like(p))
    model.save_pretrained(folder)
    return transformers.LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def train_main(rank, world, argv):
    return train.main(argv)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """{run: (its folder, its losses, the transformers model it started from)} for RUNS, and "checkpoints": {kind:
    folder}. The two-rank runs share one set of ranks."""
    root = tmp_path_factory.mktemp("hf")
    checkpoints = {kind: root / kind for kind in ("scaled", "tied")}
    models = {kind: hf_checkpoint(folder, kind == "tied", seed) for seed, (kind, folder) in
              enumerate(checkpoints.items())}
    argv = {name: BASE + STEPS + flags + ["--init-from", str(checkpoints[kind]), "--out", str(root / name)]
            for name, (kind, _, flags) in RUNS.items()}
    losses = {name: train.main(argv[name]) for name, (_, world, _) in RUNS.items() if world == 1}
    jobs = [(name, train_main, (argv[name],)) for name, (_, world, _) in RUNS.items() if world == 2]
    ranks = run_ranks(run_jobs, 2, args=(jobs,), timeout=400)
    for name, *_ in jobs:
        assert not isinstance(ranks[0][name], Failed), ranks[0][name]
        losses[name] = ranks[0][name]
    out = {name: (root / name, losses[name], models[kind]) for name, (kind, _, _) in RUNS.items()}
    return {**out, "checkpoints": checkpoints}


@pytest.fixture(scope="module")
def exports(runs, tmp_path_factory):
    """{run: its export folder}."""
    root = tmp_path_factory.mktemp("exports")
    for name in RUNS:
        assert export.main([str(runs[name][0]), str(root / name)]) == 0
    return {name: root / name for name in RUNS}


def first_batch():
    """The global batch of step 1 in every run (BASE's seq 64, batch 8, seed 1337)."""
    return TokenLoader(prepared_folder(None), "train", 64, 8, 1337, prefetch=False).get(0)


@pytest.mark.parametrize("name", list(RUNS))
def test_step_1_loss_equals_transformers(runs, name):
    """Llama 3's RoPE, the tied head, the loaded weights, and the 20 padding columns kept out of the loss: any
    of them wrong moves the loss far past fp32's rounding."""
    _, losses, model = runs[name]
    x, y = first_batch()
    with torch.no_grad():
        expected = F.cross_entropy(model(x).logits.flatten(0, 1), y.flatten()).item()
    assert len(losses) == 2
    assert losses[0] == pytest.approx(expected, rel=2e-6, abs=0), (losses[0], expected)


def continuations(run, exported, prompt, n=24):
    """(sample.py's greedy continuation of the run's save, transformers' of the export): token ids."""
    cfg, enc, tensors, save = sample.read_save(run)
    gpt = sample.build(cfg, tensors, save, torch.device("cpu"))
    ours = sample.generate(gpt, torch.tensor([prompt]), n, 0, 0, cfg.vocab_size, enc.eot_token)
    hf = transformers.LlamaForCausalLM.from_pretrained(exported, dtype=torch.float32).eval()
    theirs = hf.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False)
    return ours[0].tolist(), theirs[0].tolist()


@pytest.mark.parametrize("name", list(RUNS))
def test_greedy_continuation_after_export_equals_transformers(runs, exports, name):
    prompt = first_batch()[0][0, :16].tolist()
    ours, theirs = continuations(runs[name][0], exports[name], prompt)
    assert len(ours) > len(prompt) and ours == theirs


@pytest.mark.parametrize("name", ["scaled, one process", "tied, ddp 2"])
def test_the_export_is_the_model_that_came_in(runs, exports, name):
    """The true vocabulary (300 rows, not 320), Llama 3's RoPE scaling, tied stays tied (the run saved one tensor,
    the export writes the embedding alone), the end-of-text id as bos and eos."""
    tied = name.startswith("tied")
    folder = exports[name]
    config = json.loads((folder / "config.json").read_text())
    came_in = json.loads((runs["checkpoints"]["tied" if tied else "scaled"] / "config.json").read_text())
    assert config["vocab_size"] == VOCAB and config["tie_word_embeddings"] is tied
    assert config["rope_parameters"] == came_in["rope_parameters"] == {**LLAMA3, "rope_theta": 5000.0}
    assert config["bos_token_id"] == config["eos_token_id"] == 256
    with open(folder / "model.safetensors", "rb") as f:
        header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
    assert header["model.embed_tokens.weight"]["shape"] == [VOCAB, 128]
    assert ("lm_head.weight" in header) is not tied
    save = sorted(runs[name][0].glob("step_*"))[-1]
    assert ("lm_head.weight" in json.loads((save / "meta.json").read_text())["tensors"]) is not tied
    assert sorted(p.name for p in folder.iterdir()) == ["config.json", "generation_config.json", "model.safetensors",
                                                        "tokenizer.json", "tokenizer_config.json"]


def test_the_export_carries_the_run_tokenizer(exports):
    """The run's data used the byte tokenizer: transformers' AutoTokenizer of the export splits text into its ids,
    and generation stops at its end-of-text."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(exports["scaled, one process"])
    text = "def f(x):\n    return x  # héllo 日本<|endoftext|>next"
    ids = bytes_tokenizer().encode(text, allowed_special="all")
    assert tokenizer(text)["input_ids"] == ids and tokenizer.decode(ids) == text
    assert tokenizer.eos_token_id == 256
    generation = json.loads((exports["scaled, one process"] / "generation_config.json").read_text())
    assert generation["eos_token_id"] == 256


def test_a_bpe_file_tokenizer_exports_to_the_same_tokens(tmp_path):
    """A .tiktoken BPE (merges learned here) written as tokenizer.json: transformers splits source text, unicode
    and the end-of-text token exactly as tiktoken does."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    enc = file_tokenizer(write_tiktoken(train_bpe((stdlib / "json" / "decoder.py").read_text(), 300),
                                        tmp_path / "bpe.tiktoken"))
    for name, content in export.tokenizer_files(enc, 64).items():
        (tmp_path / name).write_text(json.dumps(content))
    tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path)
    text = (stdlib / "textwrap.py").read_text() + " héllo wörld 日本語 \t\n\n  x<|endoftext|>y"
    ids = enc.encode(text, allowed_special="all")
    assert len(ids) < 0.8 * len(text.encode())  # the merges are used
    assert tokenizer(text)["input_ids"] == ids and tokenizer.decode(ids) == text


def refused_in_two_ranks(rank, world, argv):
    return exit_and_stderr(argv)


def test_a_tied_checkpoint_is_refused_where_it_cannot_stay_tied(runs, tmp_path):
    """--tp, --pp and --dp-mode fsdp hold the embedding and the head apart: one line naming the flag and what works,
    exit 2, before anything is written."""
    tied = str(runs["checkpoints"]["tied"])
    jobs = [(flag, refused_in_two_ranks, (BASE + STEPS + flags + ["--init-from", tied, "--out", str(tmp_path / flag)],))
            for flag, flags in (("--tp", ["--tp", "2"]), ("--pp", ["--pp", "2"]), ("--dp-mode", ["--dp-mode", "fsdp"]))]
    for flag, (code, err) in run_ranks(run_jobs, 2, args=(jobs,), timeout=200)[0].items():
        assert code == 2 and err.count("\n") == 1, (flag, code, err)
        assert err.startswith(f"error: {flag}: ") and "tie_word_embeddings true" in err, err
        assert "trains in one process or with --dp-mode ddp" in err, err
        assert not (tmp_path / flag).exists()


def refused_export(argv, capsys):
    """stderr of export refusing argv: exit status 2, one line."""
    capsys.readouterr()
    assert export.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1, err
    return err


def test_the_export_target_must_be_empty_or_replaced_whole(runs, tmp_path, capsys):
    """A folder holding an older sharded checkpoint: exporting beside it would leave its index, which --init-from
    reads, so it is refused (nothing touched); --replace replaces the folder whole, and what is there is the new
    model alone, which --init-from then starts from."""
    target = tmp_path / "hf"
    transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY)).save_pretrained(target, max_shard_size="200KB")
    before = sorted(p.name for p in target.iterdir())
    assert "model.safetensors.index.json" in before
    run = str(runs["scaled, one process"][0])
    err = refused_export([run, str(target)], capsys)
    assert err.startswith(f"error: {target} is not empty") and "--replace" in err, err
    assert sorted(p.name for p in target.iterdir()) == before
    err = refused_export([run, str(Path(run).parent), "--replace"], capsys)  # would delete the run itself
    assert err == f"error: --replace: {Path(run).parent} holds {run}, which replacing it whole would delete\n"
    assert export.main([run, str(target), "--replace"]) == 0
    assert sorted(p.name for p in target.iterdir()) == ["config.json", "generation_config.json", "model.safetensors",
                                                        "tokenizer.json", "tokenizer_config.json"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]  # no temporary folder left beside it
    again = train.main(BASE + ["--steps", "1", "--init-from", str(target), "--out", str(tmp_path / "again")])
    x, y = first_batch()
    with torch.no_grad():
        logits = transformers.LlamaForCausalLM.from_pretrained(target, dtype=torch.float32).eval()(x).logits
    assert again[0] == pytest.approx(F.cross_entropy(logits.flatten(0, 1), y.flatten()).item(), rel=2e-6)


def test_export_refuses_a_save_whose_model_config_is_incomplete(runs, tmp_path, capsys):
    """A save whose config lacks n_layer would have been exported as a 4-layer model: one line naming the field."""
    save = tmp_path / "save"
    shutil.copytree(sorted(runs["scaled, one process"][0].glob("step_*"))[-1], save)
    meta = json.loads((save / "meta.json").read_text())
    del meta["config"]["model"]["n_layer"]
    (save / "meta.json").write_text(json.dumps(meta))
    capsys.readouterr()
    assert export.main([str(save), str(tmp_path / "hf")]) == 2
    assert capsys.readouterr().err == f"error: {save / 'meta.json'}: model.n_layer is missing\n"
    assert not (tmp_path / "hf").exists()
