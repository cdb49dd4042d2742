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
``keeps_after_forward``     free the unit's buffer                    keep it for the gather
(post-forward)                                                        two units on / backward
``after_backward``          free the buffer, fresh gradient outputs   keep it, or lend it (or
(post-backward)                                                       fresh memory) as a slab
``backward_ends`` / ``reset``  nothing                                empty the pool, drop slabs
``keep`` / ``lend``         ``storage.resize_(0)``                    pool / lend the memory
``refill`` (a gather)       ``storage.resize_(nbytes)``               pooled memory of that size
``reclaim`` (a gather)      gather                                    take back the unit's own
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
from typing import Generic, Protocol, TypeVar

import torch

from .backend import BackendPlan
from .order import StepOrder
from .pool import HostBufferPool
from .state import ShardedState, TrainingState
from .streamcheck import freed
from .window import InFlight, SmallUnitWindow

__all__ = ["HostStrategy", "HostUnit"]


class _Group(Protocol):
    @property
    def state(self) -> ShardedState: ...

    def unsharded_nbytes(self) -> int: ...


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
        lendable: Callable[[U], int],
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
        self._lendable = lendable  # bytes of a unit's reduce-scatter output a slab may hold
        self._slab_plan: dict[U, int] | None = None  # None: not planned this backward yet

    @classmethod
    def for_plan(
        cls, device: torch.device, plan: BackendPlan, root: U, lendable: Callable[[U], int]
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

    def keeps_after_forward(self, order: StepOrder[U], unit: U) -> bool:
        """Keep ``unit``'s memory after its forward: the unit two on (the next one's
        prefetch) gathers the same bytes, or backward's first gathers are this unit's own
        (the root, the last unit and the one before it, the last unit's backward prefetch)."""
        if self.pool is None:
            return False
        after = [a for n in order.next_in_forward(unit) for a in order.next_in_forward(n)]
        if unit is self.root or not after:
            return True
        nbytes = unit.group.unsharded_nbytes()
        return any(a.group.unsharded_nbytes() == nbytes for a in after)

    def after_backward(self, order: StepOrder[U], unit: U) -> tuple[bool, int]:
        """How ``unit``'s post-backward frees its memory: ``(keep, slab)``. ``keep``: the
        unit the next one prefetches has not been gathered for this backward yet, so the
        buffer waits in the pool for it; ``slab``: bytes of the gradient slab its reduction
        opens (0: none)."""
        if self.pool is None:
            return False, 0
        keep = any(
            after.training_state is not TrainingState.POST_BACKWARD
            and after.group.state is ShardedState.SHARDED
            for nxt in order.next_in_backward(unit)
            for after in order.next_in_backward(nxt)
        )
        if self._slab_plan is None:
            self._slab_plan = self._plan_slabs(order)
        return keep, self._slab_plan.get(unit, 0)

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
    def keep(self, storage: torch.UntypedStorage, content: object) -> None:
        """Free ``storage`` into the pool (``content``: what it holds, for :meth:`reclaim`)."""
        if self.pool is None:
            freed(storage, "a unit's unsharded buffer")
            storage.resize_(0)
            return
        self.pool.put(storage, content)

    def open_slab(self, storage: torch.UntypedStorage | None, nbytes: int) -> None:
        """Open a gradient slab of ``nbytes``: ``storage``'s memory (left at 0 bytes) or, with
        ``None``, fresh memory."""
        if self.pool is None or not self.lends:
            if storage is not None:
                freed(storage, "a unit's unsharded buffer")
                storage.resize_(0)
            return
        self.pool.start_slab(storage, nbytes)

    def refill(self, storage: torch.UntypedStorage, nbytes: int) -> str:
        """Give a gather's (0-byte) ``storage`` ``nbytes``: pooled memory if some has that
        size; ``"recycled"``, ``"fresh"`` or ``""`` (it had them)."""
        if self.pool is None:
            if storage.nbytes() == nbytes:
                return ""
            storage.resize_(nbytes)
            return "fresh"
        return self.pool.take(storage, nbytes)

    def reclaim(
        self, storage: torch.UntypedStorage, nbytes: int, matches: Callable[[object], bool]
    ) -> bool:
        """Take back pooled memory that still holds the gather (see
        [Note: taking back a unit's own gathered memory])."""
        return self.pool is not None and self.pool.reclaim(storage, nbytes, matches)

    @property
    def filling_slab(self) -> bool:
        """A gradient slab is open for reduce-scatter outputs."""
        return self.pool is not None and self.pool.filling_slab

    def grad_output(self, numel: int, dtype: torch.dtype) -> torch.Tensor | None:
        """A reduce-scatter output carved from the open slab, or ``None`` (none open, or not
        enough room left in it)."""
        return None if self.pool is None else self.pool.grad_output(numel, dtype)

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
        sizes = [self._lendable(st) for st in units]
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
