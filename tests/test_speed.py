"""Is my speed normal? For a run on a GPU the planner knows, `python -m bench.compare RUN` states the
measured MFU beside the planner's range for the model, layout and GPU, and below it names the largest
measured wait: the loader, exposed collectives, the pipeline's bubble. Here on CPU with a stand-in GPU
name and peak."""
import time

import pytest

import config
import train
from bench import compare
from bench.planner import command
from data import metrics
from data.loader import TokenLoader
from data.metrics import read_metrics
from tests.layouts import BASE

H100 = "NVIDIA H100 80GB HBM3"


def summary(mfu, **shares):
    return {"mfu": mfu, "input_share": 0.0, "comm_wait_share": 0.0, "pp_wait_share": 0.0, **shares}


@pytest.mark.parametrize("mfu,shares,verdict", [
    (0.35, {}, ": within it"),
    (0.45, {}, ": above it"),
    (0.10, {"input_share": 0.40, "comm_wait_share": 0.1}, ": below it; input-bound: the step waited for its batch 40%"),
    (0.10, {"comm_wait_share": 0.25}, ": below it; exposed communication: the step waited in collectives 25%"),
    (0.10, {"pp_wait_share": 0.30, "comm_wait_share": 0.2}, ": below it; pipeline bubble: stages waited for their "
                                                             "neighbours 30%"),
    (0.10, {"comm_wait_share": 0.01}, ": below it, and no wait explains it"),
])
def test_the_verdict_names_the_largest_wait(mfu, shares, verdict):
    line = compare.speed_line(summary(mfu, **shares), [0.30, 0.40])
    assert line.startswith(f"speed: MFU {mfu:.1%}; the planner predicts 30.0%-40.0% for this model, layout and GPU")
    assert verdict in line, line


def test_the_planner_prices_a_gpu_run_and_not_a_cpu_one():
    run = config.resolve(["--model", "small", "--peak-tflops", "989.4", "--device", "cpu", "--dp-mode", "fsdp",
                          "--global-batch", "64"],
                         environ={"WORLD_SIZE": "8", "RANK": "0", "LOCAL_WORLD_SIZE": "8"})
    cfg = train.model_config(run, 50257)
    assert command.expected_mfu(run, cfg, None) is None  # a CPU: nothing to compare with
    low, high = command.expected_mfu(run, cfg, H100)
    assert 0.05 < low < high < 0.8


def test_a_run_slowed_by_its_loader_says_it_is_input_bound(tmp_path, monkeypatch, capsys):
    """The stand-in: an H100 at its own peak (so the CPU's MFU is far below the planner's range) and a
    loader that makes every step wait. The run's summary records what the planner needs."""
    monkeypatch.setattr(metrics, "gpu_name", lambda run: H100)
    get = TokenLoader.get

    def slow(self, step):
        out = get(self, step)
        time.sleep(0.3)
        self.wait_s += 0.3
        return out
    monkeypatch.setattr(TokenLoader, "get", slow)
    metrics_file = tmp_path / "m.jsonl"
    train.main(BASE + ["--steps", "4", "--peak-tflops", "989.4", "--out", str(tmp_path / "r"),
                       "--metrics", str(metrics_file)])
    rows, summaries = read_metrics(metrics_file)
    assert all(r["input_s"] >= 0.3 for r in rows)
    s = summaries[-1]
    assert s["input_share"] > 0.3 and s["gpu"] == H100 and s["resolved"]["world"] == 1
    capsys.readouterr()
    assert compare.main([str(metrics_file)]) == 0
    out = capsys.readouterr().out
    assert "speed: MFU" in out and "below it; input-bound: the step waited for its batch" in out, out
