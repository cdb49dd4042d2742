"""One gather per rollout: a ``generate()`` loop on a sharded actor gathers each unit once.

A decode loop runs the model's forward once per generated token. With the training policy
(``reshard_after_forward=True`` on the blocks) every forward gathers every unit again, so N
decode steps cost N all-gathers per unit; the rollout needs the weights unchanged throughout,
so once is enough::

    with fullshard.rl.gathered_for_rollout(model):
        with torch.no_grad():
            out = model.generate(prompts, max_new_tokens=256)   # each unit gathered once
    # every unit is sharded again here: its unsharded memory is freed

Inside the block every unit under ``model`` keeps its parameters after its forward (FSDP2's
``reshard_after_forward=False``, which keeps a unit gathered after a forward without
gradients too); the first forward gathers each unit (with the usual prefetch), later forwards
gather nothing. On exit each unit's policy is restored and every unit resharded. Peak memory
inside the block is the whole unsharded model on each rank (what the decode loop needs anyway
to avoid re-gathering). ``prefetch=True`` gathers every unit on entry instead, all issued
before any is waited on.

``fullshard.count_collectives()`` shows it: N forwards under ``no_grad`` issue one all-gather
per unit inside the block, N per unit without it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import cast

from torch import nn

from ..engine import TrainingState
from ..module import FSDPModule
from .sleep import _root_states

__all__ = ["gathered_for_rollout"]


@contextlib.contextmanager
def gathered_for_rollout(model: nn.Module, *, prefetch: bool = False) -> Iterator[nn.Module]:
    """Keep every unit under ``model`` gathered from its first forward to the end of the
    block, then reshard them all (see the module docstring). Yields ``model``.

    ``prefetch``: gather every unit on entry (issued together, then waited on) rather than in
    the first forward. Refused in the middle of a training step (the units' states say so).
    """
    states = _root_states(model, "gathered_for_rollout")
    busy = [st.name for st in states if st.training_state is not TrainingState.IDLE]
    if busy:
        raise RuntimeError(
            f"fullshard.rl.gathered_for_rollout was entered in the middle of a forward or "
            f"backward (units {busy}); enter it between steps"
        )
    units = [cast(FSDPModule, st.modules[0]) for st in states]
    saved = [st.reshard_after_forward for st in states]
    for unit in units:
        unit.set_reshard_after_forward(False, recurse=False)
    try:
        if prefetch:
            handles = [unit.unshard(async_op=True) for unit in units]
            for handle in handles:
                if handle is not None:
                    handle.wait()
        yield model
    finally:
        for st, value in zip(states, saved):
            st.reshard_after_forward = value
            if st.ctx is not None:
                st.resolve_reshard()
        if all(st.training_state is TrainingState.IDLE for st in states):
            for unit in units:
                unit.reshard()
