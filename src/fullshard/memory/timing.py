"""The step-time model of ``fullshard plan --gpus N``: compute, communication, overlap.

[Note: the time model]
Every term is priced from the traced step of the real model (:mod:`fullshard.memory.cost`
counts each segment's ops) and the hardware table (:mod:`fullshard.memory.hardware`); every
constant is named here with where it comes from.

Compute of a segment (one unit's forward, or its backward with any recompute)::

    t = mm_flops / (peak_mm * MM_EFFICIENCY)              peak_mm: bf16, or fp8 under --float8
      + attn_flops / (peak_bf16 * ATTN_EFFICIENCY)       causal: (1 - CAUSAL_SKIP) of them
      + bytes / (hbm_bandwidth * HBM_EFFICIENCY)          every other op's reads + writes

fp32 compute runs its matmuls on TF32 tensor cores at ``TF32_FRACTION`` of the bf16 peak.
``bytes`` is what unfused kernels move (eager); ``torch.compile`` fuses elementwise chains,
so it becomes ``COMPILE_BYTES_FACTOR * bytes``. Float8 adds the casts of each matmul's
operands (``FLOAT8_CAST_BYTES`` per operand byte, also fused under compile).

Communication of one collective over a group of ``n`` ranks (alpha-beta, ring)::

    t = (n - 1) * alpha + v / (link_bandwidth * bus_efficiency)

with ``v`` the bytes each rank sends (:mod:`fullshard.memory.cluster`: the ZeRO-3 volumes) and
the link NVLink when the group fits in a node, the network otherwise.

Overlap is the prefetch schedule fullshard's engine runs: in forward the all-gather of unit
``i + 1`` is issued when unit ``i`` starts computing; in backward, while unit ``i`` computes,
the all-gather of unit ``i - 1`` and the reduce-scatter (+ HSDP all-reduce) of unit ``i + 1``
are on the wire. What does not fit under the compute it overlaps is exposed::

    exposed = ag(first unit) + sum_i max(0, comm_during(i) - compute(i)) + rs(last unit)

Tensor-parallel collectives are on the compute's critical path (no async TP): all exposed.
The optimizer step reads and writes ``OPTIMIZER_BYTES_PER_PARAM`` per local fp32 shard
element at HBM speed. The step::

    step = m * t_mb + (P - 1) * t_mb + exposed + optimizer
    t_mb = compute + TP collectives + PP send/recv          (one micro-batch of one stage)

``m`` micro-batches per step (1 without PP), ``(P - 1) * t_mb`` the 1F1B bubble. tokens/s per
GPU = ``local_batch * seq / (T * P) / step``; MFU = that x ``6 N + 12 L H Q s`` (N without
the input embedding, torchtitan's) / the bf16 peak.
"""

from __future__ import annotations

from dataclasses import dataclass

from fullshard.memory.hardware import GPU

__all__ = [
    "ALPHA_NETWORK_S",
    "ALPHA_NVLINK_S",
    "ATTN_EFFICIENCY",
    "CAUSAL_SKIP",
    "COMPILE_BYTES_FACTOR",
    "FLOAT8_CAST_BYTES",
    "HBM_EFFICIENCY",
    "MM_EFFICIENCY",
    "NETWORK_BUS_EFFICIENCY",
    "NVLINK_BUS_EFFICIENCY",
    "OPTIMIZER_BYTES_PER_PARAM",
    "TF32_FRACTION",
    "Link",
    "SegmentCost",
    "collective_time",
    "compute_time",
]

#: Fraction of the peak tensor-core rate that large bf16 GEMMs of a training step reach.
#: Fitted on one row only: torchtitan's Llama 3.1 8B on 8 H100 (FSDP, eager, bf16;
#: BENCHMARKS.md "Planner vs published results"); every other row is a prediction.
MM_EFFICIENCY = 0.48
#: Flash attention reaches a lower fraction of peak than GEMMs (FlashAttention-2 paper, Dao
#: 2023, Fig. 5-6: 50-73% of A100 peak forward, lower backward); stated, not fitted.
ATTN_EFFICIENCY = 0.50
#: Achievable fraction of the HBM peak for streaming elementwise kernels (STREAM-like
#: copies reach ~80-90% on A100/H100; unfused PyTorch ops less); stated, not fitted.
HBM_EFFICIENCY = 0.70
#: Fraction of the eager elementwise traffic left once torch.compile fuses chains of
#: pointwise ops (a fused norm / activation reads its inputs and writes its outputs once
#: instead of once per op); stated, not fitted.
COMPILE_BYTES_FACTOR = 0.4
#: Float8 (dynamic scaling): each matmul operand is read for its amax, read again to cast and
#: written in fp8, 2.5 bytes moved per bf16 byte; stated, not fitted.
FLOAT8_CAST_BYTES = 2.5
#: A causal flash-attention kernel skips the tiles above the diagonal: half the counted
#: FLOPs (s_q = s_k) are not computed (FlashAttention-2 paper, Dao 2023, counts causal
#: throughput on the half that is); stated.
CAUSAL_SKIP = 0.5
#: TF32 dense peak / BF16 dense peak on A100 (156 / 312 TFLOPS) and H100 SXM (495 / 989):
#: the datasheets of fullshard.memory.hardware; stated.
TF32_FRACTION = 0.5
#: nccl-tests bus bandwidth over NVLink reaches ~80% of the link's peak for large messages
#: (DGX H100 all-gather ~360 of 450 GB/s); stated.
NVLINK_BUS_EFFICIENCY = 0.80
#: ... and ~85-90% of a 400 Gb/s InfiniBand/RoCE rail across nodes; stated.
NETWORK_BUS_EFFICIENCY = 0.85
#: Per-step latency of a ring collective (nccl-tests small-message latencies: a few us within
#: a node, ~10 us across); stated.
ALPHA_NVLINK_S = 3e-6
ALPHA_NETWORK_S = 10e-6
#: AdamW on fp32 shards: read param, grad, exp_avg, exp_avg_sq (16 B), write param and both
#: states (12 B).
OPTIMIZER_BYTES_PER_PARAM = 28


@dataclass(frozen=True)
class Link:
    """Where one mesh dimension's collectives run."""

    kind: str  # "nvlink" | "network" | "none"
    bytes_per_s: float
    alpha_s: float


@dataclass
class SegmentCost:
    """One segment's ops, as traced (already TP-local)."""

    mm_flops: float
    attn_flops: float
    mem_bytes: float
    mm_operand_bytes: float = 0.0


def compute_time(
    c: SegmentCost, g: GPU, *, compile: bool, float8: bool, fp32: bool = False
) -> float:
    """Seconds of one segment's compute on ``g`` ([Note: the time model]); ``c.attn_flops``
    are those a kernel computes (the causal skip already taken off)."""
    fuse = COMPILE_BYTES_FACTOR if compile else 1.0
    peak_mm = g.fp8_flops if float8 and g.fp8_flops else g.bf16_flops
    if fp32 and not float8:
        peak_mm = g.bf16_flops * TF32_FRACTION
    moved = c.mem_bytes + (FLOAT8_CAST_BYTES * c.mm_operand_bytes if float8 else 0.0)
    return (
        c.mm_flops / (peak_mm * MM_EFFICIENCY)
        + c.attn_flops / (g.bf16_flops * ATTN_EFFICIENCY)
        + fuse * moved / (g.hbm_bytes_per_s * HBM_EFFICIENCY)
    )


def collective_time(n: int, volume: float, link: Link) -> float:
    """Seconds of one ring collective over ``n`` ranks moving ``volume`` bytes per rank."""
    if n <= 1 or volume <= 0:
        return 0.0
    return (n - 1) * link.alpha_s + volume / link.bytes_per_s


def link_for(g: GPU, size: int, stride: int, gpus_per_node: int) -> Link:
    """The link of a mesh dimension of ``size`` ranks ``stride`` apart in the rank order."""
    if size <= 1:
        return Link("none", float("inf"), 0.0)
    if size * stride <= gpus_per_node:
        return Link("nvlink", g.nvlink_bytes_per_s * NVLINK_BUS_EFFICIENCY, ALPHA_NVLINK_S)
    return Link("network", g.network_bytes_per_s * NETWORK_BUS_EFFICIENCY, ALPHA_NETWORK_S)
