"""Apply fullshard to a model from outside, the torchtitan way (models stay parallelism-free).

Order matters and is bottom-up: activation checkpointing and ``torch.compile`` per layer
first (they change how a layer runs, not its parameters or names), then ``fully_shard`` on each
layer, on the input embeddings when they are not tied to the output head, and last on the
root, which takes every parameter left (embeddings, final norm, head).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.utils.checkpoint import checkpoint

from fullshard import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from fullshard.train.models import Units

__all__ = ["ParallelPlan", "parallelize"]

_DTYPES = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True)
class ParallelPlan:
    """How to shard: the trainer's flags, in one place."""

    mixed_precision: str = "fp32"  # fp32 | bf16 | fp16
    reshard_after_forward: str = "auto"  # auto | true | false
    cpu_offload: bool = False
    activation_checkpointing: bool = False
    compile: bool = False

    def mp_policy(self) -> MixedPrecisionPolicy:
        """Compute in the chosen dtype, reduce gradients in fp32 (master weights stay fp32)."""
        dtype = _DTYPES[self.mixed_precision]
        if dtype is None:
            return MixedPrecisionPolicy()
        return MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)

    def offload_policy(self) -> OffloadPolicy:
        """CPU offload of sharded states, or none."""
        return CPUOffloadPolicy() if self.cpu_offload else OffloadPolicy()

    def reshard(self) -> bool | None:
        """``reshard_after_forward`` for fully_shard (``None``: FSDP2's default)."""
        return {"auto": None, "true": True, "false": False}[self.reshard_after_forward]


def _checkpointed(layer: nn.Module) -> None:
    # [Note: activation checkpointing under fully_shard] Only the layer's own forward is
    # wrapped (its __call__, and so fully_shard's hooks, stay outside), so parameter names do
    # not change and the recomputation in backward runs after the unit's pre-backward
    # all-gather, on unsharded parameters.
    layer.forward = functools.partial(checkpoint, layer.forward, use_reentrant=False)  # type: ignore[method-assign]


def parallelize(
    model: nn.Module, units: Units, plan: ParallelPlan, *, mesh: DeviceMesh | None = None
) -> nn.Module:
    """Shard ``model`` in place (layers, untied embeddings, then the root) over ``mesh``."""
    for layer in units.layers:
        if plan.activation_checkpointing:
            _checkpointed(layer)
        if plan.compile:
            layer.compile()
    shard = functools.partial(
        fully_shard,
        mesh=mesh,
        mp_policy=plan.mp_policy(),
        offload_policy=plan.offload_policy(),
        reshard_after_forward=plan.reshard(),
    )
    for layer in units.layers:
        shard(layer)
    if units.embeddings is not None:
        shard(units.embeddings)
    shard(model)
    return model
