"""The peer engines fullshard's benchmarks train side by side with fullshard: torch FSDP2
and torch FSDP1 (DeepSpeed ZeRO-3 in ``deepspeed_zero3``).

Benchmark code, not library code. It lives in the repository's ``benchmarks/`` tree and is
shipped in the wheel as its own top-level package, beside ``fullshard``, so that
``fullshard bench`` and ``fullshard plan --measure`` compare against FSDP2 from an installed
wheel. The ``fullshard`` package never imports torch's FSDP engine: ``fullshard.peers`` loads
this package by name, and only when a tool asks for the ``fsdp2`` or ``fsdp1`` engine
(``tests/test_layering.py`` checks both).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["fsdp2_fully_shard", "torch_fsdp1"]


def fsdp2_fully_shard() -> Callable[..., Any]:
    """torch FSDP2's ``fully_shard`` (``torch.distributed.fsdp.fully_shard``), the peer engine."""
    from torch.distributed.fsdp import fully_shard

    return fully_shard  # type: ignore[no-any-return]


def torch_fsdp1() -> type:
    """torch FSDP1's ``FullyShardedDataParallel``, the peer of fullshard's FSDP1 wrapper."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    return FullyShardedDataParallel
