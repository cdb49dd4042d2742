"""DeviceMesh helpers: the default mesh, validation, and the groups one unit communicates in."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import Placement, Replicate, Shard

from .backend import serving_backend
from .compat import DataParallelMeshDims, concatenate_meshes

__all__ = [
    "MeshInfo",
    "SpmdDims",
    "default_mesh",
    "member_group",
    "mesh_info",
    "mesh_info_from_dims",
]


def _device_type() -> str:
    """``cuda`` when a GPU is visible and the default group runs CUDA collectives, else ``cpu``.

    The group runs them with NCCL named alone or per device (``"cpu:gloo,cuda:nccl"``), and
    when ``init_process_group()`` was called without a backend: torch then reports
    ``"undefined"`` and makes each device's default backend (NCCL for CUDA) on first use.
    """
    if not (torch.cuda.is_available() and dist.is_initialized()):
        return "cpu"
    return "cuda" if serving_backend(str(dist.get_backend()), "cuda") == "nccl" else "cpu"


def default_mesh() -> DeviceMesh:
    """A 1-D mesh over every rank of the default process group (``cuda`` where it runs NCCL
    on a visible GPU, else ``cpu``).

    Raises a clear error if ``torch.distributed`` is not initialised.
    """
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "fully_shard needs torch.distributed to be initialised: call "
            "torch.distributed.init_process_group(...) first (torchrun sets the environment), "
            "or pass mesh=... explicitly"
        )
    return init_device_mesh(_device_type(), (dist.get_world_size(),))


@dataclass(frozen=True)
class SpmdDims:
    """Where the data-parallel dims sit in a full SPMD mesh (``dp_mesh_dims``)."""

    mesh: DeviceMesh  # the full mesh the parameters are DTensors on
    shard_dims: tuple[int, ...]  # indices of the dims fully_shard shards over (flattened)
    replicate_dims: tuple[int, ...]  # indices of the HSDP replicate dims (flattened)

    @property
    def dp_dims(self) -> frozenset[int]:
        return frozenset(self.shard_dims + self.replicate_dims)


@dataclass(frozen=True)
class MeshInfo:
    """How one unit shards and replicates: the groups and this rank's place in them."""

    mesh: DeviceMesh
    shard_group: dist.ProcessGroup
    shard_rank: int
    shard_size: int
    replicate_group: dist.ProcessGroup | None  # set for HSDP (2-D mesh)
    replicate_size: int
    placements: tuple[Placement, ...]  # of the sharded parameters
    spmd: SpmdDims | None = None  # set with dp_mesh_dims: parameters live on the full mesh

    @property
    def device(self) -> torch.device:
        """The device the mesh computes on (``cuda:<local>`` or ``cpu``)."""
        if self.mesh.device_type == "cuda":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device(self.mesh.device_type)


def mesh_info(mesh: DeviceMesh) -> MeshInfo:
    """Validate ``mesh`` and describe it.

    A 1-D mesh shards over all of its ranks; a 2-D mesh is (replicate, shard) — HSDP. The mesh
    may be a sub-mesh of a larger one (``mesh["dp"]`` of a ``(dp, tp)`` mesh) or built from a
    subgroup (``DeviceMesh.from_group``): units then communicate only within it.
    """
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(
            f"mesh must be a torch.distributed.device_mesh.DeviceMesh, got {type(mesh).__name__}"
        )
    if mesh.get_coordinate() is None:
        raise ValueError(
            f"rank {dist.get_rank()} is not in the mesh {mesh.mesh.tolist()} given to "
            f"fully_shard: pass the data-parallel sub-mesh this rank belongs to (e.g. "
            f"mesh['dp'] of the full mesh)"
        )
    if mesh.ndim == 1:
        group = mesh.get_group(0)
        return MeshInfo(mesh, group, mesh.get_local_rank(0), mesh.size(0), None, 1, (Shard(0),))
    if mesh.ndim == 2:
        return MeshInfo(
            mesh,
            mesh.get_group(1),
            mesh.get_local_rank(1),
            mesh.size(1),
            mesh.get_group(0),
            mesh.size(0),
            (Replicate(), Shard(0)),
        )
    raise ValueError(  # FSDP2's message first (callers match it), then fullshard's
        f"fully_shard expects a 1D or 2D DeviceMesh but got {mesh}\n"
        f"fully_shard supports a 1-D mesh (shard) or a 2-D mesh (replicate, shard); got a "
        f"{mesh.ndim}-D mesh of shape {tuple(mesh.shape)}: pass the data-parallel sub-mesh "
        f"(e.g. mesh['dp'] or mesh['dp_replicate', 'dp_shard']), or the whole mesh with "
        f"dp_mesh_dims=DataParallelMeshDims(...)"
    )


def mesh_info_from_dims(mesh: DeviceMesh, dims: DataParallelMeshDims) -> MeshInfo:
    """FSDP2's ``dp_mesh_dims``: shard (and replicate) over the named dims of a full mesh.

    Several names on one side are flattened into one dimension, as in FSDP2. Only names of
    ``mesh.mesh_dim_names`` are accepted; replicate-only (pure DDP) is refused.
    """
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(
            f"mesh must be a torch.distributed.device_mesh.DeviceMesh, got {type(mesh).__name__}"
        )
    # FSDP2's messages first (tests match them), then how to fix it
    names = mesh.mesh_dim_names
    if names is None:
        raise ValueError(
            f"mesh must have mesh_dim_names when dp_mesh_dims is provided: build it with "
            f"init_device_mesh(device_type, {tuple(mesh.shape)}, mesh_dim_names=(...))"
        )
    for name in (*dims.shard_names, *dims.replicate_names):
        if name not in names:
            raise ValueError(
                f"Mesh dim name '{name}' not found in mesh.mesh_dim_names {names}: "
                f"dp_mesh_dims must name dims of the mesh passed as mesh=..."
            )
    if not dims.shard_names:
        raise NotImplementedError(
            f"dp_mesh_dims={dims} replicates without sharding (pure DDP), which fullshard "
            f"does not do: name a shard dim too (DataParallelMeshDims(shard=..., "
            f"replicate=...)) for HSDP"
        )

    def sub(group: tuple[str, ...]) -> DeviceMesh:
        return mesh[group[0]] if len(group) == 1 else mesh[group]._flatten("_".join(group))

    shard = sub(dims.shard_names)
    spmd = SpmdDims(
        mesh,
        tuple(names.index(n) for n in dims.shard_names),
        tuple(names.index(n) for n in dims.replicate_names),
    )
    if not dims.replicate_names:
        info = mesh_info(shard)
    else:
        info = mesh_info(concatenate_meshes([sub(dims.replicate_names), shard]))
    return replace(info, spmd=spmd)


def member_group(
    ranks: Sequence[int], made: dict[tuple[int, ...], dist.ProcessGroup], desc: str
) -> dist.ProcessGroup:
    """The process group of ``ranks`` (this rank among them): ``made``'s group for the same
    ranks, else a new one, recorded in ``made``, that only its members create
    (``use_local_synchronization``: the other ranks take no part, and groups of different
    ranks are created independently). Every member must ask for it, like any collective
    setup."""
    key = tuple(sorted(ranks))
    group = made.get(key)
    if group is None:
        group = dist.new_group(list(key), use_local_synchronization=True, group_desc=desc)
        assert group is not None  # this rank is a member
        made[key] = group
    return group
