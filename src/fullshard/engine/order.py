"""StepOrder: the order units ran in, and what each unit's hooks gather ahead (prefetch).

Part of a root's :class:`~fullshard.engine.context.StepContext`, recorded by the unit hooks:

- the forward order (recorded each forward; the previous one drives implicit forward
  prefetch: a unit's pre-forward gathers the unit that ran after it last time);
- the post-forward order (drives implicit backward prefetch, reversed: a unit's pre-backward
  gathers the unit whose backward runs next, the one before it in forward).

[Note: a window for small units]
On the CPU a unit's collectives are exchanges between processes whose gloo threads share the
cores with the ranks' main threads: each one that a rank blocks on costs a round of wake-ups
(about half a millisecond on a 2-core VM, where a unit of 4.5 KiB computes in tens of
microseconds). With one gather ahead and one reduction in flight, a model of many small units
waits on nearly every one. So on the CPU the implicit prefetch runs further ahead, and
reductions stay in flight longer (``StepContext.make_room``), as long as the units beyond the
next one (the prefetch) or beyond ``max_pending`` (the reductions) add up to at most
``backend.SMALL_UNIT_WINDOW_BYTES`` of unsharded memory. A unit larger than that changes
nothing, so models with units of a megabyte or more run as they would without it, and the
window adds at most that many bytes to each direction's peak. ``fullshard bench --config
overhead`` (64 units of 4.5 KiB, 2 gloo ranks) steps 2.7x faster with it (BENCHMARKS.md,
2026-12-02 at 34fc753). On CUDA, where collectives queue on their own stream without blocking
the host, the window is off (``BackendPlan.window_bytes`` is 0). Each window is computed once
per order (prefix sums), and a unit's pre-hook issues only the part of its window no earlier
unit issued, so the window costs O(1) calls per unit.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

__all__ = ["StepOrder"]

U = TypeVar("U", bound=Hashable)


class StepOrder(Generic[U]):
    """Forward and post-forward orders of one root's units, and their prefetch windows.

    ``nbytes(unit)`` is the unit's gathered size (the window's measure); ``window_bytes`` the
    window ([Note: a window for small units]; 0: prefetch the next unit only)."""

    def __init__(self, nbytes: Callable[[U], int], window_bytes: int) -> None:
        self._nbytes = nbytes
        self.window_bytes = window_bytes
        self.forward: list[U] = []
        self.prev_forward: list[U] = []
        self.post_forward: list[U] = []
        # Positions in the orders above, so that each hook's look-up is O(1) (a unit's hooks
        # run every step; a list search made them O(units)). Rebuilt when an order changes.
        self._forward_seen: set[U] = set()  # the units in ``forward``
        self._prev_forward_index: dict[U, int] = {}  # unit -> its index there
        self._post_forward_index: dict[U, int] | None = None  # None: rebuild
        # Where each position's window ends, per order (None: not computed yet), and how far
        # this step's windows have issued gathers.
        self._fwd_ends: list[int] | None = None
        self._bwd_ends: list[int] | None = None
        self._fwd_issued = self._bwd_issued = 0

    def begin_forward(self) -> None:
        """The root's forward starts: the last forward's order becomes the prefetch plan."""
        if self.forward:
            self.prev_forward = self.forward
            self._prev_forward_index = {st: i for i, st in enumerate(self.forward)}
            self._fwd_ends = None
        self.clear()

    def clear(self) -> None:
        """Forget this step's orders (the previous forward's, the prefetch plan, stays)."""
        self.forward = []
        self._forward_seen = set()
        self.post_forward = []
        self._post_forward_index = None
        self._fwd_issued = self._bwd_issued = 0  # window positions issued so far this step
        self._bwd_ends = None

    def record_forward(self, unit: U) -> None:
        if unit not in self._forward_seen:
            self._forward_seen.add(unit)
            self.forward.append(unit)

    def record_post_forward(self, unit: U) -> None:
        self._bwd_ends = None  # the backward order changes
        order, index = self.post_forward, self._post_index()
        if unit not in index:
            index[unit] = len(order)
            order.append(unit)
        elif order[-1] is not unit:  # ran again (a reused module): it moves to the end
            order.remove(unit)
            order.append(unit)
            self._post_forward_index = None

    def ran_post_forward(self, unit: U) -> bool:
        """Whether ``unit``'s post-forward ran this step."""
        return unit in self._post_index()

    def _post_index(self) -> dict[U, int]:
        if self._post_forward_index is None:
            self._post_forward_index = {st: i for i, st in enumerate(self.post_forward)}
        return self._post_forward_index

    def next_in_forward(self, unit: U) -> list[U]:
        """The unit that ran after ``unit`` in the previous forward (implicit prefetch)."""
        order = self.prev_forward
        i = self._prev_forward_index.get(unit)
        if i is not None and i + 1 < len(order):
            return [order[i + 1]]
        return []

    def next_in_backward(self, unit: U) -> list[U]:
        """The unit whose backward runs after ``unit``'s (the one before it in forward)."""
        i = self._post_index().get(unit)
        if i is not None and i > 0:
            return [self.post_forward[i - 1]]
        return []

    def forward_window(self, unit: U) -> list[U]:
        """What ``unit``'s pre-forward gathers ahead (implicit prefetch): the next unit, and on
        the CPU the small ones after it that no earlier unit's window has issued yet ([Note: a
        window for small units])."""
        i = self._prev_forward_index.get(unit)
        if i is None:
            return []
        order = self.prev_forward
        if self._fwd_ends is None:
            self._fwd_ends = self._window_ends(order)
        window, self._fwd_issued = _slide(order, i, self._fwd_ends[i], self._fwd_issued)
        return window

    def backward_window(self, unit: U) -> list[U]:
        """What ``unit``'s pre-backward gathers ahead: the unit whose backward runs next, and
        on the CPU the small ones after it not issued yet."""
        i = self._post_index().get(unit)
        if i is None:
            return []
        order = self.post_forward[::-1]  # backward order
        if self._bwd_ends is None:
            self._bwd_ends = self._window_ends(order)
        r = len(order) - 1 - i
        window, self._bwd_issued = _slide(order, r, self._bwd_ends[r], self._bwd_issued)
        return window

    def _window_ends(self, order: list[U]) -> list[int]:
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
