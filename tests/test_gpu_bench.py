"""bench/gpu.py --smoke on CPU: every part (fp8's included) runs and writes its section of gpu.md with plausible
numbers, so the one-command GPU benchmark cannot rot between the rare runs on a GPU machine."""
import pytest

from bench import common, gpu

SECTIONS = ["1. Our training step", "2. Hugging Face LlamaForCausalLM", "3. Attention kernels that actually ran",
            "4. Ring attention vs SDPA", "5. FP8 block matmuls"]


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


TRAIN_CALLS = []  # the argv of each train.main the smoke run makes


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu_smoke")
    with pytest.MonkeyPatch.context() as patch:
        main = gpu.train.main
        patch.setattr(gpu.train, "main", lambda argv: (TRAIN_CALLS.append(argv), main(argv))[1])
        assert gpu.main(["--smoke", "--out", str(out)]) == 0
    return (out / "gpu.md").read_text()


def test_every_section_with_its_command_and_header(smoke):
    found = tables(smoke)
    assert [next(t for t in found if t.startswith(s)) for s in SECTIONS] == sorted(found)
    assert smoke.count("Command: `python bench/gpu.py --smoke`") == 5
    assert "Date: 20" in smoke and "Device: CPU" in smoke and "torch: " in smoke
    assert all(found[t] for t in found), "a section without table rows"


def test_our_training_step_row(smoke):
    (row,) = section(tables(smoke), "1.")
    assert (row["model"], row["compile"], row["seq"], row["status"]) == ("tiny", "eager", "64", "ok")
    assert float(row["tokens/s"]) > 0 and 0 < float(row["MFU %"]) <= 100
    assert float(row["peak alloc GB"]) > 0  # the process's peak RSS on CPU


def test_fp8_row_runs_the_same_step_in_fp8(smoke):
    (row,) = section(tables(smoke), "5.")
    assert (row["model"], row["compile"], row["seq"], row["status"]) == ("tiny", "eager", "64", "ok")
    (ours,) = section(tables(smoke), "1.")
    assert float(row["fp8 tokens/s"]) > 0 and row["fp32 tokens/s"] == ours["tokens/s"] and float(row["fp8 / fp32"]) > 0
    assert [argv[argv.index("--dtype") + 1] for argv in TRAIN_CALLS] == ["fp32", "fp8"]


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
    monkeypatch.setattr(gpu, "kernel_part", lambda r: None)
    monkeypatch.setattr(gpu, "ring_part", lambda r: None)
    assert gpu.main(["--smoke", "--out", str(tmp_path)]) == 0
    (row,) = section(tables((tmp_path / "gpu.md").read_text()), "2.")
    assert row["HF tokens/s"] == gpu.NO_HF and row["ours / HF"] == "-" and float(row["ours tokens/s"]) > 0
    assert any(line.startswith("ANSWER L22: MFU tiny eager") for line in capsys.readouterr().out.splitlines())


def test_without_a_gpu_it_says_so_and_exits_0(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(common, "has_cuda", lambda: False)
    assert gpu.main(["--out", str(tmp_path)]) == 0
    assert "needs a CUDA GPU" in capsys.readouterr().out and not (tmp_path / "gpu.md").exists()
