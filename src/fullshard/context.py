"""StepContext: what the root coordinates across its units during one training step.

Created by lazy init (``fullshard.init.lazy_init``) on the root's first forward and shared by
every unit below it. It owns the cross-unit bookkeeping the per-unit hooks
(``fullshard.hooks.FSDPState``) consult:

- the forward order (recorded each forward; the previous one drives implicit forward prefetch)
  and the post-forward order (drives implicit backward prefetch, reversed);
- the reductions in flight (at most one by default: a unit finishes the previous unit's
  reduction before issuing its own, so its buffer is freed first; up to the largest
  ``set_reduce_scatter_max_input_buffers`` of the root's units, oldest finished first) and
  the end-of-backward callback that completes units whose backward never fired (unused
  parameters, frozen inputs);
- the ``k``-rank subgroups of int ``reshard_after_forward`` (created once per ``k``);
- the communication streams (``fullshard.streams``).

[Note: a window for small units] On the CPU a unit's collectives are exchanges between
processes whose gloo threads share the cores with the ranks' main threads: each one that a
rank blocks on costs a round of wake-ups (about half a millisecond on a 2-core VM, where a
unit of 4.5 KiB computes in tens of microseconds). With one gather ahead and one reduction in
flight, a model of many small units waits on nearly every one. So on the CPU the implicit
prefetch runs further ahead, and reductions stay in flight longer, as long as the units beyond
the next one (the prefetch) or beyond ``max_pending`` (the reductions) add up to at most
``backend.SMALL_UNIT_WINDOW_BYTES`` of unsharded memory. A unit larger than that changes nothing, so
models with units of a megabyte or more run exactly as before, and the window adds at most
that many bytes to each direction's peak. ``fullshard bench --config overhead`` (64 units of
4.5 KiB, 2 gloo ranks) steps 2.7x faster with it (BENCHMARKS.md, 2026-12-02 at 34fc753). On CUDA,
where collectives queue on their own stream without blocking the host, the window is off.
Each window is computed once per order (prefix sums), and a unit's pre-hook issues only the
part of its window no earlier unit issued, so the window costs O(1) calls per unit.
"""

from __future__ import annotations

import bisect
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from .backend import BackendPlan
from .events import emit
from .pool import HostBufferPool
from .reduce import PendingReduce, lendable_output_nbytes
from .state import TrainingState
from .streams import CommStreams

if TYPE_CHECKING:
    from .group import ParamGroup
    from .hooks import FSDPState

__all__ = ["StepContext"]


class StepContext:
    """Root-level coordination of one model's units (see the module docstring)."""

    def __init__(
        self, root: FSDPState, states: list[FSDPState], device: torch.device, plan: BackendPlan
    ) -> None:
        self.root = root
        self.states = states  # every unit, root first, in module order
        self.plan = plan  # every backend-dependent choice ([Note: the backend plan])
        self.streams = CommStreams(device, plan)
        # Freed unsharded buffers for the next gather; emptied between steps (fullshard.pool).
        self.pool = HostBufferPool(device, plan)
        self.forward_order: list[FSDPState] = []
        self.prev_forward_order: list[FSDPState] = []
        self.post_forward_order: list[FSDPState] = []
        # Positions in the orders above, so that each hook's look-up is O(1) (a unit's hooks
        # run every step; a list search made them O(units)). Rebuilt when an order changes.
        # (FSDPState hashes by identity.)
        self._forward_seen: set[FSDPState] = set()  # the units in forward_order
        self._prev_forward_index: dict[FSDPState, int] = {}  # unit -> its index there
        self._post_forward_index: dict[FSDPState, int] | None = None  # None: rebuild
        # Which units open a gradient slab this step (see _plan_slabs); None: not planned yet.
        self._slab_plan: dict[FSDPState, int] | None = None
        # [Note: a window for small units]: where each position's window ends, per order
        # (None: not computed yet), and how far this step's windows have issued gathers.
        self._fwd_ends: list[int] | None = None
        self._bwd_ends: list[int] | None = None
        self._fwd_issued = self._bwd_issued = 0
        self.pending: list[PendingReduce] = []
        # [Note: a window for small units]: bytes beyond the next gather / max_pending.
        self.window_bytes = plan.window_bytes
        self.max_pending = 1  # reductions allowed in flight (see update_max_pending)
        self.reduce_window_bytes = self.window_bytes
        self.update_max_pending()
        self.callback_queued = False
        # [Note: manual backward finalization] in fullshard.finalize: the mode this backward
        # started in (None: no backward since the iteration ended), and the token of an
        # asynchronous finalize_backward not yet waited on.
        self.manual_active: bool | None = None
        self.active_reduction: object | None = None
        self._subgroups: dict[int, tuple[dist.ProcessGroup, int]] = {}

    # --------------------------------------------------------------------------- forward
    def begin_forward(self) -> None:
        """The root's forward starts: the last forward's order becomes the prefetch plan."""
        if self.forward_order:
            self.prev_forward_order = self.forward_order
            self._prev_forward_index = {st: i for i, st in enumerate(self.forward_order)}
            self._fwd_ends = None
        first = self._first_gather_sizes()  # gradient memory set free since may serve them
        self._clear_orders()
        self.pool.clear()  # kept since a forward that had no backward
        self.pool.adopt_returned(first)  # [Note: gradient memory lent for the next forward]

    def _clear_orders(self) -> None:
        self.forward_order = []
        self._forward_seen = set()
        self.post_forward_order = []
        self._post_forward_index = None
        self._slab_plan = None
        self._fwd_issued = self._bwd_issued = 0  # window positions issued so far this step
        self._bwd_ends = None

    def record_forward(self, state: FSDPState) -> None:
        if state not in self._forward_seen:
            self._forward_seen.add(state)
            self.forward_order.append(state)

    def record_post_forward(self, state: FSDPState) -> None:
        self._bwd_ends = None  # the backward order changes
        order, index = self.post_forward_order, self._post_index()
        if state not in index:
            index[state] = len(order)
            order.append(state)
        elif order[-1] is not state:  # ran again (a reused module): it moves to the end
            order.remove(state)
            order.append(state)
            self._post_forward_index = None

    def _post_index(self) -> dict[FSDPState, int]:
        if self._post_forward_index is None:
            self._post_forward_index = {st: i for i, st in enumerate(self.post_forward_order)}
        return self._post_forward_index

    def next_in_forward(self, state: FSDPState) -> list[FSDPState]:
        """The unit that ran after ``state`` in the previous forward (implicit prefetch)."""
        order = self.prev_forward_order
        i = self._prev_forward_index.get(state)
        if i is not None and i + 1 < len(order):
            return [order[i + 1]]
        return []

    def next_in_backward(self, state: FSDPState) -> list[FSDPState]:
        """The unit whose backward runs after ``state``'s (the one before it in forward)."""
        i = self._post_index().get(state)
        if i is not None and i > 0:
            return [self.post_forward_order[i - 1]]
        return []

    def forward_window(self, state: FSDPState) -> list[FSDPState]:
        """What ``state``'s pre-forward gathers ahead (implicit prefetch): the next unit, and on
        the CPU the small ones after it that no earlier unit's window has issued yet ([Note: a
        window for small units])."""
        i = self._prev_forward_index.get(state)
        if i is None:
            return []
        order = self.prev_forward_order
        if self._fwd_ends is None:
            self._fwd_ends = self._window_ends(order)
        window, self._fwd_issued = self._slide(order, i, self._fwd_ends[i], self._fwd_issued)
        return window

    def backward_window(self, state: FSDPState) -> list[FSDPState]:
        """What ``state``'s pre-backward gathers ahead: the unit whose backward runs next, and
        on the CPU the small ones after it not issued yet."""
        i = self._post_index().get(state)
        if i is None:
            return []
        order = self.post_forward_order[::-1]  # backward order
        if self._bwd_ends is None:
            self._bwd_ends = self._window_ends(order)
        r = len(order) - 1 - i
        window, self._bwd_issued = self._slide(order, r, self._bwd_ends[r], self._bwd_issued)
        return window

    @staticmethod
    def _slide(
        order: list[FSDPState], i: int, end: int, issued: int
    ) -> tuple[list[FSDPState], int]:
        """Position ``i``'s window ``order[i + 1 : end]`` less what an earlier window issued
        (positions below ``issued``; the next unit is always included, as without a window),
        and the new ``issued``."""
        return order[i + 1 : i + 2] + order[max(i + 2, issued) : end], max(issued, end)

    def _window_ends(self, order: list[FSDPState]) -> list[int]:
        """For each position ``i`` of ``order``, where its window ends (exclusive): the next
        unit, then the units after it while they add up to at most ``window_bytes``."""
        prefix = [0]
        for st in order:
            prefix.append(prefix[-1] + st.group.unsharded_nbytes())
        n = len(order)
        ends = []
        for i in range(n):
            if i + 2 >= n or not self.window_bytes:  # no window: the next unit alone
                ends.append(min(n, i + 2))
                continue
            # the largest end with prefix[end] - prefix[i + 2] <= window_bytes
            ends.append(min(n, bisect.bisect_right(prefix, prefix[i + 2] + self.window_bytes) - 1))
        return ends

    # -------------------------------------------------------------------------- backward
    def _first_gather_sizes(self) -> list[int]:
        """Bytes of the first ``pool.capacity`` units' gathers in the last forward: the next
        forward's, which allocate before any unit frees memory."""
        sizes = (st.group.unsharded_nbytes() for st in self.forward_order[: self.pool.capacity])
        return [n for n in sizes if n]

    def slab_to_start(self, state: FSDPState) -> int:
        """Bytes of the slab ``state``'s reduction opens for its and the next units' outputs
        (0: none); see [Note: gradient memory lent for the next forward] in ``fullshard.pool``."""
        if self._slab_plan is None:
            self._slab_plan = self._plan_slabs()
        return self._slab_plan.get(state, 0)

    def _plan_slabs(self) -> dict[FSDPState, int]:
        """Which units open a slab, and of what size.

        The next forward's first gathers (the sizes of the first ``pool.capacity`` units of
        this forward) allocate before any unit frees memory. Walking the reductions from the
        last one back, each run of consecutive units whose outputs fill one of those sizes
        exactly shares a slab, opened by the run's first unit: the units reduced last, so
        that no output is allocated long before its reduction.
        """
        if not self.pool.lends:
            return {}
        wanted = self._first_gather_sizes()
        # Reductions run in reverse post-forward order, except the root's: its gradients
        # (the embedding's) come last.
        order = [st for st in reversed(self.post_forward_order) if st is not self.root]
        if self.root in self._post_index():
            order.append(self.root)
        sizes = [lendable_output_nbytes(st.group) for st in order]
        plan: dict[FSDPState, int] = {}
        end = len(order)
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
            plan[order[found]] = total
            wanted.remove(total)
            end = found
        return plan

    def ensure_end_of_backward_callback(self) -> None:
        """Queue :meth:`finish_backward` on the autograd engine (once per backward).

        Outside a backward (torch pipelining calls a unit's post-backward after its backward
        has ended) there is nothing to queue on: the caller finishes the step itself."""
        if not self.callback_queued and torch._C._current_graph_task_id() != -1:
            self.callback_queued = True
            if self.manual_active is None:
                self.manual_active = self.root.manual_backward_finalization
            torch.autograd.Variable._execution_engine.queue_callback(self.finish_backward)

    def finish_pending(self) -> None:
        """Wait for the reductions in flight and hand out their gradient shards."""
        for p in self.pending:
            p.finish()
        self.pending = []

    def update_max_pending(self) -> None:
        """One cap for the root's units, the largest any asks for (as FSDP2: a unit with a
        lower cap must not undo a higher one's retention)."""
        caps = [st.group.overrides.max_input_buffers for st in self.states]
        explicit = [c for c in caps if c is not None]
        self.max_pending = max(explicit, default=1)
        # a cap set explicitly is kept exactly ([Note: a window for small units])
        self.reduce_window_bytes = 0 if explicit else self.window_bytes

    def make_room(self, nbytes: int = 0) -> None:
        """Before a unit issues its reduction (of ``nbytes`` of unsharded gradients): finish
        the oldest ones until fewer than ``max_pending`` are in flight, or on the CPU until
        those beyond ``max_pending`` fit the window with it ([Note: a window for small
        units])."""
        while len(self.pending) >= self.max_pending:
            beyond = self.pending[self.max_pending :]  # and the new one: the extra ones
            if nbytes + sum(p.nbytes for p in beyond) <= self.reduce_window_bytes:
                return
            self.pending.pop(0).finish()

    def add_pending(self, pending: list[PendingReduce]) -> None:
        self.pending.extend(pending)

    def finish_backward(self) -> None:
        """End-of-backward callback: complete every unit, wait for reductions, reset.

        With ``set_is_last_backward(False)`` on the root, the last reductions stay in flight
        (finished by the next backward) and the backward prefetch order is kept, as in FSDP2.
        Under manual finalization they stay in flight until ``finalize_backward`` ([Note:
        manual backward finalization] in ``fullshard.finalize``).
        """
        emit("backward_end", self.root.name)
        for st in self.states:
            if st.group.params and st.training_state is not TrainingState.POST_BACKWARD:
                self.make_room(st.group.unsharded_nbytes())
                self.add_pending(st.group.reduce_grads())
        if self.root.is_last_backward and not self.manual_active:
            self.end_backward_iteration()
        else:
            for st in self.states:
                st.group.finish_backward()
                st.training_state = TrainingState.IDLE
            self.pool.clear()
            self.pool.release_unused_slabs()
        self.callback_queued = False

    def end_backward_iteration(self) -> None:
        """Wait for the reductions in flight, hand out their gradients, reshard what
        ``reshard_after_backward`` says, and give pooled memory back for the optimizer step."""
        self.finish_pending()
        self.streams.wait_host_copies()
        for st in self.states:
            st.group.finish_backward()
            st.training_state = TrainingState.IDLE
        self.pool.clear()  # the optimizer step runs with no pooled memory
        self.pool.release_unused_slabs()
        self.manual_active = None

    def reset_iter_state(self) -> None:
        """Recover from an exception mid-forward or mid-backward (``FSDPModule.reset_iter_state``).

        Waits for the reductions in flight and drops their results (the failed iteration's
        gradients are lost), brings every unit back to sharded and IDLE and forgets this
        step's orders; the previous forward order (the prefetch plan) is kept. The autograd
        engine drops queued callbacks when a backward raises, so the flag is cleared too.
        """
        for p in self.pending:
            p.handle.wait()
        self.pending = []
        for st in self.states:
            st.group.reset_iter_state()
            st.training_state = TrainingState.IDLE
            st._post_forward_calls = 0
        self.streams.wait_host_copies()
        self._clear_orders()
        self.pool.forget()
        self.callback_queued = False
        self.manual_active = None
        self.active_reduction = None  # an outstanding handle's wait() now raises

    # ------------------------------------------------------------------------- subgroups
    def post_forward_subgroup(self, group: ParamGroup, k: int) -> tuple[dist.ProcessGroup, int]:
        """Process groups of ``k`` consecutive ranks within each shard group (created once)."""
        if k not in self._subgroups:
            mesh = group.info.mesh.mesh
            rows = mesh.tolist() if mesh.dim() == 2 else [mesh.tolist()]
            ranks = [row[i : i + k] for row in rows for i in range(0, len(row), k)]
            current, _ = dist.new_subgroups_by_enumeration(ranks)
            me = dist.get_rank()
            index = next(r.index(me) for r in ranks if me in r)
            self._subgroups[k] = (current, index)
        return self._subgroups[k]
