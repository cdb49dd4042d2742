"""Every collective fullshard issues goes through this module — and is counted here.

The functions are thin and stateless: they issue one ``torch.distributed`` collective
(asynchronously by default) and report what they sent to any active :class:`CollectiveStats`
recorder (see :func:`count_collectives`). Tests spy on traffic by using that recorder or by
patching :func:`_issue`, the single function that talks to ``torch.distributed``.

Byte accounting ("bytes on the wire" as the ZeRO papers count them): an all-gather counts its
full output, a reduce-scatter its full input, an all-reduce its tensor. With this convention
ZeRO-3 moves 3 x parameter bytes per step (two all-gathers and one reduce-scatter).

A group of size 1 issues nothing: all-gather and reduce-scatter become local copies and the
all-reduce a no-op, so world size 1 runs the same code path without communication.
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

__all__ = [
    "CollectiveError",
    "CollectiveRecord",
    "CollectiveStats",
    "Handle",
    "all_gather",
    "all_reduce",
    "count_collectives",
    "reduce_scatter",
]

ProcessGroup = dist.ProcessGroup


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


# Recorders currently listening. Explicit and scoped by ``count_collectives``; nothing else
# in fullshard keeps module-level state.
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

    __slots__ = ("_context", "_then", "_work")

    def __init__(
        self,
        work: Any | None,
        then: Callable[[], object] | None = None,
        context: str = "",
    ) -> None:
        self._work = work
        self._then = then  # runs once the collective has finished (e.g. a copy-out)
        self._context = context  # what to name in errors: kind, unit, group size

    def wait(self) -> None:
        """Block until the collective has finished; record the time spent waiting."""
        if self._work is None:
            return
        start = time.perf_counter()
        try:
            self._work.wait()
        except RuntimeError as e:
            raise CollectiveError(self._context, time.perf_counter() - start, e) from e
        waited = time.perf_counter() - start
        for stats in _active:
            stats.wait_seconds += waited
        self._work = None
        if self._then is not None:
            self._then()
            self._then = None

    @property
    def done(self) -> bool:
        """Whether :meth:`wait` has returned (or nothing was ever in flight)."""
        return self._work is None


def _record(kind: str, tensor: torch.Tensor, group_size: int, algorithm: str = "") -> None:
    if not _active:
        return
    nbytes = tensor.numel() * tensor.element_size()
    rec = CollectiveRecord(kind, nbytes, tensor.dtype, group_size, algorithm or kind)
    for stats in _active:
        stats.records.append(rec)


def _issue(kind: str, *args: Any, **kwargs: Any) -> Any:
    """The one place that calls ``torch.distributed``; returns its Work (or None if sync)."""
    if kind == "all_gather":
        fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    elif kind == "reduce_scatter":
        fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    elif kind == "all_reduce":
        fn = dist.all_reduce
    else:  # pragma: no cover - internal misuse
        raise ValueError(f"unknown collective kind {kind!r}")
    return fn(*args, **kwargs)


def _start(
    kind: str,
    call: str,
    what: str,
    group_size: int,
    *args: Any,
    then: Callable[[], object] | None = None,
    async_op: bool = True,
    **kwargs: Any,
) -> Handle:
    """Issue ``call`` and wrap it in a Handle whose errors name ``kind`` and ``what``."""
    context = f"{kind} of {what or 'a tensor'} (group of {group_size} ranks)"
    start = time.perf_counter()
    try:
        work = _issue(call, *args, async_op=async_op, **kwargs)
    except RuntimeError as e:
        raise CollectiveError(context, time.perf_counter() - start, e) from e
    handle = Handle(work, then=then, context=context)
    if not async_op:
        handle.wait()
    return handle


def _local_or_size(
    kind: str,
    output: torch.Tensor,
    input: torch.Tensor,
    group: ProcessGroup | None,
    *,
    output_is_full: bool,
) -> int:
    """Check the 1-D sizes of a gather/scatter pair; on one rank, do the local copy instead."""
    size = dist.get_world_size(group) if group is not None else 1
    full, part = (output, input) if output_is_full else (input, output)
    if full.numel() != part.numel() * size:
        raise ValueError(
            f"{kind}: the full buffer has {full.numel()} elements, expected "
            f"{part.numel()} x {size} ranks = {part.numel() * size}"
        )
    if size == 1 and output.data_ptr() != input.data_ptr():
        output.copy_(input)
    return size


def all_gather(
    output: torch.Tensor,
    input: torch.Tensor,
    group: ProcessGroup | None,
    *,
    async_op: bool = True,
    what: str = "",
) -> Handle:
    """Gather every rank's ``input`` (1-D, equal sizes) into ``output`` (rank-major)."""
    size = _local_or_size("all_gather", output, input, group, output_is_full=True)
    if size == 1:
        return Handle(None)
    _record("all_gather", output, size)
    return _start(
        "all_gather", "all_gather", what, size, output, input, group=group, async_op=async_op
    )


def _reduce_scatter_algorithm(group: ProcessGroup) -> str:
    """gloo's reduce-scatter is slower than its all-reduce at every size we measured
    (BASELINES.md: 18.7 vs 13.2 ms at 16 MiB on 2 ranks), so on gloo the reduction runs as an
    all-reduce of the packed buffer and each rank keeps its chunk. NCCL uses reduce-scatter."""
    return "all_reduce" if dist.get_backend(group) == "gloo" else "reduce_scatter"


def reduce_scatter(
    output: torch.Tensor,
    input: torch.Tensor,
    group: ProcessGroup | None,
    *,
    async_op: bool = True,
    algorithm: str = "auto",
    what: str = "",
) -> Handle:
    """Sum ``input`` (1-D, rank-major chunks) across ranks; this rank's chunk lands in ``output``.

    ``algorithm``: ``"reduce_scatter"``, ``"all_reduce"`` (reduce the whole buffer in place,
    then copy this rank's chunk; ``input`` is overwritten) or ``"auto"`` (the faster one for
    the backend). Either way the record's kind is ``reduce_scatter`` and its bytes the ZeRO
    payload (the input buffer); ``CollectiveRecord.algorithm`` names the call used.
    """
    size = _local_or_size("reduce_scatter", output, input, group, output_is_full=False)
    if size == 1:
        return Handle(None)
    assert group is not None
    if algorithm == "auto":
        algorithm = _reduce_scatter_algorithm(group)
    _record("reduce_scatter", input, size, algorithm)
    tensors: tuple[torch.Tensor, ...] = (output, input)
    then = None
    if algorithm == "all_reduce":  # reduce the whole buffer in place, keep this rank's row
        chunk = input.view(size, -1)[dist.get_rank(group)]
        tensors, then = (input,), lambda: output.copy_(chunk)
    return _start(
        "reduce_scatter",
        algorithm,
        what,
        size,
        *tensors,
        op=dist.ReduceOp.SUM,
        group=group,
        async_op=async_op,
        then=then,
    )


def all_reduce(
    tensor: torch.Tensor,
    group: ProcessGroup | None,
    *,
    op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM,
    async_op: bool = True,
    what: str = "",
) -> Handle:
    """Reduce ``tensor`` in place across the ranks of ``group`` (SUM by default)."""
    size = dist.get_world_size(group) if group is not None else 1
    if size == 1:
        return Handle(None)
    _record("all_reduce", tensor, size)
    return _start(
        "all_reduce", "all_reduce", what, size, tensor, op=op, group=group, async_op=async_op
    )
