"""make gpt2: the speedrun's recipe as the Makefile runs it, and its mechanics on CPU: the wsd
schedule, the fixed validation slice, the time-to-target line. The GPU run itself is not measured
here (README: the planner's prediction, labelled so)."""
import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

import config
import train
from data.loader import DataError, TokenLoader, write_shard
from data.metrics import read_metrics

REPO = Path(__file__).resolve().parent.parent


def recipe():
    """The GPT2 flags of the Makefile, as a list."""
    text = (REPO / "Makefile").read_text()
    block = re.search(r"^GPT2\s*:=(.*?)(?<!\\)\n", text, re.S | re.M).group(1)
    return block.replace("\\\n", " ").split()


def with_values(flags, **values):
    """flags with some values replaced (--name value pairs; a flag with no value is kept as it is)."""
    out, i = [], 0
    while i < len(flags):
        name = flags[i][2:].replace("-", "_")
        takes_value = i + 1 < len(flags) and not flags[i + 1].startswith("--")
        if name in values:
            out += [flags[i], str(values.pop(name))] if takes_value else []
        else:
            out += flags[i:i + 1 + takes_value]
        i += 1 + takes_value
    return out + [f for k, v in values.items() for f in (f"--{k.replace('_', '-')}", str(v))]


def test_the_recipe_is_the_speedruns():
    run = config.resolve(recipe() + ["--device", "cpu", "--no-compile"], environ={"WORLD_SIZE": "8", "RANK": "0"})
    tokens = run.global_batch * train.model_config(run, 50257).seq_len
    assert run.model == "small" and tokens == 2 ** 19  # 512 sequences of 1,024 GPT-2 tokens
    assert (run.lr, run.warmup, run.schedule, run.warmdown, run.min_lr) == (0.0018, 250, "wsd", 2000, 0)
    assert run.steps * tokens == pytest.approx(5.0e9, rel=0.001)
    assert run.eval_tokens == 10_485_760 and run.eval_batches == 20 and run.target_loss == 3.28
    assert run.accum_steps == 2  # 32 sequences a micro-batch on each of 8 GPUs


def test_make_gpt2_needs_gpus(tmp_path):
    if shutil.which("nvidia-smi") and subprocess.run(["nvidia-smi", "-L"], capture_output=True).returncode == 0:
        pytest.skip("a GPU is visible")
    done = subprocess.run(["make", "-s", "gpt2", "VENV=" + str(REPO / ".venv")], cwd=REPO, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode != 0 and "needs the GPUs of a node" in done.stderr


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    folder = tmp_path_factory.mktemp("data")
    rng = np.random.default_rng(0)
    (folder / "meta.json").write_text('{"tokenizer": "bytes", "vocab_size": 257}')
    write_shard(folder / "d_train_000000.bin", rng.integers(0, 257, 20_000))
    write_shard(folder / "d_val_000000.bin", np.arange(5_000) % 257)
    return folder


def test_the_fixed_slice_is_the_first_tokens_in_order_split_over_the_ranks(shards):
    loaders = [TokenLoader(shards, "val", 16, 4, seed=1, dp_rank=r, dp_size=2, prefetch=False,
                           fixed_tokens=128) for r in range(2)]
    tokens = np.arange(5_000) % 257
    for step in range(2):  # 128 tokens = 2 batches of 4 windows of 16
        rows = np.concatenate([loader._windows(step, loader.rows) for loader in loaders])
        expected = np.stack([tokens[j * 16:j * 16 + 17] for j in range(step * 4, step * 4 + 4)])
        assert (rows == expected).all()
        x, y = loaders[0].get(step)
        assert (x.numpy() == expected[:2, :-1]).all() and (y.numpy() == expected[:2, 1:]).all()
    with pytest.raises(DataError, match="--eval-tokens: 5,000 tokens"):
        TokenLoader(shards, "val", 16, 4, seed=1, prefetch=False, fixed_tokens=5_000)


def test_bad_eval_tokens_are_one_line():
    with pytest.raises(config.UsageError, match="--eval-tokens: 1,000 is not a multiple of global-batch x seq-len"):
        config.resolve(["--eval-every", "2", "--eval-tokens", "1000", "--device", "cpu"], environ={})
    with pytest.raises(config.UsageError, match="--eval-batches: has no effect without random windows"):
        config.resolve(["--eval-every", "2", "--eval-tokens", "8192", "--eval-batches", "2", "--device", "cpu"],
                       environ={})


def test_the_recipe_runs_scaled_down_on_cpu(shards, tmp_path, capsys):
    """The Makefile's flags with the sizes of a CPU: the schedule per step, an evaluation on the same
    slice every time, and the time-to-target line."""
    metrics = tmp_path / "m.jsonl"
    flags = with_values(recipe(), model="tiny", dtype="fp32", steps=12, global_batch=4, micro_batch=2,
                        warmup=2, warmdown=4, eval_every=4, eval_tokens=4 * 64 * 2, target_loss=100,
                        log_every=0, save_every=0)
    flags = [f for f in flags if f != "--compile"]
    train.main(flags + ["--seq-len", "64", "--device", "cpu", "--data", str(shards), "--out", str(tmp_path / "r"),
                        "--metrics", str(metrics)])
    rows, summaries = read_metrics(metrics)
    assert [r["lr"] for r in rows] == pytest.approx([train.lr_at(s, 0.0018, 0, 2, 12, 4) for s in range(12)])
    assert [r["step"] for r in rows if "val_loss" in r] == [4, 8, 12]
    assert summaries[-1]["target"]["step"] == 4 and summaries[-1]["target"]["reached"]
    assert "target: val" in capsys.readouterr().out
