"""The two state machines of a unit: what its modules see, and where it is in the step.

[Note: sharded state]
``ShardedState`` is what the modules of a unit currently register:

    SHARDED --unshard()--> UNSHARDING --wait_for_unshard()--> UNSHARDED
       ^                       |                                 |  |
       +------reshard()--------+ (a prefetch never used)         |  |
       +---------------------------------reshard()---------------+  |
    SHARDED_POST_FORWARD <--reshard_partial() (int reshard_after_forward)
       |--unshard()--> UNSHARDING (gathers within the post-forward subgroup)
       |--reshard()--> SHARDED (the kept copy dropped, e.g. at the end of backward)

Every change goes through :func:`transition`, which refuses any other move with an error that
names the unit: a hook firing in an unexpected order fails loudly instead of corrupting memory.

[Note: training state]
``TrainingState`` is where a unit is in the step, guarded the same way
(:func:`training_transition`); the table holds the moves the hooks make, no others:

    IDLE --pre-forward--> FORWARD --post-forward--> IDLE
    FORWARD --pre-forward--> FORWARD   (another of the unit's modules, or the unit called
                                        again, before its forward ended)
    IDLE | FORWARD --pre-backward--> PRE_BACKWARD --post-backward--> POST_BACKWARD
    IDLE | FORWARD --post-backward--> POST_BACKWARD   (a unit with no pre-backward hook:
                                                       one rank, or outputs needing no grad)
    any --end of backward / reset_iter_state / finalize_backward--> IDLE

(FORWARD --backward--> is a unit of several modules whose forward did not end: one of its
modules did not run.) Every hook moves through the guard; the only calls that leave the state
as it is are a pre-backward in PRE_BACKWARD (the hook of another output of the unit), one in
POST_BACKWARD (an output whose gradient arrives after the unit's backward ended: it only makes
sure the unit is gathered) and a recomputation under activation checkpointing (a forward during
backward). Refused: a forward in PRE_BACKWARD or POST_BACKWARD (after a backward that raised:
``reset_iter_state`` first), and a post-backward after the unit's post-backward, before the step
ended.
"""

from __future__ import annotations

import enum
from typing import TypeVar

__all__ = ["ShardedState", "TrainingState", "training_transition", "transition"]

_E = TypeVar("_E", bound=enum.Enum)


class ShardedState(enum.Enum):
    """Which form of a unit's parameters exists (see [Note: sharded state])."""

    SHARDED = "sharded"
    SHARDED_POST_FORWARD = "sharded_post_forward"  # plus a copy sharded over k ranks
    UNSHARDING = "unsharding"  # all-gather issued, not yet waited on
    UNSHARDED = "unsharded"


class TrainingState(enum.Enum):
    """Where a unit is in the current step."""

    IDLE = "idle"
    FORWARD = "forward"
    PRE_BACKWARD = "pre_backward"
    POST_BACKWARD = "post_backward"  # gradients reduced (or accumulated) for this backward


_S = ShardedState
_ALLOWED: frozenset[tuple[ShardedState, ShardedState]] = frozenset(
    {
        (_S.SHARDED, _S.UNSHARDING),
        (_S.SHARDED_POST_FORWARD, _S.UNSHARDING),
        (_S.UNSHARDING, _S.UNSHARDED),
        (_S.UNSHARDING, _S.SHARDED),
        (_S.UNSHARDED, _S.SHARDED),
        (_S.UNSHARDED, _S.SHARDED_POST_FORWARD),
        (_S.SHARDED_POST_FORWARD, _S.SHARDED),
    }
)


def _move(unit: str, current: _E, new: _E, allowed: frozenset[tuple[_E, _E]], what: str) -> _E:
    if (current, new) not in allowed:
        raise RuntimeError(
            f"unit {unit!r}: illegal {what} change {current.value} -> {new.value}; this is a "
            f"fullshard bug or a hook called out of order (please report it with the model)"
        )
    return new


def transition(unit: str, current: ShardedState, new: ShardedState) -> ShardedState:
    """Return ``new`` if ``current -> new`` is a legal move, else raise naming ``unit``."""
    return _move(unit, current, new, _ALLOWED, "state")


_T = TrainingState
_TRAINING_ALLOWED: frozenset[tuple[TrainingState, TrainingState]] = frozenset(
    {
        (_T.IDLE, _T.FORWARD),
        (_T.FORWARD, _T.FORWARD),
        (_T.IDLE, _T.PRE_BACKWARD),
        (_T.FORWARD, _T.PRE_BACKWARD),
        (_T.PRE_BACKWARD, _T.POST_BACKWARD),
        (_T.IDLE, _T.POST_BACKWARD),
        (_T.FORWARD, _T.POST_BACKWARD),
        *((t, _T.IDLE) for t in TrainingState),
    }
)


def training_transition(unit: str, current: TrainingState, new: TrainingState) -> TrainingState:
    """Return ``new`` if ``current -> new`` is a legal move ([Note: training state]), else raise
    naming ``unit``."""
    return _move(unit, current, new, _TRAINING_ALLOWED, "training-state")
