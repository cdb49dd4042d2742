"""The unit state machines ([Note: sharded state], [Note: training state] in fullshard.engine.state):
every legal move is accepted, every other is refused with the unit named, and a unit's
hooks firing out of order (its pre-backward during its own backward) fail loudly."""

from __future__ import annotations

import itertools

import pytest
import torch
from torch import nn

from fullshard import fully_shard
from fullshard.engine.state import (
    _ALLOWED,
    _TRAINING_ALLOWED,
    ShardedState,
    TrainingState,
    training_transition,
    transition,
)
from fullshard.module import unit_state
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
        (T.POST_BACKWARD, T.FORWARD),  # a forward after a backward that did not end
        (T.POST_BACKWARD, T.PRE_BACKWARD),  # a second backward before the step ended
        (T.POST_BACKWARD, T.POST_BACKWARD),
        (T.PRE_BACKWARD, T.PRE_BACKWARD),
    ]:
        assert (cur, new) not in _TRAINING_ALLOWED


def test_training_moves_are_the_ones_the_hooks_make() -> None:
    T = TrainingState
    assert _TRAINING_ALLOWED == {
        (T.IDLE, T.FORWARD),  # pre-forward
        (T.FORWARD, T.FORWARD),  # pre-forward of another module of the unit, or a second call
        (T.IDLE, T.PRE_BACKWARD),  # pre-backward
        (T.FORWARD, T.PRE_BACKWARD),  # ... of a unit whose forward did not end
        (T.PRE_BACKWARD, T.POST_BACKWARD),  # post-backward
        (T.IDLE, T.POST_BACKWARD),  # ... of a unit without a pre-backward hook
        (T.FORWARD, T.POST_BACKWARD),  # ... nor an ended forward
        *((t, T.IDLE) for t in T),  # post-forward (FORWARD), the end of a step (any)
    }


def _out_of_order() -> dict[str, str]:
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
    for lin in model:
        fully_shard(lin)
    fully_shard(model)
    loss = model(torch.randn(2, 8)).sum()
    loss.backward()
    state = unit_state(model[0])
    out = {}
    moves = {
        "setter": lambda: setattr(state, "training_state", TrainingState.PRE_BACKWARD),
        # an output whose gradient came after the unit's backward: it only gathers
        "pre-backward hook": state.pre_backward,
        "forward": lambda: model(torch.randn(2, 8)),
    }
    for how, move in moves.items():  # the forward last: it leaves the model mid-forward
        state._training_state = TrainingState.POST_BACKWARD  # as if the step had not ended
        try:
            move()
            out[how] = f"accepted, {state.training_state.value}, {state.group.state.value}"
        except RuntimeError as e:
            out[how] = str(e)
    return out


def test_a_hook_out_of_order_names_the_unit() -> None:
    out = run_distributed(_out_of_order, 2)[0]
    for how, new in [("setter", "pre_backward"), ("forward", "forward")]:
        want = f"unit '0': illegal training-state change post_backward -> {new}"
        assert want in out[how], (how, out[how])
    # the pre-backward hook of an output whose gradient arrives after the unit's backward
    # ended (tests/test_fsdp2_traps.py) leaves the state as it is and gathers the unit
    assert out["pre-backward hook"] == "accepted, post_backward, unsharded", out


class _ReusesA(nn.Module):
    """``a`` runs twice, then ``b``: one unit of both, as ``fully_shard([a, b])``."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)
        self.between: list[ShardedState] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(self.a(x))
        st = self.a.__dict__.get("_fullshard_state")
        if st is not None:
            self.between.append(st.group.state)
        return self.b(h)


def _unit_of_two_modules() -> dict[str, object]:
    from fullshard.engine.events import record_events

    torch.manual_seed(0)
    ref = _ReusesA()
    model = _ReusesA()
    model.load_state_dict(ref.state_dict())
    fully_shard([model.a, model.b])
    fully_shard(model)
    x = torch.randn(4, 8)
    out: dict[str, object] = {}
    for step in range(2):
        with record_events() as log:
            model(x).square().sum().backward()
        ref(x).square().sum().backward()
        gathers = [e for e in log if e.kind == "gather_issue" and e.unit == "a"]
        out[f"gathers{step}"] = len(gathers)
    out["between"] = [s.value for s in model.between]
    out["grads"] = max(
        (p.grad.full_tensor() - q.grad).abs().max().item()
        for p, q in zip(model.parameters(), ref.parameters())
    )
    return out


def test_a_unit_of_several_modules_ends_its_forward_after_the_last_one() -> None:
    """Its post-forward (the reshard) waits until every module of the unit has finished, even
    when one of them runs twice first (FSDP2 tracks the modules still to run, as here)."""
    out = run_distributed(_unit_of_two_modules, 2)[0]
    assert out["between"] == ["unsharded", "unsharded"], out
    # one gather in forward and one in backward, each step
    assert out["gathers0"] == out["gathers1"] == 2, out
    assert out["grads"] < 1e-6, out
