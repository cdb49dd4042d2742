"""Where a rank's piece of a tensor sits in the global tensor, and how to rebuild one.

Everything the checkpoint code knows about sharding goes through this module, and it relies only
on the public DTensor contract (``device_mesh``, ``placements``, ``to_local``, ``from_local``):
``Shard(d)`` splits like ``torch.chunk`` (ranks get ``ceil(n / k)`` rows, the last ones fewer,
possibly none) and ``Replicate()`` copies. Plain tensors are treated as replicated on every rank.

A *box* is ``(offset, shape)``: the region of the global tensor, one entry per dim.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch.distributed.tensor.placement_types import _StridedShard

from ..engine import root_mesh
from .manifest import CheckpointError

__all__ = [
    "Box",
    "global_shape",
    "is_writer",
    "local_box",
    "local_data",
    "model_aliases",
    "rank_and_world",
    "slices",
    "wrap_like",
]

Box = tuple[tuple[int, ...], tuple[int, ...]]  # (offset, shape), both ND


def rank_and_world() -> tuple[int, int]:
    """This process's rank and the world size; ``(0, 1)`` when torch.distributed is not set up."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def global_shape(t: torch.Tensor) -> tuple[int, ...]:
    return tuple(t.shape)


def local_data(t: torch.Tensor) -> torch.Tensor:
    """The data this rank holds for ``t``: the local shard of a DTensor, else ``t`` itself."""
    return t.to_local() if isinstance(t, DTensor) else t


def local_box(t: torch.Tensor, what: str) -> Box:
    """The box of the global tensor that this rank holds for ``t``.

    Raises :class:`CheckpointError` (naming ``what``) for placements other than Shard/Replicate
    or when the computed shape disagrees with the local tensor.
    """
    shape = list(t.shape)
    offset = [0] * len(shape)
    if not isinstance(t, DTensor):
        return tuple(offset), tuple(shape)
    mesh = t.device_mesh
    coord = mesh.get_coordinate()
    if coord is None:
        raise CheckpointError(f"{what}: this rank is not part of the tensor's device mesh")
    if any(isinstance(p, _StridedShard) for p in t.placements):
        # A dim sharded by dp inside a TP shard (fully_shard over TP, see fullshard.engine.param):
        # still one box per rank; torch's DTensor computes it.
        box_shape, box_start = compute_local_shape_and_global_offset(t.shape, mesh, t.placements)
        if tuple(box_shape) != tuple(t.to_local().shape):
            raise CheckpointError(
                f"{what}: local shard has shape {list(t.to_local().shape)} but "
                f"{t.placements} on global {list(t.shape)} give {list(box_shape)}"
            )
        return tuple(box_start), tuple(box_shape)
    for mesh_dim, p in enumerate(t.placements):
        if isinstance(p, Replicate):
            continue
        if type(p) is not Shard:
            raise CheckpointError(
                f"{what}: placement {p} on mesh dim {mesh_dim} is not supported; fullshard "
                "checkpoints handle Shard(d) and Replicate(). Redistribute to those first."
            )
        d = p.dim if p.dim >= 0 else p.dim + len(shape)
        n, c = mesh.size(mesh_dim), coord[mesh_dim]
        chunk = -(-shape[d] // n) if shape[d] else 0
        start = min(c * chunk, shape[d])
        length = max(0, min(shape[d], start + chunk) - start)
        offset[d] += start
        shape[d] = length
    local_shape = tuple(t.to_local().shape)
    if local_shape != tuple(shape):
        raise CheckpointError(
            f"{what}: local shard has shape {list(local_shape)} but torch.chunk semantics of "
            f"{t.placements} on global {list(t.shape)} give {shape}; uneven sharding other than "
            "torch.chunk's is not supported"
        )
    return tuple(offset), tuple(shape)


def is_writer(t: torch.Tensor) -> bool:
    """Whether this rank stores its box of ``t`` (exactly one rank stores each distinct box).

    A DTensor's box is written by the rank whose coordinate is 0 on every Replicate mesh dim
    (HSDP replicas hold identical shards); a plain tensor is written by global rank 0. Empty
    boxes are never written.
    """
    if isinstance(t, DTensor):
        coord: Sequence[int] = t.device_mesh.get_coordinate() or ()
        if any(isinstance(p, Replicate) and coord[i] != 0 for i, p in enumerate(t.placements)):
            return False
        if not _first_replica(t.device_mesh):
            return False
        return t.to_local().numel() > 0
    return rank_and_world()[0] == 0 and t.numel() > 0


def _first_replica(mesh: DeviceMesh) -> bool:
    """Whether this rank's copy of a sub-mesh DTensor is the one written.

    A DTensor on a sub-mesh (``mesh["dp"]`` of a ``(dp, tp)`` mesh, e.g. a norm weight under
    TP x FSDP) is replicated over the root mesh's other dims: coordinate 0 there writes.
    """
    root = root_mesh(mesh)
    names = mesh.mesh_dim_names or ()
    if root is mesh or root.mesh_dim_names is None:
        return True
    coord = root.get_coordinate() or ()
    return all(c == 0 for n, c in zip(root.mesh_dim_names, coord) if n not in names)


def slices(box: Box, origin: tuple[int, ...] | None = None) -> tuple[slice, ...]:
    """Index of ``box`` inside a tensor whose own box starts at ``origin`` (default 0)."""
    offset, shape = box
    origin = origin or (0,) * len(offset)
    return tuple(slice(o - g, o - g + s) for o, s, g in zip(offset, shape, origin))


def intersect(a: Box, b: Box) -> Box | None:
    """The intersection of two boxes, or None when it is empty (0-d boxes always intersect)."""
    lo = tuple(max(x, y) for x, y in zip(a[0], b[0]))
    hi = tuple(min(x + m, y + n) for x, m, y, n in zip(a[0], a[1], b[0], b[1]))
    if any(h <= lo_ for lo_, h in zip(lo, hi)):
        return None
    return lo, tuple(h - lo_ for lo_, h in zip(lo, hi))


def wrap_like(target: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """A tensor shaped and placed like ``target`` whose local data is ``local``.

    For a DTensor target this is ``DTensor.from_local`` with the target's mesh and placements;
    ``local`` is moved to the device of the target's local shard.
    """
    if isinstance(target, DTensor):
        device = target.to_local().device
        return DTensor.from_local(
            local.to(device),
            target.device_mesh,
            target.placements,
            run_check=False,
            shape=target.shape,
            stride=target.stride(),
        )
    return local.to(target.device)


def model_aliases(model: nn.Module) -> dict[str, str]:
    """Tied parameters and buffers: ``{fqn: first fqn of the same tensor}`` for every repeat."""
    seen: dict[int, str] = {}
    aliases: dict[str, str] = {}
    for fqn, t in _named_tensors(model):
        first = seen.setdefault(id(t), fqn)
        if first != fqn:
            aliases[fqn] = first
    return aliases


def _named_tensors(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    yield from model.named_parameters(remove_duplicate=False)
    yield from model.named_buffers(remove_duplicate=False)


def nbytes(t: torch.Tensor) -> int:
    return math.prod(local_data(t).shape) * t.dtype.itemsize
