"""CommContext: the communication resources one root's units share, by reference.

A unit's group, its per-dtype and per-mesh child groups, and the root's
:class:`~fullshard.engine.context.StepContext` all hold the *same* :class:`CommContext`: the
backend plan ([Note: the backend plan] in ``fullshard.engine.backend``), the side streams
(``fullshard.engine.streams``) and the host strategy (``fullshard.engine.host``: the CPU's
special cases; ``None`` on CUDA). Lazy init creates it once per root and binds every group to
it; nothing is copied into a group, so a choice made on the context (a test switching the
pool off, ``share_comm_ctx`` sharing streams across roots) is seen by every group at once.

Before lazy init a group holds the device's unbound context: the device's default plan, no
side streams and no host strategy, so a method called on a unit before its first forward
(``unshard()``) never needs a root and runs the core alone.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from .backend import BackendPlan
from .host import HostStrategy
from .streams import CommStreams

__all__ = ["CommContext"]


@dataclass(eq=False)
class CommContext:
    """Backend plan, side streams and host strategy of one root (see the module docstring)."""

    plan: BackendPlan
    streams: CommStreams
    host: HostStrategy[Any] | None  # None: the core alone ([Note: the host strategy])

    @classmethod
    def unbound(cls, device: torch.device) -> CommContext:
        """What a group holds before lazy init: nothing to share yet, nothing kept."""
        plan = BackendPlan.choose(device.type, "")
        return cls(plan, CommStreams(torch.device("cpu")), None)
