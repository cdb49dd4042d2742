"""Sharded checkpoints that reshard, export, survive crashes and never execute code on load.

Public API (see ``docs/checkpoint-format.md`` for the on-disk format):

- :func:`save` / :func:`load`: every rank writes only its own shards; load works at any world
  size or mesh and reads only the rows each rank keeps. ``save(..., async_save=True)``.
- :class:`CheckpointManager`, :func:`latest_checkpoint`, :func:`list_checkpoints`,
  :func:`rotate`, :func:`clean_partial`: step-numbered checkpoints, keep-last-K.
- :func:`get_full_state_dict`, :func:`load_full_state_dict`,
  :func:`load_full_state_dict_from_file`: full (unsharded) weights in and out.
- :func:`rng_state_to_json` / :func:`rng_state_from_json`: RNG states for ``extra``.
- :class:`CheckpointReader`: read any tensor of a checkpoint (used by ``fullshard ckpt``).

The names are imported on first use (PEP 562), as in :mod:`fullshard`: ``fullshard ckpt
--help`` and its argument errors run without importing torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..lazy import lazy_names

if TYPE_CHECKING:
    from .durability import clean_partial, latest_checkpoint, list_checkpoints, rotate
    from .full_state_dict import (
        get_full_state_dict,
        load_full_state_dict,
        load_full_state_dict_from_file,
    )
    from .loading import load
    from .manager import CheckpointManager
    from .manifest import CheckpointCorruptedError, CheckpointError, CheckpointMismatchError
    from .reader import CheckpointReader
    from .rng import rng_state_from_json, rng_state_to_json
    from .saving import SaveHandle, save, wait_for_pending_save

# public name -> the submodule that defines it
_LAZY = {
    "clean_partial": "durability",
    "latest_checkpoint": "durability",
    "list_checkpoints": "durability",
    "rotate": "durability",
    "get_full_state_dict": "full_state_dict",
    "load_full_state_dict": "full_state_dict",
    "load_full_state_dict_from_file": "full_state_dict",
    "load": "loading",
    "CheckpointManager": "manager",
    "CheckpointCorruptedError": "manifest",
    "CheckpointError": "manifest",
    "CheckpointMismatchError": "manifest",
    "CheckpointReader": "reader",
    "rng_state_from_json": "rng",
    "rng_state_to_json": "rng",
    "SaveHandle": "saving",
    "save": "saving",
    "wait_for_pending_save": "saving",
}

__all__ = [
    "CheckpointCorruptedError",
    "CheckpointError",
    "CheckpointManager",
    "CheckpointMismatchError",
    "CheckpointReader",
    "SaveHandle",
    "clean_partial",
    "get_full_state_dict",
    "latest_checkpoint",
    "list_checkpoints",
    "load",
    "load_full_state_dict",
    "load_full_state_dict_from_file",
    "rng_state_from_json",
    "rng_state_to_json",
    "rotate",
    "save",
    "wait_for_pending_save",
]


__getattr__, __dir__ = lazy_names(__name__, globals(), _LAZY)
