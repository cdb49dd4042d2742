"""Frozen policy dataclasses: one source of truth per setting (FSDP2-compatible names)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["CPUOffloadPolicy", "MixedPrecisionPolicy", "OffloadPolicy"]


@dataclass(frozen=True)
class MixedPrecisionPolicy:
    """Dtypes for compute and communication; ``None`` means "the parameter's own dtype".

    - ``param_dtype``: dtype of the all-gathered (unsharded) parameters used in forward/backward.
    - ``reduce_dtype``: dtype of the gradient reduction (and of gradient accumulation while
      gradient sync is off). Defaults to ``param_dtype``.
    - ``output_dtype``: dtype the unit's floating-point outputs are cast to.
    - ``cast_forward_inputs``: cast floating-point forward inputs to ``param_dtype``.

    Sharded parameters, their gradients and optimizer states stay in the original dtype.
    """

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    output_dtype: torch.dtype | None = None
    cast_forward_inputs: bool = True


@dataclass(frozen=True)
class OffloadPolicy:
    """No offloading: sharded parameters, gradients and optimizer states stay on the device."""


@dataclass(frozen=True)
class CPUOffloadPolicy(OffloadPolicy):
    """Keep sharded parameters, gradients and optimizer states in host memory.

    With an accelerator, each unit's shards are copied to the device just before its
    all-gather and gradients back after the reduction. ``pin_memory`` pins the host copies
    (only where an accelerator exists; ignored on a CPU-only machine).
    """

    pin_memory: bool = True
