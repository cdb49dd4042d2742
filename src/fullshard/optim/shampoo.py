"""A small Shampoo: whole-matrix preconditioning, the other kind of optimizer that needs it.

For a matrix gradient ``G`` (m x n) it accumulates ``L += G G^T`` and ``R += G^T G`` and steps
``W -= lr * L^(-1/4) G R^(-1/4)`` (inverse roots by eigendecomposition, recomputed every
``precondition_every`` steps); other tensors get the diagonal version (Adagrad). Its state
tensors (``L``, ``R``) do not have their parameter's shape, which is what makes it a useful
test of :class:`fullshard.optim.WholeTensor`'s state handling. It is a reference, not a tuned
implementation (no grafting, no blocking).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

from .closure import run_closure

__all__ = ["Shampoo"]


def _inverse_root(m: torch.Tensor, root: int, eps: float) -> torch.Tensor:
    vals, vecs = torch.linalg.eigh(m + eps * torch.eye(m.shape[0], dtype=m.dtype, device=m.device))
    return (vecs * vals.clamp_min(eps).pow(-1.0 / root)) @ vecs.T


class Shampoo(torch.optim.Optimizer):
    """Shampoo (Gupta et al., 2018) on whole matrices; diagonal on other tensors."""

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-2,
        eps: float = 1e-6,
        weight_decay: float = 0.0,
        precondition_every: int = 1,
    ) -> None:
        if lr < 0 or eps <= 0 or precondition_every < 1:
            raise ValueError(
                f"Shampoo: need lr >= 0, eps > 0, precondition_every >= 1; got lr={lr}, "
                f"eps={eps}, precondition_every={precondition_every}"
            )
        defaults = {
            "lr": lr,
            "eps": eps,
            "weight_decay": weight_decay,
            "precondition_every": precondition_every,
        }
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """One Shampoo step on every parameter with a gradient."""
        loss = run_closure(closure)
        for group in self.param_groups:
            lr, eps, wd = group["lr"], group["eps"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                g = p.grad
                state = self.state[p]
                if not state:
                    state["step"] = torch.tensor(0.0)
                    if p.dim() == 2:
                        state["L"] = torch.zeros(
                            p.shape[0], p.shape[0], dtype=p.dtype, device=p.device
                        )
                        state["R"] = torch.zeros(
                            p.shape[1], p.shape[1], dtype=p.dtype, device=p.device
                        )
                    else:
                        state["sum_sq"] = torch.zeros_like(p)
                state["step"] += 1
                if wd:
                    p.mul_(1 - lr * wd)
                if p.dim() != 2:
                    state["sum_sq"].addcmul_(g, g)
                    p.addcdiv_(g, state["sum_sq"].sqrt().add_(eps), value=-lr)
                    continue
                state["L"].add_(g @ g.T)
                state["R"].add_(g.T @ g)
                if "L_root" not in state or int(state["step"]) % group["precondition_every"] == 0:
                    state["L_root"] = _inverse_root(state["L"], 4, eps)
                    state["R_root"] = _inverse_root(state["R"], 4, eps)
                p.add_(state["L_root"] @ g @ state["R_root"], alpha=-lr)
        return loss
