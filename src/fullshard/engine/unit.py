"""CommUnit: what the code that moves a unit's bytes reads of the unit.

``fullshard.engine.gather``, ``fullshard.engine.reduce`` and ``fullshard.engine.extension``
work on one unit's :class:`~fullshard.engine.group.ParamGroup`, but are typed by protocols:
this one (what all three read) and the gather's and reduction's own, which extend it
(``gather.GatherUnit``, ``reduce.ReduceUnit``). The group imports them and satisfies the
protocols; they never import the group, so each names exactly what it depends on.
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch.distributed.fsdp import MixedPrecisionPolicy

from .comm import CommContext
from .mesh import MeshInfo
from .overrides import CommOverrides
from .policies import CommPolicy
from .transport import Transport

__all__ = ["CommUnit"]


class CommUnit(Protocol):
    """A unit as its collectives see it: where it lives, how it communicates."""

    @property
    def name(self) -> str:
        """The unit's module FQN, for messages and events."""

    @property
    def device(self) -> torch.device:
        """Where unsharded parameters live and compute happens."""

    @property
    def info(self) -> MeshInfo:
        """The shard and replicate groups and this rank's place in them."""

    @property
    def world(self) -> int:
        """Ranks in the shard group."""

    @property
    def comm(self) -> CommContext:
        """The root's plan, streams and buffer pool (shared by reference)."""

    @property
    def overrides(self) -> CommOverrides:
        """Custom collectives, hooks and gradient-reduction knobs."""

    @property
    def mp_policy(self) -> MixedPrecisionPolicy: ...

    @property
    def comm_policy(self) -> CommPolicy: ...

    @property
    def transport(self) -> Transport:
        """How the unit's bytes move (chosen once at lazy init)."""

    @property
    def offloaded(self) -> bool:
        """Shards, gradients and optimizer state live in host memory."""
