"""Accelerators the cluster planner knows: memory, peak FLOPS, bandwidths. Every value sourced.

Dense (not 2:4-sparse) tensor-core peaks; link bandwidths in bytes/s per GPU and direction.
``gpu("h100", {"bf16_flops": 800e12})`` overrides any field (``fullshard plan --gpu-set
bf16_flops=800e12``): the table is a starting point, not a claim about your machines.
Free of torch at import (``fullshard plan --help`` lists the names).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

__all__ = ["GPU", "GPUS", "gpu"]

_GB = 1e9
_GIB = 2**30


@dataclass(kw_only=True, frozen=True)
class GPU:
    """One accelerator and the links around it."""

    name: str
    memory_bytes: float
    """Device memory (what ``torch.cuda.mem_get_info`` calls total, roughly)."""
    bf16_flops: float
    """Peak dense bf16 tensor-core FLOP/s."""
    fp8_flops: float
    """Peak dense fp8 tensor-core FLOP/s (0: no fp8 tensor cores)."""
    hbm_bytes_per_s: float
    """Peak device-memory bandwidth."""
    nvlink_bytes_per_s: float
    """NVLink bandwidth per GPU, one direction (half the bidirectional figure vendors quote)."""
    network_bytes_per_s: float
    """Scale-out network bandwidth per GPU, one direction (the NIC rail of each GPU)."""
    gpus_per_node: int = 8
    """GPUs joined by NVLink (``--gpus-per-node`` overrides)."""


GPUS: dict[str, GPU] = {
    # NVIDIA A100 80GB SXM datasheet (nvidia.com/content/dam/en-zz/Solutions/Data-Center/a100/
    # pdf/nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf): BF16 312 TFLOPS dense, HBM2e
    # 2,039 GB/s, NVLink 600 GB/s (bidirectional); DGX A100 datasheet: 8x 200 Gb/s HDR
    # InfiniBand (one ConnectX-6 per GPU). No fp8.
    "a100-80gb": GPU(
        name="a100-80gb",
        memory_bytes=80 * _GB,
        bf16_flops=312e12,
        fp8_flops=0.0,
        hbm_bytes_per_s=2039 * _GB,
        nvlink_bytes_per_s=300 * _GB,
        network_bytes_per_s=25 * _GB,
    ),
    # NVIDIA H100 SXM5 80GB datasheet (nvidia.com/en-us/data-center/h100/): BF16 989 TFLOPS
    # and FP8 1,979 TFLOPS dense (the sheet's 1,979 / 3,958 are with sparsity), HBM3 3.35 TB/s,
    # NVLink 900 GB/s bidirectional; DGX H100: 8x 400 Gb/s ConnectX-7 (one per GPU).
    "h100": GPU(
        name="h100",
        memory_bytes=80 * _GB,
        bf16_flops=989e12,
        fp8_flops=1979e12,
        hbm_bytes_per_s=3350 * _GB,
        nvlink_bytes_per_s=450 * _GB,
        network_bytes_per_s=50 * _GB,
    ),
    # The H100 of torchtitan's published runs (torchtitan benchmarks/
    # llama3_h100_202412_torchtitan.md, "Hardware"): Grand Teton hosts, 8 H100 per host with
    # NVLink, 96 GB HBM2e at 2.4 TB/s, 400 Gb/s RDMA per GPU, 500 W power limit. torchtitan
    # divides by the SXM peak for MFU (its footnote 2: the true peak lies between SXM and NVL
    # and is unknown), so the peaks here are the SXM ones; the lower clocks at 500 W are part of
    # what the compute efficiency fitted on one of those runs absorbs (fullshard.memory.timing).
    "h100-gt": GPU(
        name="h100-gt",
        memory_bytes=96 * _GB,
        bf16_flops=989e12,
        fp8_flops=1979e12,
        hbm_bytes_per_s=2400 * _GB,
        nvlink_bytes_per_s=450 * _GB,
        network_bytes_per_s=50 * _GB,
    ),
    # NVIDIA H200 datasheet (nvidia.com/en-us/data-center/h200/): same tensor cores as H100
    # SXM, 141 GB HBM3e at 4.8 TB/s, NVLink 900 GB/s; DGX H200: 8x 400 Gb/s ConnectX-7.
    "h200": GPU(
        name="h200",
        memory_bytes=141 * _GB,
        bf16_flops=989e12,
        fp8_flops=1979e12,
        hbm_bytes_per_s=4800 * _GB,
        nvlink_bytes_per_s=450 * _GB,
        network_bytes_per_s=50 * _GB,
    ),
    # NVIDIA HGX B200 (nvidia.com/en-us/data-center/hgx/, 8 GPUs): FP16/BF16 36 PFLOPS and FP8
    # 72 PFLOPS with sparsity, i.e. 2.25 / 4.5 PFLOPS dense per GPU; 1.44 TB memory (180 GB
    # per GPU) at 8 TB/s per GPU (B200 datasheet), NVLink 5 1.8 TB/s bidirectional; DGX B200:
    # 8x 400 Gb/s ConnectX-7.
    "b200": GPU(
        name="b200",
        memory_bytes=180 * _GB,
        bf16_flops=2250e12,
        fp8_flops=4500e12,
        hbm_bytes_per_s=8000 * _GB,
        nvlink_bytes_per_s=900 * _GB,
        network_bytes_per_s=50 * _GB,
    ),
}

_FIELDS = {f.name for f in dataclasses.fields(GPU)} - {"name"}


def gpu(name: str, overrides: dict[str, float] | None = None) -> GPU:
    """The table's ``name`` with ``overrides`` (field -> value) applied."""
    if name not in GPUS:
        raise ValueError(f"--gpu {name!r}: choose from {', '.join(GPUS)} (or override fields)")
    bad = sorted(set(overrides or {}) - _FIELDS)
    if bad:
        raise ValueError(f"--gpu-set {bad}: not fields of a GPU; choose from {sorted(_FIELDS)}")
    fields = dict(overrides or {})
    if "gpus_per_node" in fields:
        fields["gpus_per_node"] = int(fields["gpus_per_node"])
    return dataclasses.replace(GPUS[name], **fields)  # type: ignore[arg-type]


def memory_gib(g: GPU) -> float:
    return g.memory_bytes / _GIB
