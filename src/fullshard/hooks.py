"""FSDPState: the module hooks of one unit, the root's lazy init and the end-of-backward callback.

One training step as the hooks see it (see ../shared/DESIGN.md):

- root pre-forward (first call): lazy init — pick the root, give tied parameters to the
  innermost unit that encloses every module using them, build packed layouts;
- unit pre-forward: finish this unit's all-gather, start the next unit's (prefetch, using the
  order recorded in the previous forward);
- unit post-forward: reshard (per ``reshard_after_forward``) and hook the outputs so the unit's
  pre-backward runs when their gradients arrive;
- pre-backward: gather again, prefetch the unit that runs backward next;
- post-backward: fired when the last gradient of the unit has been accumulated; reshards,
  reduce-scatters (asynchronously; the previous unit's reduction is finished then, so at most
  one is in flight);
- end of backward (a callback queued on the autograd engine): units whose backward never fired
  (unused parameters, frozen inputs) are completed, pending reductions finished, state reset.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._pytree import tree_flatten, tree_map

from .group import ParamGroup, ShardedState, _PendingReduce
from .param import ShardedParam
from .policies import MixedPrecisionPolicy

__all__ = ["STATE_ATTR", "FSDPState", "TrainingState", "states_under"]


class TrainingState(enum.Enum):
    """Where a unit is in the current step."""

    IDLE = "idle"
    FORWARD = "forward"
    PRE_BACKWARD = "pre_backward"
    POST_BACKWARD = "post_backward"


def _in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


def _cast_floats(tree: Any, dtype: torch.dtype | None) -> Any:
    if dtype is None:
        return tree
    return tree_map(
        lambda t: t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t, tree
    )


STATE_ATTR = "_fullshard_state"  # where a unit module keeps its FSDPState (in __dict__)


def states_under(modules: Iterable[nn.Module]) -> list[FSDPState]:
    """Every unit state in the subtrees of ``modules``, once each, in module order."""
    out: list[FSDPState] = []
    for m in modules:
        for sub in m.modules():
            st = sub.__dict__.get(STATE_ATTR)
            if st is not None and st not in out:
                out.append(st)
    return out


class FSDPState:
    """Hooks and per-step state of one ``fully_shard`` unit (plus root-only bookkeeping)."""

    def __init__(
        self,
        modules: tuple[nn.Module, ...],
        group: ParamGroup,
        reshard_after_forward: bool | int | None,
        mp_policy: MixedPrecisionPolicy,
    ) -> None:
        self.modules = modules
        self.group = group
        self.reshard_after_forward = reshard_after_forward
        self.mp_policy = mp_policy
        self.training_state = TrainingState.IDLE
        self.is_root: bool | None = None
        self.root: FSDPState | None = None
        self.forward_prefetch: list[FSDPState] | None = None  # explicit, else implicit
        self.backward_prefetch: list[FSDPState] | None = None
        self._post_forward_calls = 0
        # Root-only bookkeeping, filled by lazy init.
        self.states: list[FSDPState] = []
        self._forward_order: list[FSDPState] = []
        self._prev_forward_order: list[FSDPState] = []
        self._post_forward_order: list[FSDPState] = []
        self._pending: list[_PendingReduce] = []
        self._callback_queued = False
        self.is_last_backward = True
        self._subgroups: dict[int, tuple[dist.ProcessGroup, int]] = {}

    @property
    def name(self) -> str:
        return self.group.name

    def subtree_states(self) -> list[FSDPState]:
        """States of every FSDP unit in this unit's module subtree (this one first)."""
        return states_under(self.modules)

    # ------------------------------------------------------------------------- lazy init
    def lazy_init(self) -> None:
        """Become the root of every unit below; assign tied parameters; build layouts."""
        self.states = self.subtree_states()
        names = {id(m): n for root in self.modules for n, m in root.named_modules()}
        meta: list[str] = []
        for st in self.states:
            unit = names.get(id(st.modules[0]), "")
            st.group.name = unit or f"{type(st.modules[0]).__name__} (root)"
            for sp in st.group.params:
                sp.sync_from_modules()
                module, attr = sp.refs[0]
                prefix = names.get(id(module), "")
                sp.fqn = f"{prefix}.{attr}" if prefix else attr  # root-relative from now on
                if sp.local.is_meta:
                    meta.append(sp.fqn)
        if meta:
            shown = meta if len(meta) <= 12 else meta[:12] + [f"... {len(meta) - 12} more"]
            raise RuntimeError(
                f"parameters are still on the meta device: {shown}. Call "
                f"module.to_empty(device=...) and then reset_parameters() (or load a "
                f"checkpoint) before the forward pass"
            )
        self.is_root, self.root = True, self
        for st in self.states[1:]:
            st.is_root, st.root = False, self
        self._assign_shared_params()
        for st in self.states:
            st.group.init_layout(st._on_grad_accumulated)
            st._resolve_reshard_after_forward()

    def _assign_shared_params(self) -> None:
        """Give a parameter used by modules of several units to the innermost enclosing unit.

        FSDP2 refuses a Parameter reachable from two ``fully_shard`` calls (e.g. an embedding
        unit tied to the root's output head); here it moves to the unit whose subtree holds
        every module that uses it, which is unsharded whenever any of them computes.
        """
        subtree = {
            id(st): {id(m) for root in st.modules for m in root.modules()} for st in self.states
        }
        for owner in self.states:
            for sp in list(owner.group.params):
                users = {id(m) for m, _ in sp.refs}
                if users <= subtree[id(owner)]:
                    continue
                enclosing = [st for st in self.states if users <= subtree[id(st)]]
                if not enclosing:
                    names = [type(m).__name__ + "." + n for m, n in sp.refs]
                    raise ValueError(
                        f"parameter {sp.fqn!r} is shared by modules {names} that no single "
                        f"fully_shard unit encloses; apply fully_shard to a common ancestor "
                        f"(e.g. the root model) as well"
                    )
                target = min(enclosing, key=lambda st: len(subtree[id(st)]))
                owner.group.params.remove(sp)
                target.group.params.append(sp)

    def _resolve_reshard_after_forward(self) -> None:
        value = self.reshard_after_forward
        if value is None:
            value = not self.is_root
        world = self.group.world
        if not isinstance(value, bool) and isinstance(value, int):
            if value in (1, world):
                value = value == world
            else:
                assert self.root is not None
                group, index = self.root._post_forward_subgroup(self.group, value)
                self.group.post_forward_group, self.group.post_forward_index = group, index
        self._reshard_policy: bool | int = value

    def _post_forward_subgroup(self, group: ParamGroup, k: int) -> tuple[dist.ProcessGroup, int]:
        """Process groups of ``k`` consecutive ranks within each shard group (created once)."""
        if k not in self._subgroups:
            mesh = group.info.mesh.mesh
            rows = mesh.tolist() if mesh.dim() == 2 else [mesh.tolist()]
            ranks = [row[i : i + k] for row in rows for i in range(0, len(row), k)]
            current, _ = dist.new_subgroups_by_enumeration(ranks)
            me = dist.get_rank()
            index = next(r.index(me) for r in ranks if me in r)
            self._subgroups[k] = (current, index)
        return self._subgroups[k]

    # --------------------------------------------------------------------------- forward
    def pre_forward(
        self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """Forward pre-hook: lazy init, unshard, prefetch, cast inputs."""
        if self.root is None:
            self.lazy_init()
        root = self.root
        assert root is not None
        if self.mp_policy.cast_forward_inputs and self.mp_policy.param_dtype is not None:
            args, kwargs = _cast_floats((args, kwargs), self.mp_policy.param_dtype)
        if _in_backward():  # recomputation under activation checkpointing
            self.group.wait_for_unshard()
            return args, kwargs
        if self.is_root and self.training_state is TrainingState.IDLE:
            root._begin_forward()
        self.training_state = TrainingState.FORWARD
        if self not in root._forward_order:
            root._forward_order.append(self)
        self.group.wait_for_unshard()
        for nxt in self._forward_prefetch_targets():
            nxt.group.unshard()
        return args, kwargs

    def _begin_forward(self) -> None:
        if self._forward_order:
            self._prev_forward_order = self._forward_order
        self._forward_order = []
        self._post_forward_order = []

    def _forward_prefetch_targets(self) -> list[FSDPState]:
        if self.forward_prefetch is not None:
            return self.forward_prefetch
        assert self.root is not None
        order = self.root._prev_forward_order
        if self in order:
            i = order.index(self)
            if i + 1 < len(order):
                return [order[i + 1]]
        return []

    def post_forward(
        self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any
    ) -> Any:
        """Forward hook: reshard per policy, hook outputs for pre-backward, cast outputs."""
        if _in_backward():
            return output
        assert self.root is not None
        self._post_forward_calls += 1
        if self._post_forward_calls >= len(self.modules):
            self._post_forward_calls = 0
            order = self.root._post_forward_order
            if self in order:
                order.remove(self)
            order.append(self)
            if not torch.is_grad_enabled():
                self.group.reshard()  # no backward will come for this forward
            elif self._reshard_policy is True:
                self.group.reshard()
            elif self._reshard_policy is not False:
                self.group.reshard_partial()
            if self.training_state is TrainingState.FORWARD:
                self.training_state = TrainingState.IDLE
        if torch.is_grad_enabled():
            tensors, _ = tree_flatten(output)
            for t in tensors:
                if isinstance(t, torch.Tensor) and t.requires_grad:
                    t.register_hook(self._pre_backward_hook)
        return _cast_floats(output, self.mp_policy.output_dtype)

    # -------------------------------------------------------------------------- backward
    def _pre_backward_hook(self, grad: torch.Tensor) -> None:
        self.pre_backward()

    def pre_backward(self) -> None:
        """Gather this unit for its backward and prefetch the unit that runs backward next."""
        root = self.root
        assert root is not None
        if not root._callback_queued:
            root._callback_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(root._finish_backward)
        if self.training_state is TrainingState.PRE_BACKWARD or self.group.backward_done:
            return
        self.training_state = TrainingState.PRE_BACKWARD
        self.group.wait_for_unshard()
        for prev in self._backward_prefetch_targets():
            if not prev.group.backward_done:
                prev.group.unshard()

    def _backward_prefetch_targets(self) -> list[FSDPState]:
        if self.backward_prefetch is not None:
            return self.backward_prefetch
        assert self.root is not None
        order = self.root._post_forward_order
        if self in order:
            i = order.index(self)
            if i > 0:
                return [order[i - 1]]
        return []

    def _on_grad_accumulated(self, sp: ShardedParam) -> None:
        if self.group.on_grad_accumulated():
            self.post_backward()

    def post_backward(self) -> None:
        """All of the unit's gradients are ready: reshard and reduce-scatter them."""
        root = self.root
        assert root is not None
        # Finish the previous unit's reduction first (it has had this unit's whole backward to
        # complete in the background), so its buffer is freed before this one is allocated:
        # at most one reduction in flight.
        for p in root._pending:
            p.finish()
        root._pending = []
        pending = self.group.reduce_grads()
        self.training_state = TrainingState.POST_BACKWARD
        if pending is not None:
            root._pending.append(pending)

    def _finish_backward(self) -> None:
        """End-of-backward callback (root): complete every unit, wait for reductions."""
        for st in self.states:
            if st.group.params and not st.group.backward_done:
                pending = st.group.reduce_grads()
                if pending is not None:
                    self._pending.append(pending)
        for p in self._pending:
            p.finish()
        self._pending = []
        for st in self.states:
            st.group.finish_backward()
            st.training_state = TrainingState.IDLE
        self._callback_queued = False

    # --------------------------------------------------------------------------- helpers
    def reshard_if_idle(self) -> None:
        """Make sure modules show sharded parameters (e.g. before ``state_dict``)."""
        if self.training_state is TrainingState.IDLE and self.group.state is ShardedState.UNSHARDED:
            self.group.reshard()
