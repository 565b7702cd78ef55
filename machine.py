"""Facts about the machine a run is on: the GPU's dense bf16 peak (MFU divides by it) and memory."""
import os

import torch

# Dense bf16 tensor-core peaks in TFLOP/s, by the full name torch.cuda.get_device_name() reports
PEAK_TFLOPS = {
    "NVIDIA H100 80GB HBM3": 989.4, "NVIDIA H100 PCIe": 756.0, "NVIDIA H100 NVL": 835.0,
    "NVIDIA H200": 989.4, "NVIDIA H200 NVL": 835.0, "NVIDIA GH200 480GB": 989.4,
    "NVIDIA H800": 989.4,
    "NVIDIA A100-SXM4-80GB": 312.0, "NVIDIA A100-SXM4-40GB": 312.0, "NVIDIA A100 80GB PCIe": 312.0,
    "NVIDIA A100-PCIE-40GB": 312.0, "NVIDIA L4": 121.0, "NVIDIA L40": 181.0, "NVIDIA L40S": 362.0,
    "NVIDIA A10G": 125.0, "NVIDIA GeForce RTX 4090": 165.2,
}


# What the planner needs of a GPU besides its peak: (memory GB, HBM TB/s, NVLink GB/s a direction)
SPECS = {"NVIDIA H100 80GB HBM3": (80, 3.35, 450), "NVIDIA H200": (141, 4.8, 450),
         "NVIDIA H800": (80, 3.35, 200), "NVIDIA A100-SXM4-80GB": (80, 2.04, 300),
         "NVIDIA A100-SXM4-40GB": (40, 1.56, 300)}


def gpu_name(run):
    """The GPU's full name, or None on a CPU."""
    return torch.cuda.get_device_name(run.device) if run.backend == "nccl" else None


def peak_flops(run):
    """Per-device peak FLOP/s and where it came from: --peak-tflops, or the table by the GPU's name.

    A CPU has no honest peak (a measured matmul rate moved 70x between runs on shared cores), so
    MFU is shown there only with --peak-tflops.
    """
    if run.peak_tflops:
        return run.peak_tflops * 1e12, "--peak-tflops"
    if run.backend == "nccl":
        name = torch.cuda.get_device_name(run.device)
        if name in PEAK_TFLOPS:
            return PEAK_TFLOPS[name] * 1e12, f"{name} bf16 dense peak"
        return 0.0, f"{name} is not in the peak table; pass --peak-tflops"
    return 0.0, "no peak for a CPU: pass --peak-tflops for MFU"


def device_memory(run):
    """(bytes one rank may use, what they are): the GPU's memory, or on CPU the memory available
    now, shared by the ranks on this machine."""
    if run.backend == "nccl":
        name = torch.cuda.get_device_name(run.device)
        return torch.cuda.get_device_properties(run.device).total_memory, name
    available = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
    return available / run.ranks_here, f"this machine's available RAM / {run.ranks_here} rank(s)"
