"""Find the peer engines the comparison tools run against (torch FSDP2).

The library imports only FSDP2's public types, never its engine: the FSDP2 adapter is
benchmark code in the repository (``benchmarks/peers.py``), loaded from the checkout only when
a tool is asked for its FSDP2 mode.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = ["load_peer_fully_shard"]

_PEERS = Path(__file__).resolve().parents[3] / "benchmarks" / "peers.py"


def load_peer_fully_shard(engine: str) -> Callable[..., Any]:
    """``fully_shard`` of ``engine`` ("fullshard" or "fsdp2")."""
    if engine == "fullshard":
        from fullshard import fully_shard

        return fully_shard
    if engine != "fsdp2":
        raise ValueError(f"unknown engine {engine!r}: choose 'fullshard' or 'fsdp2'")
    if not _PEERS.is_file():
        raise RuntimeError(
            f"the FSDP2 comparison mode needs the repository's benchmarks/peers.py (looked for "
            f"{_PEERS}); run the tool from a fullshard checkout installed with pip install -e ."
        )
    spec = importlib.util.spec_from_file_location("fullshard_benchmark_peers", _PEERS)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.fsdp2_fully_shard()  # type: ignore[no-any-return]
