"""Publishing a sharded model's weights: full tensors by packed gathers, or each rank's rows.

[Note: the publication plan]
:func:`publish` gathers by *bucket*: the parameters of one or more consecutive ``fully_shard``
units that share a shard group and a wire dtype, never a unit split over two buckets, so a unit
costs at most one all-gather (fewer when small units share a bucket). Each rank casts its
shards to the wire dtype while packing them into one buffer (each parameter's piece at its
offset, tail-padded to ``ceil(n / world)`` rows), and one ``all_gather`` of that buffer
(through ``fullshard.engine.collectives``, so ``count_collectives`` counts it) gives every rank
every piece; a parameter's full tensor is the concatenation of its ranks' pieces. The gather of
bucket ``i + 1`` is issued (asynchronously) before bucket ``i``'s tensors are handed out, so the
network works while the consumer sends or loads them.

Memory: the iterator holds the gathered buffers of at most two buckets (the one handed out and
the one in flight) and the full tensor it last yielded; a bucket is at most ``bucket_bytes``
of gathered data unless one unit alone is larger (then that unit's gathered size). Tensors the
consumer keeps are the consumer's.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from fullshard.engine import Handle, all_gather, all_gather_comm, label, states_under

from .names import Geometry, geometry, lead_rank, local_tensor, named_weights

__all__ = ["DEFAULT_BUCKET_BYTES", "Gathered", "ShardRows", "gathered", "publish", "shard_rows"]

#: Default bound of one bucket's gathered bytes (256 MiB).
DEFAULT_BUCKET_BYTES = 256 << 20


@dataclass(frozen=True)
class ShardRows:
    """One rank's piece of one weight: indices ``[start, stop)`` of dim ``dim`` (dim 0 unless
    the model was sharded with ``shard_placement_fn``) of the ``shape`` tensor ``name``."""

    name: str  # checkpoint name ([Note: checkpoint names] in fullshard.rl.names)
    shape: torch.Size  # ND, global
    dtype: torch.dtype  # the wire dtype
    dim: int
    start: int
    stop: int
    local: torch.Tensor  # ND: shape with dim ``dim`` of size stop - start
    primary: bool = True  # this rank is the one that sends it ([Note: one sender per piece])

    @property
    def offsets(self) -> tuple[int, ...]:
        """Where ``local`` starts in the global tensor, per dim."""
        return tuple(self.start if i == self.dim else 0 for i in range(len(self.shape)))


def _rows(name: str, param: torch.Tensor, geo: Geometry, dtype: torch.dtype | None) -> ShardRows:
    if geo.tensor_parallel:
        raise ValueError(
            f"weight {name!r} is tensor parallel (placements "
            f"{tuple(getattr(param, 'placements', ()))}): a rank holds no box of rows of it; "
            "send it whole with send_full / publish"
        )
    local = local_tensor(param)
    local = local.to(dtype) if dtype is not None else local
    start = geo.start(geo.rank)
    stop = start + geo.rows(geo.rank)
    return ShardRows(name, geo.shape, local.dtype, geo.dim, start, stop, local, geo.primary)


def shard_rows(model: nn.Module, *, dtype: torch.dtype | None = None) -> list[ShardRows]:
    """This rank's rows of every weight of ``model``, with no communication.

    For engines that pull rows themselves: each rank hands its own pieces to the inference
    ranks that need them. ``dtype`` is the wire dtype (each weight's own when ``None``); a
    piece already in it is the shard itself (no copy), so send it before the next optimizer
    step. Under HSDP every replica returns the same rows and a weight that is not sharded
    comes whole from every rank: send only pieces with ``primary`` set, as :func:`send_rows`
    does ([Note: one sender per piece] in ``fullshard.rl.names``). Names are checkpoint names,
    tied weights once ([Note: checkpoint names]).
    """
    lead = lead_rank(model)
    return [_rows(n, p, geometry(n, p, lead), dtype) for n, p in named_weights(model)]


@dataclass
class _Entry:
    name: str
    param: torch.Tensor
    geo: Geometry
    offset: int = 0  # elements into a rank's packed slot


@dataclass
class _Bucket:
    group: dist.ProcessGroup | None
    world: int
    dtype: torch.dtype
    tensor_parallel: bool = False  # entries gathered whole by DTensor, one by one
    entries: list[_Entry] = field(default_factory=list)
    slot_numel: int = 0  # elements each rank contributes

    def gathered_bytes(self, extra: int = 0) -> int:
        return (self.slot_numel + extra) * self.world * self.dtype.itemsize

    def add(self, entries: list[_Entry]) -> None:
        for e in entries:
            e.offset = self.slot_numel
            self.slot_numel += e.geo.chunk * e.geo.row_numel
            self.entries.append(e)


def _units(model: nn.Module, dtype: torch.dtype | None) -> list[list[_Entry]]:
    """The weights by unit (and shard group and wire dtype), units in order of first use."""
    unit_of = {
        id(sp.sharded_param): i
        for i, st in enumerate(states_under([model]))
        for sp in st.group.params
    }
    units: dict[tuple[object, ...], list[_Entry]] = {}
    for name, p in named_weights(model):
        geo = geometry(name, p)
        unit = unit_of.get(id(p), name)  # a DTensor of another engine: a unit of its own
        key = (unit, id(geo.group), dtype or p.dtype)
        units.setdefault(key, []).append(_Entry(name, p, geo))
    return list(units.values())


def _plan(model: nn.Module, dtype: torch.dtype | None, bucket_bytes: int) -> list[_Bucket]:
    """Buckets of whole units ([Note: the publication plan])."""
    buckets: list[_Bucket] = []
    for unit in _units(model, dtype):
        geo = unit[0].geo
        wire = dtype or unit[0].param.dtype
        numel = sum(e.geo.chunk * e.geo.row_numel for e in unit)
        last = buckets[-1] if buckets else None
        if (
            last is None
            or geo.tensor_parallel
            or last.tensor_parallel
            or last.group is not geo.group
            or last.dtype != wire
            or last.gathered_bytes(numel) > bucket_bytes
        ):
            last = _Bucket(geo.group, geo.world, wire, geo.tensor_parallel)
            buckets.append(last)
        last.add(unit)
    return buckets


@dataclass
class _InFlight:
    bucket: _Bucket
    out: torch.Tensor  # 1D, [world * slot_numel], rank-major
    handle: Handle | None
    whole: dict[str, torch.Tensor] = field(default_factory=dict)  # tensor-parallel weights


def _issue(bucket: _Bucket, index: int) -> _InFlight:
    """Pack this rank's shards (cast to the wire dtype) and start the bucket's one gather."""
    first = local_tensor(bucket.entries[0].param)
    if bucket.tensor_parallel:  # cast on the shard, then DTensor's own gathers (synchronous)
        whole = {e.name: e.param.to(bucket.dtype).full_tensor() for e in bucket.entries}  # type: ignore[attr-defined]
        return _InFlight(bucket, first, None, whole)
    send = torch.empty(bucket.slot_numel, dtype=bucket.dtype, device=first.device)
    for e in bucket.entries:
        local = local_tensor(e.param)
        send[e.offset : e.offset + local.numel()].copy_(local.reshape(-1))  # the cast
    if bucket.group is None:
        return _InFlight(bucket, send, None)
    out = torch.empty(bucket.world * bucket.slot_numel, dtype=bucket.dtype, device=send.device)
    with label("rl publish: all-gather", f"bucket {index}"):
        comm = all_gather_comm(bucket.group, send.device)  # gloo: the engine's p2p plug-in
        handle = all_gather(out, send, bucket.group, what=f"rl publish bucket {index}", comm=comm)
    return _InFlight(bucket, out, handle)


def _full(flight: _InFlight, e: _Entry, out: torch.Tensor | None = None) -> torch.Tensor:
    """``e``'s full tensor, from its ranks' pieces in the gathered buffer: a new tensor, or
    written into ``out`` (contiguous, of its shape and the wire dtype)."""
    if e.name in flight.whole:
        whole = flight.whole.pop(e.name)
        return whole if out is None else out.copy_(whole)
    geo = e.geo
    slots = flight.out.view(flight.bucket.world, flight.bucket.slot_numel)
    pieces = [
        slots[r, e.offset : e.offset + geo.rows(r) * geo.row_numel].view(geo.piece_shape(r))
        for r in range(flight.bucket.world)
    ]
    if out is not None:
        return out.copy_(pieces[0]) if len(pieces) == 1 else torch.cat(pieces, geo.dim, out=out)
    return pieces[0].clone() if len(pieces) == 1 else torch.cat(pieces, dim=geo.dim)


@dataclass(frozen=True)
class Gathered:
    """One weight of a publication whose bucket has been gathered (:func:`gathered`): write its
    full tensor where the consumer wants it, before the iterator moves on."""

    name: str  # checkpoint name
    shape: torch.Size
    dtype: torch.dtype  # the wire dtype
    device: torch.device  # where the gathered buffer (and so the full tensor) lives
    _flight: _InFlight
    _entry: _Entry

    def full(self) -> torch.Tensor:
        """The full tensor, newly allocated."""
        return _full(self._flight, self._entry)

    def into(self, out: torch.Tensor) -> torch.Tensor:
        """The full tensor written into ``out`` (contiguous, of ``shape`` and ``dtype``): one
        copy from the gathered buffer, none through a temporary."""
        return _full(self._flight, self._entry, out)


def gathered(
    model: nn.Module, *, dtype: torch.dtype | None, bucket_bytes: int
) -> Iterator[Gathered]:
    """What :func:`publish` yields, before the full tensors are made: one :class:`Gathered`
    per weight, valid until the next one of another bucket ([Note: the publication plan])."""
    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
    buckets = _plan(model, dtype, bucket_bytes)
    pending = _issue(buckets[0], 0) if buckets else None
    try:
        for i in range(len(buckets)):
            assert pending is not None
            current = pending
            pending = _issue(buckets[i + 1], i + 1) if i + 1 < len(buckets) else None
            if current.handle is not None:
                with label("rl publish: wait", f"bucket {i}"):
                    current.handle.wait()
            for e in current.bucket.entries:
                device = current.out.device
                yield Gathered(e.name, e.geo.shape, current.bucket.dtype, device, current, e)
    finally:
        if pending is not None and pending.handle is not None:
            pending.handle.wait()


def publish(
    model: nn.Module,
    *,
    dtype: torch.dtype | None = None,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(checkpoint name, full tensor)`` for every weight of ``model``, on every rank.

    Collective: every rank of the model's shard groups iterates to the end, in step (the
    generator waits for its last gather if abandoned early). ``dtype`` is the wire dtype
    (each weight's own when ``None``): shards are cast to it before they are sent. Names are
    the Hugging Face checkpoint's: no wrapper prefixes, tied weights once
    ([Note: checkpoint names] in ``fullshard.rl.names``).

    Communication is one packed all-gather per bucket of whole units (at most one per unit),
    the next bucket's gather in flight while this one's tensors are yielded. Memory: at most two
    buckets' gathered buffers (each at most ``bucket_bytes``, or one unit's gathered size where
    a unit alone is larger) and the tensor last yielded ([Note: the publication plan]). A
    tensor-parallel weight is cast on its shard and gathered whole by ``DTensor.full_tensor()``
    ([Note: shard geometry] in ``fullshard.rl.names``). Call it between steps, when the model is
    sharded (not inside forward or backward).
    """
    for g in gathered(model, dtype=dtype, bucket_bytes=bucket_bytes):
        yield g.name, g.full()
