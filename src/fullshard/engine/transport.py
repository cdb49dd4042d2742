"""Transport: how one unit gathers its parameters and reduces its gradients.

[Note: transports]
Two ways to move a unit's bytes, with the same results:

- ``packed``: one rank-major buffer per collective. The all-gather gathers in place (this rank's
  slot of the output is the input), then each parameter is copied out; gradients are packed
  into one reduce-scatter input. This is what NCCL runs, and what a low-precision wire dtype
  and int ``reshard_after_forward`` need (see ``fullshard.engine.gather``).
- ``p2p`` ("in pieces"): point-to-point exchanges that receive each peer's shard of each
  parameter straight into the unsharded buffer and send each gradient piece straight from the
  gradient — no packed buffer, no copies. On gloo it is 2-3x faster than gloo's collectives
  (``python benchmarks/collectives.py``); where a unit needs packing (int8 wire, fp16
  pre-division, a reduce dtype other than the gradients') it packs for that collective.

A unit whose shard group is one rank (and whose gathered and stored forms agree: same dtype,
no offload, no replicas, no wire dtype) moves nothing at all: its transport is ``local``
(see [Note: a shard group of one rank] below).

``auto`` keeps what measured best: on gloo (CPU tensors), for units of at least
``backend.P2P_MIN_BYTES`` (512 KiB unsharded; below it a message's round trip costs more
than the copies saved), gathers in pieces up to 8 ranks and reductions in pieces on 2 ranks
(on more, a p2p reduce-scatter needs N - 2 chunks of scratch, +30 MiB peak RSS per rank at
N = 4 on ``fullshard bench --config memory``); packed everywhere else (NCCL). A packed
buffer's collective on gloo may itself be one p2p message per peer (on 2 ranks, up to
``backend.P2P_SMALL_BYTES``: see ``BackendPlan.algorithm``, a pure function of the buffer's
size). A unit chooses once, at lazy init (:func:`select_transport`, from its root's backend
plan: [Note: the backend plan]), and keeps packed a direction its settings need one buffer
for (a custom collective, an int8 or other wire dtype, fp16's split division); a setter that
changes one of those decides again (:func:`decide`). A gather or a reduction
only reads the decision (the kept copy of an int ``reshard_after_forward``, regathered within
its subgroup, and gradients that cannot be sent as they are, are packed). The planner's
engine model (``fullshard.memory.planner``) and the benchmarks' variants use the same
function.

[Note: a shard group of one rank]
With one rank in the shard group (world size 1, or ``mesh`` of size 1) each shard is
the whole parameter. When the unsharded form would hold the same values in the same
dtype on the same device (no ``param_dtype`` or reduce dtype other than the
parameters', no offload, no wire dtype, no replicas to all-reduce with, no
tensor-parallel or all-gather-extension parameters), the unit's transport is
``local``: each unsharded ``nn.Parameter`` is created once as an alias of its shard's
local tensor (same storage and version counter), so gathering is a no-op and
resharding frees nothing; the modules still swap between the sharded ``DTensor`` and
the plain alias (users and optimizers see ``DTensor`` parameters, the module computes
on plain tensors). The gradient autograd accumulates on the alias becomes the sharded
gradient as it is (divided by ``gradient_divide_factor`` if one is set): no packing,
no collective, no copy (``fullshard.engine.reduce.hand_out_local``). A shard replaced after
lazy init (``to_empty``, a ``swap_tensors`` conversion) is re-aliased on the next
unshard. The memory planner models the same choice (``select_transport``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, Protocol

import torch

from . import pieces
from .backend import BackendPlan
from .p2p import P2PAllGather, P2PReduceScatter, packed_comms
from .reduce import ReduceUnit, grad_division

__all__ = ["TRANSPORTS", "Transport", "aliasable", "decide", "select_transport"]

TRANSPORTS = ("auto", "packed", "p2p")


@dataclass(frozen=True)
class Transport:
    """The chosen way for one unit: per direction, in pieces (p2p) or packed; and the comm
    objects its packed buffers' collectives run through (``None``: the backend's own).

    The core reads only :attr:`gather` / :attr:`reduce` (a plug-in's way of moving the whole
    unit, else packed) and :attr:`all_gather` / :attr:`reduce_scatter` (a plug-in's comm for
    the packed buffers, else the backend's collectives): on CUDA all four are ``None``."""

    requested: str  # what the CommPolicy asked for: auto | packed | p2p
    gathers_in_pieces: bool
    reduces_in_pieces: bool
    # One rank, nothing to move: the unsharded parameters alias the shards.
    local: bool = False
    # the plan's comms for packed buffers (fullshard.engine.p2p); None: the backend's
    comms: tuple[P2PAllGather, P2PReduceScatter] | None = None

    def packing(self, gathers: bool, reductions: bool) -> Transport:
        """This transport with the directions a unit's settings need one buffer for (a custom
        collective, a wire dtype, fp16's split division) kept packed."""
        if not ((self.gathers_in_pieces and gathers) or (self.reduces_in_pieces and reductions)):
            return self
        return replace(
            self,
            gathers_in_pieces=self.gathers_in_pieces and not gathers,
            reduces_in_pieces=self.reduces_in_pieces and not reductions,
        )

    @property
    def gather(self) -> Callable[[Any], Any] | None:
        """The unit's own gather (``fullshard.engine.pieces.gather``), or ``None``: packed."""
        return pieces.gather if self.gathers_in_pieces else None

    @property
    def reduce(self) -> Callable[..., Any] | None:
        """The unit's own reduction (``fullshard.engine.pieces.reduce``), or ``None``."""
        return pieces.reduce if self.reduces_in_pieces else None

    @property
    def all_gather(self) -> P2PAllGather | None:
        """The comm a packed all-gather runs through (``None``: the backend's collective)."""
        return self.comms[0] if self.comms else None

    @property
    def reduce_scatter(self) -> P2PReduceScatter | None:
        """The comm a packed reduce-scatter runs through (``None``: the backend's)."""
        return self.comms[1] if self.comms else None

    @property
    def name(self) -> str:
        """``local``, ``packed``, ``p2p`` or ``mixed`` (gathers in pieces, reductions packed)."""
        if self.local:
            return "local"
        if self.gathers_in_pieces and self.reduces_in_pieces:
            return "p2p"
        if not self.gathers_in_pieces and not self.reduces_in_pieces:
            return "packed"
        return "mixed"


def select_transport(
    requested: str,
    backend: str,
    device_type: str,
    shard_size: int,
    unit_bytes: int,
    *,
    aliasable: bool = False,
    plan: BackendPlan | None = None,
) -> Transport:
    """The transport for a unit of ``unit_bytes`` (its unsharded size) sharded over
    ``shard_size`` ranks of a ``backend`` group.

    ``aliasable``: the unit's unsharded parameters could be its shards themselves (same dtype,
    same device, no replicas, no wire dtype); with one rank the transport is then ``local``.
    ``plan``: the root's backend plan (default: the plan for ``device_type`` and ``backend``),
    which says whether ``auto`` may move bytes in pieces ([Note: the backend plan]). A pure
    function of its arguments (no process group needed), so the memory planner models
    exactly what the engine will run.
    """
    if requested not in TRANSPORTS:
        raise ValueError(f"CommPolicy.transport must be one of {TRANSPORTS}, got {requested!r}")
    if shard_size == 1 and aliasable:
        return Transport(requested, False, False, local=True)
    plan = plan or BackendPlan.choose(device_type, backend)
    comms = packed_comms(plan)
    if requested == "packed" or shard_size == 1:
        return Transport(requested, False, False, comms=comms)
    if requested == "p2p":
        return Transport(requested, True, True, comms=comms)
    return Transport(
        requested,
        gathers_in_pieces=plan.gathers_in_pieces(shard_size, unit_bytes),
        reduces_in_pieces=plan.reduces_in_pieces(shard_size, unit_bytes),
        comms=comms,
    )


class _Deciding(ReduceUnit, Protocol):
    """What a unit's transport decision reads of it (``ParamGroup`` is one)."""

    total: int

    @property
    def extended(self) -> object | None:
        """The unit's all-gather-extension parameters' gather (None: none)."""

    @property
    def layout(self) -> list[Any]: ...

    def compute_dtype(self) -> torch.dtype: ...

    def accum_dtype(self) -> torch.dtype: ...

    def wire_gather_dtype(self) -> torch.dtype: ...


def decide(g: _Deciding, may_alias: bool) -> Transport:
    """The unit's one decision of how each direction moves: :func:`select_transport`'s choice
    for its size and its root's plan, kept packed where the unit's settings need one buffer (a
    custom collective takes packed buffers; a wire dtype other than the compute dtype, or an
    fp16 division split around the reduction, converts the packed buffer). Made at lazy init
    and again when such a setting changes (``ParamGroup.settings_changed``); a gather or a
    reduction only reads it."""
    t = select_transport(
        g.comm_policy.transport,
        g.comm.plan.backend,
        g.comm.plan.device_type,
        g.world,
        g.world * g.total * g.compute_dtype().itemsize,
        aliasable=may_alias,
        plan=g.comm.plan,
    )
    if t.local:
        return t
    return t.packing(
        gathers=g.overrides.all_gather is not None or g.wire_gather_dtype() != g.compute_dtype(),
        reductions=g.overrides.reduce_scatter is not None
        or grad_division(g, g.wire_reduce_dtype()).pre != 1.0,
    )


def aliasable(g: _Deciding) -> bool:
    """Whether the unit's unsharded parameters can be its shards themselves ([Note: a shard
    group of one rank])."""
    dtype = g.compute_dtype()
    cp = g.comm_policy
    return (
        g.world == 1
        and g.info.replicate_size == 1
        and not g.offloaded
        and g.extended is None
        and g.overrides.allows_local()
        and g.accum_dtype() == dtype
        and cp.all_gather_dtype in (None, dtype)
        and cp.reduce_dtype in (None, dtype)
        and all(
            sp.tp_mesh is None and sp.orig_dtype == dtype and sp.local.device == g.device
            for sp in g.layout
        )
    )
