"""``fully_shard.state(module)``: a unit's state in the shape FSDP2's ``FSDPState`` has.

FSDP2's ``fully_shard`` carries ``fully_shard.state(module)``, which returns the module's
``FSDPState`` (``None`` for a module that is no unit). fullshard's ``fully_shard`` carries one
too (``fullshard.api`` sets it), answering with a view of fullshard's own state that has the
parts callers outside FSDP2 use. torch's pipelining stage (torch 2.14 and older) finishes a
step's gradient reduction through it::

    state = fully_shard.state(stage_module)
    for s in state._state_ctx.all_states: for g in s._fsdp_param_groups: g.post_backward()
    state._root_post_backward_final_callback()

and FSDP2's tests read ``_lazy_init()``, ``_is_root`` and ``_state_ctx.all_states``. Two views
of one unit compare equal, as the one ``FSDPState`` FSDP2 returns twice does.

[Note: FSDP2's private names]
RL frameworks and trainers reach further into FSDP2 than ``fully_shard.state``: verl imports
``_fsdp_state._get_module_fsdp_state`` and ``_fsdp_common.TrainingState`` to set every unit's
``state._fsdp_param_group._training_state = TrainingState.IDLE`` before resharding and
offloading, and ``_fsdp_init._get_post_forward_mesh_info`` to change a unit's policy by
assigning ``state._fsdp_param_group.post_forward_mesh_info`` from ``.mesh_info``; trainers read
``fsdp_params`` (``sharded_param``, ``_orig_size``, ``sharded_size``). Under
``patch_torch_fsdp()`` torch's ``_get_module_fsdp_state`` and ``_get_post_forward_mesh_info``
are replaced (in torch's modules and wherever they were imported by name) by
:func:`get_module_fsdp_state` and :func:`get_post_forward_mesh_info`: a fullshard unit answers
with the view below, whose ``_fsdp_param_group`` reads and writes fullshard's unit (its
``reshard_after_forward``, its training state, its gather), and anything else gets torch's
answer. ``mesh_info`` is torch's own ``FSDPMeshInfo`` / ``HSDPMeshInfo`` dataclass over the
unit's mesh (torchtitan builds those itself, with ``_fsdp_init._get_mesh_info``, for
``ShardPlacementResult``, which ``fully_shard`` takes as it is). None of torch's FSDP engine
runs: the dataclasses and the enum are data. ``module._get_fsdp_state()`` answers with the
same view, patch or not (verl falls back to it; trainers probe gradients through it);
fullshard's own state is ``fullshard.module.unit_state(module)``.
"""

from __future__ import annotations

import importlib
import weakref
from collections.abc import Callable
from typing import Any, cast

import torch
from torch import nn

from .engine import STATE_ATTR, FSDPState, ShardedParam, StepContext, TrainingState

__all__ = [
    "PostForwardMeshInfo",
    "fully_shard_state",
    "get_module_fsdp_state",
    "get_post_forward_mesh_info",
    "torch_originals",
]

_FSDP2 = "torch.distributed.fsdp._fully_shard."
_ORIGINALS: dict[str, Callable[..., Any]] = {}


def torch_originals() -> dict[str, Callable[..., Any]]:
    """torch's ``_get_module_fsdp_state`` and ``_get_post_forward_mesh_info``, read once
    before ``patch_torch_fsdp`` replaces them (the replacements hand other modules to them)."""
    if not _ORIGINALS:
        state = importlib.import_module(_FSDP2 + "_fsdp_state")
        init = importlib.import_module(_FSDP2 + "_fsdp_init")
        _ORIGINALS["_get_module_fsdp_state"] = state._get_module_fsdp_state
        _ORIGINALS["_get_post_forward_mesh_info"] = init._get_post_forward_mesh_info
    return _ORIGINALS


def _common() -> Any:
    """torch's ``_fsdp_common`` (its mesh-info dataclasses and ``TrainingState`` enum)."""
    return importlib.import_module(_FSDP2 + "_fsdp_common")


# a unit's mesh info, made once per unit (verl passes it back to get_post_forward_mesh_info)
_MESH_INFOS: weakref.WeakKeyDictionary[FSDPState, Any] = weakref.WeakKeyDictionary()


def _mesh_info(state: FSDPState) -> Any:
    info = _MESH_INFOS.get(state)
    if info is None:
        mesh, common = state.group.info.mesh, _common()
        if mesh.ndim == 1:
            info = common.FSDPMeshInfo(mesh, shard_mesh_dim=0)
        else:
            info = common.HSDPMeshInfo(mesh, shard_mesh_dim=1, replicate_mesh_dim=0)
        _MESH_INFOS[state] = info
    return info


class PostForwardMeshInfo:
    """What :func:`get_post_forward_mesh_info` gives a fullshard unit for an int
    ``reshard_after_forward=k``: ``k`` ranks keep a copy after forward (fullshard makes that
    group itself, when the unit takes the policy), no new ``DeviceMesh``."""

    def __init__(self, shard_mesh_size: int, mesh_info: Any) -> None:
        self.shard_mesh_size = shard_mesh_size
        self.mesh_info = mesh_info  # the unit's

    def __repr__(self) -> str:
        return f"PostForwardMeshInfo(shard_mesh_size={self.shard_mesh_size})"


def get_post_forward_mesh_info(reshard_after_forward: bool | int, mesh_info: Any) -> Any:
    """FSDP2's ``_get_post_forward_mesh_info`` for a fullshard unit's ``mesh_info``: the unit's
    mesh info (reshard fully), ``None`` (keep) or, for an int, a :class:`PostForwardMeshInfo`;
    torch's answer for any other mesh info ([Note: FSDP2's private names])."""
    if not any(info is mesh_info for info in _MESH_INFOS.values()):  # not a fullshard unit's
        return torch_originals()["_get_post_forward_mesh_info"](reshard_after_forward, mesh_info)
    size = mesh_info.shard_mesh_size
    if not isinstance(reshard_after_forward, int):  # bool is an int
        raise ValueError(
            "reshard_after_forward should be a bool or an int representing the group size to "
            f"reshard to, not {reshard_after_forward}"
        )
    value: bool | int = reshard_after_forward
    if not isinstance(value, bool):
        if value < 1 or value > size or size % value:
            raise ValueError(
                "If passing reshard_after_forward as an int, it should be a factor of "
                f"{size}, not {value}"
            )
        value = False if value == 1 else True if value == size else value
    if value is True:
        return mesh_info
    return None if value is False else PostForwardMeshInfo(value, mesh_info)


def _torch_training_state(state: FSDPState) -> Any:
    return _common().TrainingState[state.training_state.name]


def _set_training_state(state: FSDPState, value: Any) -> None:
    name = getattr(value, "name", None)
    if not isinstance(name, str) or name not in TrainingState.__members__:
        raise TypeError(f"_training_state takes FSDP2's TrainingState, got {value!r}")
    state.training_state = TrainingState[name]


class _ParamView:
    """The part of FSDP2's ``FSDPParam`` callers read."""

    def __init__(self, sp: ShardedParam) -> None:
        self._sp = sp

    @property
    def sharded_param(self) -> nn.Parameter:
        return self._sp.sharded_param

    @property
    def _orig_size(self) -> torch.Size:
        return self._sp.orig_shape

    @property
    def sharded_size(self) -> torch.Size:
        """The padded per-rank shape (FSDP2's ``sharded_size``)."""
        return self._sp._shape_with(self._sp.chunk_rows)

    @property
    def _sharded_param_data(self) -> torch.Tensor:
        """This rank's shard as a 1-D tensor (its storage is the parameter's)."""
        return self._sp.local.view(-1)


class _GroupView:
    """The part of FSDP2's ``FSDPParamGroup`` callers use, on fullshard's unit."""

    def __init__(self, state: FSDPState) -> None:
        self._state = state

    def post_backward(self) -> None:
        if self._state.group.params:
            self._state.post_backward()

    @property
    def fsdp_params(self) -> list[_ParamView]:
        return [_ParamView(sp) for sp in self._state.group.params]

    @property
    def mesh_info(self) -> Any:
        """torch's ``FSDPMeshInfo`` (``HSDPMeshInfo`` for HSDP) over the unit's mesh."""
        return _mesh_info(self._state)

    @property
    def post_forward_mesh_info(self) -> Any:
        """``None``: the unit keeps its parameters after forward; its mesh info: it frees
        them; a :class:`PostForwardMeshInfo`: ``k`` ranks keep a copy."""
        policy = self._state.reshard_policy
        if policy is False:
            return None
        return self.mesh_info if policy is True else PostForwardMeshInfo(policy, self.mesh_info)

    @post_forward_mesh_info.setter
    def post_forward_mesh_info(self, info: Any) -> None:
        if info is None:
            value: bool | int = False
        else:
            size = getattr(info, "shard_mesh_size", None)
            if not isinstance(size, int):
                raise TypeError(f"post_forward_mesh_info takes a mesh info or None, got {info!r}")
            value = True if size == self._state.group.world else size
        _unit(self._state).set_reshard_after_forward(value, recurse=False)

    _training_state = property(  # torch's TrainingState, read and set
        lambda self: _torch_training_state(self._state),
        lambda self, value: _set_training_state(self._state, value),
    )

    def unshard(self, async_op: bool = False) -> None:
        _unit(self._state).unshard(async_op=async_op)

    def wait_for_unshard(self) -> None:
        self._state.group.wait_for_unshard()

    def reshard(self) -> None:
        self._state.group.reshard()


def _unit(state: FSDPState) -> Any:
    """The unit's ``FSDPModule`` (its first module)."""
    return cast(Any, state.modules[0])


class _StateCtxView:
    def __init__(self, ctx: StepContext[FSDPState]) -> None:
        self.all_states = [_StateView(st) for st in ctx.states]


class _StateView:
    """The part of FSDP2's ``FSDPState`` that code outside FSDP2 uses."""

    def __init__(self, state: FSDPState) -> None:
        self._state = state
        self._fsdp_param_groups = [_GroupView(state)]  # what torch 2.12+'s pipelining reads
        # torch 2.9-2.11's pipelining reads one group, None for a unit without parameters
        self._fsdp_param_group = _GroupView(state) if state.group.params else None

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _StateView) and other._state is self._state

    def __hash__(self) -> int:
        return id(self._state)

    def _ctx(self) -> StepContext[FSDPState]:
        return self._state.ctx or self._state.lazy_init()

    def _lazy_init(self) -> None:
        """Make this unit the root of the units below it (a no-op once it has a root)."""
        self._ctx()

    @property
    def _is_root(self) -> bool | None:
        """``None`` before lazy init, then whether this unit is the root."""
        return None if self._state.ctx is None else self._state.is_root

    @property
    def _state_ctx(self) -> _StateCtxView:
        return _StateCtxView(self._ctx())

    def _root_post_backward_final_callback(self) -> None:
        self._ctx().finish_backward()

    @property
    def _mp_policy(self) -> Any:
        return self._state.mp_policy

    _training_state = property(  # torch's TrainingState, read and set
        lambda self: _torch_training_state(self._state),
        lambda self, value: _set_training_state(self._state, value),
    )

    @property
    def _auto_reshard_after_forward(self) -> bool:
        """Whether the unit's policy is the default (``None``: the root keeps, others free)."""
        return self._state.reshard_after_forward is None

    @_auto_reshard_after_forward.setter
    def _auto_reshard_after_forward(self, auto: bool) -> None:
        st = self._state
        if not auto and st.reshard_after_forward is None:  # the default, made explicit
            st.reshard_after_forward = st.reshard_policy
        elif auto:
            st.reshard_after_forward = None
        if st.ctx is not None:
            st.resolve_reshard()


def fully_shard_state(module: nn.Module) -> _StateView | None:
    """FSDP2's ``fully_shard.state(module)``: the unit's state, or ``None`` for a module that
    is no unit."""
    st = module.__dict__.get(STATE_ATTR)
    return None if st is None else _StateView(st)


def get_module_fsdp_state(module: nn.Module) -> Any:
    """FSDP2's ``_get_module_fsdp_state``: a fullshard unit's state view, else torch's answer
    ([Note: FSDP2's private names])."""
    view = fully_shard_state(module)
    return view if view is not None else torch_originals()["_get_module_fsdp_state"](module)
