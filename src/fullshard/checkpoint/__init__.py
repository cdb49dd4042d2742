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
"""

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
