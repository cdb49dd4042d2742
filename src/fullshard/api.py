"""``fully_shard`` and the ``FSDPModule`` mixin — the public, FSDP2-compatible surface.

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

from collections.abc import Callable
from typing import Any, cast

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement

from .group import ParamGroup
from .hooks import STATE_ATTR, FSDPState, states_under
from .init import check_reshard_after_forward, claim_params, lazy_init, resolve_reshard
from .mesh import default_mesh, mesh_info
from .policies import CommPolicy, CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy

__all__ = ["FSDPModule", "UnshardHandle", "fully_shard", "register_fsdp_forward_method"]


def _state(module: nn.Module) -> FSDPState:
    st = module.__dict__.get(STATE_ATTR)
    if st is None:
        raise ValueError(f"{type(module).__name__} is not an FSDPModule: call fully_shard on it")
    return cast(FSDPState, st)


class UnshardHandle:
    """Returned by ``FSDPModule.unshard(async_op=True)``; :meth:`wait` finishes the gather."""

    def __init__(self, group: ParamGroup | None) -> None:
        self._group = group

    def wait(self) -> None:
        """Block until the unit's parameters are unsharded and registered."""
        if self._group is not None:
            self._group.wait_for_unshard()
            self._group = None


class FSDPModule:
    """Mixin added to every module ``fully_shard`` was applied to (FSDP2's methods)."""

    def unshard(self, async_op: bool = False) -> UnshardHandle | None:
        """All-gather this unit's parameters; with ``async_op`` return a handle to wait on."""
        state = _state(cast(nn.Module, self))
        if state.ctx is None:
            lazy_init(state)
        group = state.group
        group.unshard()
        handle = UnshardHandle(group)
        if async_op:
            return handle
        handle.wait()
        return None

    def reshard(self) -> None:
        """Free this unit's unsharded parameters and register the sharded ones."""
        _state(cast(nn.Module, self)).group.reshard()

    def _apply(self, *args: Any, **kwargs: Any) -> Any:
        # ``to_empty`` / ``to`` may replace the registered DTensors: adopt the new ones.
        ret = super()._apply(*args, **kwargs)  # type: ignore[misc]
        state = _state(cast(nn.Module, self))
        for sp in state.group.params:
            sp.sync_from_modules()
        if state.ctx is not None:  # after lazy init: a cast needs a layout in the new dtype
            state.group.init_layout(state.on_grad_accumulated)
        return ret

    def _states(self, recurse: bool) -> list[FSDPState]:
        st = _state(cast(nn.Module, self))
        return st.subtree_states() if recurse else [st]

    def set_requires_gradient_sync(
        self, requires_gradient_sync: bool, *, recurse: bool = True
    ) -> None:
        """Turn gradient reduction on/off (off: accumulate unsharded gradients locally)."""
        for st in self._states(recurse):
            st.group.requires_gradient_sync = requires_gradient_sync

    def set_requires_all_reduce(self, requires_all_reduce: bool, *, recurse: bool = True) -> None:
        """HSDP: skip (False) or do the all-reduce across replicas after the reduce-scatter."""
        for st in self._states(recurse):
            st.group.requires_all_reduce = requires_all_reduce

    def set_reshard_after_backward(
        self, reshard_after_backward: bool, *, recurse: bool = True
    ) -> None:
        """Whether to free unsharded parameters after backward (False saves a re-gather)."""
        for st in self._states(recurse):
            st.group.reshard_after_backward = reshard_after_backward

    def set_reshard_after_forward(
        self, reshard_after_forward: bool | int, *, recurse: bool = True
    ) -> None:
        """Change the post-forward reshard policy (True, False or an int group size ``k``
        that divides each unit's shard group size)."""
        states = self._states(recurse)
        for st in states:  # validate all before changing any
            check_reshard_after_forward(reshard_after_forward, st.group.world)
        for st in states:
            st.reshard_after_forward = reshard_after_forward
            if st.ctx is not None:
                resolve_reshard(st)

    def set_is_last_backward(self, is_last_backward: bool) -> None:
        """Whether the next backward is the last of the step (call it on the root).

        ``False`` (e.g. all but the last micro-batch): the end of that backward does not wait
        for the last reductions still in flight; they finish during the next backward, so
        they overlap its compute. Gradients are complete once a backward with ``True`` ends.
        """
        _state(cast(nn.Module, self)).is_last_backward = is_last_backward

    def set_modules_to_forward_prefetch(self, modules: list[FSDPModule]) -> None:
        """Explicit forward prefetch: start these units' all-gathers in this unit's pre-forward."""
        _state(cast(nn.Module, self)).forward_prefetch = [
            _state(cast(nn.Module, m)) for m in modules
        ]

    def set_modules_to_backward_prefetch(self, modules: list[FSDPModule]) -> None:
        """Explicit backward prefetch: start these units' all-gathers in this unit's pre-backward."""
        _state(cast(nn.Module, self)).backward_prefetch = [
            _state(cast(nn.Module, m)) for m in modules
        ]

    def set_gradient_divide_factor(self, factor: float) -> None:
        """Divide reduced gradients by ``factor`` instead of the data-parallel world size."""
        if factor <= 0:
            raise ValueError(f"gradient divide factor must be positive, got {factor}")
        for st in self._states(True):
            st.group.gradient_divide_factor = float(factor)

    def set_force_sum_reduction_for_comms(self, enable: bool) -> None:
        """Sum gradients across ranks without any division."""
        for st in self._states(True):
            st.group.force_sum_reduction = enable


def _fsdp_class(cls: type) -> type:
    if issubclass(cls, FSDPModule):
        return cls
    return type(f"FSDP{cls.__name__}", (FSDPModule, cls), {"__module__": cls.__module__})


def _install_hooks(module: nn.Module, state: FSDPState) -> None:
    module.__dict__[STATE_ATTR] = state
    module.__class__ = _fsdp_class(type(module))
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
    shard_placement_fn: Callable[[nn.Parameter], Placement | None] | None = None,
    mp_policy: MixedPrecisionPolicy = MixedPrecisionPolicy(),  # noqa: B008 - frozen, shared
    offload_policy: OffloadPolicy = OffloadPolicy(),  # noqa: B008 - frozen, shared
    ignored_params: set[nn.Parameter] | None = None,
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
      the end; uneven sizes allowed, unlike FSDP2) or ``None`` (``Shard(0)``).
    - ``mp_policy`` / ``offload_policy``: see :mod:`fullshard.policies`.
    - ``ignored_params``: left as plain, unsharded, uncommunicated parameters.
    - ``comm_policy`` (fullshard only): the transport (``packed`` / ``p2p`` / ``auto``) and
      low-precision communication, see :class:`fullshard.policies.CommPolicy`.

    Parameters already owned by a unit applied earlier (a child) stay with it; a Parameter
    tied across units (e.g. embedding and output head) is handled, unlike FSDP2. Returns the
    module(s), now instances of :class:`FSDPModule`.
    """
    modules = (module,) if isinstance(module, nn.Module) else tuple(module)
    if not modules:
        raise ValueError("fully_shard needs at least one module")
    for m in modules:
        if not isinstance(m, nn.Module):
            raise TypeError(f"fully_shard expects nn.Module(s), got {type(m).__name__}")
        if isinstance(m, FSDPModule):
            raise ValueError(
                f"fully_shard was already applied to this {type(m).__name__}; each module may "
                f"form only one unit (apply it once per module, bottom-up)"
            )
    info = mesh_info(mesh if mesh is not None else default_mesh())
    check_reshard_after_forward(reshard_after_forward, info.shard_size)
    if not isinstance(mp_policy, MixedPrecisionPolicy):
        raise TypeError(f"mp_policy must be a MixedPrecisionPolicy, got {type(mp_policy).__name__}")
    if not isinstance(offload_policy, OffloadPolicy):
        raise TypeError(
            f"offload_policy must be an OffloadPolicy, got {type(offload_policy).__name__}"
        )
    compute_device = info.device
    shard_device = (
        torch.device("cpu") if isinstance(offload_policy, CPUOffloadPolicy) else compute_device
    )
    ignored = {id(p) for p in (ignored_params or ())}
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
    offloaded = isinstance(offload_policy, CPUOffloadPolicy)
    pin = (
        isinstance(offload_policy, CPUOffloadPolicy)
        and offload_policy.pin_memory
        and torch.cuda.is_available()
    )
    params = claim_params(modules, info, shard_device, ignored, pin, shard_placement_fn)
    name = type(modules[0]).__name__
    group = ParamGroup(
        params,
        info,
        compute_device,
        mp_policy,
        name,
        comm_policy,
        offloaded=offloaded,
        pin_memory=pin,
    )
    state = FSDPState(modules, group, reshard_after_forward, mp_policy)
    for m in modules:
        for sub in m.modules():
            for key, buf in sub._buffers.items():
                if buf is not None and buf.device.type not in ("meta", compute_device.type):
                    sub._buffers[key] = buf.to(compute_device)
        _install_hooks(m, state)
    return module


def register_fsdp_forward_method(module: nn.Module, method_name: str) -> None:
    """Make ``module.<method_name>()`` run the unit's forward hooks (e.g. ``generate``)."""
    if not isinstance(module, FSDPModule):
        return
    state = _state(module)
    original = getattr(module, method_name)

    def wrapped(*args: Any, **kwargs: Any) -> Any:
        args, kwargs = state.pre_forward(module, args, kwargs)
        out = original(*args, **kwargs)
        return state.post_forward(module, args, kwargs, out)

    setattr(module, method_name, wrapped)


def _all_states(module: nn.Module) -> list[FSDPState]:
    """Every unit state under ``module`` (used by tests and tools)."""
    return states_under([module])
