"""train.py --init-from: a random LlamaForCausalLM saved by transformers loads with logits equal to transformers' in
one process and in fsdp 2, tp 2 and pp 2 (untied fp32 in one file; untied bf16, a vocabulary short of the padding,
sharded), and tied (bf16, 300, sharded) in one process and ddp 2; export -> --init-from -> export is bitwise
identical; a config.json this run disagrees with, a malformed config.json, index or safetensors header is one line
and exit 2, naming the field."""
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
import transformers

import config
import data.hf
import data.saves
import train
from bench.ranks import run_ranks
from data import export
from data.hf import init_from, start_from
from tests.jobs import Failed, run_jobs
from tests.test_save_integrity import exit_of, one_error_line

REPO = Path(__file__).resolve().parent.parent
TINY = dict(hidden_size=128, intermediate_size=384, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4,
            max_position_embeddings=256, rms_norm_eps=1e-6, rope_theta=5000.0)  # theta and eps: not the preset's
FLAGS = ["--model", "tiny", "--device", "cpu", "--dtype", "fp32", "--seq-len", "64", "--global-batch", "4",
         "--micro-batch", "2", "--log-every", "0"]
LAYOUTS = {"one process": [], "ddp 2": [], "fsdp 2": ["--dp-mode", "fsdp"], "tp 2": ["--tp", "2"],
           "pp 2": ["--pp", "2"]}
KINDS = {"untied": (320, False, torch.float32, {}),  # vocab, tied, dtype, save_pretrained's sharding
         "bf16-300-sharded": (300, False, torch.bfloat16, {"max_shard_size": "200KB"}),
         "tied-bf16-300-sharded": (300, True, torch.bfloat16, {"max_shard_size": "200KB"})}


def hf_model(vocab, tied, seed):
    """A random LlamaForCausalLM with weights large enough that attention is far from uniform: a RoPE layout error
    or a swapped head would move the logits well past the tolerance."""
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(vocab_size=vocab, tie_word_embeddings=tied, **TINY))
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1 + 0.1 * torch.randn_like(p) if "norm" in name else 0.15 * torch.randn_like(p))
    return model.eval()


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """{kind: (folder, vocab, fp32 transformers model)} of KINDS."""
    out = {}
    for kind, (vocab, tied, dtype, shard) in KINDS.items():
        folder = tmp_path_factory.mktemp(kind)
        hf_model(vocab, tied, seed=len(out)).to(dtype).save_pretrained(folder, **shard)
        model = transformers.LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32)  # what transformers reads
        out[kind] = (folder, vocab, model.eval())
    assert (out["tied-bf16-300-sharded"][0] / "model.safetensors.index.json").exists()
    return out


def tokens():
    return torch.randint(0, 257, (2, 64), generator=torch.Generator().manual_seed(3))  # the pystdlib data's ids


def loaded_logits(rank, world, folder, layout_flags):
    """This rank's logits of tokens() after --init-from in the layout: the full logits, or under tp its vocabulary
    shard; under pp the last stage's (the first sends it its hidden states), None elsewhere."""
    run = config.resolve(FLAGS + ["--init-from", str(folder)] + layout_flags)
    cfg, weights = init_from(run.init_from, train.model_config(run, 257), run)
    mesh = train.start_distributed(run)
    chunks, wrapper, _ = train.build(cfg, mesh, run)
    start_from(weights, wrapper, None, rank)
    with torch.no_grad():
        if mesh.pp == 1:
            return chunks[0](tokens()).numpy()
        if mesh.coord["pp"] == 0:
            dist.send(chunks[0](tokens()), rank + 1)
            return None
        hidden = torch.empty(2, 64, cfg.d_model)
        dist.recv(hidden, rank - 1)
        return chunks[0](hidden).numpy()


def bytes_read_under_tp2(rank, world, folder):
    """(bytes this rank read from the folder's tensors, the tensors' bytes): --init-from under tp 2."""
    run = config.resolve(FLAGS + ["--init-from", str(folder), "--tp", "2"])
    cfg, weights = init_from(run.init_from, train.model_config(run, 257), run)
    chunks, wrapper, _ = train.build(cfg, train.start_distributed(run), run)
    fill, read = data.saves.Saved._fill, []

    def counted(self, out, *args, **kwargs):
        read.append(out.numel() * out.element_size())
        return fill(self, out, *args, **kwargs)
    data.saves.Saved._fill = counted
    try:
        start_from(weights, wrapper, None, rank)
    finally:
        data.saves.Saved._fill = fill
    return sum(read), sum(p["numel"] for t in weights.tensors.values() for p in t["pieces"]) * 4


def test_under_tp_a_rank_reads_its_rows_not_whole_tensors(checkpoints):
    """A tensor tp splits by rows (q, k, v, gate, up, the embedding and the head) is one stretch of the file per
    rank: read as that byte range. Only the tensors split by columns are read whole, then cut."""
    folder = checkpoints["untied"][0]
    for read, total in run_ranks(bytes_read_under_tp2, 2, args=(folder,), timeout=300):
        assert read < 0.7 * total, (read, total)


def assert_logits_equal(ours, model, vocab, where=""):
    """fp32 tolerance: logits of order 1, summed in another order under tp and fsdp."""
    expected = model(tokens()).logits.detach().numpy()
    assert ours.shape == (2, 64, 320)
    np.testing.assert_allclose(ours[..., :vocab], expected, rtol=1e-5, atol=5e-5, err_msg=where)
    assert not ours[..., vocab:].any()  # padded rows: zero logits


@pytest.mark.parametrize("kind", list(KINDS))
def test_logits_equal_transformers_in_one_process(checkpoints, kind, capsys):
    folder, vocab, model = checkpoints[kind]
    assert_logits_equal(loaded_logits(0, 1, folder, []), model, vocab)
    assert "initialized from" in capsys.readouterr().out


def test_logits_equal_transformers_in_ddp2_fsdp2_tp2_pp2(checkpoints):
    """Untied in every layout; tied in ddp 2, the one that holds a tied model (the others refuse it:
    test_hf_roundtrip.py)."""
    layouts = {"untied": ("fsdp 2", "tp 2", "pp 2"), "bf16-300-sharded": ("fsdp 2", "tp 2", "pp 2"),
               "tied-bf16-300-sharded": ("ddp 2",)}
    jobs = [((kind, layout), loaded_logits, (checkpoints[kind][0], LAYOUTS[layout]))
            for kind in KINDS for layout in layouts[kind]]
    ranks = run_ranks(run_jobs, 2, args=(jobs,), timeout=300)
    for (kind, layout), _, _ in jobs:
        _, vocab, model = checkpoints[kind]
        results = [r[kind, layout] for r in ranks]
        assert not any(isinstance(r, Failed) for r in results), results
        if layout in ("fsdp 2", "ddp 2"):  # each rank computes the whole logits
            np.testing.assert_array_equal(results[0], results[1])
        ours = np.concatenate(results, axis=-1) if layout == "tp 2" else results[1]  # tp: vocab shards; pp: last
        assert_logits_equal(ours, model, vocab, where=f"{kind}, {layout}")


def train_main(rank, world, argv):
    return train.main(argv)


def test_export_then_init_from_then_export_is_bitwise_identical(tmp_path):
    """A trained run exported; a run that starts from that export in fsdp 2 and in tp 2 (one step at an lr of 1e-30
    moves no fp32 weight: Adam's step is lr-sized, far under half an ulp of every weight) saves and exports the
    same bytes."""
    train.main(FLAGS + ["--n-layer", "2", "--steps", "2", "--out", str(tmp_path / "run")])
    assert export.main([str(tmp_path / "run"), str(tmp_path / "first")]) == 0
    again = FLAGS + ["--n-layer", "2", "--steps", "1", "--lr", "1e-30", "--min-lr", "0", "--warmup", "0",
                     "--init-from", str(tmp_path / "first")]
    jobs = [(name, train_main, (again + flags + ["--out", str(tmp_path / name)],))
            for name, flags in (("fsdp", ["--dp-mode", "fsdp"]), ("tp", ["--tp", "2"]))]
    for result in run_ranks(run_jobs, 2, args=(jobs,), timeout=300):
        assert not any(isinstance(r, Failed) for r in result.values()), result
    for name in ("fsdp", "tp"):
        assert export.main([str(tmp_path / name), str(tmp_path / f"{name}-export")]) == 0
        for file in ("config.json", "model.safetensors"):
            assert (tmp_path / f"{name}-export" / file).read_bytes() == (tmp_path / "first" / file).read_bytes()


def refused(argv, capsys):
    with pytest.raises(SystemExit) as e:
        train.main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.startswith("error: ") and err.count("\n") == 1, err
    return err


def edited_copy(folder, tmp_path, edit=None, drop=None, header=None, file="config.json", content=None):
    """A copy of folder: `file` (a JSON file) through edit(json), or replaced by `content`; the last `drop` bytes
    of model.safetensors cut; its header through header(entries) (padded to its old length)."""
    copy = tmp_path / f"copy{len(list(tmp_path.iterdir()))}"
    shutil.copytree(folder, copy)
    if edit:
        value = json.loads((copy / file).read_text())
        edit(value)
        (copy / file).write_text(json.dumps(value))
    if content is not None:
        (copy / file).write_text(json.dumps(content))
    if drop:
        with open(copy / "model.safetensors", "r+b") as f:
            f.truncate(f.seek(0, 2) - drop)
    if header:
        with open(copy / "model.safetensors", "r+b") as f:
            length = int.from_bytes(f.read(8), "little")
            entries = json.loads(f.read(length))
            header(entries)
            raw = json.dumps(entries, separators=(",", ":")).encode()
            assert len(raw) <= length
            f.seek(8)
            f.write(raw + b" " * (length - len(raw)))
    return copy


def same_size_tensors(entries):
    """Two tensors of the header with the same byte size: the first layer's two norms."""
    return [entries[f"model.layers.0.{norm}.weight"] for norm in ("input_layernorm", "post_attention_layernorm")]


def overlap(entries):
    a, b = same_size_tensors(entries)
    b["data_offsets"] = list(a["data_offsets"])  # b's bytes are a's: the old place of b belongs to no tensor


def test_a_config_this_run_disagrees_with_is_one_line_and_exit_2(checkpoints, tmp_path, capsys):
    folder = checkpoints["untied"][0]
    out = tmp_path / "out"
    base = FLAGS + ["--steps", "1", "--out", str(out), "--init-from"]
    for extra, needle in [(["--n-layer", "3"], "num_hidden_layers is 4, this run has --n-layer 3"),
                          (["--d-model", "256"], "hidden_size is 128, this run has --d-model 256"),
                          (["--n-kv-head", "8"], "num_key_value_heads is 4, this run has --n-kv-head 8"),
                          (["--ffn-dim", "512"], "intermediate_size is 384, this run has --ffn-dim 512"),
                          (["--vocab-size", "1000"], "vocab_size is 320, fewer than the 1000 ids of this run")]:
        assert needle in refused(base + [str(folder)] + extra, capsys)
    for edit, needle in [(lambda c: c.update(model_type="mistral"), "model_type is 'mistral'"),
                         (lambda c: c.update(rope_parameters={"rope_type": "yarn", "rope_theta": 5e5}),
                          "rope_parameters.rope_type is 'yarn'"),
                         (lambda c: c.update(attention_bias=True), "attention_bias is True"),
                         (lambda c: c.update(head_dim=32), "head_dim is 32"),
                         (lambda c: c.update(tie_word_embeddings=False, vocab_size=128),
                          "vocab_size is 128, fewer than the 257 ids of this run's data (or --vocab-size): prepare")]:
        assert needle in refused(base + [str(edited_copy(folder, tmp_path, edit))], capsys)  # no flag suggested
    assert "is truncated or malformed" in refused(base + [str(edited_copy(folder, tmp_path, drop=4))], capsys)
    assert "is not a folder" in refused(base + [str(tmp_path / "nowhere")], capsys)
    assert not out.exists()  # refused before anything is written


def llama3(**changes):
    """A config.json edit: Llama 3's rope scaling, with `changes` to its numbers."""
    scaling = {"rope_type": "llama3", "rope_theta": 5000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 16, **changes}
    return lambda c: c.update(rope_parameters=scaling)


def test_a_malformed_checkpoint_is_one_line_and_exit_2_naming_the_field(checkpoints, tmp_path, capsys):
    """Wrong JSON shapes and types, numbers out of range (they would train into a non-finite loss), a safetensors
    header whose tensors share bytes, a folder that holds two checkpoints: refused before anything is built."""
    single, sharded = checkpoints["untied"][0], checkpoints["bf16-300-sharded"][0]
    out = tmp_path / "out"
    base = FLAGS + ["--steps", "1", "--out", str(out), "--init-from"]
    nan = float("nan")
    for folder, kwargs, needle in [
            (single, dict(content=[TINY]), "config.json is not a JSON object (it holds a list)"),
            (single, dict(edit=lambda c: (c.pop("rope_parameters"), c.update(rope_theta="abc"))),
             "config.json: rope_theta is 'abc'; it must be a finite positive number"),
            (single, dict(edit=lambda c: c["rope_parameters"].update(rope_theta=-5000.0)),
             "config.json: rope_parameters.rope_theta is -5000.0; it must be a finite positive number"),
            (single, dict(edit=lambda c: c["rope_parameters"].update(rope_theta=nan)),
             "config.json: rope_parameters.rope_theta is nan"),
            (single, dict(edit=lambda c: c.update(rope_theta=6000.0)),
             "config.json: rope_theta is 6000.0, but rope_parameters gives 5000.0"),
            (single, dict(edit=lambda c: c.update(rms_norm_eps=-1e-6)), "config.json: rms_norm_eps is -1e-06"),
            (single, dict(edit=lambda c: c.update(num_hidden_layers="4")), "num_hidden_layers is '4'; it must be an"),
            (single, dict(edit=llama3(factor=nan)), "rope_parameters.factor must be a finite positive number, got nan"),
            (single, dict(edit=llama3(low_freq_factor=-1.0)), "rope_parameters.low_freq_factor must be a finite"),
            (single, dict(edit=llama3(high_freq_factor=1.0)), "high_freq_factor 1.0 must be above low_freq_factor"),
            (single, dict(edit=llama3(original_max_position_embeddings=0.5)),
             "rope_parameters.original_max_position_embeddings must be a finite positive integer, got 0.5"),
            (single, dict(edit=llama3(partial_rotary_factor=0.5)), "rope_parameters.partial_rotary_factor is 0.5"),
            (single, dict(edit=lambda c: c.update(tie_word_embeddings="no")), "tie_word_embeddings is 'no'"),
            (single, dict(header=overlap), "model.safetensors: tensors model.layers.0.input_layernorm.weight and "
                                           "model.layers.0.post_attention_layernorm.weight overlap"),
            (sharded, dict(edit=lambda index: index.update(weight_map=list(index["weight_map"])),
                           file="model.safetensors.index.json"), "weight_map is ['"),
            (sharded, dict(edit=lambda index: index.update(weight_map={"model.norm.weight": "../x"}),
                           file="model.safetensors.index.json"), "puts model.norm.weight in '../x', not a file")]:
        assert needle in refused(base + [str(edited_copy(folder, tmp_path, **kwargs))], capsys), needle
    both = edited_copy(sharded, tmp_path)
    shutil.copy(single / "model.safetensors", both)
    assert "holds both model.safetensors and model.safetensors.index.json" in refused(base + [str(both)], capsys)
    assert not out.exists()


@pytest.mark.parametrize("name", ["config.json", "model.safetensors.index.json", "model-00001-of-00002.safetensors"])
def test_a_fifo_in_the_checkpoint_is_one_line_not_a_hang(checkpoints, tmp_path, name):
    """Was: --init-from waited forever on a FIFO where config.json (or a file it reads) should be. A child process
    with a timeout, so that a hang fails the test instead of the suite."""
    folder = tmp_path / "hf"
    shutil.copytree(checkpoints["bf16-300-sharded"][0], folder)
    names = sorted(p.name for p in folder.glob("model-*.safetensors"))
    name = names[0] if name.startswith("model-") else name
    (folder / name).unlink()
    os.mkfifo(folder / name)
    argv = FLAGS + ["--steps", "1", "--vocab-size", "300", "--out", str(tmp_path / "out"), "--init-from", str(folder)]
    try:
        out = subprocess.run([sys.executable, "train.py", *argv], cwd=REPO, capture_output=True, text=True, timeout=120)
    except subprocess.TimeoutExpired:
        pytest.fail(f"--init-from waited on a FIFO where {name} should be")
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert out.returncode == 2 and "Traceback" not in out.stderr and len(lines) == 1, out.stderr
    assert lines[0] == f"error: --init-from: cannot read {folder / name}: a FIFO, not a regular file", lines
    assert not (tmp_path / "out").exists()


def test_a_config_asking_for_a_million_layers_is_refused_before_any_is_built(checkpoints, tmp_path, monkeypatch):
    """Was: config.json's num_hidden_layers 1,000,000, with the --n-layer its refusal advised, built the model's
    shapes before any check and grew until killed. The run's checks come first: one line, exit 2."""
    folder = tmp_path / "huge"
    shutil.copytree(checkpoints["untied"][0], folder)
    hf = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**hf, "num_hidden_layers": 1_000_000}))
    monkeypatch.setattr(data.hf, "model_shapes", lambda cfg: pytest.fail("the model was listed before the checks"))
    code, err = exit_of(train.main, FLAGS + ["--init-from", str(folder), "--n-layer", "1000000", "--vocab-size",
                                             "320", "--out", str(tmp_path / "run")])
    assert code == 2 and "a step needs about" in one_error_line(err), err


def test_the_advice_for_a_checkpoints_shape_is_one_the_next_run_takes(checkpoints, tmp_path, capsys):
    """Was: the first field that differed was answered with its flag alone, and num_key_value_heads 3 beside 8
    heads with `--n-kv-head 3`, which the next run refused (8 heads do not split into 3 groups)."""
    folder = checkpoints["untied"][0]
    base = FLAGS + ["--steps", "1", "--out", str(tmp_path / "out"), "--init-from"]
    two = edited_copy(folder, tmp_path, lambda c: c.update(num_hidden_layers=2, intermediate_size=256))
    assert "num_hidden_layers is 2, this run has --n-layer 4 (pass --n-layer 2 --ffn-dim 256)" in refused(
        base + [str(two)], capsys)
    three = edited_copy(folder, tmp_path, lambda c: c.update(num_key_value_heads=3))
    err = refused(base + [str(three)], capsys)
    assert "num_key_value_heads is 3, this run has --n-kv-head 4 (and no run can take the checkpoint's shape: " \
           "n_head 8 is not divisible by n_kv_head 3)" in err and "pass" not in err, err


def test_init_from_beside_a_resume_says_it_is_not_read(checkpoints, tmp_path, capsys):
    """Was: silently ignored; a resumed run takes its weights from its save, and now says so."""
    run = FLAGS + ["--out", str(tmp_path / "run"), "--init-from", str(checkpoints["untied"][0])]
    train.main(run + ["--steps", "2", "--save-every", "1"])
    assert "note: --init-from" not in capsys.readouterr().out
    train.main(run + ["--steps", "3", "--resume"])
    out = capsys.readouterr().out
    assert f"note: --init-from {checkpoints['untied'][0]} is not read: a resumed run takes its weights from its " \
           "save" in out, out
