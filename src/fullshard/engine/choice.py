"""A unit's transport, decided from its settings ([Note: transports] in
``fullshard.engine.transport``).

``select_transport`` picks by the unit's size and its root's backend plan; here the unit's own
settings are read: whether it may be ``local`` (:func:`aliasable`, [Note: a shard group of one
rank]) and which directions stay packed because a setting needs one buffer (:func:`choose`).
``ParamGroup`` decides at lazy init and again when such a setting changes; a gather or a
reduction only reads the decision.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Protocol

import torch

from .param import ShardedParam
from .reduce import ReduceUnit, grad_division
from .transport import Transport, select_transport

__all__ = ["ChoiceUnit", "aliasable", "choose"]


class ChoiceUnit(ReduceUnit, Protocol):
    """What the decision reads of a unit, beyond what its reduction does."""

    @property
    def layout(self) -> list[ShardedParam]: ...

    @property
    def total(self) -> int:
        """Elements of one rank's packed row."""

    @property
    def extended(self) -> object | None: ...

    def compute_dtype(self) -> torch.dtype: ...

    def wire_gather_dtype(self) -> torch.dtype: ...


def choose(g: ChoiceUnit, local_ok: bool) -> Transport:
    """``g``'s one decision of how each direction moves: ``select_transport``'s choice for its
    size and backend (``local_ok``: :func:`aliasable`), kept packed where a unit's settings
    need one buffer (a custom collective takes packed buffers; a wire dtype other than the
    compute dtype, or an fp16 division split around the reduction, converts the packed
    buffer)."""
    t = select_transport(
        g.comm_policy.transport,
        g.comm.plan.backend,
        g.comm.plan.device_type,
        g.world,
        g.world * g.total * g.compute_dtype().itemsize,
        aliasable=local_ok,
        plan=g.comm.plan,
    )
    if t.local or not (t.gathers_in_pieces or t.reduces_in_pieces):
        return t
    reduce_dtype = g.wire_reduce_dtype()
    return replace(
        t,
        gathers_in_pieces=t.gathers_in_pieces
        and g.overrides.all_gather is None
        and g.wire_gather_dtype() == g.compute_dtype(),
        reduces_in_pieces=t.reduces_in_pieces
        and g.overrides.reduce_scatter is None
        and grad_division(g, reduce_dtype).pre == 1.0,
    )


def aliasable(g: ChoiceUnit) -> bool:
    """Whether ``g``'s unsharded parameters can be its shards themselves ([Note: a shard group
    of one rank] in ``fullshard.engine.transport``)."""
    dtype = g.compute_dtype()
    cp = g.comm_policy
    return (
        g.world == 1
        and g.info.replicate_size == 1
        and not g.offloaded
        and g.extended is None
        and g.overrides.allows_local()
        and g.accum_dtype() == dtype
        and cp.all_gather_dtype in (None, dtype)
        and cp.reduce_dtype in (None, dtype)
        and all(
            sp.tp_mesh is None and sp.orig_dtype == dtype and sp.local.device == g.device
            for sp in g.layout
        )
    )
