"""The all-gather side of a unit: issue, wait and copy-out.

The core gathers packed (below); a transport plug-in may gather a unit its own way instead
(``Transport.gather``, chosen once per unit: [Note: transports] in ``fullshard.engine.transport``).

[Note: packed layouts]
All-gather input: this rank's shards back to back, each padded to ``shard_numel`` elements
(``total`` elements in all). The all-gather output is rank-major, ``[world, total]``; the
copy-out splits its columns per parameter into the unsharded buffer, where parameter ``i``
occupies ``world * shard_numel_i`` contiguous elements — a padded ``[world, shard_numel_i]``
region holding the parameter (see ``ShardedParam.unsharded_view``). The reduce-scatter input
is the same ``[world, total]`` layout built from the unsharded gradients (zero padding), so
each rank's output row is exactly its padded gradient shards.

[Note: why storage is resized, not freed]
Autograd saves views of the unsharded parameters for backward. Freeing the unsharded buffer by
``untyped_storage().resize_(0)`` keeps those tensor objects (and the ``nn.Parameter`` leaves
autograd accumulates into) valid; re-gathering resizes the same storage back and refills it,
so the saved views see the parameters again without any re-registration.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.distributed as dist

from . import collectives as C
from .events import emit
from .kept import KeptBuffers
from .labels import label
from .overrides import allocate
from .param import ShardedParam
from .quant import dequantize_int8, quantize_int8
from .unit import CommUnit

__all__ = ["GatherUnit", "PendingGather", "allocate_unsharded", "finish_gather", "start_gather"]


class GatherUnit(CommUnit, Protocol):
    """What the all-gather reads of a unit (``ParamGroup`` is one), beyond :class:`CommUnit`."""

    # the kept copy of int ``reshard_after_forward`` (the gather consumes it)
    post_forward_chunk: torch.Tensor | None
    # set_keep_unsharded_storage, and the buffers it keeps ([Note: a capturable step])
    keep_unsharded_storage: bool
    kept: KeptBuffers

    @property
    def layout(self) -> list[ShardedParam]:
        """The parameters of the unit's buffer, in [Note: packed layouts] order."""

    @property
    def offsets(self) -> list[int]:
        """Each parameter's first element in the packed shard row."""

    @property
    def total(self) -> int:
        """Elements of one rank's packed row."""

    @property
    def unsharded_buf(self) -> torch.Tensor | None:
        """The unit's 1-D unsharded buffer (None: a local unit)."""

    @property
    def post_forward_group(self) -> dist.ProcessGroup | None: ...

    def regions(self) -> list[torch.Tensor]:
        """Per-parameter ``[world, shard_numel]`` views of ``unsharded_buf``."""

    def compute_dtype(self) -> torch.dtype: ...

    def wire_gather_dtype(self) -> torch.dtype: ...

    def take_back_gathered(self) -> bool:
        """Take back the unit's own freed memory if it still holds the current gather."""

    def check_materialised(self) -> None:
        """Raise, naming them, if parameters are still on the meta device."""


@dataclass
class PendingGather:
    """An all-gather in flight and the buffers it uses until it is waited on."""

    handle: C.Handle
    packed: torch.Tensor | None  # the gathered [world * total] buffer to copy out; None: in place
    send: torch.Tensor | None  # what the collective reads (kept alive until waited on)


def allocate_unsharded(g: GatherUnit, buf: torch.Tensor) -> None:
    """Give the (resized-to-0) unsharded buffer its storage back: fresh memory, or memory
    the host strategy holds ([Note: the host strategy] in ``fullshard.engine.host``)."""
    storage, nbytes, host = buf.untyped_storage(), buf.numel() * buf.element_size(), g.comm.host
    if storage.nbytes() == nbytes:
        return
    how = host.refill(storage, nbytes) if host is not None else ""
    if not how:
        storage.resize_(nbytes)
        how = "fresh"
    emit("unshard_alloc", g.name, how)


def _offload_event(g: GatherUnit) -> None:
    """Report the host-to-device copy of an offloaded unit's shards (none when they already
    live on the compute device: CPU offload on a CPU run moves nothing)."""
    if g.offloaded:
        nbytes = sum(
            sp.local_numel * sp.local.element_size()
            for sp in g.layout
            if sp.local.device != g.device
        )
        if nbytes:
            emit("h2d", g.name, nbytes=nbytes)


def start_gather(g: GatherUnit) -> PendingGather:
    """Issue the all-gather of ``g``'s parameters the way its transport says."""
    g.check_materialised()
    if g.take_back_gathered():  # see [Note: taking back a unit's own gathered memory]
        buf = g.unsharded_buf
        assert buf is not None
        # nbytes: what the all-gather would have counted (its full output)
        emit("gather_issue", g.name, "reused", nbytes=buf.numel() * buf.element_size())
        return PendingGather(C.Handle(None, g.device), None, None)
    _offload_event(g)
    # the unit's transport, decided once (transport.decide): a plug-in's own way
    # of gathering, else packed; the kept copy of an int reshard_after_forward is regathered
    # packed within its subgroup
    gather = g.transport.gather if g.post_forward_chunk is None else None
    with torch.no_grad():
        if gather is not None:
            return gather(g)
        emit("gather_issue", g.name, "packed")
        return _gather_packed(g)


def _pack_shards(g: GatherUnit, inp: torch.Tensor) -> torch.Tensor:
    """Copy this rank's shards into ``inp`` (1-D, ``total`` elements; casts to its dtype)."""
    for sp, off in zip(g.layout, g.offsets):
        sp.copy_local_into(inp[off : off + sp.shard_numel])
    return inp


def _gather_packed(g: GatherUnit) -> PendingGather:
    what = f"unit {g.name!r}"
    wire = g.wire_gather_dtype()
    comm = g.overrides.all_gather  # custom AllGather: allocates the output, runs the gather
    if g.post_forward_chunk is not None:  # int k: gather the kept copy within the subgroup
        inp, g.post_forward_chunk = g.post_forward_chunk, None
        group = g.post_forward_group
        assert group is not None
        out = allocate(comm, inp.numel() * dist.get_world_size(group), inp.dtype, g.device)
    elif wire == torch.int8:  # quantise a packed fp32 copy (see fullshard.engine.quant)
        group = g.info.shard_group
        full = torch.empty(g.total, dtype=torch.float32, device=g.device)
        inp = quantize_int8(_pack_shards(g, full), g.comm_policy.block_size)
        del full
        out = allocate(comm, inp.numel() * g.world, inp.dtype, g.device)
    else:  # in place: this rank's slot of the output is the input (no extra copy)
        group, n = g.info.shard_group, g.world * g.total
        keep = g.keep_unsharded_storage and comm is None  # [Note: a capturable step]
        out = g.kept.take(keep, "gather", n, wire, lambda: allocate(comm, n, wire, g.device))
        with g.comm.streams.use("gather"):  # offload: the H2D copy-in runs on the side stream
            inp = _pack_shards(g, out.view(g.world, g.total)[g.info.shard_rank])
    with g.comm.streams.use("gather"):
        handle = C.all_gather(out, inp, group, what=what, comm=comm or g.transport.all_gather)
    return PendingGather(handle, out, inp)


def _decode(g: GatherUnit, out: torch.Tensor) -> torch.Tensor:
    """The gathered ``[world, total]`` rows in compute dtype (dequantised if needed)."""
    dtype = g.compute_dtype()
    if out.dtype == dtype:
        return out.view(g.world, g.total)
    if out.dtype == torch.uint8:  # int8 wire format, see fullshard.engine.quant
        rows = torch.empty(g.world, g.total, dtype=dtype, device=g.device)
        dequantize_int8(out.view(g.world, -1), g.total, g.comm_policy.block_size, rows)
        return rows
    return out.view(g.world, g.total).to(dtype)


def finish_gather(g: GatherUnit, pending: PendingGather) -> None:
    """Wait for ``pending`` and make sure the unsharded buffer holds the parameters."""
    pending.handle.wait()
    emit("gather_wait", g.name)
    buf = g.unsharded_buf
    assert buf is not None
    if pending.packed is None:  # gathered in place (a plug-in's gather, or taken back)
        _copy_out(g)
        return
    # Refilling the buffer bumps no parameter's version counter (each has its own: [Note: one
    # version counter per unsharded parameter] in fullshard.engine.group), as the saved views hold
    # the values they had when saved ([Note: why storage is resized, not freed]).
    with torch.no_grad():
        allocate_unsharded(g, buf)
        sizes = [sp.shard_numel for sp in g.layout]
        torch.split_with_sizes_copy(_decode(g, pending.packed), sizes, dim=1, out=g.regions())
    g.kept.give_back(pending.packed)  # copy-out queued: the next gather's writes wait for it
    _copy_out(g)


def _copy_out(g: GatherUnit) -> None:
    """Placements whose unsharded form is not a view of the buffer copy themselves out."""
    with torch.no_grad(), label("all_gather_copy_out", g.name):
        for sp, region in zip(g.layout, g.regions()):
            sp.copy_out(region)
