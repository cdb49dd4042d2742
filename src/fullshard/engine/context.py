"""StepContext: what the root coordinates across its units during one training step.

Created by lazy init (``FSDPState.lazy_init`` in ``fullshard.engine.hooks``) on the root's
first forward and shared by every unit below it. It holds:

- ``order``, the step's orders and prefetch windows (:class:`~fullshard.engine.order.StepOrder`);
- ``comm``, the plan, streams and buffer pool every group of the root references
  (:class:`~fullshard.engine.comm.CommContext`);
- the reductions in flight (at most one by default: a unit finishes the previous unit's
  reduction before issuing its own, so its buffer is freed first; up to the largest
  ``set_reduce_scatter_max_input_buffers`` of the root's units, oldest finished first; on the
  CPU widened by [Note: a window for small units] in ``fullshard.engine.order``), the
  gradient slabs they fill, and the end-of-backward callback that completes units whose
  backward never fired (unused parameters, frozen inputs);
- the ``k``-rank subgroups of int ``reshard_after_forward`` (created once per set of ranks).

The context is generic over its units, and reads of them only what :class:`StepUnit` names
(``fullshard.engine.hooks.FSDPState`` is the one kind): the unit hooks import the context,
never the other way round.
"""

from __future__ import annotations

from typing import Generic, Protocol, TypeVar

import torch
import torch.distributed as dist

from .backend import BackendPlan
from .comm import CommContext
from .events import emit
from .group import ParamGroup
from .mesh import MeshInfo, member_group
from .order import StepOrder
from .reduce import PendingReduce, lendable_output_nbytes
from .state import TrainingState
from .streams import CommStreams

__all__ = ["StepContext", "StepUnit"]


class StepUnit(Protocol):
    """What the context reads and sets of a unit."""

    group: ParamGroup
    training_state: TrainingState
    manual_backward_finalization: bool  # read on the root

    @property
    def name(self) -> str: ...

    @property
    def is_last_backward(self) -> bool:
        """``set_is_last_backward``'s flag; the root's seeds the context's."""

    def __hash__(self) -> int: ...

    def reset_forward(self) -> None:
        """Forget a forward that did not finish (end of backward, ``reset_iter_state``)."""


U = TypeVar("U", bound=StepUnit)


def _gathered_nbytes(unit: StepUnit) -> int:
    return unit.group.unsharded_nbytes()


class StepContext(Generic[U]):
    """Root-level coordination of one model's units (see the module docstring)."""

    def __init__(
        self,
        root: U,
        states: list[U],
        device: torch.device,
        plan: BackendPlan,
        streams: CommStreams | None = None,
    ) -> None:
        self.root = root
        self.states = states  # every unit, root first, in module order
        # every backend-dependent choice ([Note: the backend plan]), the side streams
        # (``streams``: shared with other roots by share_comm_ctx) and the buffer pool
        self.comm = CommContext.for_root(device, plan, streams)
        self.order: StepOrder[U] = StepOrder(_gathered_nbytes, plan.window_bytes)
        # Which units open a gradient slab this step (see _plan_slabs); None: not planned yet.
        self._slab_plan: dict[U, int] | None = None
        self.pending: list[PendingReduce] = []
        # HSDP reductions whose all-reduce across replicas is in flight (see make_room)
        self.replicating: list[PendingReduce] = []
        self.max_pending = 1  # reductions allowed in flight (see update_max_pending)
        self.reduce_window_bytes = plan.window_bytes  # [Note: a window for small units]
        self.update_max_pending()
        # The backward (autograd graph task) whose end-of-backward callback is queued; None:
        # none queued since the last one ran.
        self.backward_task: int | None = None
        # set_is_last_backward, on any unit: one flag for every unit, as FSDP2's state context
        self.is_last_backward = root.is_last_backward
        # [Note: manual backward finalization] in fullshard.engine.finalize: the mode this
        # backward started in (None: no backward since the iteration ended), and the token of
        # an asynchronous finalize_backward not yet waited on.
        self.manual_active: bool | None = None
        self.active_reduction: object | None = None
        # the k-rank groups of int reshard_after_forward, by their ranks
        self._subgroups: dict[tuple[int, ...], dist.ProcessGroup] = {}

    def begin_forward(self) -> None:
        """The root's forward starts: the last forward's order becomes the prefetch plan,
        and memory freed since waits for the first gathers."""
        first = self._first_gather_sizes()  # gradient memory set free since may serve them
        self.order.begin_forward()
        self._slab_plan = None
        pool = self.comm.pool
        pool.clear()  # kept since a forward that had no backward
        pool.adopt_returned(first)  # [Note: gradient memory lent for the next forward]

    # -------------------------------------------------------------------------- backward
    def _first_gather_sizes(self) -> list[int]:
        """Bytes of the first ``pool.capacity`` units' gathers in the last forward: the next
        forward's, which allocate before any unit frees memory."""
        first = self.order.forward[: self.comm.pool.capacity]
        sizes = (st.group.unsharded_nbytes() for st in first)
        return [n for n in sizes if n]

    def slab_to_start(self, state: U) -> int:
        """Bytes of the slab ``state``'s reduction opens for its and the next units' outputs
        (0: none); see [Note: gradient memory lent for the next forward] in ``fullshard.engine.pool``."""
        if self._slab_plan is None:
            self._slab_plan = self._plan_slabs()
        return self._slab_plan.get(state, 0)

    def _plan_slabs(self) -> dict[U, int]:
        """Which units open a slab, and of what size.

        The next forward's first gathers (the sizes of the first ``pool.capacity`` units of
        this forward) allocate before any unit frees memory. Walking the reductions from the
        last one back, each run of consecutive units whose outputs fill one of those sizes
        exactly shares a slab, opened by the run's first unit: the units reduced last, so
        that no output is allocated long before its reduction.
        """
        if not self.comm.pool.lends:
            return {}
        wanted = self._first_gather_sizes()
        # Reductions run in reverse post-forward order, except the root's: its gradients
        # (the embedding's) come last.
        order = [st for st in reversed(self.order.post_forward) if st is not self.root]
        if self.order.ran_post_forward(self.root):
            order.append(self.root)
        sizes = [lendable_output_nbytes(st.group) for st in order]
        plan: dict[U, int] = {}
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
        task = torch._C._current_graph_task_id()
        if self.backward_task is None and task != -1:
            self.backward_task = task
            if self.manual_active is None:
                self.manual_active = self.root.manual_backward_finalization
            torch.autograd.Variable._execution_engine.queue_callback(self.finish_backward)

    def finish_pending(self) -> None:
        """Wait for the reductions in flight and hand out their gradient shards."""
        for p in (*self.replicating, *self.pending):
            p.finish()
        self.replicating, self.pending = [], []

    def update_max_pending(self) -> None:
        """One cap for the root's units, the largest any asks for (as FSDP2: a unit with a
        lower cap must not undo a higher one's retention)."""
        caps = [st.group.overrides.max_input_buffers for st in self.states]
        explicit = [c for c in caps if c is not None]
        self.max_pending = max(explicit, default=1)
        # a cap set explicitly is kept exactly ([Note: a window for small units])
        self.reduce_window_bytes = 0 if explicit else self.order.window_bytes

    def make_room(self, nbytes: int = 0) -> None:
        """Before a unit issues its reduction (of ``nbytes`` of unsharded gradients): finish
        the oldest ones until fewer than ``max_pending`` are in flight, or on the CPU until
        those beyond ``max_pending`` fit the window with it ([Note: a window for small
        units])."""
        while len(self.pending) >= self.max_pending:
            beyond = self.pending[self.max_pending :]  # and the new one: the extra ones
            if nbytes + sum(p.nbytes for p in beyond) <= self.reduce_window_bytes:
                return
            oldest = self.pending.pop(0)
            # HSDP: the oldest's reduce-scatter is done; its all-reduce across replicas then
            # runs while the next unit computes (as FSDP2's all-reduce stream), one at a time,
            # holding only the gradient shards it reduces in place
            for p in self.replicating:
                p.finish()
            self.replicating = []
            if oldest.replicate_group is not None and not oldest.allreduce_issued:
                oldest.advance()
                self.replicating.append(oldest)
            else:
                oldest.finish()

    def reduce(self, unit: U, recycle: bool = False, slab: int = 0) -> None:
        """Issue ``unit``'s reductions (``ParamGroup.reduce_grads``: ``recycle``, ``slab``),
        first finishing older ones until there is room for them (:meth:`make_room`): how
        every unit reduces, from its post-backward, the end-of-backward callback or
        ``finalize_backward``."""
        group = unit.group
        self.make_room(group.unsharded_nbytes())
        self.pending.extend(group.reduce_grads(recycle=recycle, slab=slab))

    def finish_backward(self) -> None:
        """End-of-backward callback: complete every unit, wait for reductions, reset.

        With ``set_is_last_backward(False)`` (on any unit), the last reductions stay in flight
        (finished by the next backward) and the backward prefetch order is kept, as in FSDP2.
        Under manual finalization they stay in flight until ``finalize_backward`` ([Note:
        manual backward finalization] in ``fullshard.engine.finalize``).
        """
        emit("backward_end", self.root.name)
        for st in self.states:
            if st.group.params and st.training_state is not TrainingState.POST_BACKWARD:
                self.reduce(st)
        if self.is_last_backward and not self.manual_active:
            self.end_backward_iteration()
        else:
            self._units_idle()
            self.comm.pool.clear()
            self.comm.pool.release_unused_slabs()
        self.backward_task = None

    def end_backward_iteration(self) -> None:
        """Wait for the reductions in flight, hand out their gradients, reshard what
        ``reshard_after_backward`` says, and give pooled memory back for the optimizer step."""
        self.finish_pending()
        self.comm.streams.wait_host_copies()
        self._units_idle()
        self.comm.pool.clear()  # the optimizer step runs with no pooled memory
        self.comm.pool.release_unused_slabs()
        self.manual_active = None

    def _units_idle(self) -> None:
        """After a backward: each unit resharded per ``reshard_after_backward``, IDLE, and with
        no module pending ([Note: a unit of several modules] in ``fullshard.engine.hooks``)."""
        for st in self.states:
            st.group.finish_backward()
            st.training_state = TrainingState.IDLE
            st.reset_forward()

    def reset_iter_state(self) -> None:
        """Recover from an exception mid-forward or mid-backward (``FSDPModule.reset_iter_state``).

        Waits for the reductions in flight and drops their results (the failed iteration's
        gradients are lost), brings every unit back to sharded and IDLE and forgets this
        step's orders; the previous forward order (the prefetch plan) is kept. The autograd
        engine drops queued callbacks when a backward raises, so none counts as queued.
        """
        for p in (*self.replicating, *self.pending):
            p.handle.wait()
        self.replicating, self.pending = [], []
        for st in self.states:
            st.group.reset_iter_state()
            st.training_state = TrainingState.IDLE
            st.reset_forward()
        self.comm.streams.wait_host_copies()
        self.order.clear()
        self._slab_plan = None
        self.comm.pool.forget()
        self.backward_task = None
        self.manual_active = None
        self.active_reduction = None  # an outstanding handle's wait() now raises

    # ------------------------------------------------------------------------- subgroups
    def post_forward_subgroup(self, info: MeshInfo, k: int) -> tuple[dist.ProcessGroup, int]:
        """The group of the ``k`` consecutive ranks of ``info``'s shard group that holds this
        rank, and this rank's index in it.

        Taken from the shard group's own ranks (a mesh's ``mesh`` tensor holds only this
        rank's row when the mesh is a sub-mesh, e.g. ``mesh["dp"]`` beside tensor parallel)
        and kept by its ranks, not by ``k``: units on different meshes never share one.
        Only the group's members create it (:func:`~fullshard.engine.mesh.member_group`)."""
        shard = dist.get_process_group_ranks(info.shard_group)
        start = shard.index(dist.get_rank()) // k * k
        group = member_group(shard[start : start + k], self._subgroups, "fullshard_post_forward")
        return group, dist.get_rank(group)
