"""Moving published weights from training ranks to inference ranks over ``torch.distributed``.

[Note: messages]
Training and inference ranks share one ``torch.distributed`` world (e.g. training ranks 0-1 and
an inference rank 2, on gloo or NCCL); the training ranks' mesh is a subgroup. A sender sends
each receiver a sequence of *messages*, the last one flagged; a message is two point-to-point
sends: three int64s (header bytes, payload bytes, last), then one byte buffer holding a JSON
header (per piece: name, kind ``"set"``, ``"xor"`` or ``"xor+zlib"``, dtype, shape, offsets,
bytes) followed by the payload (raw tensor bytes, an XOR mask, or a compressed one). Both
sends are tensors on the wire's device ([Note: the wire's device]). Pieces are cut to the
receiver's rows when the receivers split rows ([Note: pieces and layouts] in
``fullshard.rl.receiver``), so a split receiver gets only what it keeps. :func:`receive` takes any of them: the receiver needs
to know only which ranks send.

Three ways to send: :func:`send_full` (every training rank gathers with
:func:`fullshard.rl.publish`, one rank sends), :func:`send_rows` (every training rank sends its
own rows, no gather) and :func:`send_deltas` (every training rank sends its XOR masks,
compressed on a slow link). Each returns a :class:`SyncReport` of what this rank did.

[Note: the wire's device]
A backend moves tensors of its own device: NCCL refuses CPU tensors, gloo is the CPU's.
:func:`wire_device` says which device the world's backend drives (``"nccl"``: the current CUDA
device, ``"gloo"``: the CPU; a backend per device such as ``"cpu:gloo,cuda:nccl"``: the
accelerator's, since the weights live there and its backend is the fast one, where torch's
object collectives pick the CPU for objects that live in host memory). Every tensor handed to
``dist.send`` / ``dist.recv`` / ``dist.irecv`` is allocated there: the int64 sizes, and the
body into which the pieces are copied device to device (from the shard or the gathered buffer
on CUDA: no round trip through host memory). A receiver applies ``"set"`` and ``"xor"``
pieces from the body where it lies (the copy into its own tensors moves them if they live
elsewhere); only the JSON header and compressed masks are read on the host, once per message.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from fullshard.engine import count_collectives

from .delta import ShardDeltas, bits, decode_xor, encode_xor
from .receiver import WeightReceiver
from .weights import DEFAULT_BUCKET_BYTES, publish, shard_rows

__all__ = [
    "Receivers",
    "SyncReport",
    "backend_device",
    "receive",
    "send_deltas",
    "send_full",
    "send_rows",
    "wire_device",
]

_SIZES_TAG, _BODY_TAG = 4101, 4102


def backend_device(backend: str, bound: torch.device | None = None) -> torch.device:
    """The device whose tensors ``backend`` moves ([Note: the wire's device]).

    ``backend`` is a backend's name (``"nccl"``, ``"gloo"``) or ``device:backend`` pairs as
    ``dist.get_backend_config`` gives them (``"cpu:gloo,cuda:nccl"``). Each backend's own
    device is the first of its ``dist.Backend.backend_capability`` (gloo: the CPU, though it
    also stages CUDA tensors through host memory); of several, the accelerator's wins. An
    accelerator's index is ``bound`` (the group's ``device_id``) if given, else the current
    device, else ``LOCAL_RANK`` (0 without it) when no such accelerator is available here.
    """
    names = [pair.rpartition(":")[2].strip().lower() for pair in backend.split(",")]
    types: list[str] = []
    for name in names:
        capability = dist.Backend.backend_capability.get(name)
        if not capability:
            raise ValueError(
                f"fullshard.rl: backend {name!r} (of {backend!r}) is not a torch.distributed "
                "backend with a registered device; init the world with 'nccl' or 'gloo'"
            )
        types.append(capability[0])
    kind = next((t for t in types if t != "cpu"), "cpu")
    if kind == "cpu":
        return torch.device("cpu")
    if bound is not None and bound.type == kind and bound.index is not None:
        return bound
    accelerator = torch.accelerator.current_accelerator(check_available=True)
    if accelerator is not None and accelerator.type == kind:
        return torch.device(kind, torch.accelerator.current_device_index())
    return torch.device(kind, int(os.environ.get("LOCAL_RANK", "0")))


def wire_device(group: dist.ProcessGroup | None = None) -> torch.device:
    """The device of the tensors the wire hands to ``group``'s backend (the default group's
    when ``None``): :func:`backend_device` of its backend configuration."""
    pg = group if group is not None else dist.group.WORLD
    bound = getattr(pg, "bound_device_id", None)
    return backend_device(dist.get_backend_config(group), bound)


def _aligned(n: int) -> int:
    """``n`` rounded up to 8 bytes: every piece starts aligned for any dtype's view."""
    return (n + 7) // 8 * 8


@dataclass(frozen=True)
class Receivers:
    """The inference ranks (global ranks of the default group) weights are sent to."""

    ranks: tuple[int, ...]
    split_rows: bool = False
    """Each receiver ``i`` holds rows ``i`` of ``len(ranks)`` (``torch.chunk`` of dim 0) of every
    weight (:meth:`WeightReceiver.row_split`) and is sent only those; else full tensors."""

    def __post_init__(self) -> None:
        if not self.ranks:
            raise ValueError("Receivers needs at least one rank")

    def box(self, i: int, shape: torch.Size) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """Receiver ``i``'s box of a weight of ``shape``: (offsets, shape)."""
        if not self.split_rows or not shape:
            return (0,) * len(shape), tuple(shape)
        chunk = -(-shape[0] // len(self.ranks))
        start = min(i * chunk, shape[0])
        rows = max(0, min(chunk, shape[0] - start))
        return (start,) + (0,) * (len(shape) - 1), (rows, *shape[1:])


@dataclass
class SyncReport:
    """What one rank did in one weight sync."""

    seconds: float = 0.0
    bytes_sent: int = 0  # messages' headers and payloads this rank sent (0 on receivers)
    bytes_received: int = 0
    messages: int = 0  # messages sent (or received, on receivers)
    gathers: int = 0  # collectives this rank issued (count_collectives)
    gather_bytes: int = 0  # what they moved (an all-gather counts its full output)
    changed: int = 0  # deltas: elements whose bits changed in this rank's rows
    compressed: bool = False  # deltas: the XOR masks travelled compressed (sent or received)
    device: str = ""  # the wire's device, where the messages' tensors lived ("": none sent)
    path: str = ""  # "wire" (messages over torch.distributed), "colocated" (IPC buckets)


def _cut(
    receivers: Receivers,
    i: int,
    shape: torch.Size,
    piece: torch.Tensor,
    offsets: tuple[int, ...],
) -> tuple[torch.Tensor, tuple[int, ...]] | None:
    """The part of ``piece`` (a box of a ``shape`` weight) receiver ``i`` keeps, or None."""
    box_off, box_shape = receivers.box(i, shape)
    index: list[slice] = []
    out: list[int] = []
    for lo, size, po, psize in zip(box_off, box_shape, offsets, piece.shape, strict=True):
        a, b = max(lo, po), min(lo + size, po + psize)
        if a >= b:
            return None
        index.append(slice(a - po, b - po))
        out.append(a)
    return piece[tuple(index)], tuple(out)


class _Message:
    """Pieces for one receiver, framed as [Note: messages] says."""

    def __init__(self) -> None:
        self.entries: list[dict[str, object]] = []
        self.payload: list[bytes | torch.Tensor] = []
        self.nbytes = 0

    def add(
        self,
        name: str,
        kind: str,
        dtype: torch.dtype,
        shape: tuple[int, ...],
        offsets: tuple[int, ...],
        data: bytes | torch.Tensor,
    ) -> None:
        n = len(data) if isinstance(data, bytes) else data.numel() * data.element_size()
        dt = str(dtype).removeprefix("torch.")
        self.entries.append(
            {
                "name": name,
                "kind": kind,
                "dtype": dt,
                "shape": list(shape),
                "offsets": list(offsets),
                "nbytes": n,
            }
        )
        self.payload.append(data)
        self.nbytes += _aligned(n)

    def send(self, dst: int, last: bool, device: torch.device) -> int:
        """Send to global rank ``dst`` as tensors on ``device``; return the bytes sent."""
        header = json.dumps(self.entries).encode()
        header += b" " * (_aligned(len(header)) - len(header))  # JSON ignores the padding
        body = torch.empty(len(header) + self.nbytes, dtype=torch.uint8, device=device)
        body[: len(header)].copy_(torch.frombuffer(bytearray(header), dtype=torch.uint8))
        at = len(header)
        for data in self.payload:
            if isinstance(data, bytes):
                n = len(data)
                if n:
                    body[at : at + n].copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
            else:
                n = data.numel() * data.element_size()
                if n:
                    flat = data.detach().contiguous().reshape(-1).view(torch.uint8)
                    body[at : at + n].copy_(flat)
            at += _aligned(n)
        sizes = torch.tensor([len(header), self.nbytes, int(last)], dtype=torch.int64)
        sizes = sizes.to(device)
        dist.send(sizes, dst, tag=_SIZES_TAG)
        dist.send(body, dst, tag=_BODY_TAG)
        return sizes.numel() * 8 + body.numel()


class _Outbox:
    """Per receiver, the message being filled; sent when it holds ``limit`` bytes, as tensors
    on the wire's device ([Note: the wire's device])."""

    def __init__(self, receivers: Receivers, limit: int, report: SyncReport) -> None:
        self.receivers, self.limit, self.report = receivers, limit, report
        self.device = wire_device()
        report.device = str(self.device)
        self.messages = [_Message() for _ in receivers.ranks]

    def add(
        self,
        name: str,
        shape: torch.Size,
        piece: torch.Tensor,
        offsets: tuple[int, ...],
        *,
        xor_of: torch.dtype | None = None,
        compress: bool = False,
    ) -> None:
        """Queue ``piece`` (a box of weight ``name``) for every receiver that keeps part of it;
        ``xor_of``: the piece is an XOR mask of that dtype, ``compress``: sent compressed."""
        for i, msg in enumerate(self.messages):
            cut = _cut(self.receivers, i, shape, piece, offsets)
            if cut is None:
                continue
            part, where = cut
            if xor_of is None:
                msg.add(name, "set", part.dtype, tuple(part.shape), where, part)
            elif compress:
                msg.add(name, "xor+zlib", xor_of, tuple(part.shape), where, encode_xor(part))
            else:
                msg.add(name, "xor", xor_of, tuple(part.shape), where, part)
            if msg.nbytes >= self.limit:
                self._send(i, last=False)

    def _send(self, i: int, last: bool) -> None:
        msg = self.messages[i]
        self.report.bytes_sent += msg.send(self.receivers.ranks[i], last, self.device)
        self.report.messages += 1
        self.messages[i] = _Message()

    def close(self) -> None:
        """Send every receiver its last message."""
        for i in range(len(self.messages)):
            self._send(i, last=True)


def send_full(
    model: nn.Module,
    receivers: Receivers,
    *,
    dtype: torch.dtype | None = None,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    src: int = 0,
) -> SyncReport:
    """Publish ``model``'s full weights (:func:`fullshard.rl.publish`) and send them from global
    rank ``src`` to every receiver, a message per ``bucket_bytes``. Collective over the
    training ranks: every one of them calls it (the gathers); only ``src`` sends."""
    report, t0 = SyncReport(path="wire"), time.perf_counter()
    outbox = _Outbox(receivers, bucket_bytes, report) if dist.get_rank() == src else None
    with count_collectives() as stats:
        for name, full in publish(model, dtype=dtype, bucket_bytes=bucket_bytes):
            if outbox is not None:
                outbox.add(name, full.shape, full, (0,) * full.dim())
    if outbox is not None:
        outbox.close()
    report.gathers, report.gather_bytes = stats.calls(), stats.bytes()
    report.seconds = time.perf_counter() - t0
    return report


def send_rows(
    model: nn.Module,
    receivers: Receivers,
    *,
    dtype: torch.dtype | None = None,
    message_bytes: int = DEFAULT_BUCKET_BYTES,
) -> SyncReport:
    """Send this rank's rows of every weight (:func:`fullshard.rl.shard_rows`) to the receivers
    that keep them: no gather. Every training rank calls it; a piece another rank also holds
    (HSDP replicas, weights that are not sharded) is sent by one of them ([Note: one sender
    per piece] in ``fullshard.rl.names``)."""
    report, t0 = SyncReport(path="wire"), time.perf_counter()
    outbox = _Outbox(receivers, message_bytes, report)
    for rows in shard_rows(model, dtype=dtype):
        if rows.primary and rows.local.numel():
            outbox.add(rows.name, rows.shape, rows.local, rows.offsets)
    outbox.close()
    report.seconds = time.perf_counter() - t0
    return report


def send_deltas(
    deltas: ShardDeltas,
    receivers: Receivers,
    *,
    message_bytes: int = DEFAULT_BUCKET_BYTES,
    compress: bool | None = None,
) -> SyncReport:
    """Send this rank's changes since the last publication (:meth:`ShardDeltas.delta`) as XOR
    masks, weights without changes not at all. Every training rank calls it.

    ``compress``: send the masks compressed (:func:`fullshard.rl.encode_xor`: byte planes and
    zlib, on this CPU thread, after one copy of every mask to host memory). ``None`` (the
    default) compresses where the wire is the CPU's (gloo: a network link) and not where it is
    an accelerator's (NCCL), whose bandwidth outruns zlib: there the masks travel as they are,
    device to device. The report's ``compressed`` says which. One host sync in all: the
    changed-element counts (and, compressing, the masks) come back together."""
    report, t0 = SyncReport(path="wire"), time.perf_counter()
    outbox = _Outbox(receivers, message_bytes, report)
    report.compressed = outbox.device.type == "cpu" if compress is None else compress
    for d in deltas.delta(to_host=report.compressed):
        report.changed += d.changed
        if d.changed:
            outbox.add(
                d.name, d.shape, d.mask, d.offsets, xor_of=d.dtype, compress=report.compressed
            )
    outbox.close()
    report.seconds = time.perf_counter() - t0
    return report


class _Incoming:
    """A message being received from one sender: its sizes came, its body is in flight."""

    def __init__(self, src: int, device: torch.device) -> None:
        self.src = src
        sizes = torch.empty(3, dtype=torch.int64, device=device)
        dist.recv(sizes, src, tag=_SIZES_TAG)
        self.head, nbytes, last = (int(x) for x in sizes.tolist())
        self.last = bool(last)
        self.body = torch.empty(self.head + nbytes, dtype=torch.uint8, device=device)
        self.work = dist.irecv(self.body, src, tag=_BODY_TAG)

    @property
    def nbytes(self) -> int:
        return 24 + self.body.numel()

    def apply(self, receiver: WeightReceiver) -> bool:
        """Wait for the body and apply its pieces; whether any came compressed."""
        if self.work is not None:
            self.work.wait()
        entries = json.loads(self.body[: self.head].cpu().numpy().tobytes())
        payload, at = self.body[self.head :], 0
        compressed = any(e["kind"] == "xor+zlib" for e in entries)
        host = payload.cpu() if compressed else payload  # one copy per message, if any
        for e in entries:
            n = int(e["nbytes"])
            data = host if e["kind"] == "xor+zlib" else payload
            _apply(receiver, e, data[at : at + n])
            at += _aligned(n)
        return compressed


def _apply(receiver: WeightReceiver, entry: dict[str, object], data: torch.Tensor) -> None:
    name, kind = str(entry["name"]), entry["kind"]
    dtype = getattr(torch, str(entry["dtype"]))
    shape = torch.Size(entry["shape"])  # type: ignore[arg-type]
    offsets: tuple[int, ...] = tuple(entry["offsets"])  # type: ignore[arg-type]
    if kind == "xor+zlib":
        mask = decode_xor(data.numpy().data, shape, dtype)
        receiver.apply_xor(name, mask, offsets, dtype)
    elif kind == "xor":
        receiver.apply_xor(name, bits(data.view(dtype)).view(shape), offsets, dtype)
    elif kind == "set":
        receiver.apply_piece(name, data.view(dtype).view(shape), offsets)
    else:
        raise ValueError(f"unknown piece kind {kind!r} for {name!r}")


def receive(receiver: WeightReceiver, srcs: tuple[int, ...] | list[int]) -> SyncReport:
    """Receive and apply every message from each global rank in ``srcs`` (full buckets, rows or
    deltas; [Note: messages]) until each has sent its last. Each round takes one message from
    every sender still sending, all bodies in flight while the first ones are applied."""
    report, t0 = SyncReport(path="wire"), time.perf_counter()
    device = wire_device()
    report.device = str(device)
    active = list(srcs)
    while active:
        round_ = [_Incoming(src, device) for src in active]
        for msg in round_:
            report.compressed |= msg.apply(receiver)
            report.messages += 1
            report.bytes_received += msg.nbytes
        active = [msg.src for msg in round_ if not msg.last]
    report.seconds = time.perf_counter() - t0
    return report
