"""FSDP1's API on fullshard's engine: ``FullyShardedDataParallel`` (also ``FSDP``).

Code written for PyTorch's FSDP1 switches with one import::

    from fullshard.fsdp1 import FullyShardedDataParallel as FSDP   # was torch.distributed.fsdp

The constructor takes FSDP1's arguments and torch's own types (``ShardingStrategy``,
``MixedPrecision``, ``CPUOffload``, ``BackwardPrefetch``, wrap policies, state-dict configs);
each wrapper is one fullshard unit. See ``fullshard.fsdp1.wrapper`` for what it is and the
README's FSDP1 section for the deliberate differences (no ``FlatParameter``; ``DTensor``
shards).
"""

from __future__ import annotations

from .wrapper import FSDP, FullyShardedDataParallel, TrainingState

__all__ = ["FSDP", "FullyShardedDataParallel", "TrainingState"]
