"""The one place where fullshard deals with differences between torch releases.

fullshard supports the torch releases in ``SUPPORTED_TORCH`` (the range ``pyproject.toml``
declares and CI tests: the oldest with the whole suite, the newest with ``scripts/compat.sh``).
Everything that differs between them is named here, once, as a fact about the installed torch;
no other module looks at ``torch.__version__``. What changed, by release:

- 2.15: ``FSDPModule`` gained ``set_keep_unsharded_storage``, ``set_manual_backward_finalization``
  and ``finalize_backward`` (which returns a ``torch.distributed.fsdp.GradientReductionHandle``);
  torch's pipelining finalizes a stage's backward through them instead of reaching into FSDP2's
  state (``fully_shard.state(...)``), and ``torch.distributed.pipelining.stage`` no longer
  imports ``fully_shard``. ``MixedPrecisionPolicy`` gained ``param_dtype_override_fn``, and with
  ``reduce_dtype=None`` gradients are reduced in the parameter's ``grad_dtype`` (its own dtype
  unless set) instead of ``param_dtype``.
- 2.14: nothing FSDP2 users can observe (its FSDP2 sources equal 2.13's).
- 2.13: ``FSDPModule`` gained ``reset_iter_state``, ``set_reduce_scatter_max_input_buffers``,
  ``set_reduce_scatter_unused_params`` and ``set_separate_reduce_scatter_group``.
- 2.12: ``LaunchConfig(shutdown_timeout=...)`` (``fullshard train --stop-timeout``; before it
  the elastic agent gives workers a fixed 30 s after a stop signal).
- 2.12: ``UntypedStorage._swap_data_ptr_`` (what the CPU buffer pool recycles memory with: on
  older torch the pool and gradient slabs are off, the CPU path gathers into fresh memory).
- 2.12: ``DataParallelMeshDims`` and ``fully_shard(..., dp_mesh_dims=...)`` (the full-SPMD mesh
  form), ``ShardPlacementResult`` (a parameter on its own mesh) and
  ``FSDPModule.set_symm_mem_for_comm``.
- 2.12: torch's pipelining stage reads ``state._fsdp_param_groups`` of ``fully_shard.state(...)``;
  2.9 to 2.11 read ``state._fsdp_param_group`` (``fullshard.torch_state`` answers both).
- 2.10: ``share_comm_ctx``; ``DeviceMesh._get_root_mesh()`` (2.9 asks ``_mesh_resources``) and
  ``DeviceMesh._concatenate`` (2.9 slices the root mesh by dim names).

A feature the installed torch lacks is refused where it is used (:func:`require`), in one line
naming the feature and the torch that has it; everything else runs with FSDP2's semantics of
the installed torch.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.distributed.fsdp as _tfsdp
from torch.distributed.device_mesh import DeviceMesh

__all__ = [
    "DP_MESH_DIMS",
    "DTENSOR_SUBCLASS_VIEWS",
    "FSDP_MODULE_METHODS_SINCE",
    "LAUNCH_SHUTDOWN_TIMEOUT",
    "MP_HAS_PARAM_DTYPE_OVERRIDE",
    "PER_PARAMETER_MESH",
    "PIPELINING_USES_FINALIZE_BACKWARD",
    "REDUCE_DTYPE_FOLLOWS_GRAD_DTYPE",
    "SHARE_COMM_CTX",
    "STORAGE_SWAP",
    "STORAGE_USE_COUNT",
    "SUPPORTED_TORCH",
    "TORCH_VERSION",
    "DataParallelMeshDims",
    "TorchFeature",
    "TorchGradientReductionHandle",
    "UnsupportedByTorchError",
    "all_gather_single",
    "check_supported",
    "concatenate_meshes",
    "reduce_scatter_single",
    "require",
    "require_method",
    "root_mesh",
]

#: The torch releases fullshard supports: ``(oldest, first unsupported)`` as (major, minor).
SUPPORTED_TORCH = ((2, 9), (2, 16))


def _parse(version: str) -> tuple[int, int]:
    m = re.match(r"(\d+)\.(\d+)", version)
    if m is None:  # a build that does not say; assume the newest we know
        return SUPPORTED_TORCH[1][0], SUPPORTED_TORCH[1][1] - 1
    return int(m.group(1)), int(m.group(2))


#: The installed torch's (major, minor).
TORCH_VERSION: tuple[int, int] = _parse(torch.__version__)

#: torch 2.15's base class of the handle ``FSDPModule.finalize_backward(async_op=True)``
#: returns; on older releases fullshard's own handle stands alone (``object``).
TorchGradientReductionHandle: type = getattr(_tfsdp, "GradientReductionHandle", object)

#: ``MixedPrecisionPolicy(param_dtype_override_fn=...)`` exists (torch 2.15).
MP_HAS_PARAM_DTYPE_OVERRIDE = "param_dtype_override_fn" in {
    f.name for f in dataclasses.fields(_tfsdp.MixedPrecisionPolicy)
}

#: With ``reduce_dtype=None``, FSDP2 reduces in the parameter's ``grad_dtype`` (torch 2.15) rather
#: than in ``param_dtype`` (2.14 and older).
REDUCE_DTYPE_FOLLOWS_GRAD_DTYPE = TORCH_VERSION >= (2, 15)

#: torch.distributed's single-tensor all-gather and reduce-scatter: ``all_gather_single`` /
#: ``reduce_scatter_single`` where torch has them (2.13), else ``all_gather_into_tensor`` /
#: ``reduce_scatter_tensor`` (the same collectives under their older names).
all_gather_single: Callable[..., Any] = (
    getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
)
reduce_scatter_single: Callable[..., Any] = (
    getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
)

#: ``UntypedStorage._swap_data_ptr_`` exists (torch 2.12): the CPU buffer pool can recycle memory.
STORAGE_SWAP = hasattr(torch.UntypedStorage, "_swap_data_ptr_")

#: ``torch._C._storage_Use_Count`` exists: gradient slabs can tell when a storage is free.
STORAGE_USE_COUNT = hasattr(torch._C, "_storage_Use_Count")

#: torch's pipelining finishes a stage's backward with ``finalize_backward`` (2.15) rather than
#: through ``fully_shard.state(module)`` (2.14 and older; see ``fullshard.torch_state``).
PIPELINING_USES_FINALIZE_BACKWARD = TORCH_VERSION >= (2, 15)

#: DTensor's view ops accept a subclass of ``DTensor`` (torch 2.11; 2.9 asserts that the view's
#: class is its input's): the FSDP1 wrapper's ``WritableShard`` (fullshard.fsdp1.writeback).
DTENSOR_SUBCLASS_VIEWS = TORCH_VERSION >= (2, 11)


def check_supported() -> str | None:
    """A one-line warning if the installed torch is outside ``SUPPORTED_TORCH``, else None."""
    lo, hi = SUPPORTED_TORCH
    if lo <= TORCH_VERSION < hi:
        return None
    return (
        f"fullshard supports torch {lo[0]}.{lo[1]} to {hi[0]}.{hi[1] - 1}; torch "
        f"{torch.__version__} is installed. Install a supported torch (pip install "
        f"'torch>={lo[0]}.{lo[1]},<{hi[0]}.{hi[1]}') or report what breaks"
    )


class UnsupportedByTorchError(NotImplementedError):
    """A feature of FSDP2 that the installed torch does not have yet."""


@dataclasses.dataclass(frozen=True)
class TorchFeature:
    """A feature FSDP2 gained in torch ``since``, named as its users meet it (``what``)."""

    what: str
    since: tuple[int, int]

    @property
    def available(self) -> bool:
        """Whether the installed torch has it."""
        return TORCH_VERSION >= self.since


def require(feature: TorchFeature) -> None:
    """Refuse ``feature`` in one line if the installed torch does not have it."""
    if feature.available:
        return
    major, minor = feature.since
    raise UnsupportedByTorchError(
        f"{feature.what} needs torch {major}.{minor} or newer (FSDP2 has it from {major}.{minor}); "
        f"torch {torch.__version__} is installed: upgrade torch (pip install "
        f"'torch>={major}.{minor}') or do without it"
    )


#: ``fully_shard(..., dp_mesh_dims=DataParallelMeshDims(...))``, FSDP2's full-SPMD mesh form.
DP_MESH_DIMS = TorchFeature("fully_shard(..., dp_mesh_dims=...) (the full-SPMD mesh form)", (2, 12))

#: ``shard_placement_fn`` returning FSDP2's ``ShardPlacementResult`` (a parameter on its mesh).
PER_PARAMETER_MESH = TorchFeature(
    "shard_placement_fn returning a ShardPlacementResult (a parameter on its own mesh)", (2, 12)
)

#: ``LaunchConfig(shutdown_timeout=...)``: how long ``fullshard train``'s workers get to save after
#: a stop signal (``--stop-timeout``); older torch gives them its fixed 30 s.
LAUNCH_SHUTDOWN_TIMEOUT = TorchFeature("LaunchConfig(shutdown_timeout=...)", (2, 12))

#: ``share_comm_ctx(modules)``: several roots share one set of communication streams.
SHARE_COMM_CTX = TorchFeature("share_comm_ctx", (2, 10))

#: The ``FSDPModule`` methods newer than the oldest supported torch, and the torch that added
#: each; fullshard's ``FSDPModule`` refuses them on an older torch (:func:`require_method`).
FSDP_MODULE_METHODS_SINCE: dict[str, tuple[int, int]] = {
    "set_symm_mem_for_comm": (2, 12),
    "reset_iter_state": (2, 13),
    "set_reduce_scatter_max_input_buffers": (2, 13),
    "set_reduce_scatter_unused_params": (2, 13),
    "set_separate_reduce_scatter_group": (2, 13),
    "finalize_backward": (2, 15),
    "set_keep_unsharded_storage": (2, 15),
    "set_manual_backward_finalization": (2, 15),
}


def require_method(name: str) -> None:
    """Refuse ``FSDPModule.<name>`` if the installed torch's ``FSDPModule`` does not have it."""
    since = FSDP_MODULE_METHODS_SINCE.get(name)
    if since is not None:
        require(TorchFeature(f"FSDPModule.{name}", since))


class _NoDataParallelMeshDims:
    """Stands for ``DataParallelMeshDims`` where torch lacks it: nothing is an instance of it."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        require(DP_MESH_DIMS)


if TYPE_CHECKING:
    from torch.distributed.fsdp import DataParallelMeshDims
else:
    #: torch's ``DataParallelMeshDims`` (2.12); on older torch a stand-in that refuses itself.
    DataParallelMeshDims = getattr(_tfsdp, "DataParallelMeshDims", _NoDataParallelMeshDims)


def root_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The mesh ``mesh`` was sliced from (itself if none): ``DeviceMesh._get_root_mesh()``
    from torch 2.10, the mesh resources' ``get_root_mesh`` on 2.9."""
    get = getattr(mesh, "_get_root_mesh", None)
    if get is not None:
        return get()
    from torch.distributed.device_mesh import _mesh_resources  # type: ignore[attr-defined]

    return _mesh_resources.get_root_mesh(mesh)


def concatenate_meshes(meshes: list[DeviceMesh]) -> DeviceMesh:
    """One mesh of the dims of ``meshes`` (sub-meshes of one root mesh), in order:
    ``DeviceMesh._concatenate`` from torch 2.10; on 2.9 the root sliced by their dim names
    (what 2.9's FSDP2 does), which needs every mesh to be a named slice of the root."""
    concatenate = getattr(DeviceMesh, "_concatenate", None)
    if concatenate is not None:
        return concatenate(meshes)
    names = tuple(n for m in meshes for n in (m.mesh_dim_names or ()))
    return root_mesh(meshes[0])[names]
