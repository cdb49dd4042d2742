"""Every collective fullshard issues goes through this module — and is counted here.

The functions are thin and stateless: they issue one ``torch.distributed`` collective (or run
a comm object with torch's ``AllGather`` / ``ReduceScatter`` protocol in its place: a user's
custom collective, the backend's buffers, or the comms a unit's transport holds: a plug-in's),
asynchronously by default, and report what they sent to any active :class:`CollectiveStats`
recorder (see :func:`count_collectives`). :func:`issue` is the one door every collective and
every plug-in's exchange goes through: it names the collective in errors and wraps it in a
:class:`Handle`.

Byte accounting ("bytes on the wire" as the ZeRO papers count them): an all-gather counts its
full output, a reduce-scatter its full input, an all-reduce its tensor. With this convention
ZeRO-3 moves 3 x parameter bytes per step (two all-gathers and one reduce-scatter).

[Note: collectives under torch's tools]
``CommDebugMode``, the profiler and the stream checker see what runs: the engine takes the
same path whether or not one watches, and touches none of their state. What they see is what
was dispatched. On the core path (the CPU fast paths off, and always on CUDA) that is FSDP2's:
one all-gather per unit gather, one reduce-scatter per unit reduction. On gloo's fast paths
([Note: the backend plan] in ``fullshard.engine.backend``) it is what ran instead: a plug-in's
exchange is sends and receives, which ``CommDebugMode`` does not count; a reduce-scatter run as
an in-place all-reduce counts as an all-reduce; a unit taking back its own gathered memory runs
no collective. ``tests/test_observed.py`` checks the counts against a dispatch mode that only
records, and the README's "torch's debugging tools" lists the differences.

A group of size 1 issues nothing: all-gather and reduce-scatter become local copies and the
all-reduce a no-op, so world size 1 runs the same code path without communication.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from .compat import all_gather_single, reduce_scatter_single
from .handle import (
    CollectiveError,
    CollectiveRecord,
    CollectiveStats,
    Handle,
    count_collectives,
    record,
)

__all__ = [
    "CollectiveError",
    "CollectiveRecord",
    "CollectiveStats",
    "Handle",
    "all_gather",
    "all_reduce",
    "count_collectives",
    "issue",
    "reduce_scatter",
]

ProcessGroup = dist.ProcessGroup


def _custom(
    comm: Any,
    output: torch.Tensor,
    input: torch.Tensor,
    *rest: Any,
    group: ProcessGroup,
    async_op: bool = True,
) -> Any:
    """Run ``comm`` (torch's ``AllGather`` / ``ReduceScatter`` protocol; ``rest``: a
    reduce-scatter's op), which issues the collective itself."""
    kwargs: dict[str, Any] = {"op": rest[0]} if rest else {}
    return comm(output_tensor=output, input_tensor=input, group=group, async_op=async_op, **kwargs)


def _algorithm(comm: Any, kind: str, group: ProcessGroup, buffer: torch.Tensor) -> str:
    """What a record names as the call: the backend's ``kind``, a comm's own name for what it
    runs on ``buffer`` (a plug-in's ``algorithm(group, buffer)``), else ``"custom"``."""
    if comm is None:
        return kind
    name = getattr(comm, "algorithm", None)
    return name(group, buffer) if callable(name) else "custom"


def _device_of(args: tuple[Any, ...]) -> torch.device:
    """The device of the first tensor in a collective's arguments (nested lists included)."""
    for arg in args:
        if isinstance(arg, torch.Tensor):
            return arg.device
        if isinstance(arg, (list, tuple)):
            found = _device_of(tuple(arg))
            if found.type != "meta":
                return found
    return torch.device("meta")  # no tensor: nothing to order


def issue(
    kind: str,
    what: str,
    group_size: int,
    call: Callable[..., Any],
    *args: Any,
    then: Callable[[], object] | None = None,
    async_op: bool = True,
    **kwargs: Any,
) -> Handle:
    """Run ``call(*args, async_op=..., **kwargs)`` (what talks to ``torch.distributed``: a
    collective, a comm object, a plug-in's exchange) and wrap its work in a Handle whose errors
    name ``kind`` and ``what``; ``then`` runs once it has finished."""
    context = f"{kind} of {what or 'a tensor'} (group of {group_size} ranks)"
    start = time.perf_counter()
    try:
        work = call(*args, async_op=async_op, **kwargs)
    except RuntimeError as e:
        raise CollectiveError(context, time.perf_counter() - start, e) from e
    handle = Handle(work, _device_of(args), then=then, context=context)
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
    comm: Any = None,
) -> Handle:
    """Gather every rank's ``input`` (1-D, equal sizes) into ``output`` (rank-major).

    ``comm``: an object with torch's ``AllGather`` protocol that runs the collective instead
    (a user's custom all-gather, or a plug-in's); ``None``: the backend's all-gather.
    """
    size = _local_or_size("all_gather", output, input, group, output_is_full=True)
    if size == 1:
        return Handle(None, output.device, keep=(output, input))
    assert group is not None
    record("all_gather", output, size, _algorithm(comm, "all_gather", group, output))
    if comm is not None:
        return issue(
            "all_gather", what, size, _custom, comm, output, input, group=group, async_op=async_op
        )
    return issue(
        "all_gather", what, size, all_gather_single, output, input, group=group, async_op=async_op
    )


def reduce_scatter(
    output: torch.Tensor,
    input: torch.Tensor,
    group: ProcessGroup | None,
    *,
    async_op: bool = True,
    what: str = "",
    comm: Any = None,
) -> Handle:
    """Sum ``input`` (1-D, rank-major chunks) across ranks; this rank's chunk lands in ``output``.

    ``comm``: an object with torch's ``ReduceScatter`` protocol that runs the collective
    instead (op ``SUM``; a user's custom reduce-scatter, or a plug-in's); ``None``: the
    backend's reduce-scatter. The record's kind is ``reduce_scatter`` and its bytes the ZeRO
    payload (the input buffer); ``CollectiveRecord.algorithm`` names the call used. ``input``
    must stay untouched until the handle is waited on.
    """
    size = _local_or_size("reduce_scatter", output, input, group, output_is_full=False)
    if size == 1:
        return Handle(None, output.device, keep=(output, input))
    assert group is not None
    record("reduce_scatter", input, size, _algorithm(comm, "reduce_scatter", group, input))
    sum_ = dist.ReduceOp.SUM
    if comm is not None:
        return issue(
            "reduce_scatter",
            what,
            size,
            _custom,
            comm,
            output,
            input,
            sum_,
            group=group,
            async_op=async_op,
        )
    return issue(
        "reduce_scatter",
        what,
        size,
        reduce_scatter_single,
        output,
        input,
        op=sum_,
        group=group,
        async_op=async_op,
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
        return Handle(None, tensor.device)
    record("all_reduce", tensor, size)
    return issue(
        "all_reduce", what, size, dist.all_reduce, tensor, op=op, group=group, async_op=async_op
    )
