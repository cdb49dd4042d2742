"""Which unit each all-gather was for, under torch FSDP2 or under fullshard.

``unit_gathers(engine, units)`` is a context manager yielding a function that returns, in
order, the units gathered since it was entered, by the names of ``units`` (name -> the first
module of the unit, that is a module ``fully_shard`` was applied to). Under fullshard it reads
the engine's event log, a gather that takes back the unit's pooled memory included (the unit
had been resharded and is gathered again); under FSDP2 it counts its all-gathers.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Callable, Iterator
from typing import Any

from torch import nn

__all__ = ["by_part", "torch_groups", "unit_gathers"]

Gathered = Callable[[], list[str]]


def torch_groups(state: Any) -> list[Any]:
    """FSDP2's param groups of a unit: a list from torch 2.12, one group (or None) before."""
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is not None:
        return list(groups)
    return [state._fsdp_param_group] if state._fsdp_param_group is not None else []


@contextlib.contextmanager
def _fsdp2(units: dict[str, nn.Module]) -> Iterator[Gathered]:
    from torch.distributed.fsdp._fully_shard import _fsdp_param_group

    unit_of = {
        id(group.fsdp_params): name
        for name, module in units.items()
        for group in torch_groups(module._get_fsdp_state())  # type: ignore[operator]
    }
    original = _fsdp_param_group.foreach_all_gather
    log: list[str] = []

    def counted(fsdp_params: Any, *args: Any, **kwargs: Any) -> Any:
        log.append(unit_of[id(fsdp_params)])
        return original(fsdp_params, *args, **kwargs)

    _fsdp_param_group.foreach_all_gather = counted
    try:
        yield lambda: list(log)
    finally:
        _fsdp_param_group.foreach_all_gather = original


@contextlib.contextmanager
def _fullshard(units: dict[str, nn.Module]) -> Iterator[Gathered]:
    from fullshard.engine.events import record_events
    from fullshard.engine.hooks import STATE_ATTR

    def gathered() -> list[str]:  # unit names are given at lazy init (the first forward)
        name_of = {m.__dict__[STATE_ATTR].name: name for name, m in units.items()}
        return [name_of[e.unit] for e in events if e.kind == "gather_issue"]

    with record_events() as events:
        yield gathered


def unit_gathers(engine: str, units: dict[str, nn.Module]) -> contextlib.AbstractContextManager:
    """``engine``: ``"torch"`` (FSDP2) or ``"fullshard"``."""
    return _fsdp2(units) if engine == "torch" else _fullshard(units)


def by_part(log: list[str], marks: list[int]) -> dict[str, Any]:
    """``log`` cut at ``marks`` (its lengths at the start of each chunk and at the end of the
    last): the forward's gathers, each chunk's, and the backward's."""
    return {
        "forward": log[: marks[0]],
        "chunks": [log[a:b] for a, b in itertools.pairwise(marks)],
        "backward": log[marks[-1] :],
    }
