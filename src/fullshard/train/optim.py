"""AdamW (or Muon + AdamW) over sharded parameters, its warm-up + cosine schedule, and fp16 loss scaling.

The schedule is a pure function of the step, so nothing about it needs checkpointing; the
loss scaler's state is a small JSON-able dict kept in the checkpoint's ``extra``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import nn

from fullshard.optim import local_step

__all__ = [
    "LossScaler",
    "build_optimizer",
    "lr_at",
    "muon_ns_dtype",
    "optimizer_groups",
    "set_ns_dtype",
]


def optimizer_groups(
    model: nn.Module, kind: str, layers: Sequence[nn.Module] = ()
) -> list[list[nn.Parameter]]:
    """The parameters of each param group :func:`build_optimizer` makes, in its order:
    ``adamw``: [decayed matrices, 1-D]; ``muon``: [Muon's block matrices, AdamW's decayed
    matrices, AdamW's 1-D]. Needs no storage (works on a meta model)."""
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
    adamw = [[p for p in rest if p.dim() >= 2], [p for p in rest if p.dim() < 2]]
    return [matrices, *adamw] if matrices else adamw


def muon_ns_dtype(choice: str, device: torch.device) -> str:
    """``--muon-ns-dtype``: ``auto`` is float32 on a CPU (which emulates bf16 matmuls) and
    bfloat16 (``torch.optim.Muon``'s) elsewhere; see [Note: Newton-Schulz dtype]."""
    if choice != "auto":
        return choice
    return "float32" if device.type == "cpu" else "bfloat16"


def build_optimizer(
    model: nn.Module,
    *,
    lr: float,
    weight_decay: float,
    betas: tuple[float, float],
    kind: str = "adamw",
    layers: Sequence[nn.Module] = (),
    ns_dtype: str = "bfloat16",
) -> torch.optim.Optimizer:
    """AdamW with weight decay on matrices only (not biases, norm scales or 1-D params),
    stepping on the local shards (:func:`fullshard.optim.local_step`).

    ``kind="muon"``: :class:`fullshard.optim.Muon` (``torch.optim.Muon``'s update, its
    Newton-Schulz iteration in ``ns_dtype``) on the 2-D weights of ``layers`` (the blocks), run
    on whole matrices by :class:`fullshard.optim.WholeTensor`, with the same ``lr`` and weight
    decay (``adjust_lr_fn="match_rms_adamw"`` scales its update to AdamW's RMS), and AdamW as
    above on everything else (embeddings, head, 1-D parameters). The groups are
    :func:`optimizer_groups`'.
    """
    groups = optimizer_groups(model, kind, layers)
    decayed, flat = groups[-2:]
    # foreach=False: one kernel per parameter keeps results bitwise identical to an
    # unsharded reference regardless of how parameters are grouped.
    adamw = torch.optim.AdamW(
        [{"params": decayed, "weight_decay": weight_decay}, {"params": flat, "weight_decay": 0.0}],
        lr=lr,
        betas=betas,
        foreach=False,
    )
    # Element-wise: stepped on the local shards, bit-for-bit the DTensor step without
    # DTensor's per-op dispatch ([Note: stepping on local shards]).
    adamw = local_step(adamw)
    if kind == "adamw":
        return adamw
    from fullshard.optim import MultiOptimizer, Muon, WholeTensor

    muon = WholeTensor(
        Muon,
        groups[0],
        lr=lr,
        weight_decay=weight_decay,
        adjust_lr_fn="match_rms_adamw",
        ns_dtype=ns_dtype,
    )
    return MultiOptimizer(muon, adamw)


def set_ns_dtype(optimizer: torch.optim.Optimizer, ns_dtype: str) -> None:
    """Give every Muon group ``ns_dtype`` again after a resume (a checkpoint's options win
    on load, but the compute dtype is this run's: it may run on another device)."""
    for group in optimizer.param_groups:
        if "ns_dtype" in group:
            group["ns_dtype"] = ns_dtype


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
