"""The sharding engine: what moves parameters and gradients between ranks during a step.

This package is the engine's one door: the rest of fullshard (the API, the FSDP1 wrapper,
checkpoints, optimizers, RL, the tools) imports the names below from ``fullshard.engine`` and
never an engine submodule, so what lies behind the door can change without rippling out
(``tests/test_layering.py`` enforces it). Nothing here is public API: ``fullshard.fully_shard``
/ ``fullshard.FSDPModule`` (``fullshard.api``, ``fullshard.module``) are; users may still reach
``fullshard.engine.streamcheck`` and the documented Notes. docs/design.md draws the layers and
which module does what.

The names, by what they are for:

- a unit and its state: ``FSDPState`` (a unit's hooks and step state; ``STATE_ATTR`` is where
  a module keeps it, ``states_under`` finds them), ``ParamGroup`` (its parameters and
  collectives), ``ShardedParam``, ``dtensor_like``, ``StepContext``, ``ShardedState`` /
  ``TrainingState``, ``Handle``, ``claim_params``, ``check_reshard_after_forward``;
- policies: ``MixedPrecisionPolicy``, ``OffloadPolicy``, ``CPUOffloadPolicy``, ``CommPolicy``;
- the collective seam: ``all_gather`` / ``all_reduce`` (every collective goes through the
  engine's), ``count_collectives`` / ``CollectiveStats``, FSDP2's custom-comm
  protocol (``AllGatherComm``, ``ReduceScatterComm``, ``BackendAllGather``,
  ``BackendReduceScatter``, ``BufferSource``, ``separate_reduce_scatter_groups``),
  ``select_transport``, ``BackendPlan``, ``CommStreams``, ``user_stream``, and the CPU's
  stand-ins for CUDA streams and events (``LogicalStream``, ``LogicalEvent``);
- backward finalization: ``finalize_backward``, ``set_manual_backward_finalization``,
  ``GradientReductionHandle``;
- meshes: ``MeshInfo``, ``default_mesh``, ``mesh_info``, ``mesh_info_from_dims``;
- facts about the installed torch: ``check_supported``, ``require``, ``require_method``,
  ``root_mesh`` and the features (``DP_MESH_DIMS``, ``DTENSOR_SUBCLASS_VIEWS``,
  ``SHARE_COMM_CTX``, ``LAUNCH_SHUTDOWN_TIMEOUT``, ``DataParallelMeshDims``);
- ``FullyShardError`` and the profiler's ``label``.
"""

from .backend import BackendPlan
from .collectives import CollectiveStats, all_gather, all_reduce, count_collectives
from .compat import (
    DP_MESH_DIMS,
    DTENSOR_SUBCLASS_VIEWS,
    LAUNCH_SHUTDOWN_TIMEOUT,
    SHARE_COMM_CTX,
    DataParallelMeshDims,
    check_supported,
    require,
    require_method,
    root_mesh,
)
from .context import StepContext
from .errors import FullyShardError
from .finalize import GradientReductionHandle, finalize_backward, set_manual_backward_finalization
from .group import ParamGroup
from .handle import Handle
from .hooks import STATE_ATTR, FSDPState, states_under
from .init import check_reshard_after_forward, claim_params
from .labels import label
from .mesh import MeshInfo, default_mesh, mesh_info, mesh_info_from_dims
from .overrides import (
    AllGatherComm,
    BackendAllGather,
    BackendReduceScatter,
    BufferSource,
    ReduceScatterComm,
    separate_reduce_scatter_groups,
)
from .p2p import all_gather_comm
from .param import ShardedParam, dtensor_like
from .policies import CommPolicy, CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy
from .state import ShardedState, TrainingState
from .streamcheck import LogicalEvent, LogicalStream
from .streams import CommStreams, user_stream
from .transport import select_transport

__all__ = [
    "DP_MESH_DIMS",
    "DTENSOR_SUBCLASS_VIEWS",
    "LAUNCH_SHUTDOWN_TIMEOUT",
    "SHARE_COMM_CTX",
    "STATE_ATTR",
    "AllGatherComm",
    "BackendAllGather",
    "BackendPlan",
    "BackendReduceScatter",
    "BufferSource",
    "CPUOffloadPolicy",
    "CollectiveStats",
    "CommPolicy",
    "CommStreams",
    "DataParallelMeshDims",
    "FSDPState",
    "FullyShardError",
    "GradientReductionHandle",
    "Handle",
    "LogicalEvent",
    "LogicalStream",
    "MeshInfo",
    "MixedPrecisionPolicy",
    "OffloadPolicy",
    "ParamGroup",
    "ReduceScatterComm",
    "ShardedParam",
    "ShardedState",
    "StepContext",
    "TrainingState",
    "all_gather",
    "all_gather_comm",
    "all_reduce",
    "check_reshard_after_forward",
    "check_supported",
    "claim_params",
    "count_collectives",
    "default_mesh",
    "dtensor_like",
    "finalize_backward",
    "label",
    "mesh_info",
    "mesh_info_from_dims",
    "require",
    "require_method",
    "root_mesh",
    "select_transport",
    "separate_reduce_scatter_groups",
    "set_manual_backward_finalization",
    "states_under",
    "user_stream",
]
