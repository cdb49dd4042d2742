"""A unit's unsharded memory in the host strategy's hands: kept, lent, taken back.

The unit's side of ``fullshard.engine.pool``'s Notes. When a reshard recycles the unit's
buffer ([Note: recycling unsharded buffers]) it goes to the host strategy's pool with a record
of what it holds (:func:`content_of`: the unit's gather of these shards at these version
counters), and the unit's next gather first asks for it back (:func:`reclaim`), granted while
that record is still current ([Note: taking back a unit's own gathered memory]). A reshard
after backward may instead lend the buffer as the slab its gradients' reduce-scatter outputs
are carved from, or a slab of fresh memory opens ([Note: gradient memory lent for the next
forward]). Only a root with a host strategy (the CPU) does any of this; on the core path the
buffer is freed (``ParamGroup._release``) and nothing here runs.
"""

from __future__ import annotations

from typing import Protocol

import torch

from .comm import CommContext
from .overrides import CommOverrides
from .param import ShardedParam
from .pool import BufferContent
from .state import ShardedState

__all__ = [
    "RecycleUnit",
    "content_of",
    "give_to_host",
    "lends_own_buffer",
    "open_fresh_slab",
    "reclaim",
    "unsharded_versions",
]


class RecycleUnit(Protocol):
    """What this module reads of a unit's group."""

    @property
    def state(self) -> ShardedState: ...

    @property
    def unsharded_buf(self) -> torch.Tensor | None: ...

    @property
    def layout(self) -> list[ShardedParam]: ...

    @property
    def gathered_versions(self) -> tuple[int, ...]:
        """:func:`unsharded_versions` when the unit's gather finished."""

    @property
    def overrides(self) -> CommOverrides: ...

    @property
    def extended(self) -> object | None: ...

    @property
    def post_forward_group(self) -> object | None: ...

    @property
    def offloaded(self) -> bool: ...

    @property
    def comm(self) -> CommContext: ...

    def unsharded_nbytes(self) -> int: ...


def unsharded_versions(g: RecycleUnit) -> tuple[int, ...]:
    """The version counters of ``g``'s unsharded parameters (a write into them bumps one)."""
    return tuple(sp.unsharded_param._version for sp in g.layout if sp.unsharded_param is not None)


def content_of(g: RecycleUnit) -> BufferContent | None:
    """What ``g``'s unsharded buffer holds, if a later gather of the unit may take it back
    instead of gathering (see the Note)."""
    if (
        g.unsharded_buf is None
        or g.state is not ShardedState.UNSHARDED  # a gather in flight never finished
        or unsharded_versions(g) != g.gathered_versions  # a write into them
        or g.overrides.all_gather is not None  # a custom comm sees every gather
        or g.extended is not None
        or g.post_forward_group is not None
        or g.offloaded
    ):
        return None
    return BufferContent.of(g, _shard_tensors(g))


def give_to_host(g: RecycleUnit, storage: torch.UntypedStorage, recycle: bool, lend: bool) -> bool:
    """Hand the freed ``storage`` of ``g``'s buffer to the host strategy: into its pool
    (``recycle``) or as the slab for the next reduce-scatter outputs (``lend``, only at the
    buffer's full size). False: it took nothing, the caller frees the storage."""
    host = g.comm.host
    if host is None:
        return False
    if recycle:
        host.keep(storage, content_of(g))
        return True
    if lend and storage.nbytes() == g.unsharded_nbytes():
        host.open_slab(storage, storage.nbytes())
        return True
    return False


def lends_own_buffer(g: RecycleUnit, slab: int, recycle: bool) -> bool:
    """Whether a slab of ``slab`` bytes is ``g``'s own freed buffer: where it is that size and
    no gather takes it (``recycle``)."""
    return bool(slab) and slab == g.unsharded_nbytes() and not recycle


def open_fresh_slab(g: RecycleUnit, slab: int) -> None:
    """Open a slab of ``slab`` bytes of fresh memory (0: none)."""
    if slab and g.comm.host is not None:
        g.comm.host.open_slab(None, slab)


def reclaim(g: RecycleUnit) -> bool:
    """Take back ``g``'s own freed memory if it still holds the current gather, in place of
    gathering."""
    buf, host = g.unsharded_buf, g.comm.host
    if buf is None or host is None:
        return False

    def holds_current(content: object) -> bool:  # g's gather of its current shards
        return isinstance(content, BufferContent) and content.is_current(g, _shard_tensors(g))

    return host.reclaim(buf.untyped_storage(), g.unsharded_nbytes(), holds_current)


def _shard_tensors(g: RecycleUnit) -> tuple[torch.Tensor, ...]:
    """Each parameter's DTensor and its local tensor (an in-place update bumps the version
    counter of only the one it went through; see the Note)."""
    return tuple(t for sp in g.layout for t in (sp.sharded_param, sp.local))
