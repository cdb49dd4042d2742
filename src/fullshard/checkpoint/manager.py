"""``CheckpointManager``: step-numbered checkpoints under one root, with keep-last-K rotation.

A thin policy layer over :func:`save`, :func:`load` and the functions of durability.py::

    ckpts = CheckpointManager("run/checkpoints", keep_last=3)
    extra = ckpts.load_latest(model=model, optimizer=opt)  # None on a fresh run
    ...
    ckpts.save(step, model=model, optimizer=opt, extra={"data_pos": pos})

Checkpoints are named ``step_00000010`` (8 digits); ``latest`` is the complete one with the
highest step. After each successful save only the newest ``keep_last`` are kept and leftover
``.partial`` directories from crashed saves are removed.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .durability import clean_partial, latest_checkpoint, list_checkpoints
from .loading import load
from .saving import SaveHandle, save, wait_for_pending_save

__all__ = ["CheckpointManager"]


class CheckpointManager:
    """Save and resume step-numbered checkpoints under ``root``, keeping the newest ``keep_last``."""

    def __init__(self, root: str | os.PathLike[str], *, keep_last: int | None = None) -> None:
        if keep_last is not None and keep_last < 1:
            raise ValueError(f"keep_last must be None (keep all) or >= 1, got {keep_last}")
        self.root = Path(root)
        self.keep_last = keep_last

    def path_for(self, step: int) -> Path:
        """The directory of the checkpoint for ``step``."""
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        return self.root / f"step_{step:08d}"

    def save(
        self,
        step: int,
        *,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        extra: dict[str, Any] | None = None,
        async_save: bool = False,
    ) -> SaveHandle:
        """Save the checkpoint of ``step`` (collective); ``extra["step"]`` is set to ``step``."""
        return save(
            self.path_for(step),
            model=model,
            optimizer=optimizer,
            extra={**(extra or {}), "step": step},
            async_save=async_save,
            keep_last=self.keep_last,
        )

    def latest(self) -> Path | None:
        """The newest complete checkpoint, or None."""
        return latest_checkpoint(self.root)

    def checkpoints(self) -> list[Path]:
        """All complete checkpoints, oldest first."""
        return list_checkpoints(self.root)

    def load_latest(
        self, *, model: nn.Module, optimizer: torch.optim.Optimizer | None = None
    ) -> dict[str, Any] | None:
        """Load the newest complete checkpoint and return its ``extra``; None if there is none."""
        path = self.latest()
        if path is None:
            return None
        return load(path, model=model, optimizer=optimizer)

    def wait(self) -> None:
        """Wait for a background save to be published."""
        wait_for_pending_save()

    def clean_partial(self) -> list[Path]:
        """Remove leftover ``.partial`` directories of crashed saves (rank 0 only, no save running)."""
        return clean_partial(self.root)
