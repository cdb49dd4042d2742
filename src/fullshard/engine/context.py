"""StepContext: what the root coordinates across its units during one training step.

Created by lazy init (``FSDPState.lazy_init`` in ``fullshard.engine.hooks``) on the root's
first forward and shared by every unit below it. It holds:

- ``order``, the step's orders (:class:`~fullshard.engine.order.StepOrder`), which drive the
  implicit prefetch (:meth:`StepContext.implicit_forward_prefetch`, ...``_backward_prefetch``);
- ``comm``, the plan, streams and host strategy (the CPU's special cases, ``None`` on CUDA)
  every group of the root references (:class:`~fullshard.engine.comm.CommContext`);
- the reductions in flight (at most one by default: a unit finishes the previous unit's
  reduction before issuing its own, so its buffer is freed first; up to the largest
  ``set_reduce_scatter_max_input_buffers`` of the root's units, oldest finished first; without
  such a cap the host strategy may leave more in flight) and the end-of-backward callback that
  completes units whose backward never fired (unused parameters, frozen inputs);
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
from .host import HostStrategy, Release
from .mesh import MeshInfo, member_group
from .order import StepOrder
from .reduce import PendingReduce, direct_output_nbytes
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
        # (``streams``: shared with other roots by share_comm_ctx) and the CPU's special
        # cases ([Note: the host strategy] in fullshard.engine.host; None: the core alone)
        host = HostStrategy.for_plan(device, plan, root, direct_output_nbytes)
        self.comm = CommContext(plan, streams or CommStreams(device), host)
        self.host: HostStrategy[U] | None = host  # the comm context's (read on every hook)
        self.order: StepOrder[U] = StepOrder()
        self.pending: list[PendingReduce] = []
        # HSDP reductions whose all-reduce across replicas is in flight (see make_room)
        self.replicating: list[PendingReduce] = []
        self.max_pending = 1  # reductions allowed in flight (see update_max_pending)
        self.cap_set = False  # set_reduce_scatter_max_input_buffers gave max_pending
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
        """The root's forward starts: the last forward's order becomes the prefetch plan
        (memory freed since may serve the first gathers: the host strategy looks first)."""
        if self.host is not None:
            self.host.forward_begins(self.order)
        self.order.begin_forward()

    def forward_without_backward(self) -> None:
        """The root's forward ran without gradients: no backward (nor a gather) comes soon."""
        if self.host is not None:
            self.host.forward_without_backward()

    def implicit_forward_prefetch(self, unit: U) -> list[U]:
        """The units ``unit``'s pre-forward gathers ahead without an explicit list: the next
        one in the last forward (the host strategy may add more)."""
        if self.host is not None:
            return self.host.prefetch_forward(self.order, unit)
        return self.order.next_in_forward(unit)

    def implicit_backward_prefetch(self, unit: U) -> list[U]:
        """The units ``unit``'s pre-backward gathers ahead without an explicit list: the one
        whose backward runs next (the host strategy may add more)."""
        if self.host is not None:
            return self.host.prefetch_backward(self.order, unit)
        return self.order.next_in_backward(unit)

    def release_after_forward(self, unit: U) -> Release:
        """How ``unit``'s post-forward reshard releases its memory (the host strategy may
        hold it for a later gather)."""
        if self.host is None:
            return Release.FREE
        return self.host.after_forward(self.order, unit)

    # -------------------------------------------------------------------------- backward
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
        self.cap_set = bool(explicit)  # kept exactly: the host strategy is not asked

    def make_room(self, nbytes: int = 0) -> None:
        """Before a unit issues its reduction (of ``nbytes`` of unsharded gradients): finish
        the oldest ones until fewer than ``max_pending`` are in flight. Without a cap set by
        the user, the host strategy may find room enough for more."""
        while len(self.pending) >= self.max_pending:
            # the ones beyond max_pending (and the new one): the host strategy's to judge
            if self._host_has_room(nbytes):
                return
            oldest = self.pending.pop(0)
            # HSDP: the oldest's reduce-scatter is done; its all-reduce across replicas then
            # runs while the next unit computes (as FSDP2's all-reduce stream), one at a time,
            # holding only the gradient shards it reduces in place; so does an all-reduce hook
            # given a stream, on that stream ([Note: the all-reduce hook])
            for p in self.replicating:
                p.finish()
            self.replicating = []
            if oldest.continues:  # or its all-reduce hook, on the hook's stream
                oldest.advance()
                self.replicating.append(oldest)
            else:
                oldest.finish()

    def _host_has_room(self, nbytes: int) -> bool:
        host = self.host
        if host is None or self.cap_set:
            return False
        return host.room_for_reduction(self.pending[self.max_pending :], nbytes)

    def reduce(self, unit: U, post_backward: bool = False, reshard: bool = True) -> None:
        """Issue ``unit``'s reductions (``ParamGroup.reduce_grads``), first finishing older
        ones until there is room for them (:meth:`make_room`): how every unit reduces, from
        its post-backward (``post_backward``: the host strategy may take its memory),
        the end-of-backward callback or ``finalize_backward``. ``reshard=False``: the unit
        stays gathered (the backward still reads it; resharded later)."""
        after = None
        if post_backward and self.host is not None:
            after = self.host.after_backward(self.order, unit)
        group = unit.group
        self.make_room(group.unsharded_nbytes())
        self.pending.extend(group.reduce_grads(after, reshard=reshard))

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
            self._host_backward_ends()
        self.backward_task = None

    def end_backward_iteration(self) -> None:
        """Wait for the reductions in flight, hand out their gradients, reshard what
        ``reshard_after_backward`` says, and give held memory back for the optimizer step."""
        self.finish_pending()
        self.comm.streams.wait_host_copies()
        self._units_idle()
        self._host_backward_ends()  # the optimizer step runs with no held memory
        self.manual_active = None

    def _host_backward_ends(self) -> None:
        if self.host is not None:
            self.host.backward_ends()

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
            p.discard()
        self.replicating, self.pending = [], []
        for st in self.states:
            st.group.reset_iter_state()
            st.training_state = TrainingState.IDLE
            st.reset_forward()
        self.comm.streams.wait_host_copies()
        self.order.clear()
        if self.host is not None:
            self.host.reset()
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
