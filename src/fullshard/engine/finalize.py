"""Manual backward finalization: the caller, not autograd, ends a step's backward.

[Note: manual backward finalization]
By default the end of each backward (an autograd callback, ``StepContext.finish_backward``)
completes the units whose post-backward never fired, waits for the reductions in flight and
reshards: the step's gradients are ready when ``loss.backward()`` returns. Schedules that run
several backward passes per step and reduce once at a point of their choosing (torch's
pipelining, from torch 2.15 on) turn this off on the root with
``set_manual_backward_finalization(True)``, run their backward passes (usually with gradient
sync off, so the gradients accumulate unsharded), and call ``finalize_backward()`` on the
root: on the caller's thread it reduces every unit holding unreduced gradients (under the
settings current at that moment: gradient sync, reshard after backward), waits for the
reductions and ends the iteration. ``finalize_backward(async_op=True)`` issues the
reductions and returns a :class:`GradientReductionHandle` whose ``wait()`` does the rest.

While manual finalization is on, the end of a backward still completes the units that did
not fire (their gradients reduce now, or accumulate with sync off), but leaves the reductions
in flight and the iteration open; ``set_is_last_backward`` is superseded. The mode in force is
the one set when a backward starts, and cannot change until the iteration is finalized (or
``reset_iter_state``), as in FSDP2.
"""

from __future__ import annotations

import torch

from .compat import TorchGradientReductionHandle
from .context import StepContext
from .hooks import FSDPState
from .state import TrainingState

__all__ = ["GradientReductionHandle", "finalize_backward", "set_manual_backward_finalization"]


class GradientReductionHandle(TorchGradientReductionHandle):  # type: ignore[misc,valid-type]
    """Returned by ``FSDPModule.finalize_backward(async_op=True)``: the step's reductions are
    in flight; :meth:`wait` finishes them and hands out the sharded gradients.

    A subclass of ``torch.distributed.fsdp.GradientReductionHandle`` where torch has it (2.15).
    """

    def __init__(self, ctx: StepContext[FSDPState] | None, token: object | None) -> None:
        self._ctx = ctx
        self._token = token

    def wait(self) -> None:
        """Wait for the gradient reductions and end the backward iteration.

        Raises ``RuntimeError`` if ``reset_iter_state`` invalidated this handle.
        """
        ctx, token = self._ctx, self._token
        if ctx is None:
            return
        if ctx.active_reduction is not token:
            raise RuntimeError(
                "this gradient reduction handle was invalidated (reset_iter_state ran after "
                "finalize_backward(async_op=True)); its gradients are lost: run the step again"
            )
        ctx.end_backward_iteration()
        ctx.active_reduction = None
        self._ctx = self._token = None


def _in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


def set_manual_backward_finalization(state: FSDPState, enabled: bool) -> None:
    """``FSDPModule.set_manual_backward_finalization`` on ``state``'s unit (see the Note)."""
    if not isinstance(enabled, bool):
        raise TypeError(f"enabled must be a bool, got {type(enabled).__name__}")
    ctx = state.ctx
    if ctx is not None and not state.is_root:
        raise RuntimeError(
            f"set_manual_backward_finalization must be called on the root FSDP module, not on "
            f"the unit {state.name!r}: call it on the module fully_shard was applied to last"
        )
    if enabled != state.manual_backward_finalization and _in_backward():
        raise RuntimeError(
            "set_manual_backward_finalization cannot change mode during backward: set it "
            "before the forward whose backward it should govern"
        )
    active = ctx.manual_active if ctx is not None else None
    if active is not None and enabled != active:
        raise RuntimeError(
            f"set_manual_backward_finalization({enabled}) after a backward started with "
            f"manual finalization {active}: finish that iteration first (finalize_backward() "
            f"or reset_iter_state())"
        )
    state.manual_backward_finalization = enabled


def _check_finalizable(root: FSDPState, ctx: StepContext[FSDPState]) -> None:
    if ctx.active_reduction is not None:
        raise RuntimeError(
            "The previous gradient reduction must be waited on before finalizing backward "
            "again: call wait() on the handle finalize_backward(async_op=True) returned"
        )
    if not root.is_root:
        raise RuntimeError(
            f"finalize_backward must be called on the root FSDP module, not on the unit "
            f"{root.name!r}: call it on the module fully_shard was applied to last"
        )
    manual = ctx.manual_active
    if manual is None:
        manual = root.manual_backward_finalization
    if not manual:
        raise RuntimeError(
            "finalize_backward requires manual backward finalization: call "
            "set_manual_backward_finalization(True) on the root before forward (without it, "
            "each backward finalizes itself)"
        )
    if ctx.backward_task is not None or _in_backward():
        raise RuntimeError("finalize_backward must be called after backward completes")
    for st in ctx.states:
        for g in (st.group, *st.group.subgroups):
            if g.partial.total is not None or (
                g.has_unreduced_grads()
                and g.overrides.requires_gradient_sync
                and g.info.replicate_size > 1
                and not g.overrides.requires_all_reduce
            ):
                raise RuntimeError(
                    f"manual backward finalization does not support partial gradient "
                    f"reductions (HSDP without the all-reduce) for unit {g.name!r}: call "
                    f"set_requires_all_reduce(True) before finalize_backward, or use "
                    f"automatic backward finalization for this configuration"
                )


def finalize_backward(root: FSDPState, async_op: bool) -> GradientReductionHandle | None:
    """``FSDPModule.finalize_backward`` on the root ``root`` (see the Note)."""
    ctx = root.ctx
    if ctx is None:  # no forward yet: nothing to finalize (as FSDP2)
        return GradientReductionHandle(None, None) if async_op else None
    _check_finalizable(root, ctx)
    for st in reversed(ctx.states):  # the order backward reduces in
        group = st.group
        if group.params and group.has_unreduced_grads():
            ctx.reduce(st)  # reshards per reshard_after_backward
        elif group.reshard_after_backward:
            group.reshard()
        st.training_state = TrainingState.IDLE
    if not async_op:
        ctx.end_backward_iteration()
        return None
    token = object()
    ctx.active_reduction = token
    return GradientReductionHandle(ctx, token)
