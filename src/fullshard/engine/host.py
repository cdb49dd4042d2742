"""HostStrategy: every CPU-only memory and ordering special case of one root, in one object.

[Note: the host strategy]
The core of the engine is FSDP2's path, the one CUDA runs: per unit one all-gather into a
freshly allocated unsharded buffer, one reduce-scatter into a fresh output, buffers freed by
resizing their storage to 0 bytes, the next unit prefetched. On the CPU (gloo) four measured
special cases change *where memory comes from* and *how far ahead the step runs*; they live
here, and the core calls this object at a few named points (and nowhere else asks whether it
runs on the CPU). On CUDA, and on the CPU with every one of them switched off
(``CommPolicy(cpu_fast_paths_off=...)``), the root has no host strategy: ``comm.host`` is
``None`` and the core runs alone.

==========================  ========================================  ==========================
point (caller)              what the core does without a strategy     what the strategy adds
==========================  ========================================  ==========================
``forward_begins``          nothing                                   empty the pool; adopt lent
(``StepContext``)                                                     gradient slabs for the
                                                                      first gathers
``forward_without_backward``  nothing                                 empty the pool
``after_forward``           free the unit's buffer                    ``Release.HOLD``: keep it
(post-forward)                                                        for the gather two units
                                                                      on / backward
``after_backward``          free the buffer, fresh gradient outputs   an ``AfterBackward``: hold
(post-backward)                                                       it, or give it (or fresh
                                                                      memory) to the gradients
``backward_ends`` / ``reset``  nothing                                empty the pool, drop slabs
``release`` (a reshard)     ``storage.resize_(0)``                    pool / lend the memory
``refill`` (a gather)       ``storage.resize_(nbytes)``               pooled memory of that size
``take_back`` (a gather)    gather                                    take back the unit's own
                                                                      gathered memory, no
                                                                      collective
``grad_output``             ``torch.empty``                           carve from the open slab
``prefetch_forward`` /      the next unit (``StepOrder.next_in_*``)   and small units further
``prefetch_backward``                                                 ahead (the window)
(pre-forward/-backward)
``room_for_reduction``      finish the oldest until fewer than        leave small ones in
(``make_room``)             ``max_pending`` are in flight             flight (the window)
==========================  ========================================  ==========================

The pool's mechanics (storages swapped, content tokens, slabs) are
``fullshard.engine.pool``'s Notes; the window is [Note: a window for small units] in
``fullshard.engine.window``. The transports (pieces, p2p collectives) are per-unit choices made
once at lazy init ([Note: transports] in ``fullshard.engine.transport``). Every special case
keeps the core's results bit for bit: the parity matrix runs with and without the strategy.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import Enum, auto
from typing import Any, Generic, Protocol, TypeVar

import torch

from .backend import BackendPlan
from .order import StepOrder
from .pool import HostBufferPool
from .state import ShardedState, TrainingState
from .window import InFlight, SmallUnitWindow

__all__ = ["AfterBackward", "BufferContent", "HostStrategy", "HostUnit", "Release"]


class Release(Enum):
    """How a unit's unsharded memory is released: what the core does (``FREE``: resize its
    storage to 0 bytes), or handed to the host strategy for a named use."""

    FREE = auto()
    HOLD = auto()  # held for a later gather of the same size (or of this unit: taken back)
    GRADIENTS = auto()  # given to the next reduce-scatter outputs (the next forward's gathers)

    def for_children(self) -> Release:
        """What a unit's child groups (other meshes / dtypes) do: hold, or free."""
        return self if self is Release.HOLD else Release.FREE


@dataclass(frozen=True, eq=False)
class BufferContent:
    """What a freed unsharded buffer holds: ``group``'s gather of these shards (each
    parameter's DTensor and local tensor) at these version counters ([Note: taking back a
    unit's own gathered memory] in ``fullshard.engine.pool``)."""

    group: object  # the ParamGroup (fullshard.engine.group imports this module)
    shards: tuple[torch.Tensor, ...]
    versions: tuple[int, ...]

    @classmethod
    def of(cls, group: object, shards: tuple[torch.Tensor, ...]) -> BufferContent:
        """``group``'s gather of ``shards`` as they are now."""
        return cls(group, shards, tuple(t._version for t in shards))

    def is_current(self, group: object, shards: tuple[torch.Tensor, ...]) -> bool:
        """Still ``group``'s gather of ``shards``: the same tensors, none written since."""
        return (
            self.group is group
            and len(shards) == len(self.shards)
            and all(
                a is b and a._version == v for a, b, v in zip(shards, self.shards, self.versions)
            )
        )


class _Group(Protocol):
    @property
    def state(self) -> ShardedState: ...

    def unsharded_nbytes(self) -> int: ...

    def buffer_content(self) -> BufferContent | None:
        """What the unsharded buffer holds, if a later gather may take it back."""


class HostUnit(Protocol):
    """What the strategy reads of a unit."""

    @property
    def group(self) -> _Group: ...

    @property
    def training_state(self) -> TrainingState: ...

    def __hash__(self) -> int: ...


U = TypeVar("U", bound=HostUnit)


class HostStrategy(Generic[U]):
    """The CPU special cases of one root (see [Note: the host strategy])."""

    def __init__(
        self,
        device: torch.device,
        plan: BackendPlan,
        root: U,
        lendable: Callable[[Any], int],
    ) -> None:
        self.root = root
        # [Note: a window for small units] (fullshard.engine.window); None: one unit ahead
        self.window: SmallUnitWindow[U] | None = (
            SmallUnitWindow(_gathered_nbytes, plan.window_bytes) if plan.window_bytes else None
        )
        # [Note: recycling unsharded buffers] (fullshard.engine.pool)
        self.pool: HostBufferPool | None = HostBufferPool(device) if plan.buffer_pool else None
        # [Note: gradient memory lent for the next forward]
        self.lends = plan.grad_slabs and self.pool is not None
        self._lendable = lendable  # bytes of a group's reduce-scatter output a slab may hold
        self._slab_plan: dict[U, int] | None = None  # None: not planned this backward yet

    @classmethod
    def for_plan(
        cls, device: torch.device, plan: BackendPlan, root: U, lendable: Callable[[Any], int]
    ) -> HostStrategy[U] | None:
        """The root's strategy, or ``None`` where the plan has no host special case (CUDA,
        and the CPU with all of them switched off): the core alone."""
        if not (plan.buffer_pool or plan.window_bytes):
            return None
        return cls(device, plan, root, lendable)

    # ------------------------------------------------------------- the step's named points
    def forward_begins(self, order: StepOrder[U]) -> None:
        """The root's forward starts (before ``order`` turns the last forward into the
        plan): memory pooled since a forward without backward goes; lent gradient slabs
        nothing holds any more become memory for the first gathers; the window starts over."""
        self._slab_plan = None
        if self.window is not None:
            self.window.new_step()
        if self.pool is None:
            return
        first = self._first_gather_sizes(order)
        self.pool.clear()
        self.pool.adopt_returned(first)

    def forward_without_backward(self) -> None:
        """The root's forward ran without gradients: no gather comes soon."""
        if self.pool is not None:
            self.pool.clear()

    def after_forward(self, order: StepOrder[U], unit: U) -> Release:
        """How ``unit``'s post-forward reshard releases its memory: held when the unit two on
        (the next one's prefetch) gathers the same bytes, or backward's first gathers are this
        unit's own (the root, the last unit and the one before it, the last unit's backward
        prefetch); else freed."""
        if self.pool is None:
            return Release.FREE
        after = [a for n in order.next_in_forward(unit) for a in order.next_in_forward(n)]
        if unit is self.root or not after:
            return Release.HOLD
        nbytes = unit.group.unsharded_nbytes()
        same = any(a.group.unsharded_nbytes() == nbytes for a in after)
        return Release.HOLD if same else Release.FREE

    def after_backward(self, order: StepOrder[U], unit: U) -> AfterBackward | None:
        """How ``unit``'s post-backward releases its memory (``None``: the core's way, freed
        and no slab). The
        buffer is held where the unit the next one prefetches has not been gathered for this
        backward yet; the slab plan may open a gradient slab for its reduction."""
        if self.pool is None:
            return None
        hold = any(
            after.training_state is not TrainingState.POST_BACKWARD
            and after.group.state is ShardedState.SHARDED
            for nxt in order.next_in_backward(unit)
            for after in order.next_in_backward(nxt)
        )
        if self._slab_plan is None:
            self._slab_plan = self._plan_slabs(order)
        slab = self._slab_plan.get(unit, 0)
        return AfterBackward(self, hold, slab) if hold or slab else None

    def backward_ends(self) -> None:
        """A backward ended: the optimizer step runs with no pooled memory; slabs no
        gradient holds go back."""
        if self.pool is not None:
            self.pool.clear()
            self.pool.release_unused_slabs()

    def reset(self) -> None:
        """``reset_iter_state``: forget everything pooled and lent, and what the window issued."""
        self._slab_plan = None
        if self.window is not None:
            self.window.new_step()
        if self.pool is not None:
            self.pool.forget()

    def prefetch_forward(self, order: StepOrder[U], unit: U) -> list[U]:
        """What ``unit``'s pre-forward gathers ahead (implicit prefetch): the next unit, and
        with the window the small ones after it ([Note: a window for small units])."""
        if self.window is None:
            return order.next_in_forward(unit)
        return self.window.forward(order, unit)

    def prefetch_backward(self, order: StepOrder[U], unit: U) -> list[U]:
        """What ``unit``'s pre-backward gathers ahead: the unit whose backward runs next,
        and with the window the small ones after it."""
        if self.window is None:
            return order.next_in_backward(unit)
        return self.window.backward(order, unit)

    def room_for_reduction(self, beyond: Sequence[InFlight], nbytes: int) -> bool:
        """Whether a reduction of ``nbytes`` may be issued with ``beyond`` (the reductions in
        flight past the context's ``max_pending``) left in flight: only with the window, while
        they fit it."""
        return self.window is not None and self.window.room_for_reduction(beyond, nbytes)

    # -------------------------------------------------------------------- the buffers
    def release(self, storage: torch.UntypedStorage, how: Release, group: _Group) -> bool:
        """Take ``group``'s unsharded ``storage`` as ``how`` says: ``True`` when the strategy
        took it (left at 0 bytes), ``False`` when the core frees it."""
        if self.pool is None:
            return False
        if how is Release.HOLD:
            self.pool.put(storage, group.buffer_content())
            return True
        if how is Release.GRADIENTS and self.lends and storage.nbytes() == group.unsharded_nbytes():
            self.pool.start_slab(storage, storage.nbytes())
            return True
        return False

    def refill(self, storage: torch.UntypedStorage, nbytes: int) -> str:
        """Give a gather's (0-byte) ``storage`` held memory of ``nbytes`` if some has that
        size: ``"recycled"`` (the event's detail), or ``""`` when the core allocates it."""
        return "recycled" if self.pool is not None and self.pool.take(storage, nbytes) else ""

    def take_back(
        self, storage: torch.UntypedStorage, nbytes: int, matches: Callable[[object], bool]
    ) -> bool:
        """Give a gather's (0-byte) ``storage`` held memory that still holds the gather
        (``matches`` its content), in place of gathering (see [Note: taking back a unit's own
        gathered memory] in ``fullshard.engine.pool``)."""
        return self.pool is not None and self.pool.reclaim(storage, nbytes, matches)

    def grad_output(self, group: object, numel: int, dtype: torch.dtype) -> torch.Tensor | None:
        """A reduce-scatter output of ``group`` carved from the open gradient slab, or
        ``None`` (none open, an output that does not become the gradients as it is, or not
        enough room left)."""
        if self.pool is None or not self.pool.filling_slab or not self._lendable(group):
            return None
        return self.pool.grad_output(numel, dtype)

    def _open_slab(self, nbytes: int) -> None:
        """Open a gradient slab of ``nbytes`` of fresh memory."""
        if self.pool is not None and self.lends:
            self.pool.start_slab(None, nbytes)

    # -------------------------------------------------------------------- the slab plan
    def _first_gather_sizes(self, order: StepOrder[U]) -> list[int]:
        """Bytes of the first ``pool.capacity`` units' gathers in the last forward: the next
        forward's, which allocate before any unit frees memory."""
        assert self.pool is not None
        sizes = (st.group.unsharded_nbytes() for st in order.forward[: self.pool.capacity])
        return [n for n in sizes if n]

    def _plan_slabs(self, order: StepOrder[U]) -> dict[U, int]:
        """Which units open a slab, and of what size.

        The next forward's first gathers (the sizes of the first ``pool.capacity`` units of
        this forward) allocate before any unit frees memory. Walking the reductions from the
        last one back, each run of consecutive units whose outputs fill one of those sizes
        exactly shares a slab, opened by the run's first unit: the units reduced last, so
        that no output is allocated long before its reduction.
        """
        if not self.lends:
            return {}
        wanted = self._first_gather_sizes(order)
        # Reductions run in reverse post-forward order, except the root's: its gradients
        # (the embedding's) come last.
        units = [st for st in reversed(order.post_forward) if st is not self.root]
        if order.ran_post_forward(self.root):
            units.append(self.root)
        sizes = [self._lendable(st.group) for st in units]
        plan: dict[U, int] = {}
        end = len(units)
        while end > 0 and wanted:
            total, found = 0, -1
            for start in range(end - 1, -1, -1):
                if not sizes[start]:
                    break
                total += sizes[start]
                if total in wanted:
                    found = start
                    break
                if total > max(wanted):
                    break
            if found < 0:
                end -= 1
                continue
            plan[units[found]] = total
            wanted.remove(total)
            end = found
        return plan


def _gathered_nbytes(unit: HostUnit) -> int:
    return unit.group.unsharded_nbytes()


class AfterBackward:
    """How one unit's post-backward releases its memory (:meth:`HostStrategy.after_backward`):
    held for the next gather, or given to its reduction's outputs as a gradient slab of
    ``slab`` bytes (its own buffer where it is that size, else fresh memory)."""

    __slots__ = ("_given", "_host", "hold", "slab")

    def __init__(self, host: HostStrategy[Any], hold: bool, slab: int) -> None:
        self._host, self.hold, self.slab, self._given = host, hold, slab, False

    def release(self, reduces: bool, resharding: bool, nbytes: int) -> Release:
        """How the unit's buffer (of ``nbytes``) is released before its reduction
        (``reduces``: it has gradients to reduce; ``resharding``: it reshards now)."""
        if not reduces:  # nothing to reduce (gradient sync off, no gradients): no slab
            self.slab = 0
        # the unit's own freed buffer, where it is that size and no gather takes it
        self._given = bool(self.slab) and self.slab == nbytes and not self.hold and resharding
        if self.hold:
            return Release.HOLD
        return Release.GRADIENTS if self._given else Release.FREE

    def before_reductions(self) -> None:
        """The unit's reductions are next: open the slab in fresh memory if the unit's own
        buffer did not become it."""
        if self.slab and not self._given:
            self._host._open_slab(self.slab)
