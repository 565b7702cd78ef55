"""compare.py: the table of runs, and --plot's picture: a PNG of the stated size with one curve per run in every
panel, labelled by the flags that differ. Metrics written here the way train.py writes them (no training: fast).
Training never imports matplotlib; a summary of the wrong types is one line, not a traceback."""
import json
import subprocess
import sys
from pathlib import Path

import pytest
from PIL import Image

from bench import compare

REPO = Path(__file__).resolve().parent.parent


def write_run(folder, flags, steps=20, tokens=512, loss0=5.0, eval_every=5, mem=0.25):
    """A run folder with metrics.jsonl as train.py writes it: a row per step, val_loss every eval_every, a summary."""
    rows = [{"step": s, "loss": loss0 / s ** 0.3, "lr": 3e-3, "grad_norm": 1.0, "tokens": tokens, "dt_s": 0.1,
             "tok_s": tokens / 0.1 + s, "tflops": 0.1, "mfu": None, "hfu": None, "mem_gb": mem, "mem_reserved_gb": None,
             "comm_gb": 0.0, **({"val_loss": loss0 / s ** 0.25} if s % eval_every == 0 else {})}
            for s in range(1, steps + 1)]
    summary = {"run": str(folder), "steps": steps, "loss": rows[-1]["loss"], "val_loss": rows[-1].get("val_loss"),
               "tok_s": 5000.0, "mfu": None, "mem_gb": mem, "wall_s": 2.0, "flags": {"model": "tiny", **flags}}
    folder.mkdir(parents=True)
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows + [{"summary": summary}]))
    return folder


def curves(fig):
    """{panel title: [label of each curve]}."""
    return {ax.get_title(): [line.get_label() for line in ax.get_lines()] for ax in fig.axes if ax.get_title()}


def test_the_table_shows_the_flags_that_differ(tmp_path, capsys):
    runs = [write_run(tmp_path / "a", {"lr": 0.003}), write_run(tmp_path / "b", {"lr": 0.001})]
    assert compare.main([str(r) for r in runs]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "| run | steps | loss | val loss | tok/s | MFU | peak GB | wall s | --lr |"
    assert lines[2].endswith("| 20 | 2.0355 | 2.3644 | 5000 | - | 0.250 | 2 | 0.003 |")


def test_plot_draws_one_curve_per_run_in_every_panel(tmp_path, capsys):
    runs = [write_run(tmp_path / "a", {}), write_run(tmp_path / "b", {"lr": 0.001}, loss0=4.0),
            write_run(tmp_path / "c", {"lr": 0.001, "ckpt": "full"}, mem=0.1)]
    png = tmp_path / "runs.png"
    assert compare.main([*map(str, runs), "--plot", str(png)]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == f"wrote {png}"
    with Image.open(png) as image:
        assert image.format == "PNG" and image.size == (1200, 800)
    fig = compare.plot(runs, tmp_path / "again.png")
    labels = ["defaults", "--lr 0.001", "--ckpt full --lr 0.001"]  # the flags each sets of those that differ
    assert curves(fig) == {title: labels for title, _ in compare.PANELS}
    train_loss, val_loss = fig.axes[0].get_lines(), fig.axes[1].get_lines()
    assert [len(line.get_xdata()) for line in train_loss] == [20] * 3 and len(val_loss[0].get_xdata()) == 4
    assert len({line.get_linestyle() for line in train_loss}) == 3  # curves that coincide stay visible
    assert fig.axes[0].get_xlabel() == "step" and fig.axes[0].child_axes[0].get_xlabel() == "tokens"


def test_runs_that_share_a_label_are_told_apart_by_their_folder(tmp_path):
    runs = [write_run(tmp_path / "a", {"lr": 0.001}), write_run(tmp_path / "b", {"lr": 0.001}),
            write_run(tmp_path / "c", {})]
    fig = compare.plot(runs, tmp_path / "runs.png")
    assert curves(fig)["train loss"] == ["--lr 0.001 (a)", "--lr 0.001 (b)", "defaults"]


def test_runs_of_different_batches_are_drawn_against_tokens(tmp_path):
    runs = [write_run(tmp_path / "a", {"global-batch": 2}, tokens=512),
            write_run(tmp_path / "b", {"global-batch": 4}, tokens=1024, steps=10)]
    fig = compare.plot(runs, tmp_path / "runs.png")
    assert [ax.get_xlabel() for ax in fig.axes[:2]] == ["tokens", "tokens"]
    assert [line.get_xdata()[-1] for line in fig.axes[0].get_lines()] == [20 * 512, 10 * 1024]


def test_a_resumed_step_is_drawn_once(tmp_path):
    run = write_run(tmp_path / "a", {})
    metrics = run / "metrics.jsonl"
    lines = metrics.read_text().splitlines()
    metrics.write_text("\n".join(lines[:10] + lines[5:]) + "\n")  # resumed from step 5's save: steps 6-10 again
    fig = compare.plot([run], tmp_path / "a.png")
    assert list(fig.axes[0].get_lines()[0].get_xdata()) == list(range(1, 21))


@pytest.mark.parametrize("change", [
    {"loss": "low"}, {"steps": "20"}, {"flags": ["lr"]}, {"tok_s": True}, {"run": None}, {"val_loss": [1.0]}])
def test_a_summary_of_the_wrong_types_is_one_line(tmp_path, capsys, change):
    run = write_run(tmp_path / "a", {"lr": 0.003})
    metrics = run / "metrics.jsonl"
    *rows, last = metrics.read_text().splitlines()
    summary = json.loads(last)["summary"]
    metrics.write_text("\n".join(rows + [json.dumps({"summary": {**summary, **change}})]) + "\n")
    assert compare.main([str(run), str(write_run(tmp_path / "b", {}))]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {metrics}: the summary: {next(iter(change))!r} is ") and err.count("\n") == 1


@pytest.mark.parametrize("bad", ['{"summary": "done"}', '[1, 2]', '{"step": "1", "loss": 1.0}'])
def test_lines_that_are_no_metrics_are_one_line(tmp_path, capsys, bad):
    run = write_run(tmp_path / "a", {})
    metrics = run / "metrics.jsonl"
    metrics.write_text(metrics.read_text() + bad + "\n")
    assert compare.main([str(run), "--plot", str(tmp_path / "a.png")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {metrics}") and err.count("\n") == 1, err


def test_plot_refusals_are_one_line(tmp_path, capsys, monkeypatch):
    run = str(write_run(tmp_path / "a", {}))
    assert compare.main([run, "--plot", str(tmp_path / "a.jpg")]) == 2
    assert compare.main([run, "--plot", str(tmp_path / "no" / "such" / "a.png")]) == 2
    monkeypatch.setattr(compare, "Figure", None)  # matplotlib not installed
    assert compare.main([run, "--plot", str(tmp_path / "a.png")]) == 2
    err = capsys.readouterr().err.splitlines()
    assert [line.split(":")[:2] for line in err] == [["error", " --plot"]] * 3, err
    assert "requirements-dev.txt" in err[2] and not (tmp_path / "a.png").exists()


def test_training_never_imports_matplotlib():
    """matplotlib is a tooling dependency: train.py, sample.py and what they import never load it."""
    code = "import sys, train, sample; print(sorted(m for m in sys.modules if m.split('.')[0] == 'matplotlib'))"
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout == "[]\n", done.stderr


def test_plot_never_writes_through_a_link_nor_leaves_an_empty_file(tmp_path, capsys, monkeypatch):
    """Was: --plot onto a name linking to a run's metrics.jsonl overwrote it with the PNG; a plot that failed on a
    full disk left an empty file."""
    run = write_run(tmp_path / "a", {})
    metrics = run / "metrics.jsonl"
    before = metrics.read_bytes()
    (tmp_path / "link.png").symlink_to(metrics)
    assert compare.main([str(run), "--plot", str(tmp_path / "link.png")]) == 2
    assert "link" in capsys.readouterr().err and metrics.read_bytes() == before
    (tmp_path / "notes.png").write_text("my notes")
    assert compare.main([str(run), "--plot", str(tmp_path / "notes.png")]) == 2
    assert (tmp_path / "notes.png").read_text() == "my notes"

    def full_disk(*args, **kwargs):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(compare.Figure, "savefig", full_disk)
    assert compare.main([str(run), "--plot", str(tmp_path / "new.png")]) == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "link.png", "notes.png"]


def test_runs_of_other_layouts_show_their_ranks_and_layout_and_switches_read_on_or_off(tmp_path, capsys):
    """Was: a 2-rank DDP run and one process showed identical rows; --sp showed as True."""
    runs = [write_run(tmp_path / name, flags) for name, flags in (("one", {}), ("two", {}), ("tp", {"sp": True}))]
    for run, resolved in zip(runs, ({"world": 1, "dp": 1, "dp_mode": "ddp"}, {"world": 2, "dp": 2, "dp_mode": "ddp"},
                                    {"world": 2, "dp": 1, "dp_mode": "ddp", "tp": 2, "sp": True})):
        lines = (run / "metrics.jsonl").read_text().splitlines()
        summary = json.loads(lines[-1])
        summary["summary"]["resolved"] = resolved
        (run / "metrics.jsonl").write_text("\n".join(lines[:-1] + [json.dumps(summary)]) + "\n")
    assert compare.main([str(r) for r in runs]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("| run | ranks | layout | steps |") and lines[0].endswith("| --sp |")
    assert "| 1 | ddp 1 |" in lines[2] and "| 2 | ddp 2 |" in lines[3] and "| 2 | ddp 1 x tp 2 sp |" in lines[4]
    assert lines[4].endswith("| on |") and lines[2].endswith("| - |")


def test_curves_that_coincide_are_said_to(tmp_path, capsys):
    runs = [write_run(tmp_path / "a", {"ckpt": "none"}), write_run(tmp_path / "b", {"ckpt": "full"})]
    assert compare.main([str(r) for r in runs] + ["--plot", str(tmp_path / "p.png")]) == 0
    assert "note: --ckpt none and --ckpt full have the same train loss at every step" in capsys.readouterr().out


def test_two_runs_that_shared_one_metrics_file_are_not_spliced(tmp_path):
    """Was: --metrics shared by two runs drew one curve, the second run's steps over the first's."""
    a, b = write_run(tmp_path / "a", {}, loss0=5.0), write_run(tmp_path / "b", {}, loss0=3.0, steps=10)
    shared = tmp_path / "shared.jsonl"
    shared.write_text((a / "metrics.jsonl").read_text() + (b / "metrics.jsonl").read_text())
    summary, rows = compare.read_run(shared, rows_too=True)
    assert summary["run"] == str(b) and len(rows) == 10 and rows[0]["loss"] == 3.0
