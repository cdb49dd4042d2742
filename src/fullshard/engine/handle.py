"""A collective in flight (:class:`Handle`), its errors, and the records of what was sent.

:mod:`fullshard.engine.collectives` issues every collective and wraps it in a :class:`Handle`;
waiting on the handle orders the waiting stream after the collective (rule 2 of [Note: streams
and buffer lifetimes] in ``fullshard.engine.streams``) and names the collective, its unit and
this rank if it fails. :func:`count_collectives` records every collective's kind and bytes on the
wire while it is active (tests and benchmarks read traffic from it).
"""

from __future__ import annotations

import contextlib
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from .streams import current_stream

__all__ = [
    "CollectiveError",
    "CollectiveRecord",
    "CollectiveStats",
    "Handle",
    "count_collectives",
    "record",
]


@dataclass(frozen=True)
class CollectiveRecord:
    """One collective as issued: its kind, bytes on the wire, dtype and group size."""

    kind: str  # "all_gather" | "reduce_scatter" | "all_reduce"
    nbytes: int
    dtype: torch.dtype
    group_size: int
    algorithm: str  # the torch.distributed call that implemented it


@dataclass
class CollectiveStats:
    """Calls, bytes and waiting time per kind, accumulated while the recorder is active."""

    records: list[CollectiveRecord] = field(default_factory=list)
    wait_seconds: float = 0.0

    def calls(self, kind: str | None = None) -> int:
        """Number of collectives of ``kind`` (all kinds when ``None``)."""
        return sum(1 for r in self.records if kind is None or r.kind == kind)

    def bytes(self, kind: str | None = None) -> int:
        """Bytes on the wire of ``kind`` (all kinds when ``None``)."""
        return sum(r.nbytes for r in self.records if kind is None or r.kind == kind)

    def by_kind(self) -> dict[str, dict[str, int]]:
        """``{kind: {"calls": n, "bytes": b}}`` — the shape benchmarks print."""
        calls: Counter[str] = Counter()
        nbytes: Counter[str] = Counter()
        for r in self.records:
            calls[r.kind] += 1
            nbytes[r.kind] += r.nbytes
        return {k: {"calls": calls[k], "bytes": nbytes[k]} for k in calls}

    def reset(self) -> None:
        """Forget everything recorded so far."""
        self.records.clear()
        self.wait_seconds = 0.0


# Recorders currently listening. Explicit and scoped by ``count_collectives``; the only other
# module-level state in fullshard is the per-group p2p tag counter (``p2p._next_tag``).
_active: list[CollectiveStats] = []


@contextlib.contextmanager
def count_collectives() -> Iterator[CollectiveStats]:
    """Record every collective fullshard issues inside the ``with`` block.

    >>> with count_collectives() as stats:
    ...     loss = model(x).sum(); loss.backward()
    >>> stats.calls("reduce_scatter")
    """
    stats = CollectiveStats()
    _active.append(stats)
    try:
        yield stats
    finally:
        _active.remove(stats)


class CollectiveError(RuntimeError):
    """A collective failed or timed out; the message names it, its unit and this rank."""

    def __init__(self, context: str, waited: float, cause: BaseException) -> None:
        rank = dist.get_rank() if dist.is_initialized() else 0
        super().__init__(
            f"rank {rank}: {context} failed after {waited:.1f}s: {cause}\n"
            f"Another rank probably stopped participating (crashed, hung, or took a different "
            f"code path and skipped this unit). The timeout is the process group's: "
            f"init_process_group(timeout=...) or `fullshard train --collective-timeout`."
        )


class Handle:
    """An in-flight collective; :meth:`wait` blocks until it completes (idempotent)."""

    __slots__ = ("_context", "_device", "_event", "_keep", "_then", "_work")

    def __init__(
        self,
        work: Any | None,
        device: torch.device,
        then: Callable[[], object] | None = None,
        context: str = "",
        keep: tuple[torch.Tensor, ...] = (),
    ) -> None:
        self._work = work  # a Work, a list of them (p2p exchange), or None
        self._device = device  # where the collective's tensors live (whose streams order it)
        self._then = then  # runs once the collective has finished (e.g. a copy-out)
        self._context = context  # what to name in errors: kind, unit, group size
        # [Note: a handle without a collective]: the issuing stream's work up to here
        self._event: Any = current_stream(device).record_event()
        self._keep = keep

    def wait(self) -> None:
        """Block until the collective has finished; record the time spent waiting.

        The current stream is ordered after the collective first: gloo's reduce-scatter
        copies its result into the output inside ``work.wait()``, on the waiting thread,
        which is the collective's own write, not the waiter's."""
        self._order_after()
        if self._work is not None:
            start = time.perf_counter()
            try:
                for work in self._work if isinstance(self._work, list) else [self._work]:
                    work.wait()
            except RuntimeError as e:
                raise CollectiveError(self._context, time.perf_counter() - start, e) from e
            waited = time.perf_counter() - start
            for stats in _active:
                stats.wait_seconds += waited
            self._work = None
        self._keep = ()
        if self._then is not None:
            self._then()
            self._then = None

    def _order_after(self) -> None:
        """Rule 2: the current stream waits for the collective (on NCCL ``work.wait()`` does
        it too; where there is no work, this event is all that orders it)."""
        if self._event is not None:
            current_stream(self._device).wait_event(self._event)
            self._event = None


# [Note: a handle without a collective]
# On one rank, and where a custom all-gather returns no work, a "collective" is a local copy
# (or nothing) issued on a side stream, and no ``work.wait()`` will make the compute stream
# wait for it. So every handle records an event on the issuing stream and :meth:`Handle.wait`
# makes the current stream wait on it (FSDP2 waits on its all-gather event with or without
# work); the handle also keeps the copy's tensors (``keep``) until then, so their memory,
# allocated on the compute stream, is not reused while the side stream still reads it. On the
# CPU the event is a logical one, which is how the stream checker sees rule 2 for every
# collective (gloo's work runs on its own threads, not on a stream).


def record(
    kind: str, tensor: torch.Tensor, group_size: int, algorithm: str = "", nbytes: int = -1
) -> None:
    """Report one collective; its bytes are ``tensor``'s unless ``nbytes`` says otherwise."""
    if not _active:
        return
    if nbytes < 0:
        nbytes = tensor.numel() * tensor.element_size()
    rec = CollectiveRecord(kind, nbytes, tensor.dtype, group_size, algorithm or kind)
    for stats in _active:
        stats.records.append(rec)
