"""An opt-in log of what the engine did, in order: gathers, reductions, hooks, offload copies.

Tests use it to check *when* things happen, which results and traffic counts cannot show: that
unit ``i + 1``'s all-gather is issued before unit ``i``'s forward ends (prefetch), and that a
unit's reduce-scatter is issued during backward rather than deferred to the end-of-backward
callback. Outside :func:`record_events` nothing is recorded (one list check per event).

>>> with record_events() as log:
...     model(x).sum().backward()
>>> [(e.kind, e.unit) for e in log][:3]
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

__all__ = ["EngineEvent", "emit", "record_events"]

# kind: gather_issue | gather_wait | forward_start | forward_end | backward_start |
#       reduce_issue | allreduce_issue (HSDP) | reduce_wait | backward_end | h2d | d2h |
#       unshard_alloc (detail "recycled" or "fresh", see fullshard.engine.pool)


@dataclass(frozen=True)
class EngineEvent:
    """One thing the engine did: its kind, the unit (module FQN) and details."""

    kind: str
    unit: str
    detail: str = ""  # e.g. the transport path: "packed" or "pieces"
    nbytes: int = 0  # copies (h2d / d2h); a "reused" gather_issue: the bytes not gathered


# Logs currently listening: explicit and scoped by ``record_events`` (no other global state).
_active: list[list[EngineEvent]] = []


@contextlib.contextmanager
def record_events() -> Iterator[list[EngineEvent]]:
    """Collect every :class:`EngineEvent` emitted inside the ``with`` block, in order."""
    log: list[EngineEvent] = []
    _active.append(log)
    try:
        yield log
    finally:
        _active.remove(log)


def emit(kind: str, unit: str, detail: str = "", nbytes: int = 0) -> None:
    """Record one event in every active log (a no-op when none is active)."""
    if _active:
        event = EngineEvent(kind, unit, detail, nbytes)
        for log in _active:
            log.append(event)
