"""The engines fullshard's comparison tools run side by side: fullshard and torch FSDP2.

``fullshard bench`` and ``fullshard plan --measure`` train the same model under each engine.
torch FSDP2's ``fully_shard`` comes from ``fullshard_peers``, the benchmarks' own package
(``benchmarks/fullshard_peers``, shipped in the wheel beside ``fullshard``): this package never
imports torch's FSDP engine itself (``tests/test_layering.py`` checks it), and loads the peer only
when a tool asks for the ``fsdp2`` engine.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

__all__ = ["ENGINE_NAMES", "load_fully_shard"]

#: Engine names :func:`load_fully_shard` accepts.
ENGINE_NAMES: tuple[str, ...] = ("fullshard", "fsdp2")
#: The benchmarks' package that holds the peer engines (``benchmarks/fullshard_peers``).
PEERS_PACKAGE = "fullshard_peers"


def load_fully_shard(engine: str) -> Callable[..., Any]:
    """``fully_shard`` of ``engine``: ``"fullshard"`` (this library) or ``"fsdp2"`` (torch's)."""
    if engine == "fullshard":
        from fullshard import fully_shard

        return fully_shard
    if engine == "fsdp2":
        try:
            peers = importlib.import_module(PEERS_PACKAGE)
        except ImportError as e:
            raise ImportError(
                f"the fsdp2 engine comes from the {PEERS_PACKAGE!r} package (benchmarks/"
                f"{PEERS_PACKAGE} in the repository), which is not importable here ({e}); "
                "reinstall fullshard (`pip install .`) or choose the fullshard engine"
            ) from e
        return peers.fsdp2_fully_shard()  # type: ignore[no-any-return]
    raise ValueError(f"unknown engine {engine!r}; choose from {list(ENGINE_NAMES)}")
