"""FSDP1's constructor arguments in fullshard's terms: mesh, resharding and policies.

FSDP1 describes a unit by a ``ShardingStrategy`` over process groups; fullshard by a mesh and
``reshard_after_forward``. The mapping:

==========================  =================================  ===========================
``ShardingStrategy``        mesh                               ``reshard_after_forward``
==========================  =================================  ===========================
``FULL_SHARD``              1-D over the group                 ``None`` (root keeps, as FSDP1)
``SHARD_GRAD_OP``           1-D over the group                 ``False``
``NO_SHARD``                2-D ``(group, 1)``: replicas only  ``False``
``HYBRID_SHARD``            2-D ``(replicate, shard)``         ``None``
``_HYBRID_SHARD_ZERO2``     2-D ``(replicate, shard)``         ``False``
==========================  =================================  ===========================

``NO_SHARD`` is HSDP with one rank per shard group: every rank holds whole parameters and
gradients are all-reduced across the replicas, which is what FSDP1's ``NO_SHARD`` does. The
hybrid strategies take their 2-D mesh from ``device_mesh`` (dim 0 replicates, dim 1 shards,
as FSDP1), from ``process_group=(intra_node_group, inter_node_group)``, or by default from
nodes of ``device_count()`` ranks (FSDP1's intra-node default; on the CPU that is one rank).

``MixedPrecision`` becomes a ``MixedPrecisionPolicy`` whose ``reduce_dtype`` defaults to
``param_dtype`` (FSDP1's rule); input casting and ``buffer_dtype`` are the wrapper's
(``fullshard.fsdp1.wrapper``), since they depend on which unit is the root.
"""

from __future__ import annotations

import contextlib
import contextvars
import warnings
from collections.abc import Callable, Iterable, Iterator
from typing import Any, cast

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import CPUOffload, MixedPrecision, ShardingStrategy

from ..engine import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, default_mesh

__all__ = [
    "HYBRID",
    "check_device",
    "check_same_params",
    "device_of",
    "fsdp1_group",
    "is_stand_in",
    "mesh_cache",
    "mp_policy_of",
    "offload_policy_of",
    "reshard_after_forward_of",
    "resolve_device_type",
    "resolve_ignored",
    "resolve_mesh",
    "resolve_strategy",
    "warn_container",
    "warn_strategy",
]

HYBRID = (ShardingStrategy.HYBRID_SHARD, ShardingStrategy._HYBRID_SHARD_ZERO2)
_RESHARD: dict[ShardingStrategy, bool | None] = {
    ShardingStrategy.FULL_SHARD: None,
    ShardingStrategy.SHARD_GRAD_OP: False,
    ShardingStrategy.NO_SHARD: False,
    ShardingStrategy.HYBRID_SHARD: None,
    ShardingStrategy._HYBRID_SHARD_ZERO2: False,
}
_NAMES = ("replicate", "shard")


def fsdp1_group(info: Any, strategy: ShardingStrategy) -> tuple[dist.ProcessGroup, int]:
    """FSDP1's ``process_group`` and its size: the replicas' under ``NO_SHARD`` (fullshard's
    shard group is then one rank), else the shard group (the intra-node one if hybrid)."""
    if strategy is ShardingStrategy.NO_SHARD:
        return cast(dist.ProcessGroup, info.replicate_group), info.replicate_size
    return info.shard_group, info.shard_size


def warn_container(module: torch.nn.Module) -> None:
    """FSDP1's warning for a container without a forward (its parameters stay sharded)."""
    if isinstance(module, (torch.nn.ModuleList, torch.nn.ModuleDict)):
        warnings.warn(
            f"FSDP will not all-gather parameters for containers that do not implement "
            f"forward: {module}",
            stacklevel=3,
        )


def resolve_strategy(strategy: ShardingStrategy | None) -> ShardingStrategy:
    if strategy is None:
        return ShardingStrategy.FULL_SHARD
    if not isinstance(strategy, ShardingStrategy):
        raise TypeError(
            f"sharding_strategy must be a torch.distributed.fsdp.ShardingStrategy, got "
            f"{type(strategy).__name__}"
        )
    return strategy


def warn_strategy(strategy: ShardingStrategy, world_size: int) -> None:
    """FSDP1's warnings: a sharding strategy at world size 1 (it runs ``NO_SHARD``), and
    ``NO_SHARD`` (deprecated for ``DistributedDataParallel``)."""
    if world_size == 1 and strategy is not ShardingStrategy.NO_SHARD:
        warnings.warn(
            f"FSDP is switching to use `NO_SHARD` instead of {strategy} since the world size is 1.",
            stacklevel=5,
        )
    elif world_size > 1 and strategy is ShardingStrategy.NO_SHARD:
        warnings.warn(
            "The `NO_SHARD` sharding strategy is deprecated. If having issues, please use "
            "`DistributedDataParallel` instead.",
            FutureWarning,
            stacklevel=5,
        )


def reshard_after_forward_of(strategy: ShardingStrategy) -> bool | None:
    """``None`` (fullshard's default: all but the root reshard) for the strategies that free
    parameters after forward; FSDP1 keeps the root's too."""
    return _RESHARD[strategy]


def mp_policy_of(mp: MixedPrecision | None) -> MixedPrecisionPolicy:
    """The engine's policy for FSDP1's ``MixedPrecision``; inputs are cast by the wrapper."""
    if mp is None:
        return MixedPrecisionPolicy(cast_forward_inputs=False)
    if not isinstance(mp, MixedPrecision):
        raise TypeError(
            f"mixed_precision must be a torch.distributed.fsdp.MixedPrecision, got "
            f"{type(mp).__name__}"
        )
    if mp.keep_low_precision_grads:
        raise NotImplementedError(
            "MixedPrecision(keep_low_precision_grads=True) is not supported by fullshard: "
            "gradients are kept in the parameters' dtype (which torch's optimizers require); "
            "use a lower-precision model (module.to(dtype)) to keep low-precision gradients"
        )
    reduce = mp.reduce_dtype if mp.reduce_dtype is not None else mp.param_dtype
    return MixedPrecisionPolicy(
        param_dtype=mp.param_dtype, reduce_dtype=reduce, cast_forward_inputs=False
    )


def offload_policy_of(cpu_offload: CPUOffload | None) -> OffloadPolicy:
    if cpu_offload is None or not cpu_offload.offload_params:
        return OffloadPolicy()
    return CPUOffloadPolicy(pin_memory=True)


def device_of(device_id: int | str | torch.device | None) -> torch.device | None:
    """FSDP1's ``device_id``: a ``torch.device``, a string (``"cpu"``, ``"cuda"``,
    ``"cuda:1"``) or an index of the accelerator torch runs on. A non-CPU device without an
    index means the current device of its type, with FSDP1's warning."""
    if device_id is None:
        return None
    if isinstance(device_id, bool) or not isinstance(device_id, (int, str, torch.device)):
        raise TypeError(
            f"device_id must be an int, a str or a torch.device, got {type(device_id).__name__}"
        )
    if isinstance(device_id, int):
        accelerator = torch.accelerator.current_accelerator()
        if accelerator is None:
            raise RuntimeError(
                f"device_id={device_id} is an accelerator's index, but torch sees no "
                f"accelerator: pass device_id='cpu' (or torch.device('cpu')) to run on the CPU"
            )
        return torch.device(accelerator.type, device_id)
    device = torch.device(device_id)
    if device.type in ("cpu", "meta") or device.index is not None:
        return device
    current = torch.device(device.type, torch.get_device_module(device.type).current_device())
    warnings.warn(
        f"FSDP got the argument `device_id` {device_id} on rank {_rank()}, which does "
        f"not have an explicit index. FSDP will use the current device {current}. If this is "
        f"incorrect, call `torch.{device.type}.set_device()` before FSDP initialization or "
        f"pass the device with its index as `device_id`.",
        stacklevel=3,
    )
    return current


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def is_stand_in(process_group: Any) -> bool:
    """Whether ``process_group`` is a stand-in: an object with ``rank()`` and ``size()`` that
    is not a ``torch.distributed.ProcessGroup`` (torch's tests build FSDP1's wrapper structure
    with one), so it cannot communicate."""
    if process_group is None or isinstance(process_group, (dist.ProcessGroup, tuple)):
        return False
    return callable(getattr(process_group, "rank", None)) and callable(
        getattr(process_group, "size", None)
    )


def check_device(device: torch.device | None, compute: torch.device) -> None:
    """Refuse a ``device_id`` that is not the device the unit computes on (this rank's
    current device of its type), with FSDP1's message and the fix."""
    if device is None or device.type != compute.type or device == compute:
        return
    raise ValueError(
        f"Inconsistent compute device and `device_id` on rank {_rank()}: {compute} vs "
        f"{device}: fullshard computes on the current device; call "
        f"torch.{device.type}.set_device({device.index}) before wrapping, or pass "
        f"device_id={str(compute)!r}"
    )


def resolve_device_type(device: torch.device | None, module: torch.nn.Module) -> str:
    """The mesh's device type: ``device``'s (``device_id``'s), else that of the module's
    parameters when they are on an accelerator, else the default group's (``cuda`` where it
    runs NCCL)."""
    if device is not None:
        return device.type
    for p in module.parameters():
        if p.device.type not in ("cpu", "meta"):
            return p.device.type
    return default_mesh().device_type


# Meshes made while one root is constructed (its auto-wrapped children ask for the same ones):
# FSDP1 likewise creates its process groups once at the root and hands them down.
_MESHES: contextvars.ContextVar[dict[tuple[Any, ...], DeviceMesh] | None] = contextvars.ContextVar(
    "fullshard_fsdp1_meshes", default=None
)


@contextlib.contextmanager
def mesh_cache() -> Iterator[None]:
    """Share the meshes resolved inside the block (the outermost block owns the cache)."""
    token = _MESHES.set({}) if _MESHES.get() is None else None
    try:
        yield
    finally:
        if token is not None:
            _MESHES.reset(token)


def resolve_mesh(
    strategy: ShardingStrategy,
    process_group: Any,
    device_mesh: DeviceMesh | None,
    device_type: str,
    auto_wrapping: bool,
) -> DeviceMesh:
    """The mesh of a unit with FSDP1's ``process_group`` / ``device_mesh`` arguments (see the
    module docstring); FSDP1's messages for what FSDP1 refuses."""
    if process_group is not None and device_mesh is not None:
        raise ValueError(
            "Cannot pass both process_group and device_mesh at the same time. Please just "
            "pass only one of them."
        )
    groups = process_group if isinstance(process_group, tuple) else (process_group,)
    key: tuple[Any, ...] = (strategy in HYBRID, strategy is ShardingStrategy.NO_SHARD, device_type)
    key += tuple(id(g) for g in groups) + (id(device_mesh),)
    cache = _MESHES.get()
    if cache is not None and key in cache:
        return cache[key]
    mesh = _make_mesh(strategy, process_group, device_mesh, device_type, auto_wrapping)
    if cache is not None:
        cache[key] = mesh
    return mesh


def _make_mesh(
    strategy: ShardingStrategy,
    process_group: Any,
    device_mesh: DeviceMesh | None,
    device_type: str,
    auto_wrapping: bool,
) -> DeviceMesh:
    if strategy in HYBRID:
        if device_mesh is not None:
            if device_mesh.ndim != 2:
                raise ValueError(f"Expected device_mesh to have ndim=2 but got {device_mesh.ndim}")
            return device_mesh
        if process_group is None:
            if not auto_wrapping:
                raise ValueError(
                    f"Manual wrapping with {strategy} requires explicit specification of "
                    f"process group or device_mesh."
                )
            return _intra_node_mesh(device_type)
        if not (
            isinstance(process_group, tuple)
            and len(process_group) == 2
            and all(isinstance(g, dist.ProcessGroup) for g in process_group)
        ):
            raise ValueError(
                "Expected process_group to be passed in as either None or "
                f"Tuple[dist.ProcessGroup, dist.ProcessGroup] but got {type(process_group)}"
            )
        intra, inter = process_group
        return _mesh_of_groups(intra, inter, device_type)
    if device_mesh is not None and device_mesh.ndim != 1:
        raise ValueError(
            f"{strategy} takes a 1-D device_mesh (got {device_mesh.ndim}-D); a 2-D mesh is for "
            f"HYBRID_SHARD / _HYBRID_SHARD_ZERO2"
        )
    if strategy is ShardingStrategy.NO_SHARD:
        group = device_mesh.get_group(0) if device_mesh is not None else process_group
        world = cast(dist.ProcessGroup, dist.group.WORLD)
        return _replicate_mesh(group or world, device_type)
    if device_mesh is not None:
        return device_mesh
    if process_group is None:
        return init_device_mesh(device_type, (dist.get_world_size(),))
    return DeviceMesh.from_group(process_group, device_type)


def _intra_node_mesh(device_type: str) -> DeviceMesh:
    """FSDP1's default hybrid groups: shard within nodes of ``device_count()`` ranks."""
    world = dist.get_world_size()
    per_node = max(1, torch.get_device_module(device_type).device_count())
    if device_type == "cpu":
        per_node = 1  # torch.cpu.device_count(), what FSDP1 uses on the CPU
    if world % per_node:
        raise ValueError(
            f"the world size {world} is not a multiple of the {per_node} devices per node; "
            f"pass HYBRID_SHARD's groups (process_group=(intra, inter)) or a 2-D device_mesh"
        )
    return init_device_mesh(device_type, (world // per_node, per_node), mesh_dim_names=_NAMES)


def _mesh_of_groups(
    intra: dist.ProcessGroup, inter: dist.ProcessGroup, device_type: str
) -> DeviceMesh:
    """The ``(replicate, shard)`` mesh of FSDP1's ``(intra_node_group, inter_node_group)``:
    row ``i`` is the shard group of the replica at position ``i`` of this rank's inter group."""
    rows: list[Any] = [None] * dist.get_world_size(inter)
    dist.all_gather_object(rows, dist.get_process_group_ranks(intra), group=inter)
    mesh = torch.tensor(rows, dtype=torch.int)
    return DeviceMesh.from_group([inter, intra], device_type, mesh=mesh, mesh_dim_names=_NAMES)


def _replicate_mesh(group: dist.ProcessGroup, device_type: str) -> DeviceMesh:
    """``(n, 1)`` over ``group``'s ``n`` ranks: replicas of one rank each (``NO_SHARD``)."""
    ranks = dist.get_process_group_ranks(group)
    alone = dist.new_group([dist.get_rank()], use_local_synchronization=True)
    mesh = torch.tensor(ranks, dtype=torch.int).view(-1, 1)
    return DeviceMesh.from_group([group, alone], device_type, mesh=mesh, mesh_dim_names=_NAMES)


def resolve_ignored(
    root: torch.nn.Module,
    ignored_modules: Iterable[torch.nn.Module] | None,
    ignored_states: Iterable[Any] | None,
    is_unit: Callable[[torch.nn.Module], bool],
) -> tuple[set[torch.nn.Module], set[torch.nn.Parameter]]:
    """FSDP1's ``ignored_modules`` / ``ignored_states``: the modules left out (with their
    submodules) and the parameters left unsharded (theirs and those named), with FSDP1's
    checks and messages; nested wrappers' ignored modules and parameters are ignored too (as
    FSDP1), so a module ignored by a child is never sharded by its parent."""
    if ignored_modules is not None and ignored_states is not None:
        raise ValueError(
            "Cannot pass both ignored_modules and ignored_states at the same time. Please just "
            "pass ignored_states."
        )
    modules, params = _split_ignored(ignored_modules, ignored_states)
    for m in modules:
        if is_unit(m):
            raise ValueError("`ignored_modules` should not include FSDP modules")
    out = {sub for m in modules for sub in m.modules() if not is_unit(sub)}
    if root in out:
        warnings.warn(
            f"Trying to ignore the top-level module passed into the FSDP constructor itself "
            f"will result in all parameters being ignored and is not well-supported: "
            f"{type(root).__name__}",
            stacklevel=3,
        )
    ignored = {p for m in out for p in m.parameters()} | set(params)
    for sub in root.modules():  # what nested wrappers ignore (FSDP1 inherits it)
        out |= sub.__dict__.get("_ignored_modules", set())
        ignored |= sub.__dict__.get("_ignored_params", set())
    return out, ignored


def check_same_params(
    module: torch.nn.Module, params: list[tuple[str, torch.Size]], group: dist.ProcessGroup
) -> None:
    """Refuse, on every rank, a unit whose parameters (their shapes, in order; names may
    differ, as FSDP1's flat parameter does not see them) differ across the ranks of its group
    (``ignored_modules`` / ``ignored_states`` that differ across ranks), whose collectives
    would not match (an abort or a hang): one small gather at construction."""
    if dist.get_world_size(group) == 1:
        return
    everyone: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, params, group=group)
    shapes = [[tuple(shape) for _, shape in theirs] for theirs in everyone]
    for rank, theirs in enumerate(shapes):
        if theirs != shapes[0]:
            raise ValueError(
                f"the FullyShardedDataParallel of {type(module).__name__} shards different "
                f"parameters on its group's ranks 0 ({len(shapes[0])}: {shapes[0]}) and {rank} "
                f"({len(theirs)}: {theirs}): ignored_modules / ignored_states differ across "
                f"ranks; pass the same ignored modules and parameters on every rank"
            )


def _split_ignored(
    ignored_modules: Iterable[Any] | None, ignored_states: Iterable[Any] | None
) -> tuple[list[torch.nn.Module], list[torch.nn.Parameter]]:
    """The modules and parameters named, checked as FSDP1 checks them."""
    try:
        modules: list[Any] = list(ignored_modules or ())
    except TypeError as e:
        raise TypeError(
            f"`ignored_modules` should be an iterable of `torch.nn.Module`s but got "
            f"{type(ignored_modules)}"
        ) from e
    if not all(isinstance(m, torch.nn.Module) for m in modules):
        raise ValueError(
            f"ignored_modules expects nn.Module list elements but got types {_types(modules)}: "
            f"pass modules (parameters go in ignored_states)"
        )
    states = list(ignored_states or ())
    if all(isinstance(s, torch.nn.Parameter) for s in states):
        return modules, states
    if all(isinstance(s, torch.nn.Module) for s in states):
        return states, []
    raise ValueError(
        f"ignored_states expects all nn.Parameter or all nn.Module list elements but got "
        f"types {_types(states)}"
    )


def _types(items: list[Any]) -> list[type]:
    """The elements' types, each once, in FSDP1's order (sorted by ``repr``)."""
    return sorted({type(x) for x in items}, key=repr)
