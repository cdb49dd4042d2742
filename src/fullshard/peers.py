"""The engines fullshard's comparison tools run side by side: fullshard and torch FSDP2.

``fullshard bench`` and ``fullshard plan --measure`` train the same model under each engine.
This is the one module of the package that imports ``torch.distributed.fsdp``, and only when a
tool asks for the ``fsdp2`` engine: the engine itself never does (``tests/test_layering.py``
checks both). It lives in the package, not in the repository's ``benchmarks/``, so the
comparison works from an installed wheel.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["ENGINE_NAMES", "load_fully_shard"]

#: Engine names :func:`load_fully_shard` accepts.
ENGINE_NAMES: tuple[str, ...] = ("fullshard", "fsdp2")


def load_fully_shard(engine: str) -> Callable[..., Any]:
    """``fully_shard`` of ``engine``: ``"fullshard"`` (this library) or ``"fsdp2"`` (torch's)."""
    if engine == "fullshard":
        from fullshard import fully_shard

        return fully_shard
    if engine == "fsdp2":
        from torch.distributed.fsdp import fully_shard as torch_fully_shard

        return torch_fully_shard  # type: ignore[no-any-return]
    raise ValueError(f"unknown engine {engine!r}; choose from {list(ENGINE_NAMES)}")
