"""The memory planner's inputs and outputs: what to plan (:class:`PlanSpec`) and what the
plan says (:class:`Plan`: the units, the traced segments and the memory timeline's events).
``fullshard.memory.planner`` makes a plan from a spec ([Note: how the plan is made] there).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

from fullshard.memory.ac import ac_mode
from fullshard.memory.engines import ENGINES
from fullshard.memory.layers import TRACED_BLOCKS
from fullshard.models import GPTConfig

__all__ = ["Event", "Plan", "PlanSpec", "Segment", "Unit"]

OPTIMIZER_STATES = {"adamw": 2, "adam": 2, "sgd": 0, "sgd-momentum": 1}


@dataclass(kw_only=True, frozen=True)
class PlanSpec:
    """Everything the plan depends on."""

    model: GPTConfig | None = None
    """A fullshard GPT; or ``hf_config``."""
    hf_config: Any = None
    """A Hugging Face causal LM: a ``transformers`` ``PretrainedConfig``, or the path of a
    local ``config.json`` (or its folder). Never downloaded."""
    world_size: int
    mesh: tuple[int, int] | None = None
    """(replicate, shard) for HSDP; ``None`` = shard over all ranks."""
    param_dtype: torch.dtype = torch.float32
    """Dtype of gathered parameters and compute (sharded masters stay fp32)."""
    offload: bool = False
    """Sharded parameters, gradients and optimizer states live in host memory."""
    batch: int
    """Micro-batch per rank (sequences)."""
    seq: int
    optimizer: str = "adamw"
    ac: bool | str = False
    """Activation checkpointing of every unit (block): ``"none"`` (or ``False``), ``"full"``
    (or ``True``) or ``"selective"`` (torchtitan's op policy, :mod:`fullshard.memory.ac`)."""
    tp: int = 1
    """Tensor-parallel degree the traced model's shapes are already divided by (the caller
    builds the TP-local model); with sequence parallelism the residual stream's activations
    are ``1/tp`` of the traced ones (:mod:`fullshard.memory.cluster`)."""
    max_traced_blocks: int = TRACED_BLOCKS
    """Trace at most this many blocks and extend to all ([Note: tracing three blocks]); 0:
    trace every block."""
    reshard_after_forward: bool = True
    units: str = "block"
    """``block``: each transformer block is a unit, the root holds the rest; ``model``: one unit."""
    engine: str = "fullshard"

    def __post_init__(self) -> None:
        if (self.model is None) == (self.hf_config is None):
            raise ValueError("give exactly one of model= (a GPTConfig) or hf_config=")
        if self.optimizer not in OPTIMIZER_STATES:
            raise ValueError(
                f"optimizer {self.optimizer!r}: choose from {sorted(OPTIMIZER_STATES)}"
            )
        if self.engine not in ENGINES:
            raise ValueError(f"engine {self.engine!r}: choose from {sorted(ENGINES)}")
        if self.units not in ("block", "model"):
            raise ValueError(f"units {self.units!r}: choose 'block' or 'model'")
        ac_mode(self.ac)
        if self.batch < 1 or self.seq < 1 or self.world_size < 1 or self.tp < 1:
            raise ValueError("batch, seq and world_size must be >= 1")
        if self.mesh is not None and self.mesh[0] * self.mesh[1] != self.world_size:
            raise ValueError(
                f"mesh {self.mesh[0]}x{self.mesh[1]} does not multiply to world size {self.world_size}"
            )

    @property
    def ac_mode(self) -> str:
        return ac_mode(self.ac)

    @property
    def shard_size(self) -> int:
        return self.mesh[1] if self.mesh is not None else self.world_size


@dataclass
class Unit:
    """One communication unit: the parameters gathered and reduced together."""

    name: str
    shapes: list[tuple[int, ...]]  # unique parameters' shapes
    numel: int = 0
    padded_numel: int = 0  # dim 0 of each parameter padded to a multiple of the shard size
    shard_numel: int = 0  # padded_numel / shard size
    largest_shard_numel: int = 0

    def pad(self, shard: int) -> None:
        self.numel = sum(math.prod(s) for s in self.shapes)
        per = [math.ceil(s[0] / shard) * math.prod(s[1:]) if s else 1 for s in self.shapes]
        self.shard_numel = sum(per)
        self.padded_numel = self.shard_numel * shard
        self.largest_shard_numel = max(per, default=0)


@dataclass
class Segment:
    """A stretch of the fake step during which one unit computes (live bytes: non-parameter)."""

    label: str
    unit: int  # index into the units; 0 is the root, -1 the loss (outside the model)
    phase: str  # "forward" | "backward"
    after: int  # the last non-root unit entered in this phase (0 before any)
    start: int = 0
    start_grads: int = 0  # of which unsharded gradients
    peak: int = 0
    peak_grads: int = 0
    reduce_at: int | None = None  # live bytes when the unit reduce-scatters (backward)
    reduce_grads: int = 0
    # of which on residual-stream-shaped tensors ([b, s, d_model]: sequence parallelism shards them)
    start_hidden: int = 0
    peak_hidden: int = 0
    reduce_hidden: int = 0
    # what the segment's ops cost (fullshard.memory.cost.OpCost)
    mm_flops: int = 0
    attn_flops: int = 0
    mem_bytes: int = 0
    hidden_mem_bytes: int = 0
    mm_operand_bytes: int = 0
    causal_attn_flops: int = 0


@dataclass
class Event:
    """A moment of the step with its predicted per-rank bytes by category."""

    label: str
    bytes: dict[str, int]

    @property
    def total(self) -> int:
        return sum(v for k, v in self.bytes.items() if not k.startswith("host:"))

    @property
    def host(self) -> int:
        return sum(v for k, v in self.bytes.items() if k.startswith("host:"))


@dataclass
class Plan:
    """The prediction: every event of the step and the peak among them."""

    spec: PlanSpec
    units: list[Unit]
    events: list[Event]
    n_params: int
    segments: list[Segment] = field(default_factory=list)  # the traced step, all blocks
    peak: Event = field(init=False)

    def __post_init__(self) -> None:
        self.peak = max(self.events, key=lambda e: e.total)

    def to_dict(self) -> dict[str, Any]:
        return {
            "peak_bytes": self.peak.total,
            "peak_at": self.peak.label,
            "peak_breakdown": self.peak.bytes,
            "host_bytes": self.peak.host,
            "n_params": self.n_params,
            "units": len(self.units),
            "timeline": [{"label": e.label, "bytes": e.total} for e in self.events],
        }
