"""``FSDP.summon_full_params``: full parameters on the modules for the length of a block.

Each unit's sharded parameters (``DTensor``) are all-gathered one at a time in their own dtype
(full precision under mixed precision, as FSDP1) and registered on every module that holds
them as plain ``nn.Parameter``s of the full shape; on exit the sharded parameters are
registered again. With ``writeback`` each rank first copies its rows of the (possibly
modified) full parameters into its shard; a unit of one-rank shard groups (``NO_SHARD``)
keeps modifications regardless, as FSDP1 notes. ``rank0_only`` gives the full parameters to
rank 0 only (the others keep their shards); ``offload_to_cpu`` puts them on the CPU;
``with_grads`` gives them their full gradients, written back as the parameters are. A unit
that was unsharded on entry (the root between forward and backward) is unsharded again on exit,
as FSDP1 leaves it: its modules show the same parameters, and gradients, as before the block.

FSDP1's refusals are kept (``writeback`` with ``rank0_only``, ``offload_to_cpu`` under
``NO_SHARD``, ``with_grads`` with ``offload_to_cpu``); ``with_grads`` works whatever
``use_orig_params`` says, since fullshard always keeps the original parameters.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import ShardingStrategy
from torch.distributed.tensor import DTensor

from ..checkpoint.shards import local_box, slices
from ..engine import FSDPState, ParamGroup, ShardedParam, ShardedState, TrainingState
from .writeback import write_back

__all__ = ["check_summon_args", "summon", "summon_wrappers"]


@dataclass(frozen=True)
class _Options:
    writeback: bool
    rank0_only: bool
    offload_to_cpu: bool
    with_grads: bool


def check_summon_args(
    writeback: bool, rank0_only: bool, offload_to_cpu: bool, with_grads: bool, no_shard: bool
) -> None:
    """FSDP1's refusals (its exception types and messages)."""
    if with_grads and offload_to_cpu:
        raise NotImplementedError(
            f"with_grads={with_grads}, offload_to_cpu={offload_to_cpu} is not supported yet"
        )
    if offload_to_cpu and no_shard:
        raise NotImplementedError("offload_to_cpu=True and NO_SHARD is not supported yet")
    if writeback and rank0_only:
        raise NotImplementedError("writeback=True and rank0_only=True is not supported yet")


@contextlib.contextmanager
def summon_wrappers(
    wrappers: Sequence[Any],
    writeback: bool,
    rank0_only: bool,
    offload_to_cpu: bool,
    with_grads: bool,
) -> Iterator[None]:
    """``FullyShardedDataParallel.summon_full_params`` over ``wrappers``: FSDP1's checks and
    messages, what was changed by hand written back first (``fullshard.fsdp1.writeback``),
    then :func:`summon` of their units, each wrapper in ``SUMMON_FULL_PARAMS`` meanwhile."""
    no_shard = any(
        w.sharding_strategy is ShardingStrategy.NO_SHARD and w._has_params for w in wrappers
    )
    check_summon_args(writeback, rank0_only, offload_to_cpu, with_grads, no_shard)
    for w in wrappers:
        if w.training_state.name == "FORWARD_BACKWARD":
            raise AssertionError("Cannot manually unshard parameters during forward/backward")
        if w.training_state.name == "SUMMON_FULL_PARAMS":
            raise AssertionError(
                "Cannot manually unshard parameters when already unsharding parameters"
            )
    strategies = {id(w._unit.group): w._strategy for w in wrappers}

    def changed_by_hand(group: ParamGroup) -> None:
        write_back(group, strategies[id(group)])

    units = [w._unit for w in wrappers]
    with summon(units, writeback, rank0_only, offload_to_cpu, with_grads, before=changed_by_hand):
        for w in wrappers:
            w._summoning = True
        try:
            yield
        finally:
            for w in wrappers:
                w._summoning = False


@contextlib.contextmanager
def summon(
    states: Sequence[FSDPState],
    writeback: bool,
    rank0_only: bool,
    offload_to_cpu: bool,
    with_grads: bool,
    before: Callable[[ParamGroup], None] | None = None,
) -> Iterator[None]:
    """Full parameters of every unit in ``states`` inside the block (see the docstring);
    ``before`` runs on each unit's group once it shows its sharded parameters, first."""
    for st in states:
        if st.training_state is not TrainingState.IDLE:
            raise ValueError(
                f"expected to be in states [TrainingState.IDLE] but current state is "
                f"{st.training_state} (unit {st.name!r}): summon_full_params cannot run "
                f"inside a forward or backward"
            )
    # units left unsharded (a root between forward and backward) are unsharded again on exit
    unsharded = [st for st in states if st.group.state is not ShardedState.SHARDED]
    for st in states:
        st.reshard_if_idle()
        if before is not None:
            before(st.group)
    options = _Options(writeback, rank0_only, offload_to_cpu, with_grads)
    swapped: list[tuple[ShardedParam, nn.Parameter]] = []
    try:
        for st in states:
            swapped += _unshard(st.group.params, options)
        yield
    finally:
        with torch.no_grad():
            for sp, full in swapped:
                if writeback or sp.info.shard_size == 1:
                    _write_back(sp, full)
                sp.to_sharded()
        for st in unsharded:
            st.group.wait_for_unshard()


def _write_back(sp: ShardedParam, full: nn.Parameter) -> None:
    """Copy this rank's rows of the full parameter, and of its full gradient when it was
    given one (``with_grads``), into the shards."""
    box = slices(local_box(sp.sharded_param, sp.fqn))
    sp.local.copy_(full.detach()[box])
    grad = sp.sharded_param.grad
    if full.grad is not None and isinstance(grad, DTensor):
        grad.to_local().copy_(full.grad[box])


def _unshard(
    params: list[ShardedParam], options: _Options
) -> list[tuple[ShardedParam, nn.Parameter]]:
    keep = not options.rank0_only or dist.get_rank() == 0
    out = []
    for sp in params:
        sharded = sp.sharded_param
        data = cast(DTensor, sharded.detach()).full_tensor()
        grad = cast(DTensor | None, sharded.grad)
        full_grad = grad.full_tensor() if options.with_grads and grad is not None else None
        if not keep:
            continue
        if options.offload_to_cpu:
            data = data.cpu()
        full = nn.Parameter(data, requires_grad=sharded.requires_grad)
        full.grad = full_grad
        for module, name in sp.refs:
            module._parameters[name] = full
        out.append((sp, full))
    return out
