"""Policies: FSDP2's own classes plus fullshard's :class:`CommPolicy`.

``MixedPrecisionPolicy``, ``OffloadPolicy`` and ``CPUOffloadPolicy`` ARE
``torch.distributed.fsdp``'s classes (only the types are imported; torch's FSDP engine never
runs), so a policy built by a framework (Accelerate, transformers, Lightning) from torch's names
is accepted as is:

- ``MixedPrecisionPolicy(param_dtype, reduce_dtype, output_dtype, cast_forward_inputs)``: dtype
  of the all-gathered parameters used in forward/backward; of the gradient reduction (and of
  gradient accumulation while gradient sync is off; defaults to ``param_dtype``); the unit's
  floating-point outputs are cast to ``output_dtype``; floating-point forward inputs are cast to
  ``param_dtype`` when ``cast_forward_inputs``. ``None`` means "the parameter's own dtype".
  Sharded parameters, their gradients and optimizer states stay in the original dtype.
- ``OffloadPolicy()``: no offloading.
- ``CPUOffloadPolicy(pin_memory=True)``: sharded parameters, gradients and optimizer states live
  in host memory; with an accelerator each unit's shards are copied to the device just before
  its all-gather and gradients back after the reduction (``pin_memory`` is ignored on a
  CPU-only machine).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch import nn
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy

from .backend import CPU_CHOICES
from .compat import MP_HAS_PARAM_DTYPE_OVERRIDE

__all__ = [
    "CPUOffloadPolicy",
    "CommPolicy",
    "MixedPrecisionPolicy",
    "OffloadPolicy",
    "keeps_own_dtype",
    "own_dtype_policy",
]


def keeps_own_dtype(mp: MixedPrecisionPolicy, param: nn.Parameter, fqn: str) -> bool:
    """Whether ``mp.param_dtype_override_fn`` (torch 2.15) keeps ``param`` in its own dtype.

    Called once per parameter by ``fully_shard``, on the parameter as the user built it. As in
    FSDP2 the function may return ``None`` or ``param_dtype`` (the default) or the parameter's
    own dtype; anything else is refused.
    """
    fn = getattr(mp, "param_dtype_override_fn", None)
    if fn is None or mp.param_dtype is None:
        return False
    got = fn(param)
    if got is None:
        return False
    if not isinstance(got, torch.dtype):
        raise ValueError(
            f"param_dtype_override_fn must return a torch.dtype or None but got "
            f"{type(got).__name__} for parameter {fqn!r}"
        )
    if got not in (mp.param_dtype, param.dtype):
        raise ValueError(
            f"param_dtype_override_fn must return None, param_dtype, or the parameter's "
            f"original dtype but got {got} for parameter {fqn!r} with dtype {param.dtype} "
            f"and param_dtype {mp.param_dtype}"
        )
    return got == param.dtype and got != mp.param_dtype


def own_dtype_policy(mp: MixedPrecisionPolicy) -> MixedPrecisionPolicy:
    """``mp`` for parameters gathered in their own dtype (no ``param_dtype``, no override)."""
    if MP_HAS_PARAM_DTYPE_OVERRIDE:
        return replace(mp, param_dtype=None, param_dtype_override_fn=None)  # type: ignore[call-arg]
    return replace(mp, param_dtype=None)


@dataclass(frozen=True)
class CommPolicy:
    """Low-precision communication with full-precision masters and accumulation (beyond FSDP2).

    - ``all_gather_dtype``: dtype parameters travel in during all-gathers: ``torch.bfloat16``
      (2x fewer bytes than fp32) or ``torch.int8`` (block-wise absmax quantisation, one fp32
      scale per ``block_size`` elements: ~3.9x fewer bytes). Gathered values are dequantised
      into the compute dtype (``MixedPrecisionPolicy.param_dtype`` or the parameter's own).
    - ``reduce_dtype``: dtype of the gradient reduce-scatter (e.g. ``torch.bfloat16``); the
      sharded gradient is accumulated in the parameter's dtype (fp32 masters).

    ``None`` leaves that collective as the mixed-precision policy says.

    - ``transport``: how units move their bytes (see ``fullshard.engine.transport``): ``"packed"``
      (one rank-major buffer per collective, what NCCL runs), ``"p2p"`` (point-to-point
      exchanges straight into / out of each parameter, no packed buffers) or ``"auto"`` (the
      faster for the backend: p2p pieces on gloo, packed on NCCL).
    - ``cpu_fast_paths_off``: CPU special cases to switch off, read from the root unit's policy
      (names in ``fullshard.engine.backend.CPU_CHOICES``: ``"pieces"``, ``"p2p_collectives"``,
      ``"small_unit_window"``, ``"buffer_pool"``, ``"grad_slabs"``; see [Note: the backend
      plan]). Results are the same with any of them off; only speed and memory change.
    """

    all_gather_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    block_size: int = 256
    transport: str = "auto"
    cpu_fast_paths_off: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        unknown = [c for c in self.cpu_fast_paths_off if c not in CPU_CHOICES]
        if unknown:
            raise ValueError(
                f"CommPolicy.cpu_fast_paths_off names {unknown}; choose from {CPU_CHOICES}"
            )
        if self.transport not in ("auto", "packed", "p2p"):
            raise ValueError(
                f"CommPolicy.transport must be 'auto', 'packed' or 'p2p', got {self.transport!r}"
            )
        allowed = (None, torch.bfloat16, torch.float16, torch.int8, torch.float32)
        if self.all_gather_dtype not in allowed:
            raise ValueError(
                f"CommPolicy.all_gather_dtype must be one of bfloat16, float16, int8, float32 "
                f"or None, got {self.all_gather_dtype}"
            )
        if self.reduce_dtype == torch.int8:
            raise ValueError("CommPolicy.reduce_dtype cannot be int8: sums need a float type")
        if self.block_size < 1:
            raise ValueError(f"CommPolicy.block_size must be >= 1, got {self.block_size}")
