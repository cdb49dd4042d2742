"""AdamW (or Muon + AdamW) over sharded parameters, its warm-up + cosine schedule, and fp16 loss scaling.

The schedule is a pure function of the step, so nothing about it needs checkpointing; the
loss scaler's state is a small JSON-able dict kept in the checkpoint's ``extra``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import nn

__all__ = ["LossScaler", "build_optimizer", "lr_at"]


def build_optimizer(
    model: nn.Module,
    *,
    lr: float,
    weight_decay: float,
    betas: tuple[float, float],
    kind: str = "adamw",
    layers: Sequence[nn.Module] = (),
) -> torch.optim.Optimizer:
    """AdamW with weight decay on matrices only (not biases, norm scales or 1-D params).

    ``kind="muon"``: ``torch.optim.Muon`` on the 2-D weights of ``layers`` (the blocks), run on
    whole matrices by :class:`fullshard.optim.WholeTensor`, with the same ``lr`` and weight
    decay (``adjust_lr_fn="match_rms_adamw"`` scales its update to AdamW's RMS), and AdamW as
    above on everything else (embeddings, head, 1-D parameters).
    """
    matrices: list[nn.Parameter] = []
    if kind == "muon":
        matrices = [
            p for layer in layers for p in layer.parameters() if p.requires_grad and p.dim() == 2
        ]
        if not matrices:
            raise ValueError(
                "--optimizer muon: the model's blocks have no 2-D weights to give Muon"
            )
    elif kind != "adamw":
        raise ValueError(f"unknown optimizer {kind!r}; choose adamw or muon")
    in_muon = {id(p) for p in matrices}
    rest = [p for p in model.parameters() if p.requires_grad and id(p) not in in_muon]
    groups = [
        {"params": [p for p in rest if p.dim() >= 2], "weight_decay": weight_decay},
        {"params": [p for p in rest if p.dim() < 2], "weight_decay": 0.0},
    ]
    # foreach=False: one kernel per parameter keeps results bitwise identical to an
    # unsharded reference regardless of how parameters are grouped.
    adamw = torch.optim.AdamW(groups, lr=lr, betas=betas, foreach=False)
    if not matrices:
        return adamw
    from fullshard.optim import MultiOptimizer, WholeTensor

    muon = WholeTensor(
        torch.optim.Muon, matrices, lr=lr, weight_decay=weight_decay, adjust_lr_fn="match_rms_adamw"
    )
    return MultiOptimizer(muon, adamw)


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
