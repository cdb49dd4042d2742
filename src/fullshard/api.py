"""``fully_shard``: the public, FSDP2-compatible entry point (``FSDPModule`` is in module.py).

Code written for PyTorch FSDP2 switches with one import::

    from fullshard import fully_shard, FSDPModule, MixedPrecisionPolicy

    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)

Each call forms one unit (one packed all-gather / reduce-scatter). Applied bottom-up, every
parameter becomes a ``DTensor`` registered on its modules, so ``model.parameters()`` feeds any
``torch.optim`` optimizer and ``model.state_dict()`` returns sharded tensors.
"""

from __future__ import annotations

import warnings
import weakref
from collections import OrderedDict
from collections.abc import Callable
from typing import Any, cast

import torch
from torch import nn
from torch.distributed._composable.contract import REGISTRY_KEY, RegistryItem
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement

from .engine import (
    DP_MESH_DIMS,
    SHARE_COMM_CTX,
    STATE_ATTR,
    CommPolicy,
    CommStreams,
    CPUOffloadPolicy,
    DataParallelMeshDims,
    FSDPState,
    MeshInfo,
    MixedPrecisionPolicy,
    OffloadPolicy,
    ParamGroup,
    check_reshard_after_forward,
    check_supported,
    claim_params,
    default_mesh,
    mesh_info,
    mesh_info_from_dims,
    require,
    states_under,
)
from .module import (
    FSDPModule,
    FullyShardError,
    UnshardHandle,
    _all_states,
    _check_fsdp_modules,
    unit_state,
)
from .torch_state import fully_shard_state

__all__ = [
    "FSDPModule",
    "UnshardHandle",
    "build_unit",
    "fully_shard",
    "register_fsdp_forward_method",
    "share_comm_ctx",
]
_ = (_all_states, unit_state)  # re-exported for tests and tools


if (_unsupported := check_supported()) is not None:
    warnings.warn(_unsupported, stacklevel=2)

_FSDP_CLASSES: dict[type, type] = {}  # original class -> its FSDP<Name> subclass


def _deepcopy_refused(self: nn.Module, memo: Any) -> Any:
    raise FullyShardError(
        f"FSDP does not support deepcopy. Please use state dict for serialization.\n"
        f"copy.deepcopy of a fully_shard unit ({type(self).__name__}) is not supported: its "
        f"parameters are DTensor shards bound to hooks and a process group. Copy the weights "
        f"instead: build a new model and load model.state_dict() (sharded) or "
        f"get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))"
    )


def _fsdp_class(cls: type) -> type:
    """``FSDP<Name>(FSDPModule, <Name>)``, one per original class, as FSDP2 builds them."""
    new = _FSDP_CLASSES.get(cls)
    if new is None:
        attrs = {"__module__": cls.__module__, "__deepcopy__": _deepcopy_refused}
        new = type(f"FSDP{cls.__name__}", (FSDPModule, cls), attrs)
        _FSDP_CLASSES[cls] = new
    return new


def _install_hooks(module: nn.Module, state: FSDPState) -> None:
    module.__dict__[STATE_ATTR] = state
    module.register_forward_pre_hook(state.pre_forward, prepend=True, with_kwargs=True)
    module.register_forward_hook(state.post_forward, prepend=False, with_kwargs=True)

    def _reshard_for_io(*_: Any, **__: Any) -> None:
        state.reshard_if_idle()

    module.register_state_dict_pre_hook(_reshard_for_io)
    module._register_load_state_dict_pre_hook(_reshard_for_io)


def fully_shard(
    module: nn.Module | list[nn.Module],
    *,
    mesh: DeviceMesh | None = None,
    reshard_after_forward: bool | int | None = None,
    shard_placement_fn: Callable[[nn.Parameter], Placement | Any | None] | None = None,
    mp_policy: MixedPrecisionPolicy = MixedPrecisionPolicy(),  # noqa: B008 - frozen, shared
    offload_policy: OffloadPolicy = OffloadPolicy(),  # noqa: B008 - as FSDP2; never mutated
    ignored_params: set[nn.Parameter] | None = None,
    dp_mesh_dims: DataParallelMeshDims | None = None,
    comm_policy: CommPolicy | None = None,
) -> Any:
    """Shard ``module``'s parameters across ``mesh`` and make it one communication unit.

    Semantics follow PyTorch FSDP2's ``fully_shard``:

    - ``mesh``: 1-D (shard) or 2-D (replicate, shard) for HSDP; defaults to all ranks. May be
      a sub-mesh (``mesh["dp"]``) of a larger mesh whose other dims hold parameters that are
      already DTensors (tensor parallel): those are sharded over ``mesh`` on top of their
      placements (see ``docs/composition.md``).
    - ``reshard_after_forward``: ``True`` frees gathered parameters after forward (gather again
      in backward), ``False`` keeps them, ``None`` means False for the root and True for the
      rest, an int ``k`` keeps a copy sharded over groups of ``k`` ranks so backward gathers
      within ``k``.
    - ``shard_placement_fn``: may return ``Shard(d)`` for any dim (negative ones count from
      the end; uneven sizes allowed, unlike FSDP2), ``None`` (``Shard(0)``) or FSDP2's
      ``ShardPlacementResult(placement, mesh_info)``: that parameter shards over
      ``mesh_info.mesh`` (1-D, or 2-D (replicate, shard)) instead, e.g. MoE experts on an
      expert-parallel mesh; the unit then communicates one group per mesh. A ``mesh_info``
      with ``dp_mesh_dims`` and ``spmd_mesh`` (FSDP2's) puts that parameter in the
      full-SPMD-mesh form below, with or without the unit's own ``dp_mesh_dims``.
    - ``mp_policy`` / ``offload_policy``: see :mod:`fullshard.engine.policies`.
    - ``ignored_params``: left as plain, unsharded, uncommunicated parameters.
    - ``dp_mesh_dims``: FSDP2's full-SPMD-mesh form: ``mesh`` is the whole mesh (e.g.
      ``(dp, tp)``), every parameter is a DTensor on it with ``Replicate()`` on the dims
      ``dp_mesh_dims`` names, and the unit shards over ``shard`` (and replicates over
      ``replicate``, HSDP); several names on one side are flattened. Sharded parameters stay
      DTensors on that mesh. Not with int ``reshard_after_forward`` (as FSDP2).
    - ``comm_policy`` (fullshard only): the transport (``packed`` / ``p2p`` / ``auto``) and
      low-precision communication, see :class:`fullshard.engine.policies.CommPolicy`.

    Parameters already owned by a unit applied earlier (a child) stay with it; a Parameter
    tied across units (e.g. embedding and output head) is handled, unlike FSDP2. Returns the
    module(s), now instances of :class:`FSDPModule` — and of torch's
    ``torch.distributed.fsdp.FSDPModule`` — with ``_is_fsdp_managed_module = True`` on every
    module they manage, so frameworks that detect FSDP2 detect fullshard.
    """
    modules = (module,) if isinstance(module, nn.Module) else tuple(module)
    if not modules:
        raise ValueError("fully_shard needs at least one module")
    for m in modules:
        _check_module(m)
    info = _unit_mesh(mesh, dp_mesh_dims)
    build_unit(
        modules,
        info,
        reshard_after_forward=reshard_after_forward,
        shard_placement_fn=shard_placement_fn,
        mp_policy=mp_policy,
        offload_policy=offload_policy,
        ignored_params=ignored_params,
        comm_policy=comm_policy,
    )
    for m in modules:  # FSDP2's identity
        m.__class__ = _fsdp_class(type(m))
        # torch's composable registry names the APIs applied to a module; replicate() and
        # torch's other composable APIs skip (or refuse) modules marked "fully_shard"
        m.__dict__.setdefault(REGISTRY_KEY, OrderedDict()).setdefault("fully_shard", RegistryItem())
    return module


def build_unit(
    modules: tuple[nn.Module, ...],
    info: MeshInfo,
    *,
    reshard_after_forward: bool | int | None = None,
    shard_placement_fn: Callable[[nn.Parameter], Placement | Any | None] | None = None,
    mp_policy: MixedPrecisionPolicy = MixedPrecisionPolicy(),  # noqa: B008 - frozen, shared
    offload_policy: OffloadPolicy = OffloadPolicy(),  # noqa: B008 - never mutated
    ignored_params: set[nn.Parameter] | None = None,
    comm_policy: CommPolicy | None = None,
) -> FSDPState:
    """Make ``modules`` one unit over ``info``'s mesh: claim and shard their parameters, install
    the unit's hooks and link the units below to it. What ``fully_shard`` does, less FSDP2's
    identity (the ``FSDP<Name>`` class and torch's composable registry), which ``fully_shard``
    adds and other front ends (``fullshard.fsdp1``) do not."""
    check_reshard_after_forward(reshard_after_forward, info)
    ignored = {id(p) for p in (ignored_params or ())}
    _check_policies_and_devices(modules, mp_policy, offload_policy, ignored)
    group = _build_group(
        modules, info, ignored, shard_placement_fn, mp_policy, offload_policy, comm_policy
    )
    state = FSDPState(modules, group, reshard_after_forward, mp_policy)
    _install(modules, state)
    return state


def _check_policies_and_devices(
    modules: tuple[nn.Module, ...], mp_policy: object, offload_policy: object, ignored: set[int]
) -> None:
    """The policies' types, and the unit's parameters (but ``ignored``) on one device."""
    if not isinstance(mp_policy, MixedPrecisionPolicy):
        raise TypeError(f"mp_policy must be a MixedPrecisionPolicy, got {type(mp_policy).__name__}")
    if not isinstance(offload_policy, OffloadPolicy):
        raise TypeError(
            f"offload_policy must be an OffloadPolicy, got {type(offload_policy).__name__}"
        )
    devices = {
        (fqn, p.device)
        for m in modules
        for fqn, p in m.named_parameters()
        if not isinstance(p, DTensor) and id(p) not in ignored
    }
    if len({d for _, d in devices}) > 1:  # meta next to real counts: half-materialised
        listing = sorted(f"{fqn}: {d}" for fqn, d in devices)
        raise ValueError(
            f"parameters of one fully_shard unit are on different devices ({listing}); move "
            f"the module to one device (module.to(...)) — or build all of it on meta — "
            f"before fully_shard"
        )


def _unit_mesh(mesh: DeviceMesh | None, dp_mesh_dims: DataParallelMeshDims | None) -> MeshInfo:
    """The groups the unit communicates in: ``mesh`` (default: every rank), 1-D or 2-D
    (replicate, shard), or with ``dp_mesh_dims`` the named dims of the full mesh."""
    if dp_mesh_dims is not None:
        require(DP_MESH_DIMS)
        if not isinstance(dp_mesh_dims, DataParallelMeshDims):
            raise TypeError(
                f"dp_mesh_dims must be a torch.distributed.fsdp.DataParallelMeshDims, got "
                f"{type(dp_mesh_dims).__name__}"
            )
        if mesh is None:
            raise ValueError(
                "dp_mesh_dims names dims of the full SPMD mesh: pass that mesh as mesh=..."
            )
        return mesh_info_from_dims(mesh, dp_mesh_dims)
    if mesh is not None and mesh.ndim == 2 and mesh.mesh_dim_names is None:
        raise FullyShardError(
            f"Please init the 2D mesh for HSDP with mesh_dim_names specified\n"
            f"a 2-D mesh for HSDP must name its dims (replicate, shard): build it with "
            f"init_device_mesh(device_type, {tuple(mesh.shape)}, "
            f"mesh_dim_names=('replicate', 'shard'))"
        )
    return mesh_info(mesh if mesh is not None else default_mesh())


def _build_group(
    modules: tuple[nn.Module, ...],
    info: MeshInfo,
    ignored: set[int],
    shard_placement_fn: Callable[[nn.Parameter], Placement | Any | None] | None,
    mp_policy: MixedPrecisionPolicy,
    offload_policy: OffloadPolicy,
    comm_policy: CommPolicy | None,
) -> ParamGroup:
    """Shard the parameters no unit below owns and that are not ``ignored`` (they become
    ``DTensor`` shards on their modules) and make them one unit's group."""
    compute_device = info.device
    offloaded = isinstance(offload_policy, CPUOffloadPolicy)
    shard_device = torch.device("cpu") if offloaded else compute_device
    pin = (
        isinstance(offload_policy, CPUOffloadPolicy)
        and offload_policy.pin_memory
        and torch.cuda.is_available()
    )
    below = [sp for st in states_under(modules) for sp in st.group.params]
    params = claim_params(
        modules, info, shard_device, ignored, pin, shard_placement_fn, mp_policy, below
    )
    name = type(modules[0]).__name__
    return ParamGroup(
        params,
        info,
        compute_device,
        mp_policy,
        name,
        comm_policy,
        offloaded=offloaded,
        pin_memory=pin,
    )


def _install(modules: tuple[nn.Module, ...], state: FSDPState) -> None:
    """Make ``modules`` the unit of ``state``: buffers on the compute device, the hooks and
    the marks frameworks read; the units already applied below learn which unit encloses
    them."""
    compute_device = state.group.device
    for m in modules:
        for sub in m.modules():
            for key, buf in sub._buffers.items():
                if buf is not None and buf.device.type not in ("meta", compute_device.type):
                    sub._buffers[key] = buf.to(compute_device)
        _install_hooks(m, state)
        for sub in m.modules():  # what FSDP2 marks, and what transformers / dynamo look for
            sub._is_fsdp_managed_module = True  # type: ignore[assignment]
            sub._fsdp_use_orig_params = True  # type: ignore[assignment]
    for inner in states_under(modules):
        if inner is not state and inner.enclosing is None:
            inner.enclosing = weakref.ref(state)


# FSDP2's ``fully_shard.state(module)``: the unit's state (``None`` for a module that is no unit)
fully_shard.state = fully_shard_state  # type: ignore[attr-defined]


def _check_module(m: object) -> None:
    if not isinstance(m, nn.Module):
        raise TypeError(f"fully_shard expects nn.Module(s), got {type(m).__name__}")
    if "fully_shard" in m.__dict__.get(REGISTRY_KEY, {}):  # ours or torch's, as FSDP2 checks
        raise FullyShardError(
            f"Each distinct composable distributed API can only be applied to a module once. "
            f"fully_shard has already been applied to the following module:\n{m}\n"
            f"fully_shard was already applied to this {type(m).__name__}; each module may "
            f"form only one unit (apply it once per module, bottom-up)"
        )
    if isinstance(m, (nn.ModuleList, nn.ModuleDict)) and type(m).forward is nn.Module.forward:
        raise ValueError(
            f"fully_shard does not support containers that do not implement forward: {m}\n"
            f"fully_shard cannot make a unit of a {type(m).__name__} (it has no forward, so "
            f"its hooks would never run): apply it to each element (for block in "
            f"model.layers: fully_shard(block)) or pass them as one unit: "
            f"fully_shard(list(model.layers))"
        )


def register_fsdp_forward_method(module: nn.Module, method_name: str) -> None:
    """Make ``module.<method_name>()`` run the unit's forward hooks (e.g. ``generate``).

    A no-op on a module that is not an FSDPModule, as in FSDP2.
    """
    if not isinstance(module, FSDPModule):
        return
    if not hasattr(module, method_name):
        raise ValueError(f"{type(module).__name__} has no method {method_name!r}")
    state = unit_state(module)
    original = getattr(module, method_name)

    def wrapped(*args: Any, **kwargs: Any) -> Any:
        args, kwargs = state.pre_forward(module, args, kwargs)
        out = original(*args, **kwargs)
        return state.post_forward(module, args, kwargs, out)

    setattr(module, method_name, wrapped)


def share_comm_ctx(modules: list[FSDPModule]) -> None:
    """Let several roots (e.g. the model chunks of pipeline stages) share one set of CUDA
    communication streams, as FSDP2 does, instead of one set per root.

    Call it after ``fully_shard`` and before the first forward; on the CPU there are no
    streams, so it only validates ``modules``.
    """
    require(SHARE_COMM_CTX)
    _check_fsdp_modules(modules, "share_comm_ctx")
    states = [unit_state(cast(nn.Module, m)) for m in modules]
    if not states:
        return
    started = [st.name for st in states if st.ctx is not None]
    if started:
        raise RuntimeError(
            f"share_comm_ctx must be called before the first forward; these roots already ran "
            f"one: {started}"
        )
    shared = CommStreams(states[0].group.device)
    for st in states:
        st.shared_streams = shared
