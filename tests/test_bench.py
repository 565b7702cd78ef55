"""Smoke tests of the lab bench: each script runs in --quick mode and writes its tables; run_all.py
runs a registry, reports what runs over its budget (failing only on a crash or a hang), skips GPU-only
scripts on CPU and indexes L1-L28. No timings are asserted (numbers belong to the bench, not to tests)."""
import json
import os

import pytest
import torch

import model
from bench import common, run_all
from bench.labs import collective_bandwidth as collectives
from bench.labs import loader_stall, mfu_sweep, pp_bubble, pp_draw, precision, prepare_speed
from bench.vs_torch import measure as vs_torch


def table_rows(path):
    """The data rows of the first markdown table in a result file, as lists of cells."""
    lines = [line for line in path.read_text().splitlines() if line.startswith("|")]
    return [[c.strip() for c in line.strip("|").split("|")] for line in lines[2:]]


def test_result_file_has_command_date_hardware(tmp_path):
    path = common.write_result(tmp_path, "t", "a title", ["a", "b"], [[1, 2.5]], ["a note"], command="python x.py")
    text = path.read_text()
    assert "Command: `python x.py`" in text and "Date: 20" in text and "Hardware: " in text
    assert table_rows(path) == [["1", "2.5"]] and "- a note" in text
    assert common.command_line(["--quick", "--out", "/x", "--steps", "3"]).endswith(" --quick --steps 3")


def test_precision_tables(tmp_path, capsys):
    precision.main(["--quick", "--out", str(tmp_path)])
    dtypes = {row[0]: row[1:] for row in table_rows(tmp_path / "L1_dtypes.md")}  # fp32, bf16, fp16, fp8
    assert dtypes["parameters (master weights)"] == ["float32"] * 4
    assert dtypes["q_proj output (Linear activation)"] == ["float32", "bfloat16", "float16", "bfloat16"]
    assert dtypes["block matmul operands, forward (x, W of layers.0 q_proj)"] == [
        "float32 x float32", "bfloat16 x bfloat16", "float16 x float16", "float8_e4m3fn x float8_e4m3fn"]
    assert dtypes["block matmul operands, backward (dY, x of layers.0's last)"][1:] == [
        "bfloat16 x bfloat16", "float16 x float16", "float8_e5m2 x float8_e4m3fn"]
    assert dtypes["AdamW exp_avg"] == ["float32"] * 4 and dtypes["parameter gradients"] == ["float32"] * 4
    assert dtypes["loss scale (optim.LossScaler)"] == ["1", "1", "65536", "1"]
    assert all(cell.startswith("fp32") for cell in dtypes["matmul accumulation (measured)"])
    assert len(table_rows(tmp_path / "L2_autocast_throughput.md")) == 4
    fp8_rows = table_rows(tmp_path / "fp8_vs_bf16.md")
    assert [r[0] for r in fp8_rows[:2]] == ["bf16", "fp8"] and fp8_rows[2][-1].startswith("skipped: needs a CUDA")
    assert len(table_rows(tmp_path / "L3_matmul_alignment.md")) == 2 * 3  # fp32, bf16 x 255, 256, 264
    zeroed = {(r[0], r[2], r[3]): float(r[4].rstrip("%")) for r in table_rows(tmp_path / "L4_fp16_underflow.md")}
    assert zeroed[("4096", "fp16", "1")] > 1.0  # underflow without scaling...
    assert zeroed[("4096", "fp16", "65536")] < 0.1 and zeroed[("4096", "bf16", "1")] < 0.1  # ...fixed
    answers = [line for line in capsys.readouterr().out.splitlines() if line.startswith("ANSWER ")]
    assert [a.split(":")[0] for a in answers] == ["ANSWER L1", "ANSWER L2", "ANSWER L3", "ANSWER L4"]
    assert "matmul accumulation fp32" in answers[0]


def test_loader_stall_table(tmp_path):
    loader_stall.main(["--quick", "--out", str(tmp_path)])
    rows = table_rows(tmp_path / "L11_loader_stall.md")
    assert [r[0] for r in rows] == ["off", "on"] and all(r[5].endswith("%") for r in rows)


def test_collective_groups_and_bus_factors():
    assert collectives.partitions(4, 2) == {"intra-node": [[0, 1], [2, 3]], "inter-node": [[0, 2], [1, 3]]}
    assert collectives.partitions(8, 8) == {"intra-node": [list(range(8))]}
    assert collectives.partitions(4, 1) == {"inter-node": [[0, 1, 2, 3]]}
    n = 8
    assert collectives.BUS_FACTOR["all_reduce"](n) == 2 * 7 / 8 and collectives.BUS_FACTOR["all_gather"](n) == 7 / 8
    assert collectives.BUS_FACTOR["send_recv"](n) == 1.0


def test_collectives_table(tmp_path):
    collectives.main(["--quick", "--out", str(tmp_path), "--target-s", "0.01"])
    rows = table_rows(tmp_path / "L12_collectives.md")
    groups = ("intra-node", "inter-node")
    assert {(r[0], r[2]) for r in rows} == {(g, op) for g in groups for op in collectives.BUS_FACTOR}
    assert len(rows) == 2 * 5 * 2 and all(float(r[7]) > 0 for r in rows)
    assert "LOOPBACK ONLY" in (tmp_path / "L12_collectives.md").read_text()
    assert len(table_rows(tmp_path / "L12_collectives_peak.md")) == 5


def test_flops_per_step_table(tmp_path):
    mfu_sweep.main(["--flops-only", "--out", str(tmp_path)])
    rows = {r[0]: r for r in table_rows(tmp_path / "L21_flops_per_step.md")}
    assert set(model.PRESETS) <= set(rows)
    cfg = mfu_sweep.config_of("llama3-405b")
    assert float(rows["llama3-405b"][7]) == pytest.approx(model.flops_per_token(cfg) / 1e9, rel=1e-3)
    assert float(rows["llama3-405b"][10]) == pytest.approx(model.flops_per_token(cfg) * 2 ** 24, rel=1e-3)


def test_metrics_summary_skips_the_first_step(tmp_path):
    path = tmp_path / "m.jsonl"
    rows = [dict(step=1, mfu=0.01, hfu=0.01, tok_s=1.0, tflops=1.0, comm_gb=0.0, dt_s=9.0, mem_gb=1.0)]
    rows += [dict(step=s, mfu=0.3, hfu=0.4, tok_s=100.0, tflops=2.0, comm_gb=0.5, dt_s=0.1, mem_gb=1.0 + s)
             for s in (2, 3, 4)]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n" + json.dumps({"val_loss": 3.0}) + "\n")
    s = mfu_sweep.summarize(path)
    assert (s["mfu"], s["hfu"], s["tok_s"], s["dt_s"], s["mem_gb"], s["steps"]) == (0.3, 0.4, 100.0, 0.1, 5.0, 3)


def test_mfu_sweep_runs_train_py(tmp_path):
    mfu_sweep.main(["--quick", "--out", str(tmp_path)])
    (row,) = table_rows(tmp_path / "L22_L24_mfu_sweep.md")
    assert row[:3] == ["ddp 1", "1", "2"] and row[3].endswith("%") and row[5] == "1.000"  # no recompute: HFU = MFU


def test_pp_bubble_measures_each_schedule_side_by_side(tmp_path):
    pp_bubble.main(["--quick", "--micro-batches", "4", "--schedules", "1f1b,zb1,zbv", "--out", str(tmp_path)])
    rows = table_rows(tmp_path / "L26_pp_bubble.md")
    assert [(r[0], r[1], r[2]) for r in rows] == [("4", "1f1b", "0.571"), ("4", "zb1", "0.800"), ("4", "zbv", "0.828")]
    assert rows[0][9] == "4 3 2 1" and rows[1][9] == "4 4 4 4"  # activation sets alive per stage


def test_default_layouts_cover_every_axis():
    assert [n for n, _, _ in mfu_sweep.default_layouts(1)] == ["ddp 1", "ddp 1 + ckpt full"]
    layouts = mfu_sweep.default_layouts(2)
    assert ("tp 2", 2, ["--tp", "2"]) in layouts and ("ddp 1 + ckpt full", 1, ["--ckpt", "full"]) in layouts
    assert {n for n, _, _ in layouts} >= {"ddp 2", "fsdp 2", "tp 2", "pp 2", "cp 2"}
    assert mfu_sweep.parse_layout("tp2=2:--tp 2 --sp") == ("tp2", 2, ["--tp", "2", "--sp"])


WRITE_TABLE = ("import pathlib, sys, time\nout = pathlib.Path(sys.argv[sys.argv.index('--out') + 1])\n"
               "time.sleep({before})\n(out / '{name}.md').write_text('| a |\\n|---|\\n| 1 |\\n')\n"
               "time.sleep({after})\n")


NAMED_TABLE = ("import pathlib, sys\nout = pathlib.Path(sys.argv[sys.argv.index('--out') + 1])\n"
               "(out / (sys.argv[1] + '.md')).write_text('| a |\\n|---|\\n| 1 |\\n')\n")  # named by its argument


def fake_modules(tmp_path, monkeypatch, **scripts):
    """Each script a module of its own in tmp_path (runnable as `python -m run_all_NAME`, found by the registry)."""
    for name, text in scripts.items():
        (tmp_path / f"run_all_{name}.py").write_text(text)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    monkeypatch.setattr(run_all, "BUDGET_FACTOR", 1)  # a fake's seconds are its budget
    monkeypatch.setattr(run_all, "MIN_BUDGET_S", 0)


def fake_registry(tmp_path, monkeypatch):
    fake_modules(tmp_path, monkeypatch, ok="print('ANSWER L3: fast enough')\nprint('ANSWER L12: 1 GB/s')\n",
                 slow="import time\nprint('ANSWER L4: never', flush=True)\ntime.sleep(60)\n")
    return [run_all.Script("run_all_ok", ["L3", "L12"], 60), run_all.Script("run_all_slow", ["L4"], 2),
            run_all.Script("run_all_absent", ["L26"], 10),
            run_all.Script("run_all_ok", ["L20"], 60, gpu_only=True, name="gpu"),
            run_all.Script("run_all_ok", ["L15"], 60, net_admin=True, name="cluster")]


def test_run_all_runs_stops_skips_and_indexes(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(run_all, "REGISTRY", fake_registry(tmp_path, monkeypatch))
    monkeypatch.setattr(common, "has_cuda", lambda: False)
    monkeypatch.setattr(run_all, "can_admin_net", lambda: False)
    results = tmp_path / "results"
    assert run_all.main(["--results", str(results)]) == 0  # the slow one printed its answer: over budget, no failure
    out = capsys.readouterr().out
    assert "run_all: 2 scripts, about 62 s on a quiet 2-core machine" in out.splitlines()[0]
    assert "[1/5] run_all_ok: started, python -m run_all_ok (usually 60 s, stopped at 60 s)" in out
    assert "run_all_ok: ok in " in out and " s -> logs/run_all_ok.log" in out  # no table: its output is the log
    assert "run_all_slow: over budget: stopped at its 2 s budget; kept what it wrote" in out
    assert "run_all_absent: SKIPPED, missing" in out and "gpu: SKIPPED, needs a GPU" in out
    assert "cluster: SKIPPED, needs root (CAP_NET_ADMIN)" in out and "cluster.log" not in os.listdir(results / "logs")
    assert "run_all: 5 scripts in " in out and "stated 62 s" in out
    answers = json.loads((results / "answers.json").read_text())
    assert answers["L3"]["text"] == "fast enough" and answers["L4"]["text"] == "never"
    index = (results / "INDEX.md").read_text()
    items = [line.split("|")[1].strip() for line in index.splitlines() if line.startswith("| L")]
    assert items == [f"L{i}" for i in range(1, 29)]
    assert "| L12 |" in index and "1 GB/s" in index and "| over budget: stopped at its 2 s budget" in index
    log = (results / "logs" / "run_all_ok.log").read_text()
    assert log.startswith("$ python -m run_all_ok --out ") and log.count("ANSWER") == 2


def test_run_all_quick_runs_each_smoke_test_and_says_where_its_tables_went(tmp_path, monkeypatch, capsys):
    """--quick: each script's quick arguments, GPU scripts' CPU smoke runs too; scripts without one are left out."""
    fake_modules(tmp_path, monkeypatch, table=NAMED_TABLE)
    monkeypatch.setattr(run_all, "REGISTRY", [
        run_all.Script("run_all_table", ["L1"], 600, ["full"], quick=(["small"], 5)),
        run_all.Script("run_all_table", ["L2"], 600, ["gpu"], quick=(["smoke"], 7), gpu_only=True, name="gpu"),
        run_all.Script("run_all_table", ["L3"], 600, ["cluster"], net_admin=True, name="cluster")])
    monkeypatch.setattr(common, "has_cuda", lambda: False)
    results = tmp_path / "quick"
    assert run_all.main(["--quick", "--results", str(results)]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0].startswith("run_all --quick: 2 scripts, about 12 s on a quiet 2-core machine")
    assert "[1/2] run_all_table: started, python -m run_all_table small (usually 5 s, stopped at 5 s)" in out
    assert "[1/2] run_all_table: ok in " in out and " s -> small.md" in out
    assert "[2/2] gpu: ok in " in out and " s -> smoke.md" in out and "cluster" not in out
    assert sorted(p.name for p in results.glob("*.md")) == ["INDEX.md", "small.md", "smoke.md"]


@pytest.mark.parametrize("flags,named", [(["--pp", "20000", "--microbatches", "20000"], "--pp"),
                                         (["--microbatches", "257"], "--microbatches"),
                                         (["--schedule", "interleaved", "--virtual", "9"], "--virtual")])
def test_pp_draw_refuses_a_drawing_too_large_to_read_in_one_line(flags, named, capsys):
    """--pp 20000 --microbatches 20000 simulated for hours; a drawing is read on a screen: its bounds are stated."""
    assert pp_draw.main(flags) == 2
    out, err = capsys.readouterr()
    assert err.startswith(f"error: {named}: at most ") and err.count("\n") == 1 and out == "", err
    assert pp_draw.main(["--pp", str(pp_draw.MAX_P), "--microbatches", "8"]) == 0  # the bounds themselves draw


def test_a_short_script_gets_at_least_the_smallest_budget(tmp_path, monkeypatch, capsys):
    """Start-up alone can take minutes on a loaded machine: a 1-second script is over budget only past MIN_BUDGET_S."""
    fake_modules(tmp_path, monkeypatch, slowstart="import time\ntime.sleep(2)\n")
    monkeypatch.setattr(run_all, "MIN_BUDGET_S", 4)
    monkeypatch.setattr(run_all, "REGISTRY", [run_all.Script("run_all_slowstart", [], 1)])
    assert run_all.main(["--results", str(tmp_path / "results")]) == 0
    out = capsys.readouterr().out
    assert "(usually 1 s, stopped at 4 s)" in out and "run_all_slowstart: ok in " in out, out


def test_run_all_refuses_what_it_cannot_run_in_one_line(tmp_path, capsys):
    for argv in (["--only", "nosuchscript"], ["--budget-min", "-5"], ["--budget-scale", "0"]):
        assert run_all.main([*argv, "--results", str(tmp_path)]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith("error: --"), err
    assert not any(tmp_path.iterdir())  # refused before anything ran or was written


def test_run_all_registry_covers_the_measured_items():
    listed = {item for s in run_all.REGISTRY for item in s.items}
    assert {"L1", "L2", "L3", "L4", "L11", "L12", "L21", "L22", "L23", "L24"} <= listed
    assert set(run_all.QUESTIONS) == {f"L{i}" for i in range(1, 29)}
    assert all(item in listed or item in run_all.TESTED for item in run_all.QUESTIONS)
    # a budget is a guard against hangs, not a pass mark: a script is hung only well past it
    budgets = [max(run_all.BUDGET_FACTOR * s.seconds, run_all.MIN_BUDGET_S) for s in run_all.REGISTRY]
    assert all(min(run_all.HANG_FACTOR * b, run_all.HARD_CEILING_S) >= 2 * b for b in budgets)
    assert all(s.module.startswith("bench.") and s.source for s in run_all.REGISTRY)  # each runs from this tree
    assert all(s.quick for s in run_all.REGISTRY if not s.net_admin and s.name != "mfu_sweep_ckpt_gpu")


def test_run_all_fails_only_on_a_crash_or_a_hang(tmp_path, monkeypatch, capsys):
    """Over budget (finished late, or stopped at the budget once it had written its table) is reported and
    passes; a crash fails the run, and so does a hang: nothing written by HANG_FACTOR budgets."""
    scripts = {"late": WRITE_TABLE.format(before=4, after=0, name="late"),  # writes its table after its budget
               "writer": WRITE_TABLE.format(before=0, after=60, name="writer"),  # table, then runs on and on
               "crash": "raise SystemExit(3)\n", "hang": "import time\ntime.sleep(60)\n"}
    fake_modules(tmp_path, monkeypatch, **scripts)
    monkeypatch.setattr(run_all, "REGISTRY", [run_all.Script(f"run_all_{n}", [], 2, name=n) for n in scripts])
    monkeypatch.setattr(run_all, "HANG_FACTOR", 30)
    results = tmp_path / "results"
    assert run_all.main(["--results", str(results), "--only", "late", "--only", "writer"]) == 0
    out = capsys.readouterr().out
    assert "late: over budget: finished (budget 2 s)" in out
    assert "writer: over budget: stopped at its 2 s budget; kept what it wrote (1 file, 0 answers)" in out
    assert (results / "late.md").exists() and (results / "writer.md").read_text() == "| a |\n|---|\n| 1 |\n"
    index = (results / "INDEX.md").read_text()
    assert "| over budget: finished (budget 2 s) |" in index and "| over budget: stopped at its 2 s" in index

    assert run_all.main(["--results", str(results), "--only", "crash"]) == 1
    assert "crash: failed (exit 3)" in capsys.readouterr().out
    monkeypatch.setattr(run_all, "HARD_CEILING_S", 3)  # the hard ceiling bounds any multiple of the budget
    assert run_all.main(["--results", str(results), "--only", "hang"]) == 1
    assert "hang: hung: killed at 3 s with nothing written (budget 2 s)" in capsys.readouterr().out


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_precision_on_gpu(tmp_path):
    precision.main(["--quick", "--device", "cuda", "--out", str(tmp_path)])
    assert (tmp_path / "L4_fp16_underflow.md").exists()



def test_sweep_reports_the_line_that_says_what_failed():
    torchrun_tail = "[rank1]: Traceback (most recent call last):\n[rank1]: ValueError: boom\n" + "=" * 40 + "\n"
    assert mfu_sweep.error_line(torchrun_tail) == "ValueError: boom"
    assert mfu_sweep.error_line("noise\nerror: --tp: 3 does not divide 8\n") == "error: --tp: 3 does not divide 8"


def test_vs_torch_tp_and_pp_peers_match_losses(tmp_path, capsys):
    peers = ["tp", "tp-sp", "tp-sp-ring", "pp-gpipe", "pp-1f1b", "pp-interleaved"]
    vs_torch.main(["--quick", "--out", str(tmp_path), "--pairs", ",".join(peers)])
    rows = {r[0]: r for r in table_rows(tmp_path / "vs_torch.md")}
    assert list(rows) == peers
    assert all(rows[p][1:3] == ["ours-tp", "torch-tp"] for p in peers[:3])
    assert all(rows[p][1:3] == ["ours-pp", "torch-pp"] for p in peers[3:])
    assert all(rows[p][10] in ("bit-identical", "rtol 1e-5") for p in peers)  # the same training, step by step
    assert "ANSWER L8" in capsys.readouterr().out


def test_prepare_speed_runs_both_worker_counts(tmp_path):
    """The smoke run of bench/labs/prepare_speed.py: 1 and 2 workers side by side, their shards byte-identical."""
    assert prepare_speed.main(["--mb", "0.5", "--quick", "--out", str(tmp_path)]) == 0
    assert [row[0] for row in table_rows(tmp_path / "prepare_speed.md")] == ["1", "2"]
