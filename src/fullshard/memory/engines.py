"""How each engine the planner models holds gathered parameters and communication buffers.

Apart from :mod:`fullshard.memory.planner` and free of torch at import, so that ``fullshard
plan --help`` can list the engines without importing it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

__all__ = ["ENGINES", "EngineModel"]


@dataclass(kw_only=True, frozen=True)
class EngineModel:
    """How an engine holds gathered parameters and communication buffers."""

    name: str
    copy_out: bool
    """All-gather into one packed buffer, then copy each parameter out (torch FSDP2, fullshard
    on NCCL): the packed buffer and the per-parameter copies coexist while a unit is gathered.
    ``False``: the gather fills the parameters' buffer directly (fullshard on gloo)."""
    forward_prefetch: int
    """Units gathered ahead of the current one in forward."""
    backward_prefetch: int
    """Units gathered ahead of the current one in backward."""
    gather_input_copy: bool = False
    """The all-gather sends a packed copy of this rank's shards (alive until the gather is
    waited on); ``False``: it sends from the packed output in place."""
    reduce_pending: bool = False
    """A unit's packed reduce-scatter input stays alive until the next unit's reduction is
    issued (the reduction overlaps that unit's backward)."""
    reduce_from_grads: bool = False
    """The reduce-scatter sends straight from the gradients: no packed input buffer
    (fullshard's ``p2p`` transport, [Note: reducing in pieces])."""
    transport: tuple[str, str] | None = None
    """fullshard only: ``(backend, device type)``. The unit's transport is then what the
    engine itself selects (``fullshard.engine.transport.select_transport``), which sets
    ``copy_out``, ``reduce_from_grads`` and ``aliases`` for the plan's shard-group size."""
    aliases: bool = False
    """The unit's unsharded parameters are its shards (fullshard's ``local`` transport on one
    rank): gathering allocates nothing and each gradient becomes its shard's gradient."""

    def for_unit(self, shard_size: int, unit_bytes: int, *, aliasable: bool = False) -> EngineModel:
        """This model for one unit of ``unit_bytes`` (unsharded) over ``shard_size`` ranks:
        with the transport the engine itself would pick for it (``aliasable``: see
        ``select_transport``)."""
        if self.transport is None:
            return self
        from fullshard.engine import select_transport  # imports torch

        backend, device = self.transport
        t = select_transport("auto", backend, device, shard_size, unit_bytes, aliasable=aliasable)
        return dataclasses.replace(
            self,
            copy_out=not (t.gathers_in_pieces or t.local),
            reduce_from_grads=t.reduces_in_pieces,
            aliases=t.local,
        )


# fullshard's engine: one unit is prefetched each way and the previous reduce-scatter finishes
# before the next one is issued; how units gather and reduce is the engine's own transport
# choice for the backend (on gloo: in pieces, see fullshard.engine.transport). On the CPU freed
# unsharded buffers wait in a pool for the next gather (fullshard.engine.pool): like a caching
# allocator's reserve that memory is not tensor bytes, which is what the plan predicts.
ENGINES: dict[str, EngineModel] = {
    "fullshard": EngineModel(
        name="fullshard",
        copy_out=False,
        forward_prefetch=1,
        backward_prefetch=1,
        transport=("gloo", "cpu"),
    ),
    # fullshard on NCCL: the packed transport (not yet measured on a GPU).
    "fullshard-nccl": EngineModel(
        name="fullshard-nccl",
        copy_out=True,
        forward_prefetch=1,
        backward_prefetch=1,
        transport=("nccl", "cuda"),
    ),
    # torch FSDP2 on CPU: per-parameter copy-out, no forward prefetch (no streams), backward
    # prefetch of one unit.
    "fsdp2": EngineModel(name="fsdp2", copy_out=True, forward_prefetch=0, backward_prefetch=1),
}
