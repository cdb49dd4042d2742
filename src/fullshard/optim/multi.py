"""``MultiOptimizer``: several optimizers over disjoint parameters, used as one.

The usual Muon recipe steps the block matrices with ``WholeTensor(torch.optim.Muon)`` and the
embeddings, head and 1-D parameters with AdamW. Schedulers, ``fullshard.checkpoint`` and the
training loop want one optimizer: this is it. Its ``param_groups`` are the children's group
dicts themselves (so setting ``lr`` on one reaches its child), its state dict concatenates the
children's by position.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from .closure import run_closure

__all__ = ["MultiOptimizer"]


class MultiOptimizer(torch.optim.Optimizer):
    """Step, zero, save and load ``optimizers`` (over disjoint parameters) together.

    >>> opt = MultiOptimizer(WholeTensor(torch.optim.Muon, matrices), torch.optim.AdamW(rest))
    """

    def __init__(self, *optimizers: torch.optim.Optimizer) -> None:
        if not optimizers:
            raise ValueError("MultiOptimizer needs at least one optimizer")
        # The base class checks that no parameter is in two optimizers (into a list of its
        # own, see the param_groups setter); from then on the children's groups are read live.
        self.optimizers: list[torch.optim.Optimizer] = []
        super().__init__([{"params": g["params"]} for o in optimizers for g in o.param_groups], {})
        self.optimizers = list(optimizers)

    @property  # type: ignore[override]
    def param_groups(self) -> list[dict[str, Any]]:
        """The children's param groups, read live: a child's ``load_state_dict`` replaces its
        group dicts, and an ``lr`` set here must still reach it."""
        if not self.optimizers:
            return self._init_groups
        return [g for o in self.optimizers for g in o.param_groups]

    @param_groups.setter
    def param_groups(self, groups: list[dict[str, Any]]) -> None:
        if self.optimizers:
            raise AttributeError("MultiOptimizer.param_groups are its children's; set theirs")
        self._init_groups = groups

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """Step every child (the closure, if any, runs once)."""
        loss = run_closure(closure)
        for o in self.optimizers:
            o.step()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero (or drop) every child's gradients."""
        for o in self.optimizers:
            o.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        """The children's state dicts, concatenated by position (collective if a child's is)."""
        state: dict[int, Any] = {}
        groups: list[dict[str, Any]] = []
        offset = 0
        for o in self.optimizers:
            sd = o.state_dict()
            state.update({offset + int(k): v for k, v in sd["state"].items()})
            for g in sd["param_groups"]:
                groups.append({**g, "params": [offset + i for i in g["params"]]})
            offset += sum(len(g["params"]) for g in o.param_groups)
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Split ``state_dict`` by position and load each part into its child."""
        saved = state_dict["param_groups"]
        if len(saved) != len(self.param_groups):
            raise ValueError(
                f"MultiOptimizer.load_state_dict: the state dict has {len(saved)} param "
                f"groups, these optimizers {len(self.param_groups)} together"
            )
        state = {int(k): v for k, v in state_dict["state"].items()}
        offset, g0 = 0, 0
        for o in self.optimizers:
            n_groups = len(o.param_groups)
            n = sum(len(g["params"]) for g in o.param_groups)
            groups = [
                {**g, "params": [i - offset for i in g["params"]]}
                for g in saved[g0 : g0 + n_groups]
            ]
            part = {i - offset: v for i, v in state.items() if offset <= i < offset + n}
            o.load_state_dict({"state": part, "param_groups": groups})
            offset += n
            g0 += n_groups
