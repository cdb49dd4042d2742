"""Colocated weight sync: whole per-dtype buckets handed to an engine on the same host.

[Note: colocated buckets]
Where the trainer and the inference engine share a host (and, on GPUs, the devices: verl's and
slime's default), the engine need not receive bytes at all: it can read the trainer's memory.
:func:`publish_colocated` gathers the full weights unit by unit (:func:`fullshard.rl.publish`'s
packed gathers) straight into *buckets*: one flat tensor per wire dtype, at most
``bucket_bytes`` long (or one weight's size where a weight alone is larger), holding whole
weights at element offsets. A full bucket is handed over as one :class:`BucketMessage`: one IPC
handle for the whole flat tensor (``torch.multiprocessing.reductions.reduce_tensor``: a CUDA IPC
handle on GPUs, shared memory on the CPU) and, per weight, its checkpoint name, shape, strides
and offset. The engine's process opens the handle once per bucket
(:func:`colocated_buckets`: the ``rebuild_*`` function the handle names) and views every weight
in place (``as_strided`` on the bucket: no copy), then loads them into its model
(:func:`receive_colocated` with a :class:`~fullshard.rl.WeightReceiver`, or a callback taking
``(name, tensor)`` pairs as vLLM's ``load_weights`` and SGLang's
``update_weights_from_tensor`` do). One handle per bucket rather than per weight: opening a
handle costs far more than viewing a tensor.

Messages travel over a :class:`Link` (anything with ``send_bytes`` / ``recv_bytes``: a
``multiprocessing`` pipe end, a ZMQ socket wrapped in two lines, or :class:`DistLink` over
``torch.distributed``); each is a ``ForkingPickler`` byte string, which is what turns a CPU
bucket's storage into a shared-memory file descriptor (or file name, under the
``file_system`` sharing strategy) the engine's process can map. A descriptor is handed over by
``multiprocessing``'s resource sharer, which admits only processes of one family (started from
one parent, sharing its ``authkey``): between unrelated CPU processes (e.g. Ray actors) call
``torch.multiprocessing.set_sharing_strategy("file_system")`` in both. CUDA handles need
neither.

Which rank publishes: every training rank gathers (the gathers are collective) and every rank
given a link hands its own engine the full weights, as verl does on a colocated host (rank
``r``'s local GPU serves engine ``r``). A rank given ``None`` gathers and hands nothing (e.g.
only rank 0, for one engine on a CPU host).

[Note: the bucket lifetime protocol]
The trainer owns every bucket; the engine borrows it. Per wire dtype the trainer keeps a ring
of ``buffers`` flat tensors (allocated on first use, in shared memory on the CPU, on the
weights' device on GPUs) and numbers the buckets it sends ``0, 1, ...``:

1. The trainer fills a ring slot, makes the writes visible (below), and sends the bucket's
   message; the slot is now *lent* under the bucket's number.
2. The engine opens the handle, views, loads (copies out of the bucket), waits for its copies
   to finish (on CUDA: its stream synchronized), drops every reference to the bucket, and only
   then sends the ack, ``ack <number>``, in order.
3. The trainer writes a lent slot again only after that slot's bucket was acknowledged, and
   returns from :func:`publish_colocated` only after an end marker was sent and every bucket
   (and the end marker) acknowledged: then no engine holds or reads any bucket, and the ring
   is freed. With ``buffers=2`` the trainer fills one slot while the engine loads the other.

An engine that keeps the views beyond the ack (as its weights) reads memory the trainer
overwrites in the next sync: it must copy, which is what loading into its own model does.

[Note: CUDA IPC]
On CUDA, ``reduce_tensor`` shares the caching allocator's whole block (the handle names the
``cudaMalloc`` allocation and the bucket's offset in it), so: (a) the trainer must keep the
bucket's storage alive until the engine is done with it — the ring holds it, and the protocol
above says when the engine is done (torch's IPC reference counting would also delay the
block's reuse by the allocator after a free, but not an in-place overwrite, which is what a
ring does); (b) the gathers and copies that filled the bucket run asynchronously on the
trainer's stream, so the trainer synchronizes that stream before sending the handle (the
engine's process cannot wait on the trainer's stream otherwise); (c) the engine synchronizes
its own stream before acknowledging, so its copies have read the bucket before the trainer
overwrites it; (d) nothing goes through host memory: the buckets live on the weights' device
and the messages carry only handles and metadata. The handle names the trainer's device by
its index, so the engine's process must see that device under the same index (the same
``CUDA_VISIBLE_DEVICES``); where the caching allocator runs with ``expandable_segments``, check
that your torch shares such memory by CUDA IPC. Two processes on one GPU cannot talk over
NCCL: use a CPU link (a pipe, ZMQ, or :class:`DistLink` on a gloo group).
"""

from __future__ import annotations

import pickle
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from multiprocessing.reduction import ForkingPickler
from typing import Any, Protocol

import torch
import torch.distributed as dist
import torch.multiprocessing
from torch import nn
from torch.multiprocessing.reductions import reduce_tensor

from fullshard.engine import count_collectives

from .names import named_weights
from .receiver import WeightReceiver
from .weights import DEFAULT_BUCKET_BYTES, Gathered, gathered
from .wire import SyncReport, wire_device

__all__ = [
    "BucketEntry",
    "BucketMessage",
    "DistLink",
    "Link",
    "ReceivedBucket",
    "colocated_buckets",
    "publish_colocated",
    "receive_colocated",
]

_SIZE_TAG, _BYTES_TAG = 4111, 4112


class Link(Protocol):
    """A two-way byte channel between a trainer rank and its engine process
    (``multiprocessing.connection.Connection`` is one). A link whose sends may still be in
    flight when they return also has ``flush()``, which waits for them: the sync functions call
    it before they return, when the link has one."""

    def send_bytes(self, buf: bytes) -> None: ...

    def recv_bytes(self) -> bytes: ...


class DistLink:
    """A :class:`Link` over ``torch.distributed`` point-to-point messages with global rank
    ``peer``, as tensors on ``group``'s device ([Note: the wire's device] in
    ``fullshard.rl.wire``). Sends do not block (so the trainer sends a bucket while the engine
    sends an ack); :meth:`flush` waits for those in flight. For processes sharing a GPU,
    pass a gloo group: NCCL refuses two ranks on one device."""

    def __init__(self, peer: int, group: dist.ProcessGroup | None = None) -> None:
        self.peer, self.group = peer, group
        self.device = wire_device(group)
        self._sending: list[tuple[Any, torch.Tensor]] = []  # (work, tensor) in flight

    def send_bytes(self, buf: bytes) -> None:
        """Send ``buf`` (two messages: its length, then its bytes)."""
        self._sending = [s for s in self._sending if not s[0].is_completed()]
        for tag, t in (
            (_SIZE_TAG, torch.tensor([len(buf)], dtype=torch.int64)),
            (_BYTES_TAG, torch.frombuffer(bytearray(buf), dtype=torch.uint8)),
        ):
            t = t.to(self.device)
            self._sending.append((dist.isend(t, self.peer, self.group, tag=tag), t))

    def recv_bytes(self) -> bytes:
        """Receive the next ``send_bytes`` of the peer."""
        size = torch.empty(1, dtype=torch.int64, device=self.device)
        dist.recv(size, self.peer, self.group, tag=_SIZE_TAG)
        body = torch.empty(int(size.item()), dtype=torch.uint8, device=self.device)
        dist.recv(body, self.peer, self.group, tag=_BYTES_TAG)
        return body.cpu().numpy().tobytes()

    def flush(self) -> None:
        """Wait for every send in flight (the sync functions call it when they are done)."""
        for work, _ in self._sending:
            work.wait()
        self._sending.clear()


@dataclass(frozen=True)
class BucketEntry:
    """One weight in a bucket: ``bucket.as_strided(shape, stride, offset)``."""

    name: str  # checkpoint name ([Note: checkpoint names] in fullshard.rl.names)
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int  # elements from the bucket's first


@dataclass(frozen=True)
class BucketMessage:
    """One bucket as the trainer hands it over ([Note: colocated buckets]); the end marker has
    no ``handle``."""

    seq: int  # the bucket's number; the engine acknowledges it ([Note: the lifetime protocol])
    dtype: torch.dtype
    numel: int  # elements in use, from the bucket's first
    handle: tuple[Callable[..., torch.Tensor], tuple[Any, ...]] | None  # reduce_tensor's
    entries: tuple[BucketEntry, ...] = ()


def _ack(seq: int) -> bytes:
    return f"ack {seq}".encode()


def _flush(link: Link) -> None:
    flush = getattr(link, "flush", None)
    if callable(flush):
        flush()


def _ready(t: torch.Tensor) -> None:
    """Wait for the work queued on ``t``'s device stream ([Note: CUDA IPC] (b), (c))."""
    if t.device.type == "cuda":
        torch.cuda.current_stream(t.device).synchronize()


@dataclass
class _Slot:
    tensor: torch.Tensor  # flat, of the ring's dtype
    lent: int = -1  # the bucket it holds until acknowledged (-1: free)


@dataclass
class _Open:
    slot: _Slot
    used: int = 0
    entries: list[BucketEntry] = field(default_factory=list)


class _Sender:
    """Fills per-dtype buckets from a publication and lends them over a link, keeping
    [Note: the bucket lifetime protocol]."""

    def __init__(
        self, link: Link, capacity: dict[torch.dtype, int], bucket_bytes: int, buffers: int
    ) -> None:
        self.link, self.capacity, self.buffers = link, capacity, buffers
        self.bucket_bytes = bucket_bytes
        self.rings: dict[torch.dtype, list[_Slot]] = {}
        self.turn: dict[torch.dtype, int] = {}
        self.open: dict[torch.dtype, _Open] = {}
        self.sent = 0  # buckets sent (the next one's number)
        self.acked = 0  # buckets acknowledged (in order: 0 .. acked - 1)
        self.bytes = 0
        self.events: list[tuple[str, int]] = []  # ("send" | "ack" | "reuse", bucket)

    def add(self, g: Gathered) -> None:
        """Write ``g``'s full tensor into its dtype's open bucket (sending it first if full)."""
        numel = g.shape.numel()
        bucket = self.open.get(g.dtype)
        limit = max(self.bucket_bytes // g.dtype.itemsize, 1)
        if bucket is not None and bucket.used and bucket.used + numel > limit:
            self._send(g.dtype)
            bucket = None
        if bucket is None:
            bucket = self.open[g.dtype] = _Open(self._take(g.dtype, g.device))
        view = bucket.slot.tensor[bucket.used : bucket.used + numel].view(g.shape)
        g.into(view)
        bucket.entries.append(BucketEntry(g.name, tuple(g.shape), view.stride(), bucket.used))
        bucket.used += numel

    def _take(self, dtype: torch.dtype, device: torch.device) -> _Slot:
        """The ring's next slot, once its last bucket was acknowledged."""
        ring = self.rings.setdefault(dtype, [])
        turn = self.turn.get(dtype, 0)
        self.turn[dtype] = (turn + 1) % self.buffers
        if turn == len(ring):
            flat = torch.empty(self.capacity[dtype], dtype=dtype, device=device)
            ring.append(_Slot(flat.share_memory_() if device.type == "cpu" else flat))
        slot = ring[turn]
        if slot.lent >= 0:
            self._wait(slot.lent)
            self.events.append(("reuse", slot.lent))
            slot.lent = -1
        return slot

    def _send(self, dtype: torch.dtype) -> None:
        bucket = self.open.pop(dtype)
        flat = bucket.slot.tensor
        _ready(flat)
        msg = BucketMessage(
            self.sent, dtype, bucket.used, reduce_tensor(flat), tuple(bucket.entries)
        )
        self.link.send_bytes(bytes(ForkingPickler.dumps(msg)))
        self.events.append(("send", self.sent))
        bucket.slot.lent = self.sent
        self.sent += 1
        self.bytes += bucket.used * dtype.itemsize

    def _wait(self, seq: int) -> None:
        """Read acks until bucket ``seq`` (and every one before it) is acknowledged."""
        while self.acked <= seq:
            got = self.link.recv_bytes()
            if got != _ack(self.acked):
                raise RuntimeError(
                    f"fullshard.rl: the engine sent {got[:40]!r} where the trainer expected "
                    f"{_ack(self.acked)!r}; receive with colocated_buckets / receive_colocated"
                )
            self.events.append(("ack", self.acked))
            self.acked += 1

    def close(self) -> None:
        """Send the open buckets and the end marker; wait for every ack; free the ring."""
        for dtype in list(self.open):
            self._send(dtype)
        end = BucketMessage(self.sent, torch.uint8, 0, None)
        self.link.send_bytes(bytes(ForkingPickler.dumps(end)))
        self._wait(self.sent)  # the end marker's ack: every bucket's came before it
        _flush(self.link)
        self.rings.clear()
        if torch.cuda.is_initialized():
            torch.cuda.ipc_collect()  # release what the engine's process let go


def _capacity(
    model: nn.Module, dtype: torch.dtype | None, bucket_bytes: int
) -> dict[torch.dtype, int]:
    """Per wire dtype, a ring slot's elements: ``bucket_bytes`` worth, or the largest weight
    (a bucket holds one weight larger than ``bucket_bytes``, alone)."""
    out: dict[torch.dtype, int] = {}
    for _, p in named_weights(model):
        wire = dtype or p.dtype
        out[wire] = max(out.get(wire, 1), bucket_bytes // wire.itemsize, p.numel())
    return out


def publish_colocated(
    model: nn.Module,
    link: Link | None,
    *,
    dtype: torch.dtype | None = None,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    buffers: int = 2,
    events: list[tuple[str, int]] | None = None,
) -> SyncReport:
    """Hand ``model``'s full weights to the engine process at the other end of ``link`` as
    whole per-dtype buckets shared through IPC ([Note: colocated buckets]).

    Collective over the training ranks, like :func:`fullshard.rl.publish` (whose gathers it
    runs, with ``dtype`` the wire dtype and ``bucket_bytes`` also the gathers' bound): every
    rank calls it; a rank with ``link=None`` gathers and hands nothing. A bucket holds at most
    ``bucket_bytes`` (or one larger weight); ``buffers`` buckets per dtype are in use at once,
    each reused only after the engine acknowledged it, and the call returns once the engine
    acknowledged everything ([Note: the bucket lifetime protocol]). On CUDA the buckets stay on
    the device ([Note: CUDA IPC]). ``events``, if given, receives the ring's
    ``("send" | "ack" | "reuse", bucket)`` order (``reuse``: the slot that held the bucket
    is written again). The report's ``path`` is ``"colocated"``,
    ``messages`` the buckets, ``bytes_sent`` the bytes they held.
    """
    if bucket_bytes < 1 or buffers < 1:
        raise ValueError(
            f"publish_colocated: bucket_bytes ({bucket_bytes}) and buffers ({buffers}) must be "
            "positive"
        )
    report, t0 = SyncReport(path="colocated"), time.perf_counter()
    sender = None
    if link is not None:
        sender = _Sender(link, _capacity(model, dtype, bucket_bytes), bucket_bytes, buffers)
    with count_collectives() as stats:
        for g in gathered(model, dtype=dtype, bucket_bytes=bucket_bytes):
            if sender is not None:
                sender.add(g)
                report.device = str(g.device)
    if sender is not None:
        sender.close()
        report.messages, report.bytes_sent = sender.sent, sender.bytes
        if events is not None:
            events.extend(sender.events)
    report.gathers, report.gather_bytes = stats.calls(), stats.bytes()
    report.seconds = time.perf_counter() - t0
    return report


class ReceivedBucket:
    """One bucket open in the engine's process: the trainer's flat tensor, shared, and every
    weight viewed in it without a copy. Valid until the next bucket is asked for."""

    def __init__(self, msg: BucketMessage) -> None:
        assert msg.handle is not None
        rebuild, args = msg.handle
        self.seq, self.dtype, self.numel, self.entries = msg.seq, msg.dtype, msg.numel, msg.entries
        self.tensor: torch.Tensor = rebuild(*args)
        if self.tensor.dtype != msg.dtype or self.tensor.dim() != 1:
            raise ValueError(f"bucket {msg.seq}: not a flat {msg.dtype} tensor")

    def named_tensors(self) -> list[tuple[str, torch.Tensor]]:
        """``(checkpoint name, view)`` for every weight in the bucket: views of its storage."""
        base = self.tensor.storage_offset()
        return [
            (e.name, self.tensor.as_strided(e.shape, e.stride, base + e.offset))
            for e in self.entries
        ]

    @property
    def nbytes(self) -> int:
        """The bytes of the bucket in use."""
        return self.numel * self.dtype.itemsize


def colocated_buckets(link: Link) -> Iterator[ReceivedBucket]:
    """The engine's side of :func:`publish_colocated`: each bucket, opened from its IPC handle.

    A bucket is acknowledged when the next one is asked for: by then the consumer has loaded
    it (copied out) and keeps no view of it; on CUDA its stream is synchronized first
    ([Note: the bucket lifetime protocol], [Note: CUDA IPC]). Iterate to the end (the trainer
    waits for every ack).
    """
    while True:
        msg = pickle.loads(link.recv_bytes())
        if not isinstance(msg, BucketMessage):
            raise TypeError(f"fullshard.rl: expected a BucketMessage, got {type(msg).__name__}")
        if msg.handle is None:
            link.send_bytes(_ack(msg.seq))
            _flush(link)
            return
        bucket = ReceivedBucket(msg)
        yield bucket
        _ready(bucket.tensor)
        del bucket  # this generator's reference; the consumer dropped its own
        link.send_bytes(_ack(msg.seq))


def receive_colocated(
    link: Link,
    receiver: WeightReceiver | None = None,
    *,
    load: Callable[[Iterable[tuple[str, torch.Tensor]]], object] | None = None,
) -> SyncReport:
    """Receive every bucket :func:`publish_colocated` lends over ``link`` and load it: into
    ``receiver`` (each weight copied into the receiver's tensor, cast to its dtype) and/or by
    ``load`` (given each bucket's ``(name, view)`` pairs, e.g. an engine's ``load_weights``;
    it must copy what it keeps). Returns the report: ``path`` ``"colocated"``, ``messages``
    the buckets, ``bytes_received`` their bytes."""
    if receiver is None and load is None:
        raise ValueError("receive_colocated: give a WeightReceiver, a load callback, or both")
    report, t0 = SyncReport(path="colocated"), time.perf_counter()
    for bucket in colocated_buckets(link):
        named = bucket.named_tensors()
        if receiver is not None:
            for name, view in named:
                receiver.apply_full(name, view)
        if load is not None:
            load(named)
        report.messages += 1
        report.bytes_received += bucket.nbytes
        report.device = str(bucket.tensor.device)
        del named, bucket
    report.seconds = time.perf_counter() - t0
    return report
