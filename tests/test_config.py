"""config.py: the device peak table by full name, the CPU peak from the run's own matmul, the CUDA defaults."""
import argparse

import pytest
import torch

import config
import model as M

CFG = M.ModelConfig(vocab_size=257)


@pytest.mark.parametrize("name,tflops", [
    ("NVIDIA H100 80GB HBM3", 989.4), ("NVIDIA H100 PCIe", 756.0), ("NVIDIA H100 NVL", 835.0),
    ("NVIDIA H200", 989.4), ("NVIDIA A100-SXM4-80GB", 312.0), ("NVIDIA L4", 121.0), ("NVIDIA L40", 181.0),
    ("NVIDIA L40S", 362.0), ("NVIDIA H100 80GB HBM3 (unknown variant)", 0.0)])
def test_the_peak_table_tells_gpus_apart_by_full_name(name, tflops, monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    args = config.parse_args(["--device", "cpu"])  # parsing only: the peak lookup below names a cuda device
    peak, source = config.peak_flops(args, torch.device("cuda", 0), CFG)
    assert peak == pytest.approx(tflops * 1e12)
    assert ("--peak-tflops" in source) == (tflops == 0.0)


def test_the_cpu_peak_is_measured_on_the_runs_largest_matmul():
    args = config.parse_args(["--dtype", "fp32", "--micro-batch", "2", "--seq-len", "64"])
    peak, source = config.peak_flops(args, torch.device("cpu"), M.ModelConfig(seq_len=64, vocab_size=257))
    assert peak > 0 and "128x128x384" in source and f"{torch.get_num_threads()} threads" in source


def test_cuda_defaults_to_the_fast_path_and_cpu_to_exact_fp32():
    for device, dtype, compiled in (("cpu", "fp32", False), ("cuda", "bf16", True)):
        args = argparse.Namespace(dtype=None, compile=None)
        tf32 = torch.backends.cuda.matmul.allow_tf32
        config.device_defaults(args, torch.device(device))
        torch.backends.cuda.matmul.allow_tf32 = tf32
        assert (args.dtype, args.compile) == (dtype, compiled)
    args = argparse.Namespace(dtype="fp32", compile=False)
    config.device_defaults(args, torch.device("cpu"))
    assert (args.dtype, args.compile) == ("fp32", False)  # flags win
