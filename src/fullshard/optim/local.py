"""``local_step``: step an element-wise optimizer on the shards' local tensors.

[Note: stepping on local shards] A sharded parameter is an ``nn.Parameter`` wrapping a
``DTensor``, and so are its gradient and the optimizer states made from it
(``torch.zeros_like(p)``). An optimizer stepping on those pays DTensor's dispatch on every
operation: ops whose operands are all DTensors take its cached fast path (~20 us on this
project's CPU), but every op with a Python scalar (``exp_avg_sq.mul_(beta2)``,
``denom.add_(eps)``, ``param.mul_(1 - lr * wd)``) builds a sharding spec for the wrapped scalar
(~100-150 us). For AdamW over half of the ``speed`` benchmark model that is half of the step
(0.115 s as DTensors, 0.056 s as plain tensors, one core), and torch FSDP2 pays it too.

An element-wise optimizer (each output element depends only on the same element of the
parameter, its gradient and its states: SGD, Adam, AdamW, ...) computes exactly the same
numbers on the local shards as on the DTensors, because DTensor runs those same aten ops on
the same local tensors. :func:`local_step` wraps ``optimizer.step`` so that, for the duration
of the step only, every DTensor parameter in ``param_groups`` is replaced by its local tensor
(the gradient's local tensor as its ``.grad``) and its state by the states' local tensors;
afterwards the DTensors come back, and a state created during the step is wrapped with its
parameter's spec, as ``zeros_like`` on the DTensor would have made it. Outside ``step()``
nothing changes: ``model.parameters()``, ``param_groups``, ``optimizer.state`` and
``state_dict()`` hold DTensors, so checkpoints (DCP's optimizer state dict included) are the
same bytes with or without it. Only code that runs inside the step (the optimizer's own step
hooks) sees plain tensors.

It is not for optimizers that look across elements (Muon, Shampoo, LBFGS, Adafactor, a norm
of the update): those need the whole tensor (:class:`fullshard.optim.WholeTensor`), and on
local shards they would be silently wrong. Hence the explicit list of torch's element-wise
optimizers, and ``elementwise=True`` for a user's own.
"""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any, TypeVar

import torch
from torch.distributed.tensor import DTensor

from ..engine import dtensor_like
from .closure import run_closure

__all__ = ["ELEMENTWISE", "local_step"]

#: torch's optimizers whose update is element-wise (``local_step`` accepts them as they are).
ELEMENTWISE: frozenset[type[torch.optim.Optimizer]] = frozenset(
    {
        torch.optim.SGD,
        torch.optim.Adam,
        torch.optim.AdamW,
        torch.optim.Adamax,
        torch.optim.NAdam,
        torch.optim.RAdam,
        torch.optim.Adagrad,
        torch.optim.Adadelta,
        torch.optim.RMSprop,
        torch.optim.Rprop,
        torch.optim.ASGD,
    }
)

_MARK = "_fullshard_local_step"

OptimizerT = TypeVar("OptimizerT", bound=torch.optim.Optimizer)

# (group params list, index, DTensor parameter, its local tensor, its state before the step)
_Swap = tuple[list[Any], int, DTensor, torch.Tensor, dict[str, Any] | None]


def local_step(optimizer: OptimizerT, *, elementwise: bool | None = None) -> OptimizerT:
    """Make ``optimizer.step()`` run on the local shards of its DTensor parameters.

    The results are bit-for-bit those of stepping on the DTensors (the same ops on the same
    local tensors), without DTensor's per-op dispatch; see [Note: stepping on local shards].
    Returns ``optimizer`` itself (calling it twice is a no-op), so it composes with
    construction: ``opt = local_step(torch.optim.AdamW(model.parameters()))``.

    Args:
        optimizer: an optimizer over (some) DTensor parameters, e.g. a ``fully_shard``
            model's. Plain-tensor parameters are stepped as they are.
        elementwise: ``None`` accepts the optimizers in :data:`ELEMENTWISE` (exactly those
            classes, not subclasses). ``True`` vouches that ``optimizer``'s update is
            element-wise (no reductions over a tensor, no matrix ops); ``False`` refuses.

    Raises:
        TypeError: the optimizer is not known to be element-wise.
    """
    if getattr(optimizer, _MARK, False):
        return optimizer
    cls = type(optimizer)
    ok = cls in ELEMENTWISE if elementwise is None else elementwise
    if not ok:
        known = ", ".join(sorted(c.__name__ for c in ELEMENTWISE))
        raise TypeError(
            f"local_step: {cls.__module__}.{cls.__qualname__} is not known to be element-wise "
            f"(known: {known}). An optimizer that looks across a tensor's elements (Muon, "
            "Shampoo, LBFGS, update norms) would be wrong on local shards: run it under "
            "fullshard.optim.WholeTensor instead. If its update is element-wise, pass "
            "elementwise=True."
        )
    # An instance-level step already installed (an LR scheduler's counting wrapper) is kept
    # and called; otherwise the class's step (with the optimizer's step hooks).
    prev: Callable[..., Any] | None = optimizer.__dict__.get("step")

    def step(self: torch.optim.Optimizer, closure: Callable[[], float] | None = None) -> Any:
        loss = run_closure(closure)
        swaps = _to_local(self)
        try:
            out = prev() if prev is not None else cls.step(self)
        finally:
            _to_dtensor(self, swaps)
        return loss if closure is not None else out

    step.__doc__ = cls.step.__doc__
    if prev is not None and hasattr(prev, "_wrapped_by_lr_sched"):
        step._wrapped_by_lr_sched = True  # type: ignore[attr-defined]
    optimizer.step = types.MethodType(step, optimizer)  # type: ignore[method-assign]
    setattr(optimizer, _MARK, True)
    return optimizer


def _to_local(opt: torch.optim.Optimizer) -> list[_Swap]:
    """Put every DTensor parameter's local tensor (and its states') in its place."""
    swaps: list[_Swap] = []
    try:
        for group in opt.param_groups:
            params = group["params"]
            for i, p in enumerate(params):
                if not isinstance(p, DTensor):
                    continue
                local = p._local_tensor
                grad = p.grad
                if grad is not None:
                    if not isinstance(grad, DTensor) or grad.placements != p.placements:
                        where = getattr(grad, "placements", type(grad).__name__)
                        raise RuntimeError(
                            f"local_step: a parameter of shape {tuple(p.shape)} with "
                            f"placements {p.placements} has a gradient with {where}; "
                            "stepping on local shards needs the gradient sharded like its "
                            "parameter (fully_shard's are). Redistribute it before step()."
                        )
                    local.grad = grad._local_tensor
                state = opt.state.pop(p, None)
                if state is not None:
                    opt.state[local] = {
                        k: v._local_tensor if isinstance(v, DTensor) else v
                        for k, v in state.items()
                    }
                params[i] = local
                swaps.append((params, i, p, local, state))
    except BaseException:
        _to_dtensor(opt, swaps)
        raise
    return swaps


def _to_dtensor(opt: torch.optim.Optimizer, swaps: list[_Swap]) -> None:
    """Undo :func:`_to_local`: DTensor parameters and DTensor states again."""
    for params, i, p, local, before in swaps:
        params[i] = p
        local.grad = None
        state = opt.state.pop(local, None)
        if state is None:
            continue
        opt.state[p] = {k: _as_state(v, (before or {}).get(k), p, local) for k, v in state.items()}


def _as_state(value: Any, before: Any, p: DTensor, local: torch.Tensor) -> Any:
    """The state ``value`` as stepping on DTensors would have left it."""
    if isinstance(before, DTensor) and before._local_tensor is value:
        return before  # updated in place: the DTensor the state held
    if (
        isinstance(value, torch.Tensor)
        and not isinstance(value, DTensor)
        and value.dim() > 0
        and value.shape == local.shape
    ):
        # Made during the step (zeros_like(param), clone(grad)): wrap it like its parameter.
        if value.dtype == local.dtype and value.stride() == local.stride():
            return dtensor_like(value, p, DTensor)
        return DTensor.from_local(
            value, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride()
        )
    return value
