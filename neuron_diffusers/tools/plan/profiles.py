"""Hardware profiles for `plan report --profile`: peak FLOP/s, link bandwidth and per-collective latency per rank.

The estimate is deliberately simple: `FLOPs / peak + sum over collectives of (latency + bytes sent / bandwidth)`,
with no overlap of compute and communication, no kernel efficiency below peak, and one link tier (every pair of
ranks as fast as the figure below). docs/layouts.md compares it with published step times: read that before
trusting an absolute number. Every figure names its source; where no published figure exists, it says it is an
assumption.
"""

from __future__ import annotations

from dataclasses import dataclass

from .costs import KINDS, Costs

TERA = 1e12
GIGA = 1e9
GIB = 2**30
MICRO = 1e-6


@dataclass(frozen=True)
class Figure:
    value: float
    source: str


@dataclass(frozen=True)
class Profile:
    name: str
    rank: str
    #: Dense BF16 FLOP/s of one rank.
    peak_flops: Figure
    #: Bytes per second one rank sends to the others (one direction).
    bandwidth: Figure
    #: Seconds every collective costs whatever its size.
    latency: Figure
    #: Bytes of device memory one rank has (a layout whose weights alone exceed it cannot run).
    memory: Figure


_TRN2 = "https://awsdocs-neuron.readthedocs-hosted.com/en/latest/general/arch/neuron-hardware/trn2-arch.html"
_TRN2_LNC = "https://awsdocs-neuron.readthedocs-hosted.com/en/latest/training/best-practices.html"
_H100 = ("NVIDIA H100 SXM datasheet: BF16 Tensor Core 1,979 TFLOPS with sparsity, half without; NVLink 900 GB/s "
         "(e.g. https://archive-lib.hpctech.co.jp/gpuproduct/nvidia-h100.html)")
_NCCL_LATENCY = ("assumption: no published per-collective figure used; 10 us is the order of NCCL's small-message "
                 "collectives inside one NVLink node")

PROFILES = {
    "trn2": Profile(
        "trn2", "one logical NeuronCore (LNC=2) of a trn2.48xlarge (64 per instance)",
        Figure(10.7e15 / 64, f"10.7 BF16 PFLOPS per trn2.48xlarge ({_TRN2}) over its 64 logical cores at LNC=2 "
                             f"({_TRN2_LNC}); = 667 TFLOPS per Trainium2 chip / 4"),
        Figure(1024 * GIGA / 4, f"1,024 GB/s intra-instance NeuronLink-v3 per chip ({_TRN2}) over the chip's 4 "
                                "logical cores; assumption: that figure is per direction, and traffic between the "
                                "cores of one chip is no faster"),
        Figure(20 * MICRO, "assumption: no published Neuron per-collective latency found; 20 us"),
        Figure(24 * GIB, f"96 GiB HBM per Trainium2 chip over 4 logical cores: about 24 GiB per rank ({_TRN2_LNC})"),
    ),
    "h100": Profile(
        "h100", "one H100 SXM GPU of an 8-GPU NVLink node",
        Figure(989 * TERA, _H100),
        Figure(450 * GIGA, f"{_H100}; 900 GB/s counts both directions: 450 GB/s each way"),
        Figure(10 * MICRO, _NCCL_LATENCY),
        Figure(80 * GIGA, f"{_H100}: 80 GB HBM3"),
    ),
    "h200": Profile(
        "h200", "one H200 SXM GPU of an 8-GPU NVLink node",
        Figure(989 * TERA, "NVIDIA H200 datasheet: the H100's tensor cores (1,979 BF16 TFLOPS with sparsity, half "
                           "without), more and faster HBM (https://glennklockwood.com/garden/processors/h100)"),
        Figure(450 * GIGA, "NVIDIA H200 datasheet: NVLink 900 GB/s, both directions: 450 GB/s each way"),
        Figure(10 * MICRO, _NCCL_LATENCY),
        Figure(141 * GIGA, "NVIDIA H200 datasheet: 141 GB HBM3e"),
    ),
    "h20": Profile(
        "h20", "one H20 GPU of an 8-GPU NVLink node",
        Figure(148 * TERA, "148 dense FP16/BF16 TFLOPS: third-party spec pages (e.g. "
                           "https://willitrunai.com/es/gpus/h20-96gb); NVIDIA publishes no datasheet for the H20"),
        Figure(450 * GIGA, "NVLink 900 GB/s (same pages), both directions: 450 GB/s each way"),
        Figure(10 * MICRO, _NCCL_LATENCY),
        Figure(96 * GIGA, "96 GB HBM3 (same pages; the H20-3e has 141 GB)"),
    ),
    "l20": Profile(
        "l20", "one L20 GPU of an 8-GPU PCIe node (no NVLink)",
        Figure(119.5 * TERA, "assumption: 119.5 dense BF16 TFLOPS, the figure spec listings quote; NVIDIA publishes "
                             "no datasheet for the L20 (an AD102 with 92 of the L40S's 142 SMs)"),
        Figure(32 * GIGA, "PCIe 4.0 x16 (spec pages, e.g. https://www.topcpu.net/en/gpu-c/a40-pcie-vs-l20): 16 GT/s "
                          "x 16 lanes = 31.5 GB/s each way; assumption: no PCIe switch contention"),
        Figure(25 * MICRO, "assumption: 25 us, NCCL collectives over PCIe"),
        Figure(48 * GIGA, "48 GB GDDR6 (same spec pages)"),
    ),
}


def profile(name: str) -> Profile:
    if name not in PROFILES:
        raise ValueError(f"Unknown hardware profile '{name}'. Choose one of: {', '.join(PROFILES)}.")
    return PROFILES[name]


def step_seconds(costs: Costs, hardware: Profile) -> dict[str, float]:
    """The estimate's parts: compute, each kind of traffic, and their sum (nothing overlaps)."""
    parts = {"compute": costs.flops / hardware.peak_flops.value}
    for kind in KINDS:
        parts[kind] = costs.collectives[kind] * hardware.latency.value + costs.sent[kind] / hardware.bandwidth.value
    parts["total"] = sum(parts.values())
    return parts
