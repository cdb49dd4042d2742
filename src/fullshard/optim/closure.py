"""The ``closure`` argument every ``torch.optim.Optimizer.step`` takes."""

from __future__ import annotations

from collections.abc import Callable

import torch

__all__ = ["run_closure"]


def run_closure(closure: Callable[[], float] | None) -> float | None:
    """Re-evaluate the loss with gradients enabled (inside a ``no_grad`` step), if given."""
    if closure is None:
        return None
    with torch.enable_grad():
        return closure()
