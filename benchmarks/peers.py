"""Peer engines for side-by-side runs: the one place the repository imports torch FSDP2.

fullshard's library never imports ``torch.distributed.fsdp``. Its comparison tools
(``fullshard bench``, ``fullshard plan --engine fsdp2 --measure``) load this file from the
repository checkout (see :func:`fullshard.bench.peers.load_peer_fully_shard`) when asked for the
FSDP2 mode.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def fsdp2_fully_shard() -> Callable[..., Any]:
    """torch FSDP2's ``fully_shard``."""
    from torch.distributed.fsdp import fully_shard

    return fully_shard
