"""The unit state machines ([Note: sharded state], [Note: training state] in fullshard.state):
every legal move is accepted, every other is refused with the unit named, and a unit's
hooks firing out of order (its pre-backward during its own backward) fail loudly."""

from __future__ import annotations

import itertools

import pytest
import torch
from torch import nn

from fullshard import fully_shard
from fullshard.state import (
    _ALLOWED,
    _TRAINING_ALLOWED,
    ShardedState,
    TrainingState,
    training_transition,
    transition,
)
from fullshard.testing import run_distributed


@pytest.mark.parametrize(
    ("states", "allowed", "move"),
    [
        (ShardedState, _ALLOWED, transition),
        (TrainingState, _TRAINING_ALLOWED, training_transition),
    ],
)
def test_every_move_is_checked(states, allowed, move) -> None:
    for cur, new in itertools.product(states, repeat=2):
        if (cur, new) in allowed:
            assert move("blocks.0", cur, new) is new
        else:
            with pytest.raises(RuntimeError, match=rf"unit 'blocks.0': illegal .*{cur.value} -> "):
                move("blocks.0", cur, new)


def test_training_moves_that_are_refused() -> None:
    T = TrainingState
    for cur, new in [
        (T.PRE_BACKWARD, T.FORWARD),  # a forward inside the unit's own backward
        (T.POST_BACKWARD, T.PRE_BACKWARD),  # a second backward before the step ended
        (T.POST_BACKWARD, T.POST_BACKWARD),
        (T.PRE_BACKWARD, T.PRE_BACKWARD),
    ]:
        assert (cur, new) not in _TRAINING_ALLOWED


def _out_of_order() -> str:
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
    for lin in model:
        fully_shard(lin)
    fully_shard(model)
    loss = model(torch.randn(2, 8)).sum()
    loss.backward()
    state = model[0]._get_fsdp_state()
    state.training_state = TrainingState.POST_BACKWARD  # as if the step had not ended
    try:
        state.training_state = TrainingState.PRE_BACKWARD
    except RuntimeError as e:
        return str(e)
    return "accepted"


def test_a_hook_out_of_order_names_the_unit() -> None:
    msg = run_distributed(_out_of_order, 2)[0]
    assert "unit '0': illegal training-state change post_backward -> pre_backward" in msg, msg
