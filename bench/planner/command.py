"""The planner of one train.py command: its layout, its cluster and the MFU range the planner predicts for it.

The rehearsal's speed line (bench/dry_run.py), `python -m bench.planner train.py ...` and the speed line of a
measured run (bench/compare.py) all read a run here, so the three give one prediction for one command.
"""
from bench.planner.layout import Cluster, Layout, invalid
from bench.planner.step_time import error_bars
from data.metrics import PEAK_TFLOPS
from parallel import ckpt
from parallel.pp_schedule import chunks_per_rank

# What the planner and the rehearsal need of a GPU besides its peak, by torch's name for it: its
# memory as torch reports it (total_memory, in MiB: a little under the marketed 80, 141, 80 and 40
# GB; an H800 counted as an H100), HBM TB/s, NVLink GB/s a direction
SPECS = {"NVIDIA H100 80GB HBM3": (81_089, 3.35, 450), "NVIDIA H200": (143_156, 4.8, 450),
         "NVIDIA H800": (81_089, 3.35, 200), "NVIDIA A100-SXM4-80GB": (81_920, 2.04, 300),
         "NVIDIA A100-SXM4-40GB": (40_536, 1.56, 300)}


def layout_of(run):
    """The planner's Layout of a resolved run (config.Run, or its summary's record)."""
    kind = ckpt.parse(run.ckpt)[0]
    return Layout(dp=run.dp, tp=run.tp, pp=run.pp, cp=run.cp, dp_mode=run.dp_mode,
                  shard=(run.dp_shard or 0) * run.cp, micro=run.micro_batch,
                  ckpt=kind if kind in ("none", "selective", "op") else "full", schedule=run.pp_schedule,
                  V=chunks_per_rank(run.pp_schedule, run.pp_virtual) if run.pp > 1 else 1,
                  cp_mode=run.cp_mode, sp=run.sp, overlap=run.overlap, accumulate=run.accumulate,
                  fp8=run.dtype == "fp8")


def cluster_of(run, gpu):
    """The planner's Cluster of a run's world on GPUs named `gpu` (torch's name), or None: a CPU, a GPU it has no
    figures for."""
    spec, peak = SPECS.get(gpu), run.peak_tflops or PEAK_TFLOPS.get(gpu, 0)
    if spec is None or not peak:
        return None
    mib, hbm_tbs, nvlink_gbs = spec
    return Cluster(run.world, max(run.ranks_here, run.tp), hbm_gb=mib * 2 ** 20 / 1e9, peak_tflops=peak,
                   intra_gbs=nvlink_gbs, hbm_tbs=hbm_tbs)


def expected_mfu(run, cfg, gpu):
    """[pessimistic, optimistic] MFU the planner predicts for this model, layout and GPU (its factors' range,
    --code ours), or None: a CPU, a GPU it has no figures for, a layout it does not price."""
    cluster, layout = cluster_of(run, gpu), layout_of(run)
    if cluster is None or invalid(cfg, cluster, layout, cfg.seq_len, run.global_batch, "ours"):
        return None
    return list(error_bars(cfg, cluster, layout, cfg.seq_len, run.global_batch, "ours")["all"])


def flags_of(lay):
    """train.py's flags for a Layout (--dp is what the world leaves)."""
    flags = [f"--dp-mode {lay.dp_mode}"] + [f"--dp-shard {lay.shard // lay.cp}"] * (lay.dp_mode == "hsdp")
    if lay.tp > 1:
        flags += [f"--tp {lay.tp}"] + ["--sp"] * lay.sp
    if lay.pp > 1:
        flags += [f"--pp {lay.pp}", f"--pp-schedule {lay.schedule}"]
        flags += [f"--pp-virtual {lay.V}"] * (lay.schedule == "interleaved" and lay.V > 1)
    if lay.cp > 1:
        flags += [f"--cp {lay.cp}", f"--cp-mode {lay.cp_mode}"]
    flags += [f"--micro-batch {lay.micro}", f"--ckpt {lay.ckpt}"] + ["--no-overlap"] * (not lay.overlap)
    flags += ["--accumulate unsharded"] * (lay.accumulate == "unsharded")
    return " ".join(flags + ["--dtype fp8"] * lay.fp8 + ["--fp8-all-gather"] * (lay.fp8 and lay.dp_mode != "ddp"))
