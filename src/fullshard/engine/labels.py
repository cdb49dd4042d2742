"""Profiler labels: named ranges around the engine's work in ``torch.profiler`` traces.

[Note: profiler labels]
FSDP2 users read ``FSDP::pre_forward (layers.0)``-style ranges in their traces; fullshard's are
``fullshard::<what> (<unit>)``, the unit named by its module FQN under the root:

- ``pre_forward`` / ``post_forward`` / ``pre_backward`` / ``post_backward``: the unit's hooks;
- ``all_gather``: issuing the unit's gather; ``all_gather_wait``: waiting for it and exposing
  the unsharded parameters, with ``all_gather_copy_out`` inside (placements copied out of the
  gathered buffer); ``reshard``: freeing them;
- ``reduce_scatter``: collecting the unit's gradients and issuing their reduction;
  ``reduce_scatter_wait``: waiting for it, dividing, and handing the gradient shards to the
  sharded parameters' ``.grad`` (what the optimizer sees).

A label is opened only while a profiler records (``torch.autograd.profiler`` sets
``_is_profiler_enabled``); otherwise it costs one attribute read.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from typing import Any, TypeVar

import torch
from torch.autograd import profiler as _profiler

__all__ = ["LABELS", "label", "labelled"]

#: Every label the engine opens (the ``<what>`` of ``fullshard::<what> (<unit>)``).
LABELS: tuple[str, ...] = (
    "pre_forward",
    "post_forward",
    "pre_backward",
    "post_backward",
    "all_gather",
    "all_gather_wait",
    "all_gather_copy_out",
    "reshard",
    "reduce_scatter",
    "reduce_scatter_wait",
)

F = TypeVar("F", bound=Callable[..., Any])


def label(what: str, unit: str) -> contextlib.AbstractContextManager[Any]:
    """The range ``fullshard::<what> (<unit>)`` while a profiler records, else nothing."""
    if not _profiler._is_profiler_enabled:
        return contextlib.nullcontext()
    return torch.profiler.record_function(f"fullshard::{what} ({unit})")


def labelled(what: str, unit_attr: str = "name") -> Callable[[F], F]:
    """Decorate a method of an object whose ``unit_attr`` names the unit with the range
    ``fullshard::<what> (<unit>)`` (see [Note: profiler labels])."""

    def decorate(fn: F) -> F:
        @functools.wraps(fn)
        def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
            if not _profiler._is_profiler_enabled:
                return fn(self, *args, **kwargs)
            with torch.profiler.record_function(f"fullshard::{what} ({getattr(self, unit_attr)})"):
                return fn(self, *args, **kwargs)

        return wrapper  # type: ignore[return-value]

    return decorate
