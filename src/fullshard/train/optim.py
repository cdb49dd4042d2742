"""AdamW over sharded parameters, its warm-up + cosine schedule, and fp16 loss scaling.

The schedule is a pure function of the step, so nothing about it needs checkpointing; the
loss scaler's state is a small JSON-able dict kept in the checkpoint's ``extra``.
"""

from __future__ import annotations

import math

import torch
from torch import nn

__all__ = ["LossScaler", "build_optimizer", "lr_at"]


def build_optimizer(
    model: nn.Module, *, lr: float, weight_decay: float, betas: tuple[float, float]
) -> torch.optim.AdamW:
    """AdamW with weight decay on matrices only (not biases, norm scales or 1-D params)."""
    decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    groups = [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    # foreach=False: one kernel per parameter keeps results bitwise identical to an
    # unsharded reference regardless of how parameters are grouped.
    return torch.optim.AdamW(groups, lr=lr, betas=betas, foreach=False)


def lr_at(step: int, *, lr: float, warmup: int, total: int, min_ratio: float) -> float:
    """Learning rate of 1-based ``step``: linear warm-up, then cosine decay to ``min_ratio*lr``."""
    if warmup and step <= warmup:
        return lr * step / warmup
    progress = (step - warmup) / max(1, total - warmup)
    cosine = 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))
    return lr * (min_ratio + (1.0 - min_ratio) * cosine)


class LossScaler:
    """Dynamic loss scaling for fp16: grow the scale after ``interval`` good steps, halve on
    non-finite gradients (the loop skips those steps). Disabled, it is the identity."""

    def __init__(self, enabled: bool, *, init_scale: float = 2.0**16, interval: int = 200) -> None:
        self.enabled = enabled
        self.scale = init_scale if enabled else 1.0
        self.interval = interval
        self.good_steps = 0

    def update(self, finite: bool) -> None:
        """Account for one step whose gradients were (or were not) finite."""
        if not self.enabled:
            return
        if not finite:
            self.scale = max(self.scale / 2.0, 1.0)
            self.good_steps = 0
            return
        self.good_steps += 1
        if self.good_steps >= self.interval:
            self.scale *= 2.0
            self.good_steps = 0

    def state_dict(self) -> dict[str, float]:
        """JSON-able state."""
        return {"scale": self.scale, "good_steps": self.good_steps}

    def load_state_dict(self, state: dict[str, float]) -> None:
        """Restore :meth:`state_dict`."""
        if self.enabled and state:
            self.scale = float(state["scale"])
            self.good_steps = int(state["good_steps"])
