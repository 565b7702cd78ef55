"""The learning-rate schedules (cosine; warmup-stable-decay with --warmdown), and --target-loss's
time-to-target line in the summary."""
import math
import re

import pytest

import config
import train
from data.metrics import read_metrics, run_summary, summary_line
from tests.layouts import BASE, exit_and_stderr


def test_cosine_is_as_it_was():
    lr, low, warmup, total = 1.0, 0.1, 2, 10
    for step in range(total):
        if step < warmup:
            expected = lr * (step + 1) / warmup
        else:
            progress = (step - warmup) / (total - warmup)
            expected = low + 0.5 * (1 + math.cos(math.pi * progress)) * (lr - low)
        assert train.lr_at(step, lr, low, warmup, total) == pytest.approx(expected, rel=1e-12)


def test_wsd_holds_the_peak_then_decays_linearly_over_the_last_k_steps():
    got = [train.lr_at(s, 1.0, 0.0, 2, 12, warmdown=4) for s in range(12)]
    assert got == pytest.approx([0.5, 1, 1, 1, 1, 1, 1, 1, 1, 0.75, 0.5, 0.25])
    assert train.lr_at(11, 1.0, 0.2, 2, 12, warmdown=4) == pytest.approx(0.2 + 0.25 * 0.8)


def test_a_longer_run_lengthens_wsds_stable_part_where_cosine_bends():
    """Continuing a finished run with a larger --steps: wsd is back at the peak (stable), cosine
    is somewhere down its (now longer) curve."""
    step, old, new = 100, 100, 200
    assert train.lr_at(step - 1, 1.0, 0.0, 10, old, warmdown=20) < 0.1  # the first run decayed
    assert train.lr_at(step, 1.0, 0.0, 10, new, warmdown=20) == 1.0  # its continuation is stable
    assert train.lr_at(step, 1.0, 0.0, 10, new) < 0.99


@pytest.mark.parametrize("flags,message", [
    (["--warmdown", "3"], "--warmdown: has no effect without --schedule wsd"),
    (["--schedule", "wsd"], "--warmdown: --schedule wsd needs the length of its decay"),
    (["--schedule", "wsd", "--warmdown", "11"], "--warmdown: 11 is more than --steps 10"),
    (["--target-loss", "3.28"], "--target-loss: has no effect without --eval-every"),
])
def test_bad_schedule_flags_are_one_line(flags, message, tmp_path):
    code, err = exit_and_stderr(BASE + ["--out", str(tmp_path / "r")] + flags)
    assert code == 2 and err.strip().startswith("error: " + message), err
    assert not (tmp_path / "r").exists()


def test_a_wsd_run_logs_its_schedule_and_its_time_to_target(tmp_path, capsys):
    metrics = tmp_path / "m.jsonl"
    train.main(BASE + ["--steps", "8", "--warmup", "2", "--schedule", "wsd", "--warmdown", "3",
                       "--min-lr", "0", "--eval-every", "2", "--eval-batches", "1", "--target-loss", "100",
                       "--out", str(tmp_path / "r"), "--metrics", str(metrics)])
    rows, summaries = read_metrics(metrics)
    assert [r["lr"] for r in rows] == pytest.approx([train.lr_at(s, 3e-3, 0, 2, 8, 3) for s in range(8)])
    target = summaries[-1]["target"]
    assert target["reached"] and target["step"] == 2 and target["tokens"] == 2 * 8 * 64
    assert target["elapsed_s"] == rows[1]["elapsed_s"]
    out = capsys.readouterr().out
    assert f"target: val {target['val_loss']:.4f} <= 100 first at step 2, 1,024 tokens" in out


def test_the_summary_names_the_best_loss_when_the_target_is_not_reached():
    rows = [{"step": s, "loss": 5.0, "tokens": 10, "tok_s": 1.0, "mfu": None, "mem_gb": None, "dt_s": 1.0,
             "elapsed_s": float(s), **({"val_loss": v} if v else {})}
            for s, v in ((1, None), (2, 4.0), (3, None), (4, 3.5), (5, 3.6))]
    s = run_summary(rows, 9.0, "r", {}, target_loss=3.28)
    assert s["target"] == {"loss": 3.28, "reached": False, "step": 4, "tokens": 40, "elapsed_s": 4.0,
                           "val_loss": 3.5}
    assert summary_line(s).splitlines()[-1] == "target: val 3.28 not reached; best 3.5000 at step 4, 40 tokens, 4 s"
    s = run_summary(rows, 9.0, "r", {}, target_loss=3.9)
    assert summary_line(s).splitlines()[-1] == "target: val 3.5000 <= 3.9 first at step 4, 40 tokens, 4 s"


@pytest.mark.parametrize("flags, line", [
    (["--lr", "1e-4"], "--min-lr: 0.0003 is above --lr 0.0001"),  # the "decay" would climb 3x
    (["--steps", "30", "--warmup", "20", "--schedule", "wsd", "--warmdown", "15"],
     "--warmdown: its 15 steps overlap --warmup's 20 in 30"),  # it would jump, or never happen
])
def test_a_schedule_that_is_not_the_one_asked_for_is_refused(flags, line):
    """Was: --min-lr above --lr climbed to 140 times the peak; a warm-down overlapping the warmup jumped."""
    with pytest.raises(config.UsageError, match=f"^{re.escape(line)}$"):
        config.parse_args(flags)


def test_an_evaluation_longer_than_its_split_is_refused(tmp_path):
    """Was: --eval-batches 10**9 evaluated for ever, where --eval-tokens past the split was refused."""
    code, err = exit_and_stderr(BASE + ["--steps", "2", "--eval-every", "1", "--eval-batches", str(10 ** 9),
                                        "--out", str(tmp_path / "run")])
    assert code == 2 and "--eval-batches: 1,000,000,000 batches of 8 windows are more windows than the val split " \
                         "has tokens" in err, err
