"""DDP overlap from hook ordering (L9, L10), gradients as bucket views, and the data-parallel flag errors (exit
status 2)."""

import pytest
import torch
from torch import nn

import model
import train
from bench.ranks import run_ranks
from parallel.ddp import DDP
from parallel.materialize import init_weights
from parallel.mesh import LayoutError, Mesh
from tests.counting import all_reduces_launched
from tests.layouts import exit_and_stderr

CFG = model.ModelConfig(n_layer=2, d_model=32, n_head=4, n_kv_head=2, ffn_dim=64, vocab_size=64, seq_len=16)


def _backward_orders(rank, world, bucket_mb):
    return {overlap: _backward_order(rank, world, overlap, bucket_mb) for overlap in (True, False)}


def _backward_order(rank, world, overlap, bucket_mb):
    """Runs one backward and returns how many all-reduces had been launched when the last gradient
    (the embedding's, the first layer's) was produced, i.e. while backward was still running."""
    mesh = Mesh(rank, world)
    with torch.device("meta"):
        gpt = model.GPT(CFG)
    init_weights(gpt, seed=0, device="cpu")
    ddp = DDP(nn.ModuleList([gpt]), mesh, bucket_mb=bucket_mb, overlap=overlap)
    seen_at_last_grad = []
    gpt.embed_tokens.weight.register_hook(lambda g: seen_at_last_grad.append(len(mesh.stats.log)))
    x = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(rank))
    gpt(x, x).backward()
    launched_in_backward = all_reduces_launched(mesh)
    in_flight_after_backward = len(mesh.stats.in_flight())
    grads_are_bucket_views = all(p.grad.untyped_storage().data_ptr() == b.buffer.untyped_storage().data_ptr()
                                 for b in ddp.buckets for p in b.params)
    first_bucket_bytes = 2 * (world - 1) / world * 4 * sum(p.numel() for p in ddp.buckets[0].params)
    first_launch = mesh.stats.log[0] if mesh.stats.log else None
    ddp.finish_grad_sync()
    return dict(before_end=seen_at_last_grad[0], launched_in_backward=launched_in_backward,
                in_flight_after_backward=in_flight_after_backward, grads_are_bucket_views=grads_are_bucket_views,
                in_flight_after_sync=len(mesh.stats.in_flight()),
                buckets=len(ddp.buckets), calls=mesh.stats.calls["all_reduce"], first_launch=first_launch,
                first_bucket_bytes=first_bucket_bytes, first_bucket=[n for n, p in gpt.named_parameters()
                                                                     if any(p is q for q in ddp.buckets[0].params)])


@pytest.fixture(scope="module")
def backward_orders():
    return run_ranks(_backward_orders, 2, args=(0.02,))[0]


@pytest.mark.parametrize("overlap", [True, False])
def test_ddp_first_bucket_all_reduce_launches_before_backward_ends(overlap, backward_orders):
    r = backward_orders[overlap]
    print(f"\noverlap={overlap}: {r['buckets']} buckets, {r['calls']} all-reduce calls, "
          f"{r['before_end']} launched before the last gradient existed, {r['launched_in_backward']} during backward")
    assert r["buckets"] > 2 and r["calls"] == r["buckets"]  # one all-reduce per bucket (L10)
    assert "lm_head.weight" in r["first_bucket"]  # reverse creation order: backward's first grads come first
    if overlap:
        assert r["before_end"] >= 1 and r["launched_in_backward"] == r["buckets"]
        assert r["in_flight_after_backward"] == r["buckets"]  # every bucket in flight at once, none waited for yet
        assert r["first_launch"][0] == "all_reduce" and r["first_launch"][2] == r["first_bucket_bytes"]
    else:
        assert r["before_end"] == 0 and r["launched_in_backward"] == 0
    assert r["grads_are_bucket_views"] and r["in_flight_after_sync"] == 0  # no copy in or out; all waited for


def _exit_line(argv, capsys):
    with pytest.raises(SystemExit) as e:
        train.main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    return e.value.code, err


@pytest.mark.parametrize("flags, flag", [
    (["--dp", "2"], "--dp"),  # dp x tp x pp x cp must equal the world size (1 here)
    (["--dp-mode", "hsdp"], "--dp-shard"),  # hsdp without a shard size
    (["--dp-mode", "hsdp", "--dp-shard", "3"], "--dp-shard"),  # shard size must divide dp
    (["--dp-mode", "fsdp", "--reduce-dtype", "fp8"], "--reduce-dtype"),
    (["--dp-mode", "zero"], "--dp-mode"),
])
def test_dp_bad_flags_print_one_line_and_exit_2(flags, flag, capsys, tmp_path):
    code, err = _exit_line(["--model", "tiny", "--steps", "1", "--out", str(tmp_path)] + flags, capsys)
    assert code == 2 and len(err) == 1 and err[0].startswith(f"error: {flag}:"), err
    assert not list(tmp_path.iterdir())  # nothing written


def _main_exit(rank, world, argv):
    return exit_and_stderr(argv)


def test_dp_not_dividing_world_on_two_ranks(tmp_path):
    """A real 2-rank world where --dp 3 does not divide it: every rank exits 2, rank 0 prints one line."""
    ranks = run_ranks(_main_exit, 2, args=(["--dp", "3", "--steps", "1", "--out", str(tmp_path)],))
    assert [code for code, _ in ranks] == [2, 2]
    assert ranks[0][1] == "error: --dp: dp·tp·pp·cp = 3·1·1·1 = 3 != world size 2\n" and ranks[1][1] == ""


def test_mesh_rejects_bad_dp_layouts():
    with pytest.raises(LayoutError, match="--dp"):
        Mesh(0, 4, dp=3)
    with pytest.raises(LayoutError, match="--dp-shard"):
        Mesh(0, 4, dp=4, dp_shard=3)
