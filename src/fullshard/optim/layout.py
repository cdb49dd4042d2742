"""Where each rank's rows of a sharded tensor lie, and which rank owns each whole tensor.

Everything here reads the public DTensor view only (``device_mesh``, ``placements``, the local
tensor): a tensor is split along one tensor dim ``d`` by a ``Shard(d)`` placement on one mesh
dim (the *shard group*) with ``torch.chunk`` semantics (ranks get ``ceil(n / k)`` rows, the
last ones fewer, possibly none); every other mesh dim must be ``Replicate()`` (HSDP replicas
hold identical shards and each replica runs the same exchange inside its own shard group).
Plain tensors and DTensors replicated everywhere are *whole* on every rank.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

__all__ = ["ShardLayout", "assign_owners", "chunk_bounds", "layout_of", "local_of"]


def chunk_bounds(n: int, parts: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Start and length of each of ``parts`` ``torch.chunk`` pieces of ``n`` rows."""
    chunk = -(-n // parts) if n else 0
    starts = tuple(min(r * chunk, n) for r in range(parts))
    lengths = tuple(max(0, min(n, s + chunk) - s) for s in starts)
    return starts, lengths


@dataclass(frozen=True, slots=True)
class ShardLayout:
    """How one tensor is split over its shard group (``size == 1``: whole on this rank)."""

    shape: tuple[int, ...]  # global shape
    dim: int  # the tensor dim that is split
    group: dist.ProcessGroup | None  # the shard group; None when whole on every rank
    ranks: tuple[int, ...]  # global ranks of the shard group, in group-rank order
    rank: int  # this rank's index in the shard group
    starts: tuple[int, ...]  # per group rank: first index along ``dim``
    lengths: tuple[int, ...]  # per group rank: extent along ``dim`` (0 for empty shards)

    @property
    def size(self) -> int:
        """Ranks in the shard group."""
        return len(self.ranks)

    def piece_shape(self, r: int) -> tuple[int, ...]:
        """Shape of group rank ``r``'s piece."""
        shape = list(self.shape)
        if shape:
            shape[self.dim] = self.lengths[r]
        return tuple(shape)

    def piece(self, full: torch.Tensor, r: int) -> torch.Tensor:
        """Group rank ``r``'s piece as a view of the whole tensor ``full``."""
        if full.dim() == 0:
            return full
        return full.narrow(self.dim, self.starts[r], self.lengths[r])

    def numel(self, r: int) -> int:
        """Elements of group rank ``r``'s piece."""
        n = 1
        for s in self.piece_shape(r):
            n *= s
        return n

    def along(self, shape: Sequence[int], dim: int) -> ShardLayout:
        """The same shard group splitting a tensor of ``shape`` along ``dim`` (optimizer state
        whose shape differs from its parameter's is split along dim 0)."""
        shape = tuple(shape)
        starts, lengths = chunk_bounds(shape[dim] if shape else 1, self.size)
        return ShardLayout(shape, dim, self.group, self.ranks, self.rank, starts, lengths)


def local_of(t: torch.Tensor) -> torch.Tensor:
    """The data this rank holds for ``t``: a DTensor's local tensor, else ``t`` itself."""
    return t._local_tensor if isinstance(t, DTensor) else t


def layout_of(t: torch.Tensor, what: str) -> ShardLayout:
    """The :class:`ShardLayout` of ``t`` (named ``what`` in errors).

    Raises ``ValueError`` for placements other than one ``Shard(d)`` plus ``Replicate()``, and
    when the local tensor's shape is not the ``torch.chunk`` piece the placements imply.
    """
    shape = tuple(t.shape)
    rank = dist.get_rank() if dist.is_initialized() else 0
    if not isinstance(t, DTensor):
        return ShardLayout(shape, 0, None, (rank,), 0, (0,), (shape[0] if shape else 1,))
    mesh, placements = t.device_mesh, t.placements
    bad = [p for p in placements if not isinstance(p, Replicate) and type(p) is not Shard]
    sharded = [i for i, p in enumerate(placements) if type(p) is Shard]
    if bad or len(sharded) > 1:
        raise ValueError(
            f"fullshard.optim: {what} has placements {tuple(placements)} on a mesh of shape "
            f"{tuple(mesh.shape)}; whole-tensor optimizers support one Shard(d) mesh dim "
            "(the shard group) and Replicate() on the others. Redistribute the parameter or "
            "optimize it with a plain (element-wise) optimizer."
        )
    if not sharded:
        return ShardLayout(shape, 0, None, (rank,), 0, (0,), (shape[0] if shape else 1,))
    mesh_dim = sharded[0]
    placement = placements[mesh_dim]
    assert isinstance(placement, Shard)
    dim = placement.dim % len(shape)
    group = mesh.get_group(mesh_dim)
    ranks = tuple(dist.get_process_group_ranks(group))
    starts, lengths = chunk_bounds(shape[dim], len(ranks))
    me = mesh.get_local_rank(mesh_dim)
    layout = ShardLayout(shape, dim, group, ranks, me, starts, lengths)
    local_shape, _ = compute_local_shape_and_global_offset(t.shape, mesh, placements)
    got = tuple(t._local_tensor.shape)
    if got != layout.piece_shape(me) or tuple(local_shape) != got:
        raise ValueError(
            f"fullshard.optim: {what} holds a local shard of shape {list(got)} on rank {rank}, "
            f"but torch.chunk semantics of {tuple(placements)} on global {list(shape)} give "
            f"{list(layout.piece_shape(me))}; other uneven shardings are not supported"
        )
    return layout


def assign_owners(layouts: Sequence[ShardLayout], nbytes: Sequence[int]) -> list[int]:
    """The owning group rank of each tensor: balanced by bytes, the same on every rank.

    Per shard group (tensors whose groups have the same ranks), the largest tensor goes first
    to the least-loaded rank (ties: the lower rank; equal sizes: the earlier tensor). Whole
    tensors are owned by every rank (returned as their own index 0).
    """
    owners = [0] * len(layouts)
    by_group: dict[tuple[int, ...], list[int]] = {}
    for i, lay in enumerate(layouts):
        if lay.size > 1:
            by_group.setdefault(lay.ranks, []).append(i)
    for ranks, members in by_group.items():
        loads = [(0, r) for r in range(len(ranks))]  # (bytes owned, group rank): a min-heap
        for i in sorted(members, key=lambda i: (-nbytes[i], i)):
            load, r = heapq.heappop(loads)
            owners[i] = r
            heapq.heappush(loads, (load + nbytes[i], r))
    return owners
