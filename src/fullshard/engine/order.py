"""StepOrder: the order units ran in, and the unit each unit's hooks gather ahead (prefetch).

Part of a root's :class:`~fullshard.engine.context.StepContext`, recorded by the unit hooks:

- the forward order (recorded each forward; the previous one drives implicit forward
  prefetch: a unit's pre-forward gathers the unit that ran after it last time);
- the post-forward order (drives implicit backward prefetch, reversed: a unit's pre-backward
  gathers the unit whose backward runs next, the one before it in forward).

The prefetch here is FSDP2's, one unit ahead. On the CPU the root's host strategy may gather
further ahead ([Note: the host strategy] in ``fullshard.engine.host``); it reads the orders
through :meth:`StepOrder.position_in_prev_forward`, :meth:`StepOrder.position_in_post_forward`
and :attr:`StepOrder.revision`.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Generic, TypeVar

__all__ = ["StepOrder"]

U = TypeVar("U", bound=Hashable)


class StepOrder(Generic[U]):
    """Forward and post-forward orders of one root's units, and their implicit prefetch."""

    def __init__(self) -> None:
        self.forward: list[U] = []
        self.prev_forward: list[U] = []  # replaced when a forward begins, never changed
        self.post_forward: list[U] = []
        # Changes whenever this step's orders do (a unit recorded or moved, a new step), so
        # that what is computed from them can be kept until then.
        self.revision = 0
        # Positions in the orders above, so that each hook's look-up is O(1) (a unit's hooks
        # run every step; a list search made them O(units)). Rebuilt when an order changes.
        self._forward_seen: set[U] = set()  # the units in ``forward``
        self._prev_forward_index: dict[U, int] = {}  # unit -> its index there
        self._post_forward_index: dict[U, int] | None = None  # None: rebuild

    def begin_forward(self) -> None:
        """The root's forward starts: the last forward's order becomes the prefetch plan."""
        if self.forward:
            self.prev_forward = self.forward
            self._prev_forward_index = {st: i for i, st in enumerate(self.forward)}
        self.clear()

    def clear(self) -> None:
        """Forget this step's orders (the previous forward's, the prefetch plan, stays)."""
        self.forward = []
        self._forward_seen = set()
        self.post_forward = []
        self._post_forward_index = None
        self.revision += 1

    def record_forward(self, unit: U) -> None:
        if unit not in self._forward_seen:
            self._forward_seen.add(unit)
            self.forward.append(unit)
            self.revision += 1

    def record_post_forward(self, unit: U) -> None:
        self.revision += 1
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

    def position_in_prev_forward(self, unit: U) -> int | None:
        """``unit``'s index in the previous forward's order (None: it did not run there)."""
        return self._prev_forward_index.get(unit)

    def position_in_post_forward(self, unit: U) -> int | None:
        """``unit``'s index in this step's post-forward order (None: not run yet)."""
        return self._post_index().get(unit)

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
