"""SmallUnitWindow: on the CPU, how far ahead small units are gathered and reduced.

Part of the root's host strategy (:class:`~fullshard.engine.host.HostStrategy`, which asks it
at its ``prefetch_forward`` / ``prefetch_backward`` / ``room_for_reduction`` points); the
core's prefetch is one unit ahead (:class:`~fullshard.engine.order.StepOrder`'s
``next_in_forward`` / ``next_in_backward``) and its reductions are at most ``max_pending`` in
flight.

[Note: a window for small units]
On the CPU a unit's collectives are exchanges between processes whose gloo threads share the
cores with the ranks' main threads: each one that a rank blocks on costs a round of wake-ups
(about half a millisecond on a 2-core VM, where a unit of 4.5 KiB computes in tens of
microseconds). With one gather ahead and one reduction in flight, a model of many small units
waits on nearly every one. So on the CPU the implicit prefetch runs further ahead, and
reductions stay in flight longer (``StepContext.make_room`` asks :meth:`room_for_reduction`),
as long as the units beyond the next one (the prefetch) or beyond ``max_pending`` (the
reductions) add up to at most ``backend.SMALL_UNIT_WINDOW_BYTES`` of unsharded memory. A unit
larger than that changes nothing, so models with units of a megabyte or more run as they would
without it, and the window adds at most that many bytes to each direction's peak. A
reduction cap set with ``set_reduce_scatter_max_input_buffers`` is kept exactly (the context
does not ask the window then). ``fullshard bench --config overhead`` (64 units of 4.5 KiB, 2
gloo ranks) steps 2.7x faster with it (BENCHMARKS.md, 2026-12-02 at 34fc753). On CUDA, where
collectives queue on their own stream without blocking the host, there is no window
(``BackendPlan.window_bytes`` is 0, and no host strategy). Each window is computed once per
order (prefix sums), and a unit's pre-hook issues only the part of its window no earlier unit
issued, so the window costs O(1) calls per unit.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Hashable, Sequence
from typing import Generic, Protocol, TypeVar

from .order import StepOrder

__all__ = ["SmallUnitWindow"]

U = TypeVar("U", bound=Hashable)


class InFlight(Protocol):
    """A reduction in flight, as the window reads it."""

    @property
    def nbytes(self) -> int:
        """The reducing unit's unsharded bytes."""


class SmallUnitWindow(Generic[U]):
    """The prefetch and reduction windows of one root (see the Note).

    ``nbytes(unit)`` is a unit's gathered size (the window's measure); ``window_bytes`` the
    bytes allowed beyond the next unit (the prefetch) and beyond ``max_pending`` reductions."""

    def __init__(self, nbytes: Callable[[U], int], window_bytes: int) -> None:
        self._nbytes = nbytes
        self.window_bytes = window_bytes
        # Where each position's window ends, per order, and the order it was computed for:
        # the forward's plan (``prev_forward``, replaced, never changed, when a forward
        # begins) by identity; the backward order by the order's revision.
        self._fwd_order: list[U] | None = None
        self._fwd_ends: list[int] = []
        self._bwd_revision = -1
        self._bwd_ends: list[int] = []
        # How far this step's windows have issued gathers (positions in each order).
        self._fwd_issued = self._bwd_issued = 0

    def new_step(self) -> None:
        """A forward begins, or the step is reset: no window has issued anything yet."""
        self._fwd_issued = self._bwd_issued = 0

    def forward(self, order: StepOrder[U], unit: U) -> list[U]:
        """What ``unit``'s pre-forward gathers ahead: the next unit, and the small ones after
        it that no earlier unit's window has issued yet."""
        i = order.position_in_prev_forward(unit)
        if i is None:
            return []
        plan = order.prev_forward
        if self._fwd_order is not plan:
            self._fwd_order, self._fwd_ends = plan, self._ends(plan)
        window, self._fwd_issued = _slide(plan, i, self._fwd_ends[i], self._fwd_issued)
        return window

    def backward(self, order: StepOrder[U], unit: U) -> list[U]:
        """What ``unit``'s pre-backward gathers ahead: the unit whose backward runs next, and
        the small ones after it not issued yet."""
        i = order.position_in_post_forward(unit)
        if i is None:
            return []
        backward = order.post_forward[::-1]
        if self._bwd_revision != order.revision:
            self._bwd_revision, self._bwd_ends = order.revision, self._ends(backward)
        r = len(backward) - 1 - i
        window, self._bwd_issued = _slide(backward, r, self._bwd_ends[r], self._bwd_issued)
        return window

    def room_for_reduction(self, beyond: Sequence[InFlight], nbytes: int) -> bool:
        """Whether a reduction of ``nbytes`` may be issued while ``beyond`` (the reductions in
        flight past ``max_pending``) stay in flight: together they fit the window."""
        return nbytes + sum(p.nbytes for p in beyond) <= self.window_bytes

    def _ends(self, order: list[U]) -> list[int]:
        """For each position ``i`` of ``order``, where its window ends (exclusive): the next
        unit, then the units after it while they add up to at most ``window_bytes``."""
        prefix = [0]
        for st in order:
            prefix.append(prefix[-1] + self._nbytes(st))
        n = len(order)
        ends = []
        for i in range(n):
            if i + 2 >= n or not self.window_bytes:  # no window: the next unit alone
                ends.append(min(n, i + 2))
                continue
            # the largest end with prefix[end] - prefix[i + 2] <= window_bytes
            ends.append(min(n, bisect.bisect_right(prefix, prefix[i + 2] + self.window_bytes) - 1))
        return ends


def _slide(order: list[U], i: int, end: int, issued: int) -> tuple[list[U], int]:
    """Position ``i``'s window ``order[i + 1 : end]`` less what an earlier window issued
    (positions below ``issued``; the next unit is always included, as without a window), and
    the new ``issued``."""
    return order[i + 1 : i + 2] + order[max(i + 2, issued) : end], max(issued, end)
