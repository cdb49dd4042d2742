"""The ``p2p`` transport: a unit gathered and reduced in pieces, with no packed buffer.

A plug-in of the core's gather and reduction (``fullshard.engine.gather`` /
``fullshard.engine.reduce``): a unit whose transport gathers (reduces) in pieces holds
:func:`gather` (:func:`reduce`) as ``Transport.gather`` (``Transport.reduce``), chosen once per
unit ([Note: transports] in ``fullshard.engine.transport``); the core calls it in place of its
packed path. On CUDA, by default, no unit holds them. The exchanges are
``fullshard.engine.p2p``'s.

[Note: gathering in pieces]
With the ``p2p`` transport a unit skips the packed buffer altogether: it allocates the
unsharded buffer when the gather is issued, copies its own shards into their rows, and
receives every peer's shard of every parameter straight into that parameter's row — one
message per parameter and peer. No ``[world, total]`` buffer is allocated and nothing is copied
out, which saves a unit-sized buffer and a unit-sized copy per gather. A low-precision wire
dtype and int ``k`` resharding still gather packed.

[Note: reducing in pieces]
With the ``p2p`` transport each parameter's gradient rows are sent to their owner straight
from the unsharded gradient, and the peers' rows for this rank land in the output shard (on
more than 2 ranks, all but one peer's in a scratch buffer), where this rank's own rows are
added on wait: no packed ``[world, total]`` buffer, no packing copy. The gradients stay alive
until then (as the packed buffer would). fp16's pre-division and a reduce dtype other than the
gradients' still pack (see [Note: packed layouts] in ``fullshard.engine.gather``), and so do
gradients that cannot be sent as they are (another dtype: accumulated without sync in the
reduce dtype; not contiguous): :func:`reduce` returns ``None`` for them.
"""

from __future__ import annotations

import torch

from .events import emit
from .gather import GatherUnit, PendingGather, allocate_unsharded
from .handle import Handle
from .p2p import all_gather_pieces, reduce_scatter_pieces
from .reduce import ReduceUnit, Reduction, reduce_output

__all__ = ["gather", "reduce"]


def gather(g: GatherUnit) -> PendingGather:
    """All-gather straight into the unsharded buffer (see [Note: gathering in pieces])."""
    emit("gather_issue", g.name, "pieces")
    buf = g.unsharded_buf
    assert buf is not None
    me = g.info.shard_rank
    allocate_unsharded(g, buf)  # on the compute stream ([Note: streams and buffer lifetimes])
    regions = g.regions()
    with g.comm.streams.use("gather"):
        for sp, region in zip(g.layout, regions):
            sp.copy_local_into(region[me])
        pieces = [
            [sp.rank_piece(region[r], r) for sp, region in zip(g.layout, regions)]
            for r in range(g.world)
        ]
        nbytes = buf.numel() * buf.element_size()
        what = f"unit {g.name!r}"
        handle = all_gather_pieces(pieces, g.info.shard_group, nbytes=nbytes, what=what)
    return PendingGather(handle, None, None)


def reduce(g: ReduceUnit, r: Reduction) -> tuple[Handle, torch.Tensor, object] | None:
    """Reduce-scatter straight from the gradients (see [Note: reducing in pieces]); ``None``
    (nothing issued) where a gradient cannot be sent as it is."""
    ok = (grad is not None and grad.dtype == r.dtype and grad.is_contiguous() for grad in r.grads)
    if not all(ok):
        return None
    emit("reduce_issue", g.name, "pieces")
    out = reduce_output(g, r.total, r.dtype)
    for sp, o in zip(r.params, r.offsets):  # padding: never read, but keep it finite
        if sp.local_numel < sp.shard_numel:
            out[o + sp.local_numel : o + sp.shard_numel].zero_()
    flats = [grad.view(-1) for grad in r.grads if grad is not None]
    per_param = [sp.grad_pieces(flat) for sp, flat in zip(r.params, flats)]
    pieces = [[pp[k] for pp in per_param] for k in range(g.world)]
    outputs = [out[o : o + sp.local_numel] for sp, o in zip(r.params, r.offsets)]
    nbytes = g.world * r.total * out.element_size()
    with g.comm.streams.use("reduce"):
        handle = reduce_scatter_pieces(pieces, outputs, g.reduce_group, nbytes=nbytes, what=r.what)
    return handle, out, flats
