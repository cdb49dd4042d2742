"""Activation checkpointing as the planner traces it and the measured runs apply it.

Three modes, torchtitan's (``--ac none|selective|full``):

- ``none``: autograd saves what each op needs.
- ``full``: each block is recomputed in backward; only its inputs are saved.
- ``selective``: torchtitan's op-level policy
  (``torchtitan/models/llama3/infra/parallelize.py``, ``_apply_ac_to_transformer_block`` with
  ``selective_ac_option="op"``): save the outputs of the attention kernel and of every other
  matmul of a block (the 1st, 3rd, ... in call order), recompute the rest (elementwise ops,
  norms, the other matmuls). torchtitan counts ``aten.mm`` only; a ``nn.Linear`` with a bias
  dispatches ``aten.addmm``, so both count here (the policy is otherwise the same).
"""

from __future__ import annotations

import contextlib
from collections import defaultdict
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

__all__ = ["AC_MODES", "ac_mode", "checkpointed", "selective_policy"]

AC_MODES = ("none", "selective", "full")

aten = torch.ops.aten

_SAVE = {
    aten.mm.default,
    aten.addmm.default,
    aten._scaled_dot_product_efficient_attention.default,
    aten._scaled_dot_product_flash_attention.default,
    aten._scaled_dot_product_cudnn_attention.default,
    aten._scaled_dot_product_flash_attention_for_cpu.default,
    aten.abs.default,  # torchtitan (Dec 2024) saves abs/max for float8's amax
    aten.max.default,
}
_MATMUL = {aten.mm.default, aten.addmm.default}


def ac_mode(ac: bool | str) -> str:
    """``True`` -> ``"full"``, ``False`` -> ``"none"``, a mode name -> itself (checked)."""
    if isinstance(ac, bool):
        return "full" if ac else "none"
    if ac not in AC_MODES:
        raise ValueError(f"ac {ac!r}: choose from {', '.join(AC_MODES)}")
    return ac


def selective_policy() -> Callable[..., Any]:
    """A fresh policy for one checkpointed call (its matmul counter starts at zero)."""
    from torch.utils.checkpoint import CheckpointPolicy

    count: dict[bool, int] = defaultdict(int)

    def policy(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        if func in _MATMUL:
            count[ctx.is_recompute] += 1
            if count[ctx.is_recompute] % 2 == 0:  # every second matmul is recomputed
                return CheckpointPolicy.PREFER_RECOMPUTE
        return CheckpointPolicy.MUST_SAVE if func in _SAVE else CheckpointPolicy.PREFER_RECOMPUTE

    return policy


def _context_fn() -> Any:
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    return create_selective_checkpoint_contexts(selective_policy())


@contextlib.contextmanager
def checkpointed(blocks: list[nn.Module], mode: str) -> Iterator[None]:
    """Within the block, each of ``blocks`` runs under ``mode``'s checkpointing (non-reentrant)."""
    from torch.utils.checkpoint import checkpoint

    if mode == "none":
        yield
        return
    extra: dict[str, Any] = {"context_fn": _context_fn} if mode == "selective" else {}
    saved = []
    for b in blocks:
        fwd = b.forward
        saved.append((b, fwd))

        def ck(*a: Any, _f: Callable[..., Any] = fwd, **k: Any) -> Any:
            return checkpoint(_f, *a, use_reentrant=False, **extra, **k)

        b.forward = ck  # type: ignore[method-assign]
    try:
        yield
    finally:
        for b, fwd in saved:
            b.forward = fwd  # type: ignore[method-assign]
