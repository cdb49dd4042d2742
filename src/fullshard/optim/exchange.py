"""The two batched exchanges of a whole-tensor optimizer step, and their byte counts.

[Note: one exchange each way] Every exchange is one ``all_to_all_single`` over the shard group
on a flat byte buffer (gloo and NCCL both implement it with uneven splits): rank ``r``'s
segment for peer ``j`` holds, back to back, its pieces of every tensor that ``j`` receives, so
tensors of any dtypes and sizes travel in one collective, never one per parameter. Sizes come
from the layouts, which every rank knows, so nothing about sizes is exchanged first. Each piece
starts at a multiple of ``_ALIGN`` bytes so it can be viewed back as its dtype. A rank's own
piece never enters the buffer (it is copied locally) and its bytes are not counted.

Both exchanges come in two halves: ``start_gather`` / ``start_scatter`` pack the buffer and
issue the collective asynchronously, returning a :class:`Pending`; its ``wait()`` unpacks. The
optimizer issues every shard group's exchange before waiting on any, and does the work that
needs no exchange while they travel (see [Note: whole-tensor step]).

``gather`` sends every rank's piece of each tensor to that tensor's owner, which assembles the
whole tensor; ``scatter`` sends each owner's whole tensor back as pieces. A 16-byte header in
every segment of ``gather`` carries one flag per rank (the optimizer's "my shards changed
outside the optimizer" bit) at no extra collective.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

import torch
import torch.distributed as dist

from .layout import ShardLayout

__all__ = ["Pending", "Traffic", "gather", "scatter", "start_gather", "start_scatter"]

_T = TypeVar("_T")

_ALIGN = 16  # bytes; the largest element size (complex128)
_HEADER = _ALIGN  # gather's per-segment header: byte 0 is the sender's flag


@dataclass(slots=True)
class Traffic:
    """Bytes this rank sent and received over the network, and the exchanges issued."""

    sent_bytes: int = 0
    received_bytes: int = 0
    exchanges: int = 0

    def add(self, other: Traffic) -> None:
        """Accumulate ``other`` into this record."""
        self.sent_bytes += other.sent_bytes
        self.received_bytes += other.received_bytes
        self.exchanges += other.exchanges


class Pending(Generic[_T]):
    """An exchange in flight: :meth:`wait` completes it (once) and returns its result."""

    def __init__(self, work: dist.Work | None, send: torch.Tensor, finish: Callable[[], _T]):
        self._work = work
        self._send: torch.Tensor | None = send  # the engine keeps the send buffer alive
        self._finish: Callable[[], _T] | None = finish

    def wait(self) -> _T:
        """Wait for the collective, unpack the received bytes, return the exchange's result."""
        if self._finish is None:
            raise RuntimeError("this exchange was already waited on")
        if self._work is not None:
            self._work.wait()
        finish, self._finish, self._send = self._finish, None, None
        return finish()


def _padded(nbytes: int) -> int:
    return -(-nbytes // _ALIGN) * _ALIGN


def _nbytes(lay: ShardLayout, r: int, dtype: torch.dtype) -> int:
    return lay.numel(r) * dtype.itemsize


def _comm_device(group: dist.ProcessGroup, device: torch.device) -> torch.device:
    """Where the byte buffers live: NCCL cannot move host memory (CPU offload), so stage there
    on this rank's GPU."""
    if device.type == "cpu" and "nccl" in str(dist.get_backend(group)):
        return torch.device("cuda", torch.cuda.current_device())
    return device


def _bytes_view(
    buf: torch.Tensor, at: int, dtype: torch.dtype, shape: Sequence[int]
) -> torch.Tensor:
    n = 1
    for s in shape:
        n *= s
    return buf[at : at + n * dtype.itemsize].view(dtype).view(tuple(shape))


def _all_to_all(
    group: dist.ProcessGroup,
    send: torch.Tensor,
    send_splits: list[int],
    recv_splits: list[int],
    device: torch.device,
) -> tuple[torch.Tensor, dist.Work | None]:
    recv = torch.empty(sum(recv_splits), dtype=torch.uint8, device=device)
    work = dist.all_to_all_single(recv, send, recv_splits, send_splits, group=group, async_op=True)
    return recv, work


def gather(
    group: dist.ProcessGroup,
    layouts: Sequence[ShardLayout],
    owners: Sequence[int],
    locals_: Sequence[torch.Tensor],
    *,
    flag: bool = False,
) -> tuple[list[torch.Tensor | None], bool, Traffic]:
    """Assemble each tensor whole on its owner: :func:`start_gather` and wait."""
    return start_gather(group, layouts, owners, locals_, flag=flag).wait()


def scatter(
    group: dist.ProcessGroup,
    layouts: Sequence[ShardLayout],
    owners: Sequence[int],
    fulls: Sequence[torch.Tensor | None],
    outs: Sequence[torch.Tensor],
) -> Traffic:
    """Copy each owner's whole tensor into every rank's piece: :func:`start_scatter` and wait."""
    return start_scatter(group, layouts, owners, fulls, outs).wait()


def start_gather(
    group: dist.ProcessGroup,
    layouts: Sequence[ShardLayout],
    owners: Sequence[int],
    locals_: Sequence[torch.Tensor],
    *,
    flag: bool = False,
) -> Pending[tuple[list[torch.Tensor | None], bool, Traffic]]:
    """Start assembling each tensor whole on its owner from every rank's piece ``locals_[i]``.

    All layouts share ``group``. ``wait()`` returns the whole tensors (``None`` where this rank
    is not the owner), whether any rank of the group passed ``flag=True``, and the traffic.
    ``locals_`` are packed before this returns, except this rank's own pieces: leave those
    unchanged until ``wait()``.
    """
    size = dist.get_world_size(group)
    me = dist.get_rank(group)
    device = _comm_device(group, locals_[0].device if locals_ else torch.device("cpu"))
    send_splits, recv_splits = [0] * size, [0] * size
    for lay, owner, t in zip(layouts, owners, locals_):
        if owner != me:
            send_splits[owner] += _padded(_nbytes(lay, me, t.dtype))
        else:
            for r in range(size):
                if r != me:
                    recv_splits[r] += _padded(_nbytes(lay, r, t.dtype))
    for r in range(size):
        if r != me:
            send_splits[r] += _HEADER
            recv_splits[r] += _HEADER
    send = torch.zeros(sum(send_splits), dtype=torch.uint8, device=device)
    cursor = [sum(send_splits[:r]) for r in range(size)]
    for r in range(size):
        if r != me:
            send[cursor[r]] = int(flag)
            cursor[r] += _HEADER
    for lay, owner, t in zip(layouts, owners, locals_):
        if owner != me:
            _bytes_view(send, cursor[owner], t.dtype, t.shape).copy_(t)
            cursor[owner] += _padded(_nbytes(lay, me, t.dtype))
    recv, work = _all_to_all(group, send, send_splits, recv_splits, device)
    sent = send.numel()
    return Pending(
        work,
        send,
        lambda: _unpack_gather(layouts, owners, locals_, me, flag, recv, recv_splits, sent),
    )


def _unpack_gather(
    layouts: Sequence[ShardLayout],
    owners: Sequence[int],
    locals_: Sequence[torch.Tensor],
    me: int,
    flag: bool,
    recv: torch.Tensor,
    recv_splits: list[int],
    sent: int,
) -> tuple[list[torch.Tensor | None], bool, Traffic]:
    size = len(recv_splits)
    read = [sum(recv_splits[:r]) for r in range(size)]
    any_flag = flag
    for r in range(size):
        if r != me:
            any_flag = any_flag or bool(recv[read[r]].item())
            read[r] += _HEADER
    fulls: list[torch.Tensor | None] = []
    for lay, owner, t in zip(layouts, owners, locals_):
        if owner != me:
            fulls.append(None)
            continue
        full = torch.empty(lay.shape, dtype=t.dtype, device=t.device)
        for r in range(size):
            piece = lay.piece(full, r)
            if r == me:
                piece.copy_(t)
            else:
                piece.copy_(_bytes_view(recv, read[r], t.dtype, lay.piece_shape(r)))
                read[r] += _padded(_nbytes(lay, r, t.dtype))
        fulls.append(full)
    return fulls, any_flag, Traffic(sent, recv.numel(), 1)


def start_scatter(
    group: dist.ProcessGroup,
    layouts: Sequence[ShardLayout],
    owners: Sequence[int],
    fulls: Sequence[torch.Tensor | None],
    outs: Sequence[torch.Tensor],
) -> Pending[Traffic]:
    """Start copying each owner's whole tensor ``fulls[i]`` into every rank's piece ``outs[i]``.

    ``fulls[i]`` is read on the owner only (``None`` elsewhere), packed before this returns;
    ``outs[i]`` is this rank's piece, written in place (any strides) by ``wait()`` (the owner's
    own piece at once).
    """
    size = dist.get_world_size(group)
    me = dist.get_rank(group)
    device = _comm_device(group, outs[0].device if outs else torch.device("cpu"))
    send_splits, recv_splits = [0] * size, [0] * size
    for lay, owner, out in zip(layouts, owners, outs):
        if owner == me:
            for r in range(size):
                if r != me:
                    send_splits[r] += _padded(_nbytes(lay, r, out.dtype))
        else:
            recv_splits[owner] += _padded(_nbytes(lay, me, out.dtype))
    send = torch.empty(sum(send_splits), dtype=torch.uint8, device=device)
    cursor = [sum(send_splits[:r]) for r in range(size)]
    for lay, owner, full, out in zip(layouts, owners, fulls, outs):
        if owner != me:
            continue
        assert full is not None
        for r in range(size):
            if r == me:
                out.copy_(lay.piece(full, r))
            else:
                _bytes_view(send, cursor[r], out.dtype, lay.piece_shape(r)).copy_(
                    lay.piece(full, r)
                )
                cursor[r] += _padded(_nbytes(lay, r, out.dtype))
    recv, work = _all_to_all(group, send, send_splits, recv_splits, device)

    def finish() -> Traffic:
        read = [sum(recv_splits[:r]) for r in range(size)]
        for lay, owner, out in zip(layouts, owners, outs):
            if owner != me:
                out.copy_(_bytes_view(recv, read[owner], out.dtype, out.shape))
                read[owner] += _padded(_nbytes(lay, me, out.dtype))
        return Traffic(sent, recv.numel(), 1)

    sent = send.numel()
    return Pending(work, send, finish)


def all_gather_json(group: dist.ProcessGroup, payload: bytes, device: torch.device) -> list[bytes]:
    """Every group rank's ``payload`` (JSON bytes: metadata for a state dict, never pickle)."""
    size = dist.get_world_size(group)
    n = torch.tensor([len(payload)], dtype=torch.int64, device=device)
    sizes = [torch.zeros_like(n) for _ in range(size)]
    dist.all_gather(sizes, n, group=group)
    longest = max(int(s.item()) for s in sizes)
    mine = torch.zeros(longest, dtype=torch.uint8, device=device)
    mine[: len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8) if payload else 0
    got = [torch.empty_like(mine) for _ in range(size)]
    dist.all_gather(got, mine, group=group)
    return [bytes(g[: int(s.item())].cpu().tolist()) for g, s in zip(got, sizes)]
