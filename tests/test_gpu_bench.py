"""bench/gpu --smoke on CPU: every part (fp8's and the planner's factors included) runs and writes its section of
gpu.md with plausible numbers, and only into --out; the GPU run's order and budget: the rows that matter most first,
every training run a child stopped at its deadline with the steps it finished. So the one-command GPU benchmark cannot
rot between the rare runs on a GPU machine."""
import json
import sys

import pytest

from bench import common
from bench.gpu import checks as gpu_checks
from bench.gpu import measure as gpu
from bench.gpu import runs as gpu_runs
from bench.planner import plan
from bench.planner.factors import MEASURED, load

SECTIONS = ["1. Our training step", "2. Hugging Face LlamaForCausalLM", "3. Attention kernels that actually ran",
            "4. Ring attention vs SDPA", "5. FP8 block matmuls", "6. This code's efficiency factors for the planner"]


def tables(text):
    """{section title: [{column: cell}]} of each "## title" section's markdown table."""
    found, title = {}, None
    for line in text.splitlines():
        if line.startswith("## "):
            title = line[3:]
            found[title] = []
        elif title and line.startswith("|"):
            found[title].append([c.strip() for c in line.strip().strip("|").split("|")])
    return {t: [dict(zip(rows[0], row)) for row in rows[2:]] for t, rows in found.items()}


def section(found, prefix):
    (rows,) = [rows for title, rows in found.items() if title.startswith(prefix)]
    return rows


CALLS = []  # the command of each child process the smoke run starts


def results_folder():
    """{file: (size, mtime)} of bench/results: what a run that writes only into --out leaves as it was."""
    return {f: (f.stat().st_size, f.stat().st_mtime_ns) for f in common.RESULTS.rglob("*") if f.is_file()}


@pytest.fixture(scope="module")
def smoke_run(tmp_path_factory):
    out, before = tmp_path_factory.mktemp("gpu_smoke"), results_folder()
    with pytest.MonkeyPatch.context() as patch:
        child = gpu_runs.child
        patch.setattr(gpu_runs, "child", lambda cmd, *a: (CALLS.append(cmd), child(cmd, *a))[1])
        assert gpu.main(["--smoke", "--out", str(out)]) == 0
    return out, before, results_folder()


@pytest.fixture(scope="module")
def smoke(smoke_run):
    return (smoke_run[0] / "gpu.md").read_text()


def test_every_section_with_its_command_and_header(smoke):
    found = tables(smoke)
    assert [next(t for t in found if t.startswith(s)) for s in SECTIONS] == sorted(found)
    assert smoke.count("Command: `python -m bench.gpu --smoke`") == 6
    assert "Date: 20" in smoke and "Device: CPU" in smoke and "torch: " in smoke
    assert all(found[t] for t in found), "a section without table rows"


def test_our_training_step_row(smoke):
    (row,) = section(tables(smoke), "1.")
    assert (row["model"], row["compile"], row["seq"], row["status"]) == ("tiny", "eager", "64", "ok")
    # MFU over the CPU's best matmul rate, which the bench hands train.py as --peak-tflops (a CPU has no peak of its
    # own): on shared cores that can land below the step's own rate, so only its sign is checked here
    assert float(row["tokens/s"]) > 0 and float(row["MFU %"]) > 0
    assert float(row["peak alloc GB"]) > 0  # the tensors' peak on CPU


def test_fp8_row_runs_the_same_step_in_fp8(smoke):
    (row,) = section(tables(smoke), "5.")
    assert (row["model"], row["compile"], row["seq"], row["status"]) == ("tiny", "eager", "64", "ok")
    (ours,) = section(tables(smoke), "1.")
    assert float(row["fp8 tokens/s"]) > 0 and row["fp32 tokens/s"] == ours["tokens/s"] and float(row["fp8 / fp32"]) > 0
    runs = [cmd for cmd in CALLS if cmd[1].endswith("train.py")]
    assert [cmd[cmd.index("--dtype") + 1] for cmd in runs] == ["fp32", "fp8"]


def test_hugging_face_row(smoke):
    (row,) = section(tables(smoke), "2.")
    if gpu.transformers is None:
        assert row["HF tokens/s"] == gpu.NO_HF
        return
    assert row["status"] == "ok" and row["HF attention"] == "sdpa"
    assert float(row["HF tokens/s"]) > 0 and float(row["ours / HF"]) > 0


def test_attention_kernels_are_named_and_classified(smoke):
    rows = section(tables(smoke), "3.")
    paths = {r["attention path"] for r in rows}
    assert "model.causal_attention" in paths and any(p.startswith("ring attention, cp = 1") for p in paths)
    for path in paths:
        classes = {r["class"] for r in rows if r["attention path"] == path}
        assert classes & {"flash", "efficient", "cudnn", "math"}, f"{path}: no attention kernel found"
        assert all(r["kernel"].startswith("aten::") for r in rows if r["attention path"] == path
                   and r["class"] != "other")  # CPU: the profiler's aten ops


def test_ring_attention_matches_sdpa_at_bf16_tolerance(smoke):
    rows = section(tables(smoke), "4.")
    assert len(rows) == 6  # RingAttention and the causal and full block, with flash_cpu and math
    assert "math" in {r["kernel"] for r in rows} <= {"flash_cpu", "math"}
    for r in rows:
        assert r["bf16 tolerance"] == "pass", r
        assert all(0 <= float(r[f"max abs d {t}"]) < 0.1 for t in ("out", "dq", "dk", "dv"))


def test_without_transformers_the_rest_runs_and_answers_l22(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(gpu, "transformers", None)
    monkeypatch.setattr(gpu_checks, "kernel_part", lambda r: None)
    monkeypatch.setattr(gpu_checks, "ring_part", lambda r: None)
    monkeypatch.setattr(gpu, "factors_part", lambda r: None)
    assert gpu.main(["--smoke", "--out", str(tmp_path)]) == 0
    (row,) = section(tables((tmp_path / "gpu.md").read_text()), "2.")
    assert row["HF tokens/s"] == gpu.NO_HF and row["ours / HF"] == "-" and float(row["ours tokens/s"]) > 0
    assert any(line.startswith("ANSWER L22: MFU tiny eager") for line in capsys.readouterr().out.splitlines())


def test_without_a_gpu_it_says_so_and_exits_0(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(common, "has_cuda", lambda: False)
    assert gpu.main(["--out", str(tmp_path)]) == 0
    assert "needs a CUDA GPU" in capsys.readouterr().out and not (tmp_path / "gpu.md").exists()


@pytest.mark.parametrize("flags", [["--steps", "-3"], ["--steps", "0"], ["--budget-s", "-5"], ["--budget-s", "nan"]])
def test_bad_flags_are_one_line_and_exit_2_before_anything_runs(tmp_path, capsys, flags):
    assert gpu.main(["--smoke", "--out", str(tmp_path), *flags]) == 2
    out, err = capsys.readouterr()
    assert err.startswith(f"error: {flags[0]}: ") and err.count("\n") == 1 and out == "", (out, err)
    assert not (tmp_path / "gpu.md").exists()


# ---------------------------------------------------------------- where it writes, the planner's factors

def test_it_writes_only_into_out(smoke_run):
    out, before, after = smoke_run
    assert sorted(f.name for f in out.iterdir()) == ["gpu.md", "plan_factors.json"]
    assert before == after  # bench/results as it was


def test_the_factors_it_measures_load_into_the_planner(smoke_run, capsys):
    path = smoke_run[0] / "plan_factors.json"
    got = json.loads(path.read_text())
    assert {"matmul_tflops", "attention_tflops", "memory_gbs", "launch_us"} <= set(got["rates"])
    factors, names = load(path)
    assert {"mm", "attn", "launch_us"} <= set(names) <= set(MEASURED)
    assert factors.mm == got["factors"]["mm"] > 0
    assert plan.main(["--code", "ours", "--factors", str(path), "--gpus", "8", "--layout", "dp=8,dp_mode=fsdp"]) == 0
    assert "efficiency factors: measured (" in capsys.readouterr().out


# ---------------------------------------------------------------- order and budget of the GPU run

def test_the_rows_that_matter_most_run_first():
    """small and 1b, bf16, compiled: ours, then Hugging Face's; then the planner's factors; the rest after."""
    assert [p for p, _, _ in gpu.GPU_RUNS] == ["small", "1b"]
    assert gpu.schedule(smoke=False)[:3] == [("ours", True), ("hf", True), ("factors", None)]
    assert {step for step in gpu.schedule(smoke=False)[3:]} == {("ours", False), ("hf", False), ("fp8", True),
                                                                ("kernels", None), ("ring", None)}
    assert [part for part, _ in gpu.schedule(smoke=True)] == ["ours", "hf", "factors", "fp8", "kernels", "ring"]


def test_the_default_budget_leaves_a_10_minute_command_its_margin():
    """Runs are stopped at the budget; what may follow it (the report, an in-process part started with
    MIN_START_S left) and the start-up fit in the 2 minutes left of 10."""
    assert gpu.BUDGET_S + max(gpu.MIN_START_S.values()) <= 600 - 60 and gpu.BUDGET_S <= 480
    assert max(gpu.RUN_CAP_S.values()) < gpu.BUDGET_S / 3  # one run cannot take the others' turn


def test_a_run_past_its_deadline_is_stopped(tmp_path):
    forever = [sys.executable, "-c", "import time; print('started', flush=True); time.sleep(600)"]
    assert gpu_runs.child(forever, 0.5, tmp_path / "log") == "stopped at the budget"
    assert "started" in (tmp_path / "log").read_text()
    failing = [sys.executable, "-c", "raise SystemExit('torch.OutOfMemoryError: CUDA out of memory')"]
    assert gpu_runs.child(failing, 60, tmp_path / "oom") == "OOM"


def test_a_stopped_run_keeps_the_steps_it_finished(tmp_path, monkeypatch):
    def stopped(cmd, timeout_s, log):  # train.py wrote 4 --metrics rows, then the deadline came
        rows = [{"step": i, "tok_s": 100.0 * (i + 1), "mfu": 0.1, "tflops": 1.0, "mem_gb": 2.0,
                 "mem_reserved_gb": 3.0} for i in range(4)]
        (tmp_path / "m.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        return "stopped at the budget"
    monkeypatch.setattr(gpu_runs, "child", stopped)
    monkeypatch.setattr(gpu_runs, "lines", lambda path: [json.loads(x) for x in (tmp_path / "m.jsonl").read_text()
                                                    .splitlines()])
    r = gpu.Run(True, 30, 480.0, tmp_path, "python -m bench.gpu")
    got, status = gpu_runs.run_ours(r, tmp_path, "tiny", {"seq_len": 64}, 4, False, "fp32")
    assert status == "stopped at the budget after 4 steps" and got["tok_s"] == 300.0  # the median of steps 2-4


def test_with_no_budget_left_every_run_is_stopped_and_gpu_md_still_written(tmp_path, monkeypatch):
    monkeypatch.setattr(gpu_checks, "kernel_part", lambda r: None)
    monkeypatch.setattr(gpu_checks, "ring_part", lambda r: None)
    monkeypatch.setattr(gpu, "factors_part", lambda r: None)
    assert gpu.main(["--smoke", "--out", str(tmp_path), "--budget-s", "0"]) == 0
    found = tables((tmp_path / "gpu.md").read_text())
    statuses = [row["status"] for title in found for row in found[title] if title[0] in "125"]
    assert statuses and all(s == "stopped at the budget" or s == gpu.NO_HF for s in statuses), statuses
