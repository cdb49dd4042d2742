"""The point-to-point comm plug-in: gloo's all-gather and reduce-scatter as p2p exchanges.

The core (``fullshard.engine.collectives``) issues the backend's collectives, or runs a comm
object with torch's ``AllGather`` / ``ReduceScatter`` protocol in their place. This module is
such a comm object for gloo, and the exchanges under it; it is a plug-in, chosen once per unit
with the unit's transport ([Note: transports] in ``fullshard.engine.transport``) and absent on
CUDA, where the core issues NCCL's collectives itself.

[Note: p2p on gloo]
gloo's all-gather and reduce-scatter are slow on CPU: on 2 ranks over loopback, 12.6 MiB takes
5.6 ms to all-gather and 14 ms to reduce-scatter (8.7 ms as an all-reduce), while sending each
peer its chunk with ``isend``/``irecv`` takes 3.5 ms (all-gather) and 4.1 ms (reduce-scatter,
including the local sum); on 4 ranks 5.9 vs 11.3 ms and 8.7 vs 21.5 ms
(``python benchmarks/collectives.py --nproc 2`` / ``--nproc 4``). The exchange moves exactly the
ZeRO bytes, (N - 1) / N of the buffer per rank. The all-gather receives straight into the
output; the reduce-scatter must hold all N - 1 received chunks before summing, which is free on
2 ranks (the one chunk lands in the output) but costs N - 2 chunks of scratch on more, so there
it stays an in-place all-reduce (``BackendPlan.algorithm``). Every message in flight has its
own tag (see ``_next_tag``); like any collective, an exchange relies on every rank issuing its
collectives in the same order.

:class:`P2PAllGather` / :class:`P2PReduceScatter` run a packed buffer's collective the way the
root's backend plan says for its size (the backend's collective, a p2p exchange, or the
reduce-scatter as an in-place all-reduce); :func:`all_gather_pieces` /
:func:`reduce_scatter_pieces` exchange several tensors per rank, each straight where it
belongs (the ``p2p`` transport's gathers and reductions, ``fullshard.engine.pieces``).
Records and errors go through the core's :func:`~fullshard.engine.collectives.issue`, so
``count_collectives`` names the call that ran (``CollectiveRecord.algorithm``).
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from . import collectives as C
from .backend import BackendPlan
from .compat import all_gather_single, reduce_scatter_single
from .handle import Handle, record

__all__ = [
    "P2PAllGather",
    "P2PReduceScatter",
    "all_gather_comm",
    "all_gather_pieces",
    "packed_comms",
    "reduce_scatter_pieces",
]

ProcessGroup = dist.ProcessGroup


class _Works:
    """What a p2p comm returns: its works (waited in order), then a finishing step (a copy
    or a local sum) once they are done."""

    __slots__ = ("_then", "_works")

    def __init__(self, works: list[Any], then: Callable[[], object] | None = None) -> None:
        self._works, self._then = works, then

    def wait(self, timeout: Any = None) -> bool:
        for work in self._works:
            work.wait()
        self._works = []
        if self._then is not None:
            self._then()
            self._then = None
        return True


def _finished(works: _Works, async_op: bool) -> _Works | None:
    """``works``, or, for a synchronous call (as torch's protocol has it), ``None`` once
    they have finished."""
    if async_op:
        return works
    works.wait()
    return None


class _P2PComm:
    """The buffer allocation and algorithm choice both p2p comms share."""

    kind = ""
    known: tuple[str, ...] = ()

    def __init__(self, plan: BackendPlan | None = None, algorithm: str = "auto") -> None:
        if algorithm not in ("auto", *self.known):
            raise ValueError(
                f"{self.kind}: unknown algorithm {algorithm!r}; choose from {('auto', *self.known)}"
            )
        self.plan, self.fixed = plan, algorithm

    def allocate(
        self, size: Sequence[int], *, dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def algorithm(self, group: ProcessGroup, buffer: torch.Tensor) -> str:
        """The call implementing this comm on the packed ``buffer`` (the full one) over
        ``group``: the fixed one, else the plan's (the group's default plan without one), a
        pure function of the buffer's size."""
        if self.fixed != "auto":
            return self.fixed
        plan = self.plan or BackendPlan.for_group(group, buffer.device)
        return plan.algorithm(self.kind, group.size(), buffer.numel() * buffer.element_size())


class P2PAllGather(_P2PComm):
    """torch's ``AllGather`` protocol, run as [Note: p2p on gloo] says for the buffer's size."""

    kind = "all_gather"
    known = ("all_gather", "p2p")

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: ProcessGroup,
        async_op: bool = False,
    ) -> Any:
        if self.algorithm(group, output_tensor) != "p2p":
            return all_gather_single(output_tensor, input_tensor, group=group, async_op=async_op)
        rows = output_tensor.view(group.size(), -1)
        me = group.rank()
        if rows[me].data_ptr() != input_tensor.data_ptr():
            rows[me].copy_(input_tensor)
        pieces = [[row] for row in rows]
        works = _Works(_exchange([pieces[me]] * group.size(), pieces, group=group))
        return _finished(works, async_op)


class P2PReduceScatter(_P2PComm):
    """torch's ``ReduceScatter`` protocol (sum), run as [Note: p2p on gloo] says for the
    buffer's size: the collective, a p2p exchange, or an in-place all-reduce of the whole
    input (``input_tensor`` is then overwritten)."""

    kind = "reduce_scatter"
    known = ("reduce_scatter", "all_reduce", "p2p")

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: ProcessGroup,
        op: Any = dist.ReduceOp.SUM,
        async_op: bool = False,
    ) -> Any:
        algorithm = self.algorithm(group, input_tensor)
        if algorithm == "reduce_scatter":
            return reduce_scatter_single(
                output_tensor, input_tensor, op=op, group=group, async_op=async_op
            )
        chunks = list(input_tensor.view(group.size(), -1))
        if algorithm == "p2p":
            works = _reduce_scatter_p2p([[c] for c in chunks], [output_tensor], group)
            return _finished(works, async_op)
        # the whole buffer in place, then this rank's row
        work = dist.all_reduce(input_tensor, op=op, group=group, async_op=True)
        works = _Works([work], lambda: output_tensor.copy_(chunks[group.rank()]))
        return _finished(works, async_op)


@functools.cache
def packed_comms(plan: BackendPlan) -> tuple[P2PAllGather, P2PReduceScatter] | None:
    """The comms a unit's packed buffers use under ``plan`` (one pair per plan), or ``None``
    where the plan has no p2p collectives (CUDA: the core's collectives)."""
    if not plan.p2p_collectives:
        return None
    return P2PAllGather(plan), P2PReduceScatter(plan)


def all_gather_comm(group: ProcessGroup | None, device: torch.device) -> P2PAllGather | None:
    """The comm a packed all-gather of ``device`` tensors over ``group`` runs through, as a
    unit's would under the group's default plan (``None``: the backend's collective), for
    callers outside the engine that gather one packed buffer (``fullshard.rl``)."""
    comms = packed_comms(BackendPlan.for_group(group, device))
    return comms[0] if comms else None


# ----------------------------------------------------------------------------- in pieces
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
    p2p exchange: it lets a unit's parameters be gathered into their unsharded buffer with no
    packed buffer and no copy-out. ``nbytes`` is what to count on the wire (the packed
    all-gather's full output, for comparable accounting).
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
    sends = [pieces[me]] * size
    return C.issue("all_gather", what, size, _exchange, sends, pieces, group=group)


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
    sizes; overwritten). Always a p2p exchange: a unit's gradients are sent straight from the
    unsharded gradients, with no packed buffer. Every piece must stay untouched until the
    handle is waited on. ``nbytes`` is what to count on the wire (the packed reduce-scatter's
    full input).
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
    return C.issue("reduce_scatter", what, size, _reduce_scatter_p2p, pieces, outputs, group)


def _reduce_scatter_p2p(
    pieces: list[list[torch.Tensor]],
    outputs: list[torch.Tensor],
    group: ProcessGroup,
    async_op: bool = True,
) -> _Works:
    """The p2p reduce-scatter: the first peer's pieces land in ``outputs`` themselves, any
    other peers' in one scratch buffer; this rank's own pieces and the scratch are added on
    wait.

    The scratch is the one buffer allocated on the issuing (side) stream and read on the
    waiting one; it needs no ``record_stream``: once freed, the caching allocator hands its
    memory only to later allocations on the side stream, and every later use of a side
    stream starts by waiting for the compute stream (rule 1 of [Note: checking stream order on
    the CPU] in ``fullshard.engine.streamcheck``), so what reuses it runs after the last read.
    """
    size, me = group.size(), group.rank()
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

    return _Works(_exchange(pieces, recvs, group=group), finish)


# ---------------------------------------------------------------------------- the exchange
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
    messages share one NCCL stream). Used for CUDA tensors (a ``p2p`` transport asked for on
    CUDA); peers are named by global rank."""
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
# 16-byte receive in the test suite. So every message in flight gets its own tag. Every rank
# issues the same exchanges on a group in the same order — as it must for any collective — so
# the counters agree across ranks without communication. Tags start above 2**20 to stay clear
# of a user's own send/recv tags on the same group.
_next_tag: weakref.WeakKeyDictionary[ProcessGroup, int] = weakref.WeakKeyDictionary()
_P2P_TAG_BASE = 1 << 20
_P2P_TAG_SPACE = 1 << 30
