"""The one place where fullshard deals with differences between torch releases.

fullshard supports the torch releases in ``SUPPORTED_TORCH`` (the range ``pyproject.toml``
declares and CI tests: the oldest with the whole suite, the newest with ``scripts/compat.sh``).
Everything that differs between them is named here, once, as a fact about the installed torch;
no other module looks at ``torch.__version__``. What changed, by release:

- 2.15: ``FSDPModule`` gained ``set_keep_unsharded_storage``, ``set_manual_backward_finalization``
  and ``finalize_backward`` (which returns a ``torch.distributed.fsdp.GradientReductionHandle``);
  torch's pipelining finalizes a stage's backward through them instead of reaching into FSDP2's
  state (``fully_shard.state(...)``), and ``torch.distributed.pipelining.stage`` no longer
  imports ``fully_shard``. ``MixedPrecisionPolicy`` gained ``param_dtype_override_fn``, and with
  ``reduce_dtype=None`` gradients are reduced in the parameter's ``grad_dtype`` (its own dtype
  unless set) instead of ``param_dtype``.
- 2.14: nothing FSDP2 users can observe (its FSDP2 sources equal 2.13's).
"""

from __future__ import annotations

import dataclasses
import re

import torch
import torch.distributed.fsdp as _tfsdp

__all__ = [
    "MP_HAS_PARAM_DTYPE_OVERRIDE",
    "PIPELINING_USES_FINALIZE_BACKWARD",
    "REDUCE_DTYPE_FOLLOWS_GRAD_DTYPE",
    "SUPPORTED_TORCH",
    "TORCH_VERSION",
    "TorchGradientReductionHandle",
    "check_supported",
]

#: The torch releases fullshard supports: ``(oldest, first unsupported)`` as (major, minor).
SUPPORTED_TORCH = ((2, 13), (2, 16))


def _parse(version: str) -> tuple[int, int]:
    m = re.match(r"(\d+)\.(\d+)", version)
    if m is None:  # a build that does not say; assume the newest we know
        return SUPPORTED_TORCH[1][0], SUPPORTED_TORCH[1][1] - 1
    return int(m.group(1)), int(m.group(2))


#: The installed torch's (major, minor).
TORCH_VERSION: tuple[int, int] = _parse(torch.__version__)

#: torch 2.15's base class of the handle ``FSDPModule.finalize_backward(async_op=True)``
#: returns; on older releases fullshard's own handle stands alone (``object``).
TorchGradientReductionHandle: type = getattr(_tfsdp, "GradientReductionHandle", object)

#: ``MixedPrecisionPolicy(param_dtype_override_fn=...)`` exists (torch 2.15).
MP_HAS_PARAM_DTYPE_OVERRIDE = "param_dtype_override_fn" in {
    f.name for f in dataclasses.fields(_tfsdp.MixedPrecisionPolicy)
}

#: With ``reduce_dtype=None``, FSDP2 reduces in the parameter's ``grad_dtype`` (torch 2.15) rather
#: than in ``param_dtype`` (2.14 and older).
REDUCE_DTYPE_FOLLOWS_GRAD_DTYPE = TORCH_VERSION >= (2, 15)

#: torch's pipelining finishes a stage's backward with ``finalize_backward`` (2.15) rather than
#: through ``fully_shard.state(module)`` (2.14 and older; see ``fullshard.patch``).
PIPELINING_USES_FINALIZE_BACKWARD = TORCH_VERSION >= (2, 15)


def check_supported() -> str | None:
    """A one-line warning if the installed torch is outside ``SUPPORTED_TORCH``, else None."""
    lo, hi = SUPPORTED_TORCH
    if lo <= TORCH_VERSION < hi:
        return None
    return (
        f"fullshard supports torch {lo[0]}.{lo[1]} to {hi[0]}.{hi[1] - 1}; torch "
        f"{torch.__version__} is installed. Install a supported torch (pip install "
        f"'torch>={lo[0]}.{lo[1]},<{hi[0]}.{hi[1]}') or report what breaks"
    )
