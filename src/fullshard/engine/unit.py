"""CommUnit: what the code that moves a unit's bytes reads of the unit.

``fullshard.engine.gather``, ``fullshard.engine.reduce`` and ``fullshard.engine.extension``
work on one unit's :class:`~fullshard.engine.group.ParamGroup`, but are typed by protocols:
this one (what all three read) and the gather's and reduction's own, which extend it
(``gather.GatherUnit``, ``reduce.ReduceUnit``). The group imports them and satisfies the
protocols; they never import the group, so each names exactly what it depends on.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch
from torch.distributed.fsdp import MixedPrecisionPolicy

from .comm import CommContext
from .mesh import MeshInfo
from .overrides import CommOverrides
from .policies import CommPolicy

__all__ = ["CommUnit", "UnitTransport"]


class UnitTransport(Protocol):
    """What the core reads of a unit's transport (``fullshard.engine.transport.Transport``,
    which holds the plug-ins; those import the gather and reduction, hence a protocol)."""

    @property
    def local(self) -> bool:
        """One rank, nothing to move ([Note: a shard group of one rank])."""

    @property
    def gather(self) -> Callable[[Any], Any] | None:
        """A plug-in's gather of the whole unit (``None``: the core's packed gather)."""

    @property
    def reduce(self) -> Callable[..., Any] | None:
        """A plug-in's reduction of the whole unit (``None``: packed)."""

    @property
    def all_gather(self) -> Any:
        """The comm packed all-gathers run through (``None``: the backend's collective)."""

    @property
    def reduce_scatter(self) -> Any:
        """The comm packed reduce-scatters run through (``None``: the backend's)."""


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
    def transport(self) -> UnitTransport:
        """How the unit's bytes move (chosen once at lazy init)."""

    @property
    def offloaded(self) -> bool:
        """Shards, gradients and optimizer state live in host memory."""
