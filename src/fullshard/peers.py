"""The engines fullshard's comparison tools run side by side: fullshard, torch FSDP2, DeepSpeed.

``fullshard bench`` and ``fullshard plan --measure`` train the same model under each engine.
The peers come from ``fullshard_peers``, the benchmarks' own package (``benchmarks/
fullshard_peers``, shipped in the wheel beside ``fullshard``): this package never imports torch's
FSDP engine or DeepSpeed itself (``tests/test_layering.py`` checks it), and loads a peer only when
a tool asks for it.

- :func:`load_fully_shard`: engines applied with a ``fully_shard`` call (fullshard, ``fsdp2``).
- :func:`load_torch_fsdp1`: torch's FSDP1 wrapper class (``fsdp1``), beside fullshard's own
  (``fullshard.fsdp1``).
- :func:`load_peer`: whole training engines that own forward, backward and step (``deepspeed``:
  DeepSpeed ZeRO-3, from the optional ``peers`` extra); :func:`peer_missing` says, without
  importing it, whether one is installed and how to install it if not.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from types import ModuleType
from typing import Any

__all__ = [
    "ENGINE_NAMES",
    "PEER_ENGINES",
    "load_fully_shard",
    "load_peer",
    "load_torch_fsdp1",
    "peer_missing",
]

#: Engine names :func:`load_fully_shard` accepts.
ENGINE_NAMES: tuple[str, ...] = ("fullshard", "fsdp2")
#: Whole-engine peers :func:`load_peer` accepts -> their module in the peers package.
PEER_ENGINES: dict[str, str] = {"deepspeed": "deepspeed_zero3"}
#: The benchmarks' package that holds the peer engines (``benchmarks/fullshard_peers``).
PEERS_PACKAGE = "fullshard_peers"


def _peers_package(what: str) -> ModuleType:
    try:
        return importlib.import_module(PEERS_PACKAGE)
    except ImportError as e:
        raise ImportError(
            f"the {what} engine comes from the {PEERS_PACKAGE!r} package (benchmarks/"
            f"{PEERS_PACKAGE} in the repository), which is not importable here ({e}); "
            "reinstall fullshard (`pip install .`) or choose the fullshard engine"
        ) from e


def load_fully_shard(engine: str) -> Callable[..., Any]:
    """``fully_shard`` of ``engine``: ``"fullshard"`` (this library) or ``"fsdp2"`` (torch's)."""
    if engine == "fullshard":
        from fullshard import fully_shard

        return fully_shard
    if engine == "fsdp2":
        return _peers_package(engine).fsdp2_fully_shard()  # type: ignore[no-any-return]
    raise ValueError(f"unknown engine {engine!r}; choose from {list(ENGINE_NAMES)}")


def load_torch_fsdp1() -> type:
    """torch's ``FullyShardedDataParallel`` (FSDP1), the peer of fullshard's FSDP1 wrapper."""
    return _peers_package("fsdp1").torch_fsdp1()  # type: ignore[no-any-return]


def load_peer(engine: str) -> ModuleType:
    """The peers package's module for a whole-engine peer (importing it imports no engine)."""
    if engine not in PEER_ENGINES:
        raise ValueError(f"unknown peer engine {engine!r}; choose from {list(PEER_ENGINES)}")
    _peers_package(engine)
    return importlib.import_module(f"{PEERS_PACKAGE}.{PEER_ENGINES[engine]}")


def peer_missing(engine: str) -> str | None:
    """``None`` if ``engine`` can run here, else why not and how to install it, in one line."""
    try:
        why: str | None = load_peer(engine).missing()
    except ImportError as e:
        return str(e)
    return why
