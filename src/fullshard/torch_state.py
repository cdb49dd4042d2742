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
"""

from __future__ import annotations

from torch import nn

from .engine.context import StepContext
from .engine.hooks import STATE_ATTR, FSDPState

__all__ = ["fully_shard_state"]


class _GroupView:
    def __init__(self, state: FSDPState) -> None:
        self._state = state

    def post_backward(self) -> None:
        if self._state.group.params:
            self._state.post_backward()


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


def fully_shard_state(module: nn.Module) -> _StateView | None:
    """FSDP2's ``fully_shard.state(module)``: the unit's state, or ``None`` for a module that
    is no unit."""
    st = module.__dict__.get(STATE_ATTR)
    return None if st is None else _StateView(st)
