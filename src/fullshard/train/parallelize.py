"""Apply fullshard to a model from outside, the torchtitan way (models stay parallelism-free).

Order matters and is bottom-up: tensor parallelism per layer first (``--tp``: parameters
become TP DTensors, see :mod:`fullshard.train.tp`), then activation checkpointing and
``torch.compile`` per layer (they change how a layer runs, not its parameters or names), then
``fully_shard`` on each layer, on the input embeddings when they are not tied to the output
head, and last on the root, which takes every parameter left (embeddings, final norm, head).

The mesh (:func:`build_mesh`) is ``(dp_replicate, dp_shard, tp)`` from ``init_device_mesh``;
``fully_shard`` gets its data-parallel part: ``mesh["dp_shard"]`` (ZeRO-3) or, with
``--dp-replicate`` above 1, the 2-D ``mesh["dp_replicate", "dp_shard"]`` (HSDP).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.utils.checkpoint import checkpoint

from fullshard import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from fullshard.train.degrees import MESH_DIM_NAMES, Degrees
from fullshard.train.models import Units

__all__ = ["Meshes", "ParallelPlan", "build_mesh", "parallelize"]


@dataclass(frozen=True)
class Meshes:
    """The job's mesh and the parts of it each parallelism uses."""

    full: DeviceMesh  # (dp_replicate, dp_shard, tp)
    dp: DeviceMesh  # what fully_shard gets: 1-D dp_shard, or 2-D (dp_replicate, dp_shard)
    tp: DeviceMesh | None  # None when --tp 1


def build_mesh(degrees: Degrees, device_type: str) -> Meshes:
    """``init_device_mesh`` over every rank of the job, shaped by ``degrees``."""
    full = init_device_mesh(device_type, degrees.shape, mesh_dim_names=MESH_DIM_NAMES)
    dp = full["dp_replicate", "dp_shard"] if degrees.replicate > 1 else full["dp_shard"]
    return Meshes(full=full, dp=dp, tp=full["tp"] if degrees.tp > 1 else None)


_DTYPES = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True)
class ParallelPlan:
    """How to shard: the trainer's flags, in one place."""

    mixed_precision: str = "fp32"  # fp32 | bf16 | fp16
    reshard_after_forward: str = "auto"  # auto | true | false | an int K (as text)
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

    def reshard(self) -> bool | int | None:
        """``reshard_after_forward`` for fully_shard (``None``: FSDP2's default; an int K:
        a copy sharded over K ranks)."""
        named = {"auto": None, "true": True, "false": False}
        text = self.reshard_after_forward.strip()
        return named[text] if text in named else int(text)


def _checkpointed(layer: nn.Module) -> None:
    # [Note: activation checkpointing under fully_shard] Only the layer's own forward is
    # wrapped (its __call__, and so fully_shard's hooks, stay outside), so parameter names do
    # not change and the recomputation in backward runs after the unit's pre-backward
    # all-gather, on unsharded parameters.
    layer.forward = functools.partial(checkpoint, layer.forward, use_reentrant=False)  # type: ignore[method-assign]


def parallelize(
    model: nn.Module,
    units: Units,
    plan: ParallelPlan,
    *,
    mesh: DeviceMesh | None = None,
    tp_mesh: DeviceMesh | None = None,
) -> nn.Module:
    """Shard ``model`` in place over the data-parallel ``mesh`` (layers, untied embeddings,
    then the root), after splitting its blocks over ``tp_mesh`` when given."""
    if tp_mesh is not None:
        from fullshard.train.tp import apply_tp

        apply_tp(model, units.layers, tp_mesh)
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
