"""Init-time work: claiming parameters at ``fully_shard``, and the root's lazy init.

``claim_params`` (at ``fully_shard``) turns every parameter of a new unit that no unit below
owns into a :class:`~fullshard.engine.param.ShardedParam`. Lazy init (``FSDPState.lazy_init`` in
``fullshard.engine.hooks``: the root's first forward, or an explicit ``unshard()``) then, once
for the whole model:

1. names every unit and parameter by its FQN relative to the root and refuses parameters still
   on the meta device (naming them): :func:`name_units`;
2. moves a parameter tied across units to the innermost unit that encloses every module using
   it (FSDP2 refuses such models): :func:`assign_shared_params`;
3. builds each unit's layout (unsharded views, gradient hooks), resolves
   ``reshard_after_forward`` (``None``: False for the root, True for the rest; int ``k``: a
   ``k``-rank subgroup) and hands every unit the shared
   :class:`~fullshard.engine.context.StepContext`.

The functions here work on modules and groups, not on the unit hooks' ``FSDPState``, so the
hooks import them and nothing here imports the hooks.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from .compat import PER_PARAMETER_MESH, require, root_mesh
from .group import ParamGroup
from .mesh import MeshInfo, mesh_info, mesh_info_from_dims
from .param import ShardedParam
from .policies import MixedPrecisionPolicy, keeps_own_dtype

__all__ = [
    "assign_shared_params",
    "check_reshard_after_forward",
    "claim_params",
    "name_units",
    "resolve_reshard_after_forward",
]


def check_reshard_after_forward(value: object, info: MeshInfo) -> None:
    """The one validation of a ``reshard_after_forward`` value for a unit sharded as ``info``:
    ``fully_shard`` and ``set_reshard_after_forward`` run it before they change anything, and
    the unit's state keeps the value as given (:func:`resolve_reshard_after_forward`)."""
    if value is None or isinstance(value, bool):
        return
    if not isinstance(value, int) or value < 1:
        raise ValueError(
            f"reshard_after_forward must be True, False, None or a positive int, got {value!r}"
        )
    if info.spmd is not None:  # FSDP2's message first
        raise NotImplementedError(
            f"reshard_after_forward as int is not yet supported with SPMD mesh (dp_mesh_dims)\n"
            f"reshard_after_forward={value} (an int) is not supported with dp_mesh_dims; use "
            f"True or False"
        )
    if info.shard_size % value != 0:
        raise ValueError(
            f"reshard_after_forward={value} must divide the shard group size "
            f"{info.shard_size}: after forward each group of {value} ranks keeps one copy "
            f"sharded among them"
        )


def resolve_reshard_after_forward(
    value: bool | int | None, is_root: bool, world: int
) -> bool | int:
    """What a unit does after forward under a (validated) ``reshard_after_forward``: ``True``
    frees, ``False`` keeps, an int ``k`` keeps a copy sharded over ``k`` ranks. ``None`` is
    ``False`` for the root and ``True`` for the rest; ``k`` = 1 keeps everything (``False``),
    ``k`` = the shard group size frees (``True``)."""
    if value is None:
        return not is_root
    if isinstance(value, bool) or value not in (1, world):
        return value
    return value == world


def claim_params(
    modules: tuple[nn.Module, ...],
    info: MeshInfo,
    device: torch.device,
    ignored: set[int],
    pin_memory: bool,
    placement_fn: Callable[[nn.Parameter], object] | None = None,
    mp_policy: MixedPrecisionPolicy | None = None,
    owned_below: Iterable[ShardedParam] = (),
) -> list[ShardedParam]:
    """Shard every parameter in ``modules`` not owned by a unit below; re-tie shared ones.

    ``placement_fn`` is ``shard_placement_fn``: ``None``, ``Shard(d)`` or a
    ``ShardPlacementResult`` (a placement on another mesh) per parameter.
    Parameters that are DTensors on other mesh dims (tensor parallel) are sharded over
    ``info``'s mesh on top of their placements. ``mp_policy``'s ``param_dtype_override_fn``
    is evaluated here, once per parameter. ``owned_below``: the parameters of the units
    already applied inside ``modules``, which stay theirs.
    """
    below = list(owned_below)
    by_sharded = {id(sp.sharded_param): sp for sp in below}
    claimed: dict[int, ShardedParam] = {}
    new: list[ShardedParam] = []
    meshes: dict[object, MeshInfo] = {_mesh_key(info): info}  # per-parameter meshes, one each
    for m in modules:
        for prefix, sub in m.named_modules():
            for name, p in list(sub._parameters.items()):
                if p is None or id(p) in ignored:
                    continue
                fqn = f"{prefix}.{name}" if prefix else name
                sp = by_sharded.get(id(p)) or claimed.get(id(p))
                if sp is None:
                    sp = next((b for b in below if b.is_original(p)), None)  # tied across units
                if sp is not None:
                    sp.add_ref(sub, name)
                    continue
                result = placement_fn(p) if placement_fn is not None else None
                placement, p_info = _resolve_placement(result, fqn, info, meshes)
                if p_info.spmd is not None:
                    _check_spmd_param(p, fqn, p_info)
                elif isinstance(p, DTensor):
                    _check_foreign_dtensor(p, fqn, m, p_info)
                sp = ShardedParam(
                    p, fqn, p_info, device, pin_memory=pin_memory, placement=placement
                )
                sp.keeps_own_dtype = mp_policy is not None and keeps_own_dtype(mp_policy, p, fqn)
                sp.add_ref(sub, name)
                claimed[id(p)] = sp
                new.append(sp)
    return new


def _mesh_key(info: MeshInfo) -> object:
    """What identifies a unit's or a parameter's mesh: the mesh, or with ``dp_mesh_dims`` the
    full mesh and the dims named."""
    spmd = info.spmd
    if spmd is None:
        return info.mesh
    names = spmd.mesh.mesh_dim_names or ()
    return (
        spmd.mesh,
        tuple(names[i] for i in spmd.shard_dims),
        tuple(names[i] for i in spmd.replicate_dims),
    )


def _resolve_placement(
    result: object, fqn: str, info: MeshInfo, meshes: dict[object, MeshInfo]
) -> tuple[Shard | None, MeshInfo]:
    """A ``shard_placement_fn`` result as (placement, the mesh the parameter shards over).

    ``None`` / ``Shard(d)`` shard over the unit's mesh (or its ``dp_mesh_dims``); FSDP2's
    ``ShardPlacementResult`` (``placement`` and ``mesh_info``, whose ``mesh`` is a 1-D shard
    or 2-D (replicate, shard) mesh) shards this parameter over its own mesh: the unit then
    gathers and reduces it in a separate communication group ([Note: one group per mesh] in
    ``fullshard.engine.partition``). As in FSDP2, a ``mesh_info`` with ``dp_mesh_dims`` (and
    ``spmd_mesh``, the full mesh) puts that parameter in the full-SPMD-mesh form whatever the
    unit uses, and one without puts it in the sub-mesh form.
    """
    if result is None or isinstance(result, Shard):
        return result, info
    require(PER_PARAMETER_MESH)
    result_info = getattr(result, "mesh_info", None)
    mesh = getattr(result_info, "mesh", None)
    placement = getattr(result, "placement", None)
    if not isinstance(mesh, DeviceMesh) or not (placement is None or isinstance(placement, Shard)):
        raise ValueError(
            f"shard_placement_fn returned {result!r} for {fqn!r}; return Shard(d), None "
            f"(Shard(0)) or a ShardPlacementResult(placement=Shard(d) or None, "
            f"mesh_info=FSDPMeshInfo(mesh, shard_mesh_dim=0))"
        )
    dims = getattr(result_info, "dp_mesh_dims", None)
    spmd_mesh = getattr(result_info, "spmd_mesh", None)
    if dims is not None and not isinstance(spmd_mesh, DeviceMesh):
        raise ValueError(
            f"shard_placement_fn gave {fqn!r} a mesh_info with dp_mesh_dims={dims} but no "
            f"spmd_mesh (the full mesh the parameter is a DTensor on): build it as "
            f"HSDPMeshInfo/FSDPMeshInfo(..., dp_mesh_dims=dims, spmd_mesh=full_mesh)"
        )
    key = mesh if dims is None else (spmd_mesh, dims.shard_names, dims.replicate_names)
    if key not in meshes:
        if isinstance(spmd_mesh, DeviceMesh) and dims is not None:  # FSDP2's SPMD form
            meshes[key] = mesh_info_from_dims(spmd_mesh, dims)
        elif mesh.ndim == 2 and mesh.mesh_dim_names is None:
            raise ValueError(
                f"the 2-D mesh shard_placement_fn gave {fqn!r} must name its dims "
                f"(replicate, shard)"
            )
        else:
            meshes[key] = mesh_info(mesh)
    return placement, meshes[key]


def _check_spmd_param(p: nn.Parameter, fqn: str, info: MeshInfo) -> None:
    """``dp_mesh_dims``: a parameter must be a DTensor on the full mesh, Replicate on dp."""
    spmd = info.spmd
    assert spmd is not None
    if not isinstance(p, DTensor):
        raise ValueError(
            f"with dp_mesh_dims every parameter must be a DTensor on the full SPMD mesh "
            f"{spmd.mesh.mesh_dim_names} (as in FSDP2); {fqn!r} is a plain "
            f"{type(p.data).__name__}: distribute it first (distribute_tensor(p, mesh, "
            f"[Replicate(), ...])) or pass it in ignored_params"
        )
    if p.device_mesh != spmd.mesh:
        raise ValueError(
            f"parameter {fqn!r} is a DTensor on mesh {p.device_mesh}, not the mesh passed "
            f"to fully_shard with dp_mesh_dims ({spmd.mesh}); distribute it on that mesh"
        )
    names = spmd.mesh.mesh_dim_names or ()
    dims = [("shard", i) for i in spmd.shard_dims] + [("replicate", i) for i in spmd.replicate_dims]
    for kind, i in dims:  # in FSDP2's order, with its message first
        if not isinstance(p.placements[i], Replicate):
            raise ValueError(
                f"Expected Replicate() on DP {kind} dim '{names[i]}' (index {i}) but got "
                f"{p.placements[i]}\n"
                f"parameter {fqn!r} has placement {p.placements[i]} on the data-parallel "
                f"mesh dim {names[i]!r}; with dp_mesh_dims it must be Replicate() there "
                f"(fully_shard does the sharding)"
            )


def _check_foreign_dtensor(p: DTensor, fqn: str, m: nn.Module, info: MeshInfo) -> None:
    """A DTensor parameter must live on mesh dims other than the unit's own (TP, EP)."""
    mesh = p.device_mesh
    dp_names = set(info.mesh.mesh_dim_names or ())
    shared = dp_names & set(mesh.mesh_dim_names or ())
    if mesh == info.mesh or shared:
        raise ValueError(
            f"parameter {fqn!r} of {type(m).__name__} is already a DTensor on the mesh dims "
            f"{sorted(shared) or list(mesh.mesh_dim_names or ())} this fully_shard call shards "
            f"over: apply fully_shard bottom-up (each block first, then the root), and pass "
            f"the data-parallel sub-mesh (mesh['dp']) when parameters are tensor-parallel"
        )
    if root_mesh(mesh) != root_mesh(info.mesh):
        raise ValueError(
            f"parameter {fqn!r} is a DTensor on mesh {mesh} that is not part of the same "
            f"device mesh as fully_shard's {info.mesh}: take both as sub-meshes of one "
            f"init_device_mesh(..., mesh_dim_names=(...)) (e.g. mesh['dp'] and mesh['tp'])"
        )


def name_units(
    root_modules: tuple[nn.Module, ...], units: list[tuple[tuple[nn.Module, ...], ParamGroup]]
) -> None:
    """Name every unit (its modules, group) and parameter by its FQN relative to the root;
    refuse parameters still on the meta device, naming those of the first such unit."""
    names = {id(m): n for top in root_modules for n, m in top.named_modules()}
    for modules, group in units:
        unit = names.get(id(modules[0]), "")
        cls = type(modules[0]).__name__.removeprefix("FSDP")  # the user's class name
        group.name = unit or f"{cls} (root)"
        for sp in group.params:
            sp.sync_from_modules()
            module, attr = sp.refs[0]
            prefix = names.get(id(module), "")
            sp.fqn = f"{prefix}.{attr}" if prefix else attr  # root-relative from now on
        group.check_materialised()  # as FSDP2: the first unit (root first) with meta ones


def assign_shared_params(units: list[tuple[tuple[nn.Module, ...], ParamGroup]]) -> None:
    """Give a parameter used by modules of several units to the innermost enclosing unit.

    FSDP2 refuses a Parameter reachable from two ``fully_shard`` calls (e.g. an embedding
    unit tied to the root's output head); here it moves to the unit whose subtree holds every
    module that uses it, which is unsharded whenever any of them computes.
    """
    subtree = [{id(m) for top in modules for m in top.modules()} for modules, _ in units]
    for i, (_, owner) in enumerate(units):
        for sp in list(owner.params):
            users = {id(m) for m, _ in sp.refs}
            if users <= subtree[i]:
                continue
            enclosing = [j for j in range(len(units)) if users <= subtree[j]]
            if not enclosing:
                names = [type(m).__name__ + "." + n for m, n in sp.refs]
                raise ValueError(
                    f"parameter {sp.fqn!r} is shared by modules {names} that no single "
                    f"fully_shard unit encloses; apply fully_shard to a common ancestor "
                    f"(e.g. the root model) as well"
                )
            target = min(enclosing, key=lambda j: len(subtree[j]))
            owner.params.remove(sp)
            units[target][1].params.append(sp)
