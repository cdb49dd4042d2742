"""Every collective fullshard issues goes through this module — and is counted here.

The functions are thin and stateless: they issue one ``torch.distributed`` collective — or, on
gloo, the equivalent exchange of point-to-point sends and receives (see [Note: p2p on gloo]) —
asynchronously by default, and report what they sent to any active :class:`CollectiveStats`
recorder (see :func:`count_collectives`). Tests spy on traffic by using that recorder or by
patching :func:`_issue`, the single function that talks to ``torch.distributed``.

[Note: p2p on gloo]
gloo's all-gather and reduce-scatter are slow on CPU: on 2 ranks over loopback, 12.6 MiB takes
5.6 ms to all-gather and 14 ms to reduce-scatter (8.7 ms as an all-reduce), while sending each
peer its chunk with ``isend``/``irecv`` takes 3.5 ms (all-gather) and 4.1 ms (reduce-scatter,
including the local sum); on 4 ranks 5.9 vs 11.3 ms and 8.7 vs 21.5 ms
(``python benchmarks/collectives.py --nproc 2`` / ``--nproc 4``). The exchange moves exactly the
ZeRO bytes, (N - 1) / N of the buffer per rank. The all-gather receives straight into the
output; the reduce-scatter must hold all N - 1 received chunks before summing, which is free on
2 ranks (the one chunk lands in the output) but costs N - 2 chunks of scratch on more, so there
it stays an in-place all-reduce (see :func:`_algorithm`). Every message in flight has its own
tag (see ``_next_tag``); like any collective, an exchange relies on every rank issuing its
collectives in the same order.

Byte accounting ("bytes on the wire" as the ZeRO papers count them): an all-gather counts its
full output, a reduce-scatter its full input, an all-reduce its tensor. With this convention
ZeRO-3 moves 3 x parameter bytes per step (two all-gathers and one reduce-scatter).

[Note: collectives under torch's tools]
``CommDebugMode``, the profiler and the stream checker see what runs: the engine takes the
same path whether or not one watches, and touches none of their state. What they see is what
was dispatched. On the core path (the CPU fast paths off, and always on CUDA) that is FSDP2's:
one all-gather per unit gather, one reduce-scatter per unit reduction. On gloo's fast paths
([Note: the backend plan] in ``fullshard.engine.backend``) it is what ran instead: a p2p
exchange is sends and receives, which ``CommDebugMode`` does not count; a reduce-scatter run as
an in-place all-reduce counts as an all-reduce; a unit taking back its own gathered memory runs
no collective. ``tests/test_observed.py`` checks the counts against a dispatch mode that only
records, and the README's "torch's debugging tools" lists the differences.

A group of size 1 issues nothing: all-gather and reduce-scatter become local copies and the
all-reduce a no-op, so world size 1 runs the same code path without communication.
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from .backend import BackendPlan
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
    "reduce_scatter",
]

ProcessGroup = dist.ProcessGroup


def _issue(kind: str, *args: Any, **kwargs: Any) -> Any:
    """The one place that calls ``torch.distributed``; returns its Work (or None if sync).

    ``"p2p"`` takes ``(sends, recvs)``: per group rank, the tensors to send it and the tensors
    to receive from it (see :func:`_exchange`); it returns the list of their Works.
    ``"custom"`` takes ``(comm, output, input[, op])`` and calls the user's comm object (torch's
    ``AllGather`` / ``ReduceScatter`` protocol), which issues the collective itself.
    """
    if kind == "p2p":
        return _exchange(*args, **kwargs)
    if kind == "custom":  # a user's AllGather / ReduceScatter object (FSDPModule.set_custom_*)
        comm, output, input, *rest = args
        if rest:  # reduce-scatter: the op
            kwargs["op"] = rest[0]
        return comm(output_tensor=output, input_tensor=input, **kwargs)
    if kind == "all_gather":
        fn = all_gather_single
    elif kind == "reduce_scatter":
        fn = reduce_scatter_single
    elif kind == "all_reduce":
        fn = dist.all_reduce
    else:  # pragma: no cover - internal misuse
        raise ValueError(f"unknown collective kind {kind!r}")
    return fn(*args, **kwargs)


def _exchange(
    sends: list[list[torch.Tensor]],
    recvs: list[list[torch.Tensor]],
    *,
    group: ProcessGroup,
    async_op: bool = True,
) -> list[Any]:
    """Send the tensors ``sends[r]`` to, and receive ``recvs[r]`` from, every other group rank.

    One message per non-empty tensor; a peer's lists must mirror ours (its ``sends[me]`` has
    the sizes of our ``recvs[peer]``). Message ``k`` of the exchange carries tag ``base + k``,
    ``base`` drawn from the group's tag counter (see [Note: p2p on gloo]). Peers are visited in
    a rotation (send to ``me + i``, receive from ``me - i``) so that every rank talks to a
    different peer at each step instead of all sending to rank 0 first.

    The messages go straight to the group's ``send`` / ``recv`` (group ranks), what
    ``dist.isend`` / ``dist.irecv`` end in after their per-call argument checks and rank
    conversions: a unit's exchange is one message per parameter and peer, hundreds per step,
    and those checks cost as much CPU as posting the message.
    """
    size, me = group.size(), group.rank()
    n = max(len(t) for t in sends)
    base = _P2P_TAG_BASE + _next_tag.get(group, 0)
    _next_tag[group] = (_next_tag.get(group, 0) + n) % _P2P_TAG_SPACE
    if any(t.is_cuda for ts in (*sends, *recvs) for t in ts):
        return _exchange_grouped(sends, recvs, group, base)
    works = []
    for i in range(1, size):
        dst, src = (me + i) % size, (me - i) % size
        for k, t in enumerate(sends[dst]):
            if t.numel():
                works.append(group.send([_real(t)], dst, base + k))
        for k, t in enumerate(recvs[src]):
            if t.numel():
                works.append(group.recv([_real(t)], src, base + k))
    return works


def _exchange_grouped(
    sends: list[list[torch.Tensor]],
    recvs: list[list[torch.Tensor]],
    group: ProcessGroup,
    base: int,
) -> list[Any]:
    """:func:`_exchange` as one batch (``dist.batch_isend_irecv``): NCCL needs a send and a
    receive between the same two ranks grouped, or both ranks block in their sends (a pair's
    messages share one NCCL stream). Used for CUDA tensors; peers are named by global rank."""
    size, me = group.size(), group.rank()
    ops = []
    for i in range(1, size):
        dst, src = (me + i) % size, (me - i) % size
        to, frm = dist.get_global_rank(group, dst), dist.get_global_rank(group, src)
        ops += [
            dist.P2POp(dist.isend, _real(t), to, group, base + k)
            for k, t in enumerate(sends[dst])
            if t.numel()
        ]
        ops += [
            dist.P2POp(dist.irecv, _real(t), frm, group, base + k)
            for k, t in enumerate(recvs[src])
            if t.numel()
        ]
    return list(dist.batch_isend_irecv(ops)) if ops else []


def _real(t: torch.Tensor) -> torch.Tensor:
    """What a message carries for ``t``: complex tensors as their real view (as dist.isend)."""
    return torch.view_as_real(t) if t.is_complex() else t


# Per process group, the next p2p tag offset. gloo does not promise to match a peer's messages
# to our receives in posting order: with one tag per kind, a 96-byte message once landed in a
# 16-byte receive in the test suite. So every message in flight gets its own tag. Every rank issues the same exchanges on a group in the same order — as it
# must for any collective — so the counters agree across ranks without communication. Tags
# start above 2**20 to stay clear of a user's own send/recv tags on the same group.
_next_tag: weakref.WeakKeyDictionary[ProcessGroup, int] = weakref.WeakKeyDictionary()
_P2P_TAG_BASE = 1 << 20
_P2P_TAG_SPACE = 1 << 30


def _algorithm(
    kind: str,
    requested: str,
    group: ProcessGroup,
    device: torch.device,
    nbytes: int,
    plan: BackendPlan | None = None,
) -> str:
    """The call that implements ``kind`` on an ``nbytes`` buffer: ``requested`` unless it is
    ``"auto"``, which asks the backend plan (``plan``, else the group's default one; see
    :meth:`fullshard.engine.backend.BackendPlan.algorithm`), a pure function of the buffer."""
    known = ("auto", kind, "p2p", *(("all_reduce",) if kind == "reduce_scatter" else ()))
    if requested not in known:
        raise ValueError(f"{kind}: unknown algorithm {requested!r}; choose from {known}")
    if requested != "auto":
        return requested
    plan = plan or BackendPlan.for_group(group, device)
    return plan.algorithm(kind, dist.get_world_size(group), nbytes)


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
    algorithm: str = "auto",
    what: str = "",
    comm: Any = None,
    plan: BackendPlan | None = None,
) -> Handle:
    """Gather every rank's ``input`` (1-D, equal sizes) into ``output`` (rank-major).

    ``algorithm``: ``"all_gather"`` (the backend's collective), ``"p2p"`` (every rank sends its
    ``input`` to each peer; see [Note: p2p on gloo]) or ``"auto"`` (see :func:`_algorithm`).
    ``comm``: a custom ``AllGather`` object that runs the collective instead (algorithm
    ``"custom"``).
    """
    size = _local_or_size("all_gather", output, input, group, output_is_full=True)
    if size == 1:
        return Handle(None, output.device, keep=(output, input))
    assert group is not None
    if comm is not None:
        record("all_gather", output, size, "custom")
        return _start(
            "all_gather", "custom", what, size, comm, output, input, group=group, async_op=async_op
        )
    nbytes = output.numel() * output.element_size()
    algorithm = _algorithm("all_gather", algorithm, group, output.device, nbytes, plan)
    record("all_gather", output, size, algorithm)
    if algorithm != "p2p":
        return _start(
            "all_gather", "all_gather", what, size, output, input, group=group, async_op=async_op
        )
    rows = output.view(size, -1)
    me = dist.get_rank(group)
    if rows[me].data_ptr() != input.data_ptr():
        rows[me].copy_(input)
    return _gather_p2p([[row] for row in rows], group, what, async_op)


def _gather_p2p(
    pieces: list[list[torch.Tensor]], group: ProcessGroup, what: str, async_op: bool
) -> Handle:
    """Send this rank's ``pieces`` to every peer and receive theirs into their ``pieces``."""
    size, me = dist.get_world_size(group), dist.get_rank(group)
    sends = [pieces[me]] * size
    return _start("all_gather", "p2p", what, size, sends, pieces, group=group, async_op=async_op)


def all_gather_pieces(
    pieces: list[list[torch.Tensor]],
    group: ProcessGroup | None,
    *,
    nbytes: int,
    what: str = "",
) -> Handle:
    """All-gather several tensors per rank, each received straight where it belongs.

    ``pieces[r]`` are group rank ``r``'s tensors (1-D, contiguous, the same sizes on every
    rank); this rank's are the data to send, the others' are filled from their owners. Always a
    p2p exchange (gloo, see [Note: p2p on gloo]): it lets a unit's parameters be gathered into
    their unsharded buffer with no packed buffer and no copy-out. ``nbytes`` is what to count
    on the wire (the packed all-gather's full output, for comparable accounting).
    """
    size = dist.get_world_size(group) if group is not None else 1
    if len(pieces) != size or any(len(p) != len(pieces[0]) for p in pieces):
        raise ValueError(
            f"all_gather_pieces: expected {size} ranks x the same number of tensors, got "
            f"{[len(p) for p in pieces]}"
        )
    if size == 1:
        return Handle(None, pieces[0][0].device)
    assert group is not None
    me = dist.get_rank(group)
    record("all_gather", pieces[me][0], size, "p2p", nbytes=nbytes)
    return _gather_p2p(pieces, group, what, True)


def reduce_scatter(
    output: torch.Tensor,
    input: torch.Tensor,
    group: ProcessGroup | None,
    *,
    async_op: bool = True,
    algorithm: str = "auto",
    what: str = "",
    comm: Any = None,
    plan: BackendPlan | None = None,
) -> Handle:
    """Sum ``input`` (1-D, rank-major chunks) across ranks; this rank's chunk lands in ``output``.

    ``algorithm``: ``"reduce_scatter"``, ``"all_reduce"`` (reduce the whole buffer in place,
    then copy this rank's chunk; ``input`` is overwritten), ``"p2p"`` (send each peer its
    chunk, receive theirs of ours and sum them here; see [Note: p2p on gloo]) or ``"auto"``
    (see :func:`_algorithm`). Either way the record's
    kind is ``reduce_scatter`` and its bytes the ZeRO payload (the input buffer);
    ``CollectiveRecord.algorithm`` names the call used. ``input`` must stay untouched until
    the handle is waited on. ``comm``: a custom ``ReduceScatter`` object that runs the
    collective instead (algorithm ``"custom"``, op ``SUM``).
    """
    size = _local_or_size("reduce_scatter", output, input, group, output_is_full=False)
    if size == 1:
        return Handle(None, output.device, keep=(output, input))
    assert group is not None
    if comm is not None:
        record("reduce_scatter", input, size, "custom")
        return _start(
            "reduce_scatter",
            "custom",
            what,
            size,
            comm,
            output,
            input,
            dist.ReduceOp.SUM,
            group=group,
            async_op=async_op,
        )
    nbytes = input.numel() * input.element_size()
    algorithm = _algorithm("reduce_scatter", algorithm, group, input.device, nbytes, plan)
    record("reduce_scatter", input, size, algorithm)
    me = dist.get_rank(group)
    chunks = list(input.view(size, -1))
    if algorithm == "p2p":
        pieces = [[c] for c in chunks]
        return _reduce_scatter_p2p(pieces, [output], group, what, async_op)
    tensors: tuple[torch.Tensor, ...] = (output, input)
    then = None
    if algorithm == "all_reduce":  # reduce the whole buffer in place, keep this rank's row
        tensors, then = (input,), lambda: output.copy_(chunks[me])
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


def reduce_scatter_pieces(
    pieces: list[list[torch.Tensor]],
    outputs: list[torch.Tensor],
    group: ProcessGroup | None,
    *,
    nbytes: int,
    what: str = "",
) -> Handle:
    """Reduce-scatter several tensors per rank, sent from where they are, summed into place.

    ``pieces[r]`` are this rank's contributions to group rank ``r``'s result (1-D, contiguous,
    sizes agreed by all ranks); the sum over ranks of ``pieces[me]`` lands in ``outputs`` (same
    sizes; overwritten). Always a p2p exchange (gloo, see [Note: p2p on gloo]): a unit's
    gradients are sent straight from the unsharded gradients, with no packed buffer. Every
    piece must stay untouched until the handle is waited on. ``nbytes`` is what to count on the
    wire (the packed reduce-scatter's full input).
    """
    size = dist.get_world_size(group) if group is not None else 1
    me = dist.get_rank(group) if group is not None else 0
    if len(pieces) != size or any(len(p) != len(outputs) for p in pieces):
        raise ValueError(
            f"reduce_scatter_pieces: expected {size} ranks x {len(outputs)} tensors, got "
            f"{[len(p) for p in pieces]}"
        )
    if size == 1:
        for out, piece in zip(outputs, pieces[0]):
            out.copy_(piece)
        return Handle(None, outputs[0].device, keep=(*outputs, *pieces[0]))
    assert group is not None
    record("reduce_scatter", pieces[me][0], size, "p2p", nbytes=nbytes)
    return _reduce_scatter_p2p(pieces, outputs, group, what, True)


def _reduce_scatter_p2p(
    pieces: list[list[torch.Tensor]],
    outputs: list[torch.Tensor],
    group: ProcessGroup,
    what: str,
    async_op: bool,
) -> Handle:
    """The p2p reduce-scatter: the first peer's pieces land in ``outputs`` themselves, any
    other peers' in one scratch buffer; this rank's own pieces and the scratch are added on
    wait.

    The scratch is the one buffer allocated on the issuing (side) stream and read on the
    waiting one; it needs no ``record_stream``: once freed, the caching allocator hands its
    memory only to later allocations on the side stream, and every later use of a side
    stream starts by waiting for the compute stream (rule 1 of [Note: checking stream order on
    the CPU] in ``fullshard.engine.streamcheck``), so what reuses it runs after the last read.
    """
    size, me = dist.get_world_size(group), dist.get_rank(group)
    peers = [(me - i) % size for i in range(1, size)]
    sizes = [o.numel() for o in outputs]
    out0 = outputs[0]
    scratch = torch.empty(size - 2, sum(sizes), dtype=out0.dtype, device=out0.device)
    recvs: list[list[torch.Tensor]] = [[] for _ in range(size)]
    recvs[peers[0]] = list(outputs)
    for row, peer in zip(scratch, peers[1:]):
        recvs[peer] = list(row.split(sizes))

    def finish() -> None:
        for k, out in enumerate(outputs):
            out.add_(pieces[me][k])
            for peer in peers[1:]:
                out.add_(recvs[peer][k])

    return _start(
        "reduce_scatter",
        "p2p",
        what,
        size,
        pieces,
        recvs,
        group=group,
        async_op=async_op,
        then=finish,
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
    return _start(
        "all_reduce", "all_reduce", what, size, tensor, op=op, group=group, async_op=async_op
    )
