"""--dtype fp8 (fp8.py) on CPU: the scale rule, the CPU matmul against torch._scaled_mm, each scaled matmul's error
against bf16, 300 training steps against bf16, layouts against one fp8 process, scales under tp equal to one
process's, FSDP's fp8 all-gather (half the bytes, the same numbers), and the bad inputs. The multi-rank checks share
one set of 2 gloo ranks (the `runs` fixture); each test reads its own result."""
import json
import math
from dataclasses import replace

import numpy as np
import pytest
import torch
from torch import nn

import config
import model
import train
from bench.planner import plan
from bench.planner.ours import fsdp_parts
from bench.planner.step_time import MM_EFF, MM_ROWS0
from bench.ranks import run_ranks
from data.loader import TokenLoader
from data.prepare import prepared_folder
from model import PRESETS
from parallel import fp8, global_name, tp
from parallel.fsdp import FSDP
from parallel.materialize import init_weights, local_init
from parallel.mesh import Mesh
from tests.jobs import Failed, run_jobs
from tests.layouts import BASE, assert_same_losses
from tests.wrapper_state import full_grads

FAST = ["--peak-tflops", "1", "--dtype", "fp8"]
# Layouts against one fp8 process: their bf16 roundings differ (each sums its bf16 residual stream and partial sums in
# its own order), and an fp8 cast turns a one-ulp bf16 difference (2^-8) into a one-ulp e4m3 one (2^-3) wherever it
# crosses a rounding boundary: 10 steps stay within 2e-2 (measured: cp2 1.03%, the others under 1e-2).
LAYOUT_RTOL = 2e-2
LAYOUTS = {"fsdp2": ["--dp-mode", "fsdp"], "fsdp2-fp8-all-gather": ["--dp-mode", "fsdp", "--fp8-all-gather"],
           "tp2": ["--tp", "2"], "tp2-sp": ["--tp", "2", "--sp"], "pp2": ["--pp", "2"], "cp2": ["--cp", "2"]}
STEP1_GRADS, GRAD_RTOL = ("fsdp2", "tp2", "tp2-sp", "cp2"), 0.15  # measured: at most 6e-2, about an e5m2 cast
# FSDP units of odd sizes: one rank's shard holds the end of the matrices and the norm gains
FSDP_CFG = model.ModelConfig(n_layer=2, d_model=18, n_head=3, n_kv_head=1, ffn_dim=31, vocab_size=64, seq_len=16)
RMS_E4M3, RMS_E5M2 = 2.0 ** -3 / 12 ** 0.5, 2.0 ** -2 / 12 ** 0.5  # rms relative error of one cast, at most


# ---------------------------------------------------------------- the scale rule and the matmul, one process

def test_the_scale_is_the_largest_power_of_two_that_fits():
    amax = torch.cat([torch.exp2(torch.linspace(-100, 100, 4001)), torch.tensor([448.0, 449.0, 57344.0, 0.0])])
    for fmt in (fp8.E4M3, fp8.E5M2):
        s = fp8.scale_for(amax, fmt)
        top = torch.finfo(fmt).max
        assert torch.equal(torch.exp2(torch.log2(s).round()), s)  # a power of two
        fits = amax * s <= top
        assert fits.all() and (amax[:-1] * s[:-1] * 2 > top).all()  # and the largest (amax 0: anything fits)
        assert torch.isfinite(fp8.cast(amax[:-1], s[:-1], fmt).float()).all()  # nothing saturates or overflows
    assert fp8.scale_for(torch.tensor([448.0, 449.0]), fp8.E4M3).tolist() == [1.0, 0.5]


@pytest.mark.parametrize("fmt_a,out_dtype", [("E4M3", torch.bfloat16), ("E5M2", torch.float32)])
def test_the_cpu_matmul_is_torch_scaled_mm(fmt_a, out_dtype):
    """CPU's upcast-then-multiply against torch._scaled_mm itself (slow on CPU: small shapes) on the same operands."""
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(32, 64, generator=g) * 30, torch.randn(48, 64, generator=g)
    sa, sb = torch.tensor(2.0 ** -3), torch.tensor(2.0 ** 5)
    a8, b8 = fp8.cast(a, sa, getattr(fp8, fmt_a)), fp8.cast(b, sb, fp8.E4M3)
    ours = fp8.scaled_mm(a8, b8.t(), sa, sb, out_dtype).float()
    theirs = torch._scaled_mm(a8, b8.t(), scale_a=1 / sa, scale_b=1 / sb, out_dtype=out_dtype).float()
    ulp = 2.0 ** -8 if out_dtype == torch.bfloat16 else 2.0 ** -23  # the output's rounding, summation order aside
    exact = (a8.double() @ b8.t().double()) / (sa.double() * sb.double())  # fp8 products are exact in fp64
    ours_err, theirs_err = (ours.double() - exact).abs(), (theirs.double() - exact).abs()
    assert (ours_err <= 2 * ulp * exact.abs()).all()  # fp32 sums, one rounding, as _scaled_mm's arithmetic
    assert ours_err.max() <= theirs_err.max()  # and no further from the product than torch's own (its CPU
    # reference sums in an order that varies with the CPU's vector width: 4 ulp here on AVX-512)
    assert (ours - a @ b.t()).abs().max() < 0.2 * (a @ b.t()).abs().max()  # and it is the product


def relative_error(got, want):
    return ((got.float() - want.float()).norm() / want.float().norm()).item()


def test_each_scaled_matmul_is_within_the_fp8_error_of_bf16():
    """Y = x·Wᵀ (e4m3 x e4m3), dx = dY·W and dW = dYᵀ·x (e5m2 x e4m3) against the bf16 matmuls of the same inputs.
    A cast to p mantissa bits errs uniformly within half an ulp, and an ulp is at most 2^-p of the value: an rms
    relative error of at most 2^-p/√12 per operand (e4m3 0.036, e5m2 0.072, away from the subnormals, which these
    scales keep empty); independent errors add in quadrature through a dot product. So Y within √2·0.036 = 0.051,
    dx and dW within √(0.036² + 0.072²) = 0.081 (measured: 0.038, 0.059, 0.059), and above bf16's 2^-8: the casts
    happen."""
    g = torch.Generator().manual_seed(1)
    x, w = torch.randn(4, 64, 128, generator=g), torch.randn(96, 128, generator=g) * 0.02
    dy = torch.randn(4, 64, 96, generator=g) * 1e-4
    x8, w8 = x.clone().requires_grad_(), w.clone().requires_grad_()
    fp8.linear(x8, w8).backward(dy)
    xb, wb = x.bfloat16().requires_grad_(), w.bfloat16().requires_grad_()
    y = xb @ wb.t()
    y.backward(dy.bfloat16())
    errors = {"y": relative_error(fp8.linear(x, w), y), "dx": relative_error(x8.grad, xb.grad),
              "dw": relative_error(w8.grad, wb.grad)}
    forward, backward = math.hypot(RMS_E4M3, RMS_E4M3), math.hypot(RMS_E5M2, RMS_E4M3)
    bounds = {"y": forward, "dx": backward, "dw": backward}
    for name, err in errors.items():
        assert 2.0 ** -8 < err < bounds[name], errors

    def rounded(t, fmt):  # t as its format holds it, scaled by its whole-tensor power of two
        scale = fp8.scale_for(t.bfloat16().abs().amax().float(), fmt)
        return fp8.cast(t, scale, fmt).float() / scale
    xq, wq, dyq = rounded(x, fp8.E4M3), rounded(w, fp8.E4M3), rounded(dy.bfloat16(), fp8.E5M2)
    torch.testing.assert_close(fp8.linear(x, w).float(), (xq @ wq.t()).bfloat16().float(), rtol=2 ** -8, atol=0)
    torch.testing.assert_close(x8.grad, dyq @ wq, rtol=1e-5, atol=1e-12)  # exactly these formats and scales
    torch.testing.assert_close(w8.grad, dyq.flatten(0, 1).t() @ xq.flatten(0, 1), rtol=1e-5, atol=1e-12)
    assert fp8.linear(x, w).dtype == torch.bfloat16 and x8.grad.dtype == x.dtype and w8.grad.dtype == w.dtype


SMALL = ["--micro-batch", "4", "--global-batch", "4", "--seq-len", "32", "--n-layer", "2", "--d-model", "64",
         "--n-head", "4", "--n-kv-head", "2", "--ffn-dim", "128", "--warmup", "20", "--peak-tflops", "1"]


def test_300_fp8_steps_end_within_5_percent_of_bf16(tmp_path):
    """The same seed and batches; a 2-layer tiny model so that both runs take well under a minute on one core. The
    mean of the last 100 steps: on 128 tokens a step the two runs drift apart by a few percent either way, and the
    CPU's bf16 matmul kernels move it (fp8 2.9% below bf16 on one machine, within 2% on another)."""
    losses = {d: train.main(BASE + SMALL + ["--steps", "300", "--dtype", d, "--out", str(tmp_path / d)])
              for d in ("bf16", "fp8")}
    assert losses["fp8"] != losses["bf16"]  # fp8 ran
    assert losses["fp8"][-1] < losses["fp8"][0] - 2  # and learned
    late = {d: sum(v[-100:]) / 100 for d, v in losses.items()}
    assert abs(late["fp8"] / late["bf16"] - 1) < 0.05, late


# ---------------------------------------------------------------- layouts, tp scales, FSDP's fp8 all-gather: 2 ranks

def _train(rank, world, argv):
    return train.main(argv)


def _tp_scales_rank(rank, world):
    """A column-parallel linear whose second shard (of W and of dY) sits 2^14 below the first: with its own scale it
    would keep bits that one process's tensorwise scale loses to underflow. Reduced over tp, each rank's columns of Y
    and rows of dW equal one process's bit for bit."""
    mesh = Mesh(rank, world, tp=world)
    g = torch.Generator().manual_seed(2)
    x, w, dy = torch.randn(32, 64, generator=g), torch.randn(48, 64, generator=g), torch.randn(32, 48, generator=g)
    w[24:] *= 2.0 ** -14
    dy[:, 24:] *= 2.0 ** -14
    xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
    y = fp8.linear(xr, wr)
    y.backward(dy)
    cols = slice(rank * 24, (rank + 1) * 24)
    xs, ws = x.clone().requires_grad_(), w[cols].clone().requires_grad_()
    mesh.stats.reset()
    ys = fp8.linear(xs, ws, [mesh.tp_group])
    ys.backward(dy[:, cols])
    return dict(y=torch.equal(ys, y[:, cols]), dw=torch.equal(ws.grad, wr.grad[cols]),
                max_calls=mesh.stats.calls["all_reduce_max"])


def _reductions_rank(rank, world):
    """A 2-layer tp-2 GPT in fp8: the scale reductions of one forward and one backward."""
    mesh = Mesh(rank, world, tp=world)
    cfg = model.ModelConfig(n_layer=2, d_model=64, n_head=4, n_kv_head=2, ffn_dim=128, vocab_size=256, seq_len=16)
    with torch.device("meta"):
        gpt = tp.parallelize(model.GPT(cfg), mesh)
    gpt = init_weights(fp8.apply(gpt, mesh.tp_group, mesh.cp_group), 0, "cpu")
    x = torch.randint(0, 256, (2, 17), generator=torch.Generator().manual_seed(0))
    mesh.stats.reset()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = gpt(x[:, :-1], x[:, 1:])
    forward = mesh.stats.calls["all_reduce_max"]
    loss.backward()
    return forward, mesh.stats.calls["all_reduce_max"] - forward


def _fsdp_gather_rank(rank, world):
    """One forward and backward of FSDP under fp8, its block units gathered in bf16, then in fp8."""
    mesh, out = Mesh(rank, world), {}
    x = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(rank))
    for in_fp8 in (False, True):
        with torch.device("meta"):
            gpt = fp8.apply(model.GPT(FSDP_CFG))
        wrapper = FSDP(nn.ModuleList([gpt]), mesh, mesh.dp_cp_group,
                       lambda name, p, flat=None, out=None: local_init(name, p, FSDP_CFG, 5, flat, out), "cpu",
                       compute_dtype=torch.bfloat16)
        if in_fp8:
            fp8.gather_in_fp8(wrapper, mesh.tp_group)
        mesh.stats.reset()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = wrapper.module[0](x, x.roll(-1, 1))
        loss.backward()
        wrapper.finish_grad_sync()
        blocks = [u for u in wrapper.units if u.name.startswith("layers.")]
        out[in_fp8] = dict(loss=loss.item(), grads=[p.grad.numpy().copy() for p in wrapper.optim_params()],
                           gathers=sorted(b for kind, _, b in mesh.stats.log if kind == "all_gather"),
                           block_bytes={(world - 1) / world * 2 * u.padded for u in blocks},
                           side_bytes=[(world - 1) * 2 * u.gather.v for u in blocks] if in_fp8 else [])
    return out


def _step1_grads(rank, world, flags):
    """The step-1 gradients (after the gradient sync) by global name; a tp-sharded one as (its block, tp_shard)."""
    args = config.resolve(BASE + FAST + ["--out", "unwritten"] + flags)
    mesh = train.start_distributed(args)
    folder = prepared_folder(args.data, rank, world)
    cfg = train.model_config(args, json.loads((folder / "meta.json").read_text())["vocab_size"])
    x, y = TokenLoader(folder, "train", cfg.seq_len, args.global_batch, args.seed, mesh.coord["dp"], mesh.dp,
                       prefetch=False).get(0)
    trainer = train.prepare(args, cfg, mesh)  # bf16 autocast, the block matmuls in fp8
    wrapper = trainer.wrapper
    train.forward_backward(trainer, x, y)
    wrapper.finish_grad_sync()
    shards = {global_name(n): getattr(p, "tp_shard", None) for n, p in wrapper.module.named_parameters()}
    return {k: (g.numpy(), shards.get(k)) for k, g in full_grads(wrapper).items()}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("fp8_runs")
    jobs = [(name, _train, (BASE + FAST + ["--out", str(out / name)] + flags,)) for name, flags in LAYOUTS.items()]
    jobs += [("tp_scales", _tp_scales_rank, ()), ("fsdp_gather", _fsdp_gather_rank, ()),
             ("reductions", _reductions_rank, ())]
    jobs += [(f"grads {name}", _step1_grads, (LAYOUTS[name],)) for name in STEP1_GRADS]
    ranks = run_ranks(run_jobs, 2, args=(jobs,), timeout=600)
    return dict(ref=train.main(BASE + FAST + ["--out", str(out / "ref")]), ranks=ranks,
                grads=_step1_grads(0, 1, []))


def result(runs, key):
    for rank, r in enumerate(runs["ranks"]):
        if isinstance(r[key], Failed):
            pytest.fail(f"rank {rank} failed in {key}:\n{r[key]}")
    return [r[key] for r in runs["ranks"]]


@pytest.mark.parametrize("name", LAYOUTS)
def test_each_layout_matches_one_fp8_process(name, runs):
    assert_same_losses(result(runs, name)[0], runs["ref"], rtol=LAYOUT_RTOL)


@pytest.mark.parametrize("name", STEP1_GRADS)
def test_each_layout_has_one_fp8_process_step1_gradients(name, runs):
    """Losses drift apart slowly; the first gradients show a missing or extra sum at once. Each tensor (a tp rank's
    block of it) within GRAD_RTOL of one process's, in norm."""
    for r in result(runs, f"grads {name}"):
        for key, (got, tp_shard) in r.items():
            want = runs["grads"][key][0]
            if tp_shard:
                dim, rank, world = tp_shard
                want = np.split(want, world, axis=dim)[rank]
            assert np.linalg.norm(got - want) <= GRAD_RTOL * np.linalg.norm(want), key


def test_fp8_all_gather_changes_no_number(runs):
    """Power-of-two scales: a weight gathered in e4m3 and dequantized casts back to the values the bf16 gather gives."""
    assert result(runs, "fsdp2-fp8-all-gather")[0] == result(runs, "fsdp2")[0]
    for r in result(runs, "fsdp_gather"):
        assert r[True]["loss"] == r[False]["loss"]
        assert all(np.array_equal(a, b) for a, b in zip(r[True]["grads"], r[False]["grads"]))


def test_fp8_all_gather_sends_exactly_half_the_bytes_of_bf16(runs):
    """Each block unit's all-gather: (M-1)/M · padded bytes in e4m3 against 2x that in bf16, and beside it the norm
    gains in bf16, (M-1) · 2v; the embedding and norm + head units stay in bf16. Forward and backward gather each
    block once: every block's entries twice."""
    for r in result(runs, "fsdp_gather"):
        bf16, fp8_run = r[False], r[True]
        halved = [b / 2 if b in bf16["block_bytes"] else b for b in bf16["gathers"]]
        assert fp8_run["gathers"] == sorted(halved + 2 * fp8_run["side_bytes"])
        assert halved != bf16["gathers"] and all(0 < s <= 2 * 2 * FSDP_CFG.d_model for s in fp8_run["side_bytes"])


def test_scales_under_tp_are_one_process_scales(runs):
    for r in result(runs, "tp_scales"):
        assert r["y"] and r["dw"]
        assert r["max_calls"] == 2  # one all-reduce of (amax x, amax W) in forward, one of amax dY in backward


def test_each_amax_is_reduced_only_where_its_tensor_is_split(runs):
    """Per layer under tp: one reduction of the block's weights and one of o's and of down's inputs in forward (the
    column linears see their whole input), one of each column linear's dY in backward (the row linears' dY is whole):
    3 + 5, where reducing every tensor's amax over tp took 7 + 7."""
    for forward, backward in result(runs, "reductions"):
        assert (forward, backward) == (3 * 2, 5 * 2)


# ---------------------------------------------------------------- the planner (bench/planner/plan.py --dtype fp8)

def test_the_planner_counts_the_fp8_all_gather_bytes_the_counters_read(runs):
    """--code ours' FSDP gather bytes for the same model, layout and batch as _fsdp_gather_rank (one micro-batch of
    2 x 16 tokens per rank, 2 ranks): equal to the collective layer's, in bf16 and in fp8 (v = 2d: the norm gains
    sit in one shard)."""
    for in_fp8 in (False, True):
        s = plan.Shape(FSDP_CFG, plan.Layout(dp=2, dp_mode="fsdp", micro=2, fp8=in_fp8), 16, 4, code="ours")
        ((layers, params, embed, head, _),) = s.stages()
        parts, _ = fsdp_parts(s, layers, params, embed, head)
        for r in result(runs, "fsdp_gather"):
            assert parts["gather"][0] == pytest.approx(sum(r[in_fp8]["gathers"]), rel=1e-12)


def test_the_planner_runs_block_matmuls_at_twice_the_bf16_rate():
    cfg, cl = PRESETS["llama3-8b"], plan.Cluster(gpus=8)
    lay = plan.Layout(dp=8, dp_mode="fsdp", micro=1, ckpt="full")
    bf16, fp8_time = (plan.step_time(cfg, cl, replace(lay, fp8=f), 8192, 64) for f in (False, True))
    t = 8192  # tokens per micro-batch; seconds of the block matmuls in "compute" at bf16 (plan_time.py's formula)
    matmuls = 6 * (plan.Shape(cfg, lay, 8192, 64).p_layer - 2 * cfg.d_model) * cfg.n_layer * t * (64 // 8) / (
        cl.peak_tflops * 1e12 * MM_EFF * t / (t + MM_ROWS0))
    assert bf16["compute"] - fp8_time["compute"] == pytest.approx(matmuls / 2, rel=1e-9)
    assert fp8_time["mfu"] > bf16["mfu"] and fp8_time["dp"] <= bf16["dp"]
    assert plan.comm_bytes(cfg, replace(lay, fp8=True), 8192, 64)["dp"] < plan.comm_bytes(cfg, lay, 8192, 64)["dp"]


def test_plan_cli_takes_dtype_fp8(capsys):
    assert plan.main(["--model", "llama3-8b", "--gpus", "16", "--dtype", "fp8", "--top", "3"]) == 0
    top = capsys.readouterr().out.split("layouts by predicted MFU")[1].splitlines()[2]
    assert top.endswith("fp8=1") or ",fp8=1," in top


# ---------------------------------------------------------------- bad input

BAD = {"d_model": (["--d-model", "72", "--n-head", "4", "--n-kv-head", "2"], "--d-model"),
       "ffn_dim": (["--ffn-dim", "200"], "--ffn-dim"),
       "kv dimension": (["--d-model", "96", "--n-head", "8", "--n-kv-head", "2"], "--n-kv-head"),
       "tokens": (["--seq-len", "36", "--micro-batch", "1", "--global-batch", "8"], "--micro-batch"),
       "all-gather without fp8": (["--dtype", "bf16", "--dp-mode", "fsdp", "--fp8-all-gather"], "--fp8-all-gather"),
       "all-gather under ddp": (["--fp8-all-gather"], "--fp8-all-gather"),
       "zero-bubble schedule": (["--pp", "2", "--pp-schedule", "zb1"], "--pp-schedule")}


@pytest.mark.parametrize("case", list(BAD) + ["no _scaled_mm"])
def test_bad_fp8_input_is_one_line_and_exit_2(case, tmp_path, capsys, monkeypatch):
    flags, named = BAD.get(case, ([], "--dtype"))
    if case == "no _scaled_mm":
        monkeypatch.delattr(torch, "_scaled_mm")
    out = tmp_path / "run"
    with pytest.raises(SystemExit) as exit_info:
        train.main(BASE + FAST + ["--out", str(out)] + flags)
    err = capsys.readouterr().err.strip()
    assert exit_info.value.code == 2
    assert len(err.splitlines()) == 1 and err.startswith("error:") and named in err, err
    assert not out.exists()
    if case == "no _scaled_mm":
        assert "torch._scaled_mm" in err


def test_misfit_names_the_dimension_a_rank_multiplies():
    cfg = model.ModelConfig(d_model=128, n_head=8, n_kv_head=4, ffn_dim=384, vocab_size=320)  # head_dim 16
    assert fp8.misfit(cfg, 1, 256) is None and fp8.misfit(cfg, 4, 256) is None  # kv: 4 heads / 4 x 16 = 16
    assert fp8.misfit(cfg, 8, 256) is None  # 4 kv heads over tp 8: tp.validate refuses that, not fp8
    assert fp8.misfit(model.ModelConfig(d_model=96, n_head=8, n_kv_head=2, ffn_dim=384), 1, 256)[0] == "--n-kv-head"
    assert fp8.misfit(cfg, 2, 8)[0] == "--micro-batch"
