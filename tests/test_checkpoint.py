"""Sharded checkpoints: exact resume in every layout, resharding (optimizer state too), export and sampling from a
sharded save, atomic saves that keep the newest K, async saves that overlap training, and bad input."""
import contextlib
import io
import json
import shutil
import threading
import time
import weakref
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist

import data.export
import data.saver
import data.saves
import model
import sample
import train
from bench.ranks import run_ranks
from data import integrity
from data.loader import TokenLoader
from data.metrics import read_metrics
from data.prepare import prepared_folder
from tests.layouts import BASE

ARGS = BASE + ["--peak-tflops", "1", "--keep", "0"]
CROSS_ENTROPY = model.cross_entropy_loss  # keep every save: the tests resume from older ones
RESUME_LAYOUTS = {  # world -> {name: flags}: 4 steps straight vs 2 + save + resume 2, bitwise (fp32, CPU)
    2: {"ddp": ["--dp", "2"], "fsdp-async": ["--dp-mode", "fsdp", "--async-save"],
        "tp-sp-dropout": ["--tp", "2", "--sp", "--dropout", "0.1"],
        **{f"pp-{s}": ["--pp", "2", "--pp-schedule", s] for s in ("gpipe", "1f1b", "zb1", "zbv")},
        "pp-interleaved": ["--pp", "2", "--pp-schedule", "interleaved", "--pp-virtual", "2"],
        **{f"cp-{m}": ["--cp", "2", "--cp-mode", m] for m in ("ring", "ulysses", "allgather")}},
    16: {"4d": ["--dp", "2", "--dp-mode", "fsdp", "--cp", "2", "--pp", "2", "--tp", "2"]},
}
FSDP4 = ["--dp-mode", "fsdp", "--micro-batch", "2"]
RESHARD_TARGETS = {"fsdp4": FSDP4, "tp2xpp2": ["--tp", "2", "--pp", "2", "--micro-batch", "2"],
                   "hsdp2x2": ["--dp-mode", "hsdp", "--dp-shard", "2", "--micro-batch", "2"]}


def quiet(fn, *args):
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        return fn(*args)


def drop_saves_after(run, step, rank):
    """As if the run had died right after the save of `step`."""
    dist.barrier()
    if rank == 0:
        for save in data.saves.complete_saves(run):
            if int(save.name.split("_")[1]) > step:
                shutil.rmtree(save)
    dist.barrier()


def straight_then_resumed(rank, run, flags, steps, save_every):
    straight = quiet(train.main, ARGS + ["--out", run, "--steps", str(steps), "--save-every", str(save_every)] + flags)
    drop_saves_after(run, save_every, rank)
    resumed = quiet(train.main, ARGS + ["--out", run, "--steps", str(steps), "--resume"] + flags)
    return straight, resumed


def _resume_rank(rank, world, layouts, root):
    out = {}
    for name, flags in layouts.items():
        try:
            out[name] = straight_then_resumed(rank, f"{root}/{name}", flags, steps=4, save_every=2)
        except Exception as e:  # noqa: BLE001 - reported per layout by the test that reads it
            out[name] = f"{type(e).__name__}: {e}"
    return out


@pytest.fixture(scope="module")
def resume_runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("resume")
    runs = {}
    for world, layouts in RESUME_LAYOUTS.items():
        runs.update(run_ranks(_resume_rank, world, args=(layouts, str(root)), timeout=400)[0])
    return root, runs


@pytest.mark.parametrize("name", [*RESUME_LAYOUTS[2], *RESUME_LAYOUTS[16]])
def test_same_layout_resume_is_bitwise(resume_runs, name):
    """ddp, fsdp (async save), tp+sp with dropout (per-rank RNG), every pp schedule, every cp mode, 2x2x2x2 4D."""
    got = resume_runs[1][name]
    assert not isinstance(got, str), got
    straight, resumed = got
    assert len(straight) == 4 and resumed == straight[2:], (straight, resumed)


def test_each_element_is_written_once(resume_runs):
    """The 4D save: one writer per element (dp, cp and tp replicas deduplicated), pieces spread over ranks."""
    saved = data.saves.Saved(resume_runs[0] / "4d" / "step_0000002").validate()
    full = model.GPT(integrity.config_from_dict(saved.meta["config"]["model"]))
    assert set(saved.tensors) == {n for n, _ in full.named_parameters()}
    for name, t in saved.tensors.items():
        covered = torch.zeros(t["shape"], dtype=torch.int32)
        for p in t["pieces"]:
            block = covered.chunk(p["tp"][2], p["tp"][0])[p["tp"][1]] if p["tp"] else covered
            flat = block.reshape(-1).clone()
            flat[p["start"]:p["start"] + p["numel"]] += 1
            block.copy_(flat.view(block.shape))
        assert covered.eq(1).all(), name
    assert len(saved.meta["files"]) == 16  # fsdp shards over dp x cp: every rank owns a distinct piece


# ---------------------------------------------------------------- resharding: saved at fsdp 4

def _reshard_rank(rank, world, root):
    base = f"{root}/fsdp4"
    out = {"straight": quiet(train.main, ARGS + FSDP4 + ["--out", base, "--steps", "8", "--save-every", "3"])}
    for name, flags in RESHARD_TARGETS.items():
        run = Path(root) / f"to-{name}"
        if rank == 0:
            shutil.copytree(f"{base}/step_0000003", run / "step_0000003")
        dist.barrier()
        out[name] = quiet(train.main, ARGS + flags + ["--out", str(run), "--steps", "8", "--save-every", "3",
                                                      "--resume"])
    # the resharded hsdp run saved at step 6 in its own layout: resume from that one, bitwise
    drop_saves_after(f"{root}/to-hsdp2x2", 6, rank)
    out["hsdp-again"] = quiet(train.main, ARGS + RESHARD_TARGETS["hsdp2x2"] + ["--out", f"{root}/to-hsdp2x2",
                                                                              "--steps", "8", "--resume"])
    return out


@pytest.fixture(scope="module")
def reshard_runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("reshard")
    runs = run_ranks(_reshard_rank, 4, args=(str(root),), timeout=400)[0]
    one = root / "one-process"
    shutil.copytree(root / "fsdp4" / "step_0000003", one / "step_0000003")
    assembled, tensor = [], data.saves.Saved.tensor
    data.saves.Saved.tensor = lambda *args: assembled.append(args[1:]) or tensor(*args)
    try:
        runs["one-process"] = quiet(train.main, ARGS + ["--out", str(one), "--steps", "8", "--resume"])
    finally:
        data.saves.Saved.tensor = tensor
    runs["full tensors assembled"] = assembled
    return root, runs


@pytest.mark.parametrize("name", ["tp2xpp2", "hsdp2x2", "one-process"])
def test_fsdp4_save_resumes_in_another_layout(reshard_runs, name):
    """Weights and Adam state resharded: the 5 losses after the step-3 save continue the fsdp-4 run."""
    straight = reshard_runs[1]["straight"]
    np.testing.assert_allclose(reshard_runs[1][name], straight[3:], rtol=1e-5, atol=0)
    if name == "one-process":  # the same tp split (none): each piece read from the files, no full tensor built
        assert reshard_runs[1]["full tensors assembled"] == []


def test_fsdp4_and_hsdp_resume_in_their_own_layout_is_bitwise(reshard_runs):
    runs = reshard_runs[1]
    assert runs["fsdp4"] == runs["straight"][3:]
    assert runs["hsdp-again"] == runs["hsdp2x2"][3:]


def read_safetensors(path):
    raw = Path(path).read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + n])
    return {k: torch.frombuffer(bytearray(raw[8 + n + a:8 + n + b]), dtype=torch.float32).view(v["shape"])
            for k, v in header.items() for a, b in [v["data_offsets"]]}


def test_export_and_sample_from_the_fsdp4_save(reshard_runs, tmp_path, monkeypatch, capsys):
    """model.py export streams one full tensor at a time; the exported model's loss on step 4's batch is the one
    the fsdp-4 run logged; sample.py runs on the sharded save."""
    read, live, most = data.saves.Saved.tensor, [0], [0]

    def counted(self, name, kind="param"):
        t = read(self, name, kind)
        live[0] += 1
        most[0] = max(most[0], live[0])
        weakref.finalize(t, lambda: live.__setitem__(0, live[0] - 1))
        return t

    monkeypatch.setattr(data.saves.Saved, "tensor", counted)
    save = reshard_runs[0] / "fsdp4" / "step_0000003"
    assert data.export.main([str(save), str(tmp_path)]) == 0
    assert most[0] == 1
    tensors = read_safetensors(tmp_path / "model.safetensors")
    config = data.saves.Saved(save).meta["config"]
    cfg = integrity.config_from_dict(config["model"])
    gpt = model.GPT(cfg)
    padded = lambda t: torch.cat([t, t.new_zeros(cfg.padded_vocab - len(t), *t.shape[1:])])  # the export: true vocab
    gpt.load_state_dict({k.removeprefix("model."): padded(v) if "embed" in k or "lm_head" in k else v
                         for k, v in tensors.items()})
    loader = TokenLoader(prepared_folder(None), "train", 64, 8, 1337, prefetch=False)
    with torch.no_grad():
        loss = gpt(*loader.get(3)).item()
    assert loss == pytest.approx(reshard_runs[1]["straight"][3], rel=1e-5)
    capsys.readouterr()
    assert sample.main(["--run", str(save), "--prompt", "def ", "--max-new-tokens", "8", "--temperature", "0"]) == 0
    text = capsys.readouterr().out
    assert text.startswith("def ") and len(text) > len("def \n"), text


# ---------------------------------------------------------------- one process: atomic saves, keep, async, bad input

def run1(argv):
    return quiet(train.main, ARGS + ["--micro-batch", "8"] + argv)


def test_a_save_that_lost_its_completion_marker_is_resumed_not_deleted(tmp_path, capsys):
    """Was: --resume auto deleted a save whose files and meta.json verify but whose `complete` was gone, then
    trained from step 0. A resume takes it (loading checks every byte); none deletes it."""
    assert len(run1(["--out", str(tmp_path), "--steps", "2", "--save-every", "1"])) == 2
    (tmp_path / "step_0000002" / "complete").unlink()
    assert [p.name for p in data.saves.complete_saves(tmp_path)] == ["step_0000001", "step_0000002"]
    assert run1(["--out", str(tmp_path), "--steps", "3", "--resume", "auto"]) == run1(
        ["--out", str(tmp_path / "again"), "--steps", "3"])[2:]  # resumed at step 2: the third loss
    assert (tmp_path / "step_0000002" / "meta.json").exists()


def test_resume_auto_keep_k_and_incomplete_saves_are_ignored_then_removed(tmp_path):
    """--resume auto starts fresh in an empty folder; --keep 2 leaves the newest two; a killed save and a folder
    without `complete` are skipped by the next resume, which removes them."""
    assert len(run1(["--out", str(tmp_path), "--steps", "3", "--save-every", "1", "--keep", "2",
                     "--resume", "auto"])) == 3
    assert [p.name for p in data.saves.complete_saves(tmp_path)] == ["step_0000002", "step_0000003"]
    killed = tmp_path / ".tmp_step_0000004_abcdef"  # a save killed mid-write
    unmarked = tmp_path / "step_0000005"  # no `complete`: not a save
    for folder in (killed, unmarked):
        folder.mkdir()
        (folder / "rank00000.bin").write_bytes(b"junk")
    assert run1(["--out", str(tmp_path), "--steps", "3", "--resume", "auto"]) == []  # resumed at the end: step 3
    assert not killed.exists() and not unmarked.exists()
    assert [p.name for p in data.saves.complete_saves(tmp_path)] == ["step_0000002", "step_0000003"]


def test_async_save_writes_while_training_continues(tmp_path, monkeypatch):
    """The step-2 save is written only after step 3 has updated the weights and step 4 has started (a sync save
    would block the loop: the writer would time out); saves never overlap; the metrics show the stall; and the
    save, a snapshot taken before step 3, resumes bitwise."""
    steps_started, seen, in_flight, most = [], [], [0], [0]
    lr_at, write_rank = train.lr_at, data.saver.write_rank
    later = threading.Event()

    def tracking_lr_at(step, *args):
        steps_started.append(step)
        if len(steps_started) >= 4:
            later.set()
        return lr_at(step, *args)

    def slow_write(folder, rank, pieces, info):
        in_flight[0] += 1
        most[0] = max(most[0], in_flight[0])
        seen.append(later.wait(timeout=20))
        if len(seen) == 1:
            time.sleep(1)  # still writing when step 4 ends: its save must wait for this one
        write_rank(folder, rank, pieces, info)
        in_flight[0] -= 1

    monkeypatch.setattr(train, "lr_at", tracking_lr_at)
    monkeypatch.setattr(data.saver, "write_rank", slow_write)
    metrics = tmp_path / "m.jsonl"
    straight = run1(["--out", str(tmp_path), "--steps", "4", "--save-every", "2", "--async-save",
                     "--metrics", str(metrics)])
    assert seen == [True, True] and most[0] == 1, (seen, most)
    rows = read_metrics(metrics)[0]
    assert [r["step"] for r in rows if "save_stall_s" in r] == [2, 4]
    monkeypatch.setattr(data.saver, "write_rank", write_rank)
    shutil.rmtree(tmp_path / "step_0000004")
    assert run1(["--out", str(tmp_path), "--steps", "4", "--resume"]) == straight[2:]


def test_fp16_resume_restores_the_loss_scale(tmp_path, monkeypatch):
    """An overflow at step 1 halves the scale to 2^15; the resumed run continues with 2^15, bitwise."""
    unscale_and_clip, calls = train.unscale_and_clip, []

    def overflow_once(grads_and_replicas, *args):
        calls.append(1)
        if len(calls) == 1:
            grads_and_replicas[0][0].view(-1)[0] = float("inf")
        return unscale_and_clip(grads_and_replicas, *args)

    monkeypatch.setattr(train, "unscale_and_clip", overflow_once)
    fp16 = ["--dtype", "fp16", "--seq-len", "32", "--out", str(tmp_path), "--steps", "3"]
    straight = run1(fp16 + ["--save-every", "2"])
    shutil.rmtree(tmp_path / "step_0000003")
    metrics = tmp_path / "m.jsonl"
    assert run1(fp16 + ["--resume", "--metrics", str(metrics)]) == straight[2:]
    assert read_metrics(metrics)[0][0]["loss_scale"] == 2.0 ** 15


def snapshot(folder):
    return {str(p.relative_to(folder)): (p.stat().st_size, p.stat().st_mtime_ns) for p in sorted(folder.rglob("*"))}


def _truncate(run):
    data = next(run.glob("step_*/rank00000.bin"))
    data.write_bytes(data.read_bytes()[:1000])


BAD_RESUMES = {
    "no save (only a killed one)": ([], lambda run: (run / ".tmp_step_0000001_abcdef").mkdir(), "no complete save"),
    "a different model shape": (["--d-model", "64"], None, "model.d_model=128, this run has model.d_model=64"),
    "truncated files": ([], _truncate, "rank00000.bin is truncated: 1000 of"),
}


@pytest.mark.parametrize("case", list(BAD_RESUMES))
def test_bad_resume_is_one_line_exit_2_and_touches_nothing(case, tmp_path, capsys):
    flags, damage, needle = BAD_RESUMES[case]
    run = tmp_path / "run"
    if damage is _truncate or case == "a different model shape":
        run1(["--out", str(run), "--steps", "1"])
    run.mkdir(exist_ok=True)
    if damage:
        damage(run)
    before = snapshot(run)
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        train.main(ARGS + ["--micro-batch", "8", "--steps", "1", "--out", str(run), "--resume"] + flags)
    err = capsys.readouterr().err.strip()
    assert exit_info.value.code == 2
    assert len(err.splitlines()) == 1 and err.startswith("error: --resume: ") and needle in err, err
    assert snapshot(run) == before
