"""config.py: the device peak table by full name, the CPU peak from the run's own matmul, the CUDA defaults."""
import argparse
from unittest import mock

import pytest
import torch

import config
import model
import train
from data import metrics
from parallel.mesh import LayoutError

CFG = model.ModelConfig(vocab_size=257)


@pytest.mark.parametrize("name,tflops", [
    ("NVIDIA H100 80GB HBM3", 989.4), ("NVIDIA H100 PCIe", 756.0), ("NVIDIA H100 NVL", 835.0),
    ("NVIDIA H200", 989.4), ("NVIDIA A100-SXM4-80GB", 312.0), ("NVIDIA L4", 121.0), ("NVIDIA L40", 181.0),
    ("NVIDIA L40S", 362.0), ("NVIDIA H100 80GB HBM3 (unknown variant)", 0.0)])
def test_the_peak_table_tells_gpus_apart_by_full_name(name, tflops, monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    run = argparse.Namespace(peak_tflops=None, backend="nccl", device="cuda:0")  # the lookup alone
    peak, source = metrics.peak_flops(run)
    assert peak == pytest.approx(tflops * 1e12)
    assert ("--peak-tflops" in source) == (tflops == 0.0)


def test_a_cpu_has_no_peak_unless_one_is_given():
    """A measured CPU matmul rate read anything from 0.004 to 0.305 TFLOP/s on shared cores (MFU 167%): no MFU there
    without --peak-tflops."""
    peak, source = metrics.peak_flops(config.resolve(["--device", "cpu"], environ={}))
    assert peak == 0 and "--peak-tflops" in source
    assert metrics.peak_flops(config.resolve(["--device", "cpu", "--peak-tflops", "2"], environ={}))[0] == 2e12


@pytest.fixture
def a_cuda_machine(monkeypatch):
    """resolve() on a machine whose torch sees a Hopper GPU (nothing runs on it)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    flags = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = flags


def test_cuda_defaults_to_the_fast_path_and_cpu_to_exact_fp32(a_cuda_machine):
    for flags, device, dtype, compiled in (([], "cuda:0", "bf16", True), (["--device", "cpu"], "cpu", "fp32", False),
                                           (["--dtype", "fp32", "--no-compile"], "cuda:0", "fp32", False)):
        run = config.resolve(flags, environ={"LOCAL_RANK": "0"})
        assert (run.device, run.dtype, run.compile) == (device, dtype, compiled)  # flags win


@pytest.mark.parametrize("flags, tf32", [([], True), (["--dtype", "fp16"], True), (["--dtype", "fp32"], False),
                                         (["--dtype", "fp32", "--tf32"], True), (["--no-tf32"], False),
                                         (["--device", "cpu"], False)])
def test_fp32_means_fp32_tf32_only_where_asked(a_cuda_machine, flags, tf32):
    """On CUDA the bf16 and fp16 runs let the matmuls that stay fp32 use TF32 tensor cores; --dtype fp32 does not
    (it used to), unless --tf32 asks."""
    run = config.resolve(flags, environ={})
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = not tf32
    with mock.patch.object(torch.cuda, "set_device"):  # a stand-in CUDA machine has no device to set
        train.start_distributed(run)  # sets the matmul precision
    assert run.tf32 == tf32 == torch.backends.cuda.matmul.allow_tf32 == torch.backends.cudnn.allow_tf32


def test_the_resolved_run_is_frozen():
    run = config.resolve(["--device", "cpu"], environ={})
    with pytest.raises(AttributeError, match="cannot assign to field"):
        run.dtype = "bf16"


@pytest.mark.parametrize("environ, line", [
    ({"RANK": "4", "WORLD_SIZE": "2"}, "RANK: 4 is not a rank of WORLD_SIZE 2"),  # was: an hour's silent wait
    ({"WORLD_SIZE": "abc"}, "WORLD_SIZE: 'abc' is not a non-negative integer (the launcher's)"),  # a traceback
    ({"LOCAL_RANK": "8", "LOCAL_WORLD_SIZE": "8"}, "LOCAL_RANK: 8 is not a rank of LOCAL_WORLD_SIZE 8")])
def test_the_launchers_environment_is_checked(environ, line):
    with pytest.raises(LayoutError, match=f"^{line.replace('(', '[(]').replace(')', '[)]')}$"):
        config.resolve(["--device", "cpu"], environ=environ)
