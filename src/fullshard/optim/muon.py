"""``Muon``: ``torch.optim.Muon`` with a choice of the dtype its Newton-Schulz iteration runs in.

[Note: Newton-Schulz dtype] ``torch.optim.Muon`` orthogonalises every update in bfloat16.
That is the fast choice on a GPU, but a CPU without native bf16 matrix units (AVX2, or
AVX-512 without its BF16 extension) emulates bf16 matmuls: on this project's CI machine the
five iterations for the ``small`` preset's sixteen block matrices take 9.7 s in bf16 and 0.3 s
in float32 (one thread, ``docs/train.md``). This class is ``torch.optim.Muon`` (a subclass: same
constructor checks, param groups, state and state dict) with one more param-group option,
``ns_dtype``. Its step is the same sequence of operations as torch's; with
``ns_dtype="bfloat16"`` (the default) its results are bit-for-bit torch's, with another dtype
only the orthogonalisation's rounding differs (float32 is closer to the exact iteration than
bfloat16 is). Being a per-tensor optimizer it runs under
:class:`fullshard.optim.WholeTensor` like ``torch.optim.Muon``.

The option is a dtype *name* (``"float32"``), not a ``torch.dtype``, so that checkpoints can
store it with the other options (they are JSON).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from .closure import run_closure

__all__ = ["Muon", "newton_schulz"]


def ns_dtype_of(name: object) -> torch.dtype:
    """The floating dtype ``name`` (``"float32"``) names; ``ValueError`` naming the fix."""
    dtype = getattr(torch, name, None) if isinstance(name, str) else None
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(
            f"Muon: ns_dtype must name a floating dtype, e.g. 'float32' or 'bfloat16' (a "
            f"string, so that checkpoints can store it), got {name!r}"
        )
    return dtype


def newton_schulz(
    update: torch.Tensor,
    coefficients: tuple[float, float, float],
    steps: int,
    eps: float,
    dtype: torch.dtype,
) -> torch.Tensor:
    """Approximately orthogonalise the 2-D ``update`` with ``steps`` quintic Newton-Schulz
    iterations computed in ``dtype``; returned in ``dtype``, in ``update``'s orientation."""
    if update.dim() != 2:
        raise ValueError(f"Muon: the update must be a matrix, got shape {list(update.shape)}")
    if not steps < 100:
        raise ValueError(f"Muon: ns_steps must be below 100, got {steps}")
    a, b, c = coefficients
    tall = update.size(0) > update.size(1)
    x = update.to(dtype, copy=True)  # never the momentum buffer itself: x is scaled in place
    if tall:  # iterate on the wide orientation: the Gram matrix is the smaller one
        x = x.T
    x.div_(x.norm().clamp(min=eps))  # spectral norm <= Frobenius norm = 1
    for _ in range(steps):
        gram = x @ x.T
        poly = torch.addmm(gram, gram, gram, beta=b, alpha=c)  # b*G + c*G^2
        x = torch.addmm(x, poly, x, beta=a)  # a*X + (b*G + c*G^2) X
    return x.T if tall else x


def _lr_ratio(adjust_lr_fn: str | None, shape: torch.Size) -> float:
    rows, cols = shape[0], shape[1]
    if adjust_lr_fn is None or adjust_lr_fn == "original":
        return math.sqrt(max(1, rows / cols))
    if adjust_lr_fn == "match_rms_adamw":
        return 0.2 * math.sqrt(max(rows, cols))
    return 1.0


class Muon(torch.optim.Muon):
    """``torch.optim.Muon`` whose Newton-Schulz iteration runs in ``ns_dtype``.

    >>> opt = Muon(matrices, lr=1e-3, adjust_lr_fn="match_rms_adamw", ns_dtype="float32")

    Every argument but ``ns_dtype`` is ``torch.optim.Muon``'s. ``ns_dtype`` (a param-group
    option, like ``lr``): the name of the floating dtype the orthogonalisation computes in;
    ``"bfloat16"``, the default, is ``torch.optim.Muon`` bit for bit; ``"float32"`` is the fast
    choice on CPUs without native bf16 matmuls. See [Note: Newton-Schulz dtype].
    """

    def __init__(self, params: Any, *args: Any, ns_dtype: str = "bfloat16", **kwargs: Any) -> None:
        ns_dtype_of(ns_dtype)
        self._default_ns_dtype = ns_dtype  # read by add_param_group during super().__init__
        super().__init__(params, *args, **kwargs)
        self.defaults["ns_dtype"] = ns_dtype

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """``torch.optim.Optimizer.add_param_group``, checking the group's ``ns_dtype``."""
        ns_dtype_of(param_group.setdefault("ns_dtype", self._default_ns_dtype))
        super().add_param_group(param_group)

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """One Muon step of every parameter with a gradient (``torch.optim.Muon.step``)."""
        loss = run_closure(closure)
        for group in self.param_groups:
            # A group loaded from a torch.optim.Muon state dict has no ns_dtype.
            dtype = ns_dtype_of(group.get("ns_dtype", self._default_ns_dtype))
            lr = group["lr"]
            lr = lr.item() if isinstance(lr, torch.Tensor) else lr
            momentum = group["momentum"]
            for p in group["params"]:
                grad = p.grad
                if grad is None:
                    continue
                if torch.is_complex(p) or grad.is_sparse:
                    raise RuntimeError(
                        f"Muon: a parameter of shape {list(p.shape)} is complex or has a "
                        "sparse gradient; Muon supports neither"
                    )
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(
                        grad, memory_format=torch.preserve_format
                    )
                buf = state["momentum_buffer"]
                buf.lerp_(grad, 1 - momentum)
                update = grad.lerp(buf, momentum) if group["nesterov"] else buf
                ortho = newton_schulz(
                    update, group["ns_coefficients"], group["ns_steps"], group["eps"], dtype
                )
                p.mul_(1 - lr * group["weight_decay"])
                p.add_(ortho, alpha=-lr * _lr_ratio(group["adjust_lr_fn"], p.shape))
        return loss
