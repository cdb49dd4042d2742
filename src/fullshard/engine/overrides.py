"""FSDP2's per-unit communication overrides: custom collectives, the all-reduce hook and the
reduce-scatter knobs beyond the defaults (the ``set_*`` methods of ``FSDPModule``).

One :class:`CommOverrides` per unit (``ParamGroup.overrides``, shared by reference with the unit's
per-dtype and per-mesh child groups) holds them; ``fullshard.engine.gather`` and ``fullshard.engine.reduce`` read it.

- ``all_gather`` / ``reduce_scatter``: objects following torch's ``AllGather`` /
  ``ReduceScatter`` protocol (``allocate(size, dtype=, device=)`` and ``__call__``). A unit
  with one allocates that direction's packed buffers through ``allocate`` and runs the
  collective through it, so that direction always uses the packed transport.
- ``all_reduce_hook``, ``hook_stream``: the hook called on the unit's reduced gradient shards
  (the flat, padded reduce-scatter output; after the all-reduce across replicas with HSDP),
  and the stream it runs on, as FSDP2 does ([Note: the all-reduce hook] in
  ``fullshard.engine.reduce``).
- ``reduce_scatter_unused_params``: see [Note: unused parameters] in ``fullshard.engine.reduce``.
- ``max_input_buffers``: reductions allowed in flight at once (the root's units share one cap,
  the largest any of them asks for; ``StepContext.make_room``); ``None``, the default, is 1
  widened on the CPU by the window for small units ([Note: a window for small units] in
  ``fullshard.engine.window``), which a cap set explicitly replaces.
- ``reduce_scatter_group``: a process group of its own for the unit's reduce-scatters
  (:func:`separate_reduce_scatter_groups`);
- ``requires_gradient_sync``, ``requires_all_reduce``, ``gradient_divide_factor``,
  ``force_sum_reduction``: how the unit's gradients are reduced (FSDP2's setters of the same
  names); the child groups read them through the shared object.

[Note: comm buffers from the backend]
FSDP2's ``set_allocate_memory_from_process_group_for_comm`` and ``set_symm_mem_for_comm``
change where a unit's communication buffers (the packed all-gather output, the reduce-scatter
input and output) come from. fullshard implements them as comm objects of its own,
:class:`BackendAllGather` / :class:`BackendReduceScatter`, set in the same ``all_gather`` /
``reduce_scatter`` slots as a user's custom comm, so every buffer still comes from one seam,
:func:`allocate`. ``source`` says where from:

- ``"process_group"``: the group backend's own allocator (``Backend.allocate_tensor``; NCCL
  hands out memory from a ``torch.cuda.MemPool`` registered with its communicators, which lets
  it use zero-copy transfers), or ``torch.empty`` when the backend has none;
- ``"symmetric"``: the symmetric-memory pool of the device
  (``torch.distributed._symmetric_memory.get_mem_pool``); before each collective the buffers
  it reads or writes are rendezvoused on the collective's group (cached by the pool), so NCCL
  can pick its symmetric-memory kernels. Every rank allocates the same sizes, as the pool needs.

The collective itself is the backend's plain all-gather / reduce-scatter (sum; fullshard
divides separately), so numerics are unchanged.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol

import torch
import torch.distributed as dist

from .mesh import member_group

__all__ = [
    "AllGatherComm",
    "BackendAllGather",
    "BackendReduceScatter",
    "BufferSource",
    "CommOverrides",
    "ReduceScatterComm",
    "allocate",
    "separate_reduce_scatter_groups",
]


class _Allocates(Protocol):
    def allocate(
        self, size: Sequence[int], *, dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor: ...


class AllGatherComm(_Allocates, Protocol):
    """FSDP2's ``AllGather`` protocol (defined in torch's private ``_fsdp_api`` module)."""

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        async_op: bool = False,
    ) -> Any: ...


class ReduceScatterComm(_Allocates, Protocol):
    """FSDP2's ``ReduceScatter`` protocol (defined in torch's private ``_fsdp_api`` module)."""

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        op: Any,
        async_op: bool = False,
    ) -> Any: ...


@dataclass
class CommOverrides:
    """What a unit does differently from the defaults (see the module docstring)."""

    all_gather: AllGatherComm | None = None
    reduce_scatter: ReduceScatterComm | None = None
    all_reduce_hook: Callable[[torch.Tensor], None] | None = None
    # the stream to run the hook on ([Note: a user's stream] in fullshard.engine.streams)
    hook_stream: Any = None
    reduce_scatter_unused_params: bool = False
    max_input_buffers: int | None = None  # None: the default (see the module docstring)
    reduce_scatter_group: dist.ProcessGroup | None = None
    # How gradients are reduced (FSDPModule.set_requires_gradient_sync, set_requires_all_reduce,
    # set_gradient_divide_factor, set_force_sum_reduction_for_comms).
    requires_gradient_sync: bool = True
    requires_all_reduce: bool = True
    gradient_divide_factor: float | None = None
    force_sum_reduction: bool = False

    def allows_local(self) -> bool:
        """Whether a one-rank unit may skip its collectives (the ``local`` transport): not when
        a custom collective, the all-reduce hook or unused-parameter reduction must run."""
        return (
            self.all_gather is None
            and self.reduce_scatter is None
            and self.all_reduce_hook is None
            and not self.reduce_scatter_unused_params
        )


def allocate(
    comm: _Allocates | None, numel: int, dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """A 1-D communication buffer: from ``comm.allocate`` when a custom comm is set."""
    if comm is None:
        return torch.empty(numel, dtype=dtype, device=device)
    buf = comm.allocate((numel,), dtype=dtype, device=device)
    if buf.numel() != numel or buf.dtype != dtype:
        raise ValueError(
            f"{type(comm).__name__}.allocate(({numel},), dtype={dtype}) returned a "
            f"{buf.dtype} tensor of {buf.numel()} elements; it must return exactly that"
        )
    return buf.view(-1)


BufferSource = Literal["process_group", "symmetric"]


class _BackendBuffers:
    """Allocates communication buffers from ``source`` (see [Note: comm buffers from the
    backend]); ``group_of()`` is the process group the buffers are for (read when allocating,
    so a later ``set_separate_reduce_scatter_group`` is followed)."""

    def __init__(self, source: BufferSource, group_of: Callable[[], dist.ProcessGroup]) -> None:
        self.source = source
        self._group_of = group_of

    def allocate(
        self, size: Sequence[int], *, dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        """A 1-D buffer of ``prod(size)`` elements from this object's source."""
        numel = math.prod(int(s) for s in size)
        if self.source == "symmetric":
            from torch.distributed import _symmetric_memory as symm_mem

            with torch.cuda.use_mem_pool(symm_mem.get_mem_pool(device)):
                return torch.empty(numel, dtype=dtype, device=device)
        backend = self._group_of()._get_backend(device)
        if backend.supports_tensor_alloc(device):
            return backend.allocate_tensor(numel, dtype=dtype, device=device)
        return torch.empty(numel, dtype=dtype, device=device)

    def _register(self, group: dist.ProcessGroup, *tensors: torch.Tensor) -> None:
        if self.source == "symmetric":
            from torch.distributed import _symmetric_memory as symm_mem

            for t in tensors:
                symm_mem.rendezvous(t, group=group.group_name)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(source={self.source!r})"


class BackendAllGather(_BackendBuffers):
    """The all-gather with buffers from the backend (an :class:`AllGatherComm`)."""

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        async_op: bool = False,
    ) -> Any:
        # The output only: the packed gather's input is a slice of it (an extension's or an
        # int8 input is plain memory, which NCCL sends the regular way).
        self._register(group, output_tensor)
        return dist.all_gather_into_tensor(
            output_tensor, input_tensor, group=group, async_op=async_op
        )


class BackendReduceScatter(_BackendBuffers):
    """The reduce-scatter with buffers from the backend (a :class:`ReduceScatterComm`)."""

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        op: Any,
        async_op: bool = False,
    ) -> Any:
        self._register(group, input_tensor, output_tensor)
        return dist.reduce_scatter_tensor(
            output_tensor, input_tensor, op=op, group=group, async_op=async_op
        )


def separate_reduce_scatter_groups(
    shard_groups: list[dist.ProcessGroup],
    existing: list[dist.ProcessGroup | None],
) -> list[dist.ProcessGroup]:
    """One new process group per distinct set of shard ranks (``shard_groups[i]``'s ranks),
    reusing any group in ``existing`` already made for the same ranks.

    Only the members of each new group take part in creating it
    (:func:`~fullshard.engine.mesh.member_group`), so HSDP's shard groups are created
    independently; every member must make the call, like any collective setup.
    """
    made: dict[tuple[int, ...], dist.ProcessGroup] = {}
    for group in existing:
        if group is not None:
            made.setdefault(tuple(sorted(dist.get_process_group_ranks(group))), group)
    return [
        member_group(dist.get_process_group_ranks(shard), made, "fullshard_reduce_scatter")
        for shard in shard_groups
    ]
