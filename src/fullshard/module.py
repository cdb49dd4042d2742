"""``FSDPModule``: the class every ``fully_shard`` unit becomes, with all of FSDP2's methods.

fullshard's ``FSDPModule`` subclasses ``torch.distributed.fsdp.FSDPModule``, so code that
recognises FSDP2 units by class (Accelerate, Lightning Fabric, transformers, torch's pipelining
schedules and DCP helpers) sees fullshard's units as FSDP2 units. Every public method of
``FSDPModule`` in each supported torch release (``fullshard.engine.compat``) is overridden here
(``tests/test_fsdp2_compat.py`` checks that none is inherited): torch's methods reach into torch's engine state, which a fullshard unit does not
have, so none of them ever runs.

Methods whose FSDP2 meaning is about CUDA streams or NCCL buffers either do the same thing in
fullshard's terms (documented per method) or, where the machine cannot do it (a CPU-only gloo
group), raise an error saying why.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal, cast, overload

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule as _TorchFSDPModule
from torch.distributed.fsdp import UnshardHandle as _TorchUnshardHandle

from .engine import (
    STATE_ATTR,
    AllGatherComm,
    BackendAllGather,
    BackendReduceScatter,
    BufferSource,
    FSDPState,
    FullyShardError,
    GradientReductionHandle,
    ParamGroup,
    ReduceScatterComm,
    check_reshard_after_forward,
    finalize_backward,
    require_method,
    separate_reduce_scatter_groups,
    set_manual_backward_finalization,
    states_under,
    user_stream,
)
from .torch_state import fully_shard_state

__all__ = [
    "FSDPModule",
    "FullyShardError",
    "GradientReductionHandle",
    "UnshardHandle",
    "adopt_applied_params",
    "unit_state",
]


def unit_state(module: nn.Module) -> FSDPState:
    """fullshard's own state of a unit (the engine's: its group, context, policies), for
    fullshard's tools and tests. Code written for FSDP2 reads ``module._get_fsdp_state()``,
    which answers in FSDP2's shape (:mod:`fullshard.torch_state`)."""
    st = module.__dict__.get(STATE_ATTR)
    if st is None:
        raise FullyShardError(
            f"{type(module).__name__} is not an FSDPModule: call fully_shard on it"
        )
    return cast(FSDPState, st)


def _all_states(module: nn.Module) -> list[FSDPState]:
    """Every unit state under ``module`` (used by tests and tools)."""
    return states_under([module])


def adopt_applied_params(state: FSDPState) -> None:
    """After ``module._apply`` (``to_empty``, ``to``, a dtype cast): the unit adopts the
    parameters now registered, and rebuilds its layout for their dtype after lazy init."""
    for sp in state.group.params:
        sp.sync_from_modules()
    if state.ctx is not None:
        state.group.init_layout(state.on_grad_accumulated)


def _check_fsdp_modules(modules: list[Any], what: str) -> None:
    for m in modules:
        if not isinstance(m, FSDPModule):
            raise ValueError(f"{what} expects FSDPModules (fully_shard units), got {type(m)}")


def _check_comm(comm: object, method: str) -> None:
    if not callable(comm) or not callable(getattr(comm, "allocate", None)):
        raise TypeError(
            f"{method} expects an object with allocate(size, *, dtype, device) and __call__ "
            f"(torch's AllGather / ReduceScatter protocol), got {type(comm).__name__}"
        )


def _check_collectives(state: FSDPState, method: str) -> None:
    """A one-rank unit initialised without collectives (the ``local`` transport, see
    [Note: a shard group of one rank]) cannot start running them: say when to call."""
    if state.group.transport.local:
        raise RuntimeError(
            f"{method} on unit {state.group.name!r}: its shard group has one rank and it was "
            "initialised (at the first forward) without collectives, so there is nothing to "
            f"customise now; call {method} before the first forward"
        )


def _on_cpu_group(state: FSDPState) -> bool:
    return state.group.device.type == "cpu"


class UnshardHandle(_TorchUnshardHandle):
    """Returned by ``FSDPModule.unshard(async_op=True)``; :meth:`wait` finishes the gather."""

    def __init__(self, group: ParamGroup | None) -> None:
        self._group = group

    def wait(self) -> None:
        """Block until the unit's parameters are unsharded and registered."""
        if self._group is not None:
            self._group.wait_for_unshard()
            self._group = None


class FSDPModule(_TorchFSDPModule):
    """Added to the class of every module ``fully_shard`` was applied to (FSDP2's methods).

    ``isinstance(unit, torch.distributed.fsdp.FSDPModule)`` is true. Indexing or slicing a
    sharded container (``seq[1:]``) builds a plain container of the original class, as in FSDP2.
    """

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        # Construct the original class (e.g. ``nn.Sequential.__getitem__(slice)`` calls
        # ``self.__class__(...)``): the new container is not a unit.
        orig = next(c for c in cls.__mro__ if not issubclass(c, _TorchFSDPModule))
        self = orig.__new__(orig, *args, **kwargs)
        self.__init__(*args, **kwargs)  # type: ignore[misc]
        return self

    def _get_fsdp_state(self) -> Any:  # type: ignore[override]
        """The unit's state in FSDP2's shape, as ``fully_shard.state(module)`` gives it
        (``_fsdp_param_group``, ``_fsdp_param_groups``, ``_lazy_init()``, ``_training_state``):
        code written for FSDP2 (verl, trainers' gradient probes, DINOv3's resharding) reaches
        FSDP2's ``FSDPState`` here. fullshard's own state: :func:`unit_state`."""
        return fully_shard_state(cast(nn.Module, self))

    def _states(self, recurse: bool) -> list[FSDPState]:
        st = unit_state(cast(nn.Module, self))
        return st.subtree_states() if recurse else [st]

    # ------------------------------------------------------------------ gather / free
    def unshard(self, async_op: bool = False) -> UnshardHandle | None:  # type: ignore[override]
        """All-gather this unit's parameters (not recursive), following ``mp_policy``.

        With ``async_op`` return a handle; the unit's pre-forward waits on a pending unshard,
        so ``wait()`` is needed only to use the parameters before that.
        """
        state = unit_state(cast(nn.Module, self))
        if state.ctx is None:
            state.outermost().lazy_init()
        group = state.group
        group.unshard()
        handle = UnshardHandle(group)
        if async_op:
            return handle
        handle.wait()
        return None

    def reshard(self) -> None:
        """Free this unit's unsharded parameters and register the sharded ones (not recursive)."""
        unit_state(cast(nn.Module, self)).group.reshard()

    def reset_iter_state(self) -> None:
        """Recover after an exception aborted a forward or backward mid-flight (root only).

        Waits for collectives in flight, reshards every unit, discards pending gradient
        reductions (the failed iteration's gradients are lost, including gradients accumulated
        with gradient sync off) and clears the per-iteration state, so the next iteration runs
        normally. Raises ``RuntimeError`` on a non-root unit.
        """
        require_method("reset_iter_state")
        root = unit_state(cast(nn.Module, self))
        if root.ctx is None:  # no forward ran yet: nothing to reset
            return
        if not root.is_root:
            raise RuntimeError(
                f"reset_iter_state must be called on the root FSDP module, not on the unit "
                f"{root.name!r}: call it on the module fully_shard was applied to last"
            )
        root.ctx.reset_iter_state()

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> Any:
        # ``to_empty`` / ``to`` may replace the registered DTensors: adopt the new ones.
        # super(_TorchFSDPModule, ...): skip torch's FSDPModule._apply (torch's engine state).
        ret = super(_TorchFSDPModule, self)._apply(fn, recurse)  # type: ignore[misc]
        adopt_applied_params(unit_state(cast(nn.Module, self)))
        return ret

    def set_keep_unsharded_storage(self, keep: bool, *, recurse: bool = True) -> None:
        """Whether resharding keeps the unsharded parameters' memory (torch 2.15's FSDP2).

        Kept, the unsharded buffer keeps its address across reshard and unshard (what CUDA
        graph capture needs), at the cost of holding it between uses; resharding then only
        registers the sharded parameters again. Default ``False``: resharding frees it.
        """
        require_method("set_keep_unsharded_storage")
        if not isinstance(keep, bool):
            raise TypeError(f"keep must be a bool, got {type(keep).__name__}")
        for st in self._states(recurse):
            for group in (st.group, *st.group.subgroups):
                group.keep_unsharded_storage = keep
                if not keep:
                    group.kept.clear()

    def set_manual_backward_finalization(self, enabled: bool) -> None:
        """Whether the caller ends each backward iteration with :meth:`finalize_backward`
        (call on the root, before the forward; torch 2.15's FSDP2). See [Note: manual backward
        finalization] in ``fullshard.engine.finalize``; it supersedes :meth:`set_is_last_backward`."""
        require_method("set_manual_backward_finalization")
        set_manual_backward_finalization(unit_state(cast(nn.Module, self)), enabled)

    @overload
    def finalize_backward(self, *, async_op: Literal[False] = False) -> None: ...

    @overload
    def finalize_backward(self, *, async_op: Literal[True]) -> GradientReductionHandle: ...

    @overload
    def finalize_backward(self, *, async_op: bool) -> GradientReductionHandle | None: ...

    def finalize_backward(self, *, async_op: bool = False) -> GradientReductionHandle | None:
        """Finish the backward iteration on the calling thread (root only, manual finalization).

        Reduces every unit's unreduced gradients under the current settings (gradient sync,
        reshard after backward), waits for the reductions and ends the iteration; before the
        root's first forward it does nothing. ``async_op=True`` issues the reductions and
        returns a :class:`GradientReductionHandle`; call its ``wait()`` before reading the
        gradients or starting the next iteration.
        """
        require_method("finalize_backward")
        return finalize_backward(unit_state(cast(nn.Module, self)), async_op)

    # --------------------------------------------------------------- gradient knobs
    def set_requires_gradient_sync(
        self, requires_gradient_sync: bool, *, recurse: bool = True
    ) -> None:
        """Turn gradient reduction on/off (off: accumulate unsharded gradients locally)."""
        for st in self._states(recurse):
            st.group.overrides.requires_gradient_sync = requires_gradient_sync

    def set_requires_all_reduce(self, requires_all_reduce: bool, *, recurse: bool = True) -> None:
        """HSDP: skip (False) or do the all-reduce across replicas after the reduce-scatter."""
        for st in self._states(recurse):
            st.group.overrides.requires_all_reduce = requires_all_reduce

    def set_reshard_after_backward(
        self, reshard_after_backward: bool, *, recurse: bool = True
    ) -> None:
        """Whether to free unsharded parameters after backward (False saves a re-gather)."""
        for st in self._states(recurse):
            st.group.reshard_after_backward = reshard_after_backward

    def set_reshard_after_forward(  # type: ignore[override]
        self, reshard_after_forward: bool | int, recurse: bool = True
    ) -> None:
        """Change the post-forward reshard policy: a bool as in FSDP2, or (fullshard) an int
        group size ``k`` that divides each unit's shard group size."""
        states = self._states(recurse)
        for st in states:  # validate all before changing any
            check_reshard_after_forward(reshard_after_forward, st.group.info)
        for st in states:
            st.reshard_after_forward = reshard_after_forward
            if st.ctx is not None:
                st.resolve_reshard()

    def set_is_last_backward(self, is_last_backward: bool) -> None:
        """Whether the next backward is the last of the step.

        ``False`` (e.g. all but the last micro-batch): the end of that backward does not wait
        for the last reductions still in flight; they finish during the next backward, so
        they overlap its compute. Gradients are complete once a backward with ``True`` ends.
        As in FSDP2 the flag is one for the whole model: after the first forward, calling it
        on any unit sets it; before, only the root's call counts (a unit's own is dropped
        when the root's lazy init makes the shared one, as FSDP2 drops it).
        """
        unit_state(cast(nn.Module, self)).is_last_backward = is_last_backward

    def set_gradient_divide_factor(self, factor: float) -> None:
        """Divide reduced gradients by ``factor`` instead of the data-parallel world size."""
        if factor <= 0:
            raise ValueError(f"gradient divide factor must be positive, got {factor}")
        for st in self._states(True):
            st.group.overrides.gradient_divide_factor = float(factor)
            st.group.settings_changed()  # fp16's split division packs the reduction

    def set_reduce_scatter_divide_factor(self, factor: float) -> None:
        """Deprecated FSDP2 name of :meth:`set_gradient_divide_factor`."""
        self.set_gradient_divide_factor(factor)

    def set_force_sum_reduction_for_comms(self, enable: bool) -> None:
        """Use only sum reductions in the collectives, dividing separately (FSDP2's meaning:
        gradients are still divided by the world size or the divide factor).

        fullshard's collectives always sum and divide separately, so this changes only what
        an all-reduce hook sees: the sum, with the division after the hook."""
        for st in self._states(True):
            st.group.overrides.force_sum_reduction = enable

    def set_reduce_scatter_unused_params(
        self, reduce_scatter_unused_params: bool, *, recurse: bool = True
    ) -> None:
        """Whether trainable parameters without a gradient join the reduction with zeros, so
        every rank issues the same reductions when ranks use different parameters (mixture of
        experts, conditional branches); like DDP's ``find_unused_parameters``.

        fullshard then reduces such units at the end of backward, in module order on every
        rank, so their reductions do not overlap backward compute (see
        [Note: unused parameters] in ``fullshard.engine.reduce``).
        """
        require_method("set_reduce_scatter_unused_params")
        for st in self._states(recurse):
            if reduce_scatter_unused_params:
                _check_collectives(st, "set_reduce_scatter_unused_params(True)")
            st.group.overrides.reduce_scatter_unused_params = bool(reduce_scatter_unused_params)

    def set_reduce_scatter_max_input_buffers(
        self, max_input_buffers: int, *, recurse: bool = True
    ) -> None:
        """How many gradient reductions may be in flight at once (FSDP2's reduce-scatter input
        buffers); ``1``, the default, finishes the previous unit's reduction before a unit
        issues its own.

        More keeps more reductions (and their buffers) alive, so a slow reduction does not stall
        the next unit's post-backward, at the cost of peak memory. The root's units share one
        cap, the largest any of them was given (as FSDP2).
        """
        require_method("set_reduce_scatter_max_input_buffers")
        if isinstance(max_input_buffers, bool) or not isinstance(max_input_buffers, int):
            raise TypeError(
                f"max_input_buffers must be an int, got {type(max_input_buffers).__name__}"
            )
        if max_input_buffers < 1:
            raise ValueError(f"max_input_buffers must be a positive int, got {max_input_buffers}")
        states = self._states(recurse)
        for st in states:  # validate all before changing any
            symmetric = getattr(st.group.overrides.reduce_scatter, "source", None) == "symmetric"
            _check_symm_buffers(st, max_input_buffers, symmetric=symmetric)
        contexts = []
        for st in states:
            st.group.overrides.max_input_buffers = max_input_buffers
            if st.ctx is not None and st.ctx not in contexts:
                contexts.append(st.ctx)
        for ctx in contexts:
            ctx.update_max_pending()

    def set_separate_reduce_scatter_group(
        self, enable: bool = True, *, recurse: bool = True
    ) -> None:
        """Give gradient reduce-scatters a process group of their own (``True``), separate
        from the all-gathers' shard group, so that the two can progress concurrently on
        backends that run one collective at a time per communicator; ``False`` goes back to
        the shared group.

        One group is created per distinct set of shard ranks among the units this call
        reaches (typically one), reused by later calls; only its members take part in
        creating it, but every member must make the call, like any collective setup.
        """
        require_method("set_separate_reduce_scatter_group")
        states = self._states(recurse)
        if not enable:
            for st in states:
                st.group.overrides.reduce_scatter_group = None
            return
        groups = separate_reduce_scatter_groups(
            [st.group.info.shard_group for st in states],
            [st.group.overrides.reduce_scatter_group for st in states],
        )
        for st, group in zip(states, groups):
            st.group.overrides.reduce_scatter_group = group

    def set_all_reduce_hook(
        self,
        hook: Callable[[torch.Tensor], None],
        *,
        stream: torch.cuda.Stream | None = None,
    ) -> None:
        """Call ``hook(reduce_output)`` on this unit's reduced gradients (not recursive).

        ``reduce_output`` is the 1-D reduce-scatter output (this rank's gradient shards back
        to back, padded), after the all-reduce across replicas with HSDP; the hook may modify
        it in place (e.g. an all-reduce over another group, a scaling) before it becomes the
        parameters' ``.grad``. See [Note: the all-reduce hook] in ``fullshard.engine.reduce``.
        ``stream`` (not with HSDP, as FSDP2): the stream to run the hook on, ordered after the
        reduce-scatter; the gradients are handed out after it (on the compute stream, which
        waits for it). On CUDA a ``torch.cuda.Stream`` of the unit's device; on the CPU a
        ``torch.Stream(device="cpu")`` (or ``torch.cpu.Stream``), which stands for a logical
        stream that ``fullshard.engine.streamcheck.check_streams()`` checks ([Note: a user's
        stream] in ``fullshard.engine.streams``); another object is refused. With HSDP (a 2-D
        mesh, whatever its replicate size) a stream is refused with FSDP2's ``ValueError``, its
        message exactly (torch's tests compare it whole).
        """
        state = unit_state(cast(nn.Module, self))
        if not callable(hook):
            raise TypeError(f"set_all_reduce_hook expects a callable, got {type(hook).__name__}")
        if stream is not None and state.group.info.replicate_group is not None:
            raise ValueError("stream cannot be set when using native HSDP")
        _check_collectives(state, "set_all_reduce_hook")
        if stream is not None:
            stream = user_stream(stream, state.group.device, "set_all_reduce_hook: stream")
        state.group.overrides.all_reduce_hook = hook
        state.group.overrides.hook_stream = stream

    # ------------------------------------------------------------- prefetch / unshard
    def set_modules_to_forward_prefetch(self, modules: list[FSDPModule]) -> None:  # type: ignore[override]
        """Explicit forward prefetch: start these units' all-gathers in this unit's pre-forward."""
        _check_fsdp_modules(modules, "set_modules_to_forward_prefetch")
        unit_state(cast(nn.Module, self)).forward_prefetch = [
            unit_state(cast(nn.Module, m)) for m in modules
        ]

    def set_modules_to_backward_prefetch(self, modules: list[FSDPModule]) -> None:  # type: ignore[override]
        """Explicit backward prefetch: start these units' all-gathers in this unit's pre-backward."""
        _check_fsdp_modules(modules, "set_modules_to_backward_prefetch")
        unit_state(cast(nn.Module, self)).backward_prefetch = [
            unit_state(cast(nn.Module, m)) for m in modules
        ]

    def set_unshard_in_backward(self, unshard_in_backward: bool) -> None:
        """Whether this unit gathers its parameters for backward (not recursive).

        ``False`` is for units whose backward reads no parameter (an embedding: its weight
        gradient needs only the indices): the unit's pre-backward all-gather is skipped; its
        gradients are still reduce-scattered.
        """
        unit_state(cast(nn.Module, self)).group.unshard_in_backward = unshard_in_backward

    def _set_unshard_async_op(self, async_op: bool) -> None:
        """FSDP2: issue pre-forward/pre-backward gathers with ``async_op`` so their buffers come
        from the default stream. fullshard always allocates on the current stream and issues
        gathers asynchronously (waited in pre-forward), i.e. it already behaves as ``True``,
        with implicit prefetch kept; either value is accepted and changes nothing."""
        if not isinstance(async_op, bool):
            raise TypeError(f"async_op must be a bool, got {type(async_op).__name__}")

    def set_post_optim_event(self, event: torch.Event) -> None:
        """Make the next forward's gathers wait on ``event`` (recorded after the optimizer step);
        the event is used once, then dropped.

        FSDP2 waits on this event *instead of* the current stream, to avoid false dependencies.
        fullshard issues its gathers from the current stream, so they already follow it; the
        event is waited on as well (correct, but no dependency is removed). On a CPU unit the
        call is accepted and changes nothing, as in FSDP2, whose CPU streams' ``wait_event``
        does nothing (the optimizer step is complete when ``step()`` returns); so is ``None``
        (FSDP2 then waits on the current stream, which fullshard's gathers follow anyway).
        """
        module = cast(nn.Module, self)
        if _on_cpu_group(unit_state(module)) or event is None:
            return
        handles: list[Any] = []

        def wait_once(*_: Any, **__: Any) -> None:
            event.wait()  # the current stream (where fullshard issues gathers) waits
            handles.pop().remove()

        handles.append(module.register_forward_pre_hook(wait_once, prepend=True))

    # ----------------------------------------------------------- custom collectives
    def set_custom_all_gather(self, comm: AllGatherComm) -> None:
        """Run this unit's all-gathers through ``comm`` (torch's ``AllGather`` protocol; not
        recursive): the gathered buffer comes from ``comm.allocate((numel,), dtype=,
        device=)`` and the collective is ``comm(output_tensor=, input_tensor=, group=,
        async_op=)``, which returns a Work (or ``None`` once done). The unit then gathers
        packed (one buffer, see ``fullshard.engine.transport``)."""
        _check_comm(comm, "set_custom_all_gather")
        state = unit_state(cast(nn.Module, self))
        _check_collectives(state, "set_custom_all_gather")
        state.group.overrides.all_gather = comm
        state.group.settings_changed()

    def set_custom_reduce_scatter(self, comm: ReduceScatterComm) -> None:
        """Run this unit's gradient reduce-scatters through ``comm`` (torch's
        ``ReduceScatter`` protocol; not recursive): input and output buffers come from
        ``comm.allocate`` and the collective is ``comm(output_tensor=, input_tensor=, group=,
        op=ReduceOp.SUM, async_op=)`` (fullshard divides separately). The unit then reduces
        packed."""
        _check_comm(comm, "set_custom_reduce_scatter")
        state = unit_state(cast(nn.Module, self))
        _check_collectives(state, "set_custom_reduce_scatter")
        state.group.overrides.reduce_scatter = comm
        state.group.settings_changed()

    def set_allocate_memory_from_process_group_for_comm(self, enable: bool) -> None:
        """Allocate this unit's communication buffers (all-gather output, reduce-scatter input
        and output) with the process group's own allocator (``True``; NCCL: from a memory
        pool registered with its communicators, for zero-copy transfers) or with
        ``torch.empty`` (``False``, the default). Not recursive, as in FSDP2.

        On a CPU unit it is accepted and changes nothing, as in FSDP2 (gloo has no allocator,
        FSDP2 falls back to ``torch.empty``). Cannot be combined with custom comms or
        :meth:`set_symm_mem_for_comm` (``FullyShardError``, an ``AssertionError`` as in
        FSDP2); see [Note: comm buffers from the backend] in ``fullshard.engine.overrides``.
        """
        state = unit_state(cast(nn.Module, self))
        if enable and _on_cpu_group(state):  # the buffers are torch.empty's already
            _check_no_other_buffer_knob(state, "process_group")
            return
        _set_backend_buffers(state, "process_group", enable)

    def set_symm_mem_for_comm(self, backend: Literal["NCCL"] = "NCCL") -> None:
        """Allocate this unit's communication buffers in symmetric memory (``backend``:
        ``"NCCL"``), so NCCL can use its symmetric-memory all-gather (copy engine on one node
        with ``NCCL_CTA_POLICY=2``) and reduce-scatter kernels. Not recursive, as in FSDP2.

        FSDP2 moves the reduce-scatter buffers too only after
        :meth:`set_force_sum_reduction_for_comms` (NCCL's symmetric reduce-scatter sums
        only); fullshard's reduce-scatters always sum, so both directions move. Hence
        ``set_reduce_scatter_max_input_buffers(> 1)`` is refused with it, as in FSDP2 (each
        buffer held would be a symmetric segment of its own). CUDA and NCCL only (CPU:
        ``RuntimeError``); cannot be combined with custom comms or
        :meth:`set_allocate_memory_from_process_group_for_comm`. Call it on every rank of
        the unit's groups (it synchronises them once).
        """
        require_method("set_symm_mem_for_comm")
        if backend != "NCCL":
            raise ValueError(f"set_symm_mem_for_comm supports backend='NCCL' only, got {backend!r}")
        state = unit_state(cast(nn.Module, self))
        if _on_cpu_group(state):
            raise RuntimeError(
                f"set_symm_mem_for_comm on unit {state.name!r}: symmetric memory needs CUDA and "
                f"an NCCL group; this unit computes on the CPU (leave it unset on CPU)"
            )
        _check_symm_buffers(state, state.group.overrides.max_input_buffers or 1, symmetric=True)
        from torch.distributed import _symmetric_memory as symm_mem

        if symm_mem.get_backend(state.group.device) != backend:  # fixed once memory exists
            symm_mem.set_backend(backend)
        _set_backend_buffers(state, "symmetric", True)
        # Every rank initialises its communicators now: a later rendezvous needs them.
        for group in {state.group.info.shard_group, state.group.reduce_group}:
            torch.distributed.barrier(group=group)


_KNOB = {
    "process_group": "set_allocate_memory_from_process_group_for_comm",
    "symmetric": "set_symm_mem_for_comm",
}


def _set_backend_buffers(state: FSDPState, source: BufferSource, enable: bool) -> None:
    """Point the unit's comm slots at fullshard's backend comms for ``source`` (``enable``)
    or back at the defaults, refusing a comm that another knob set."""
    ov, g, method = state.group.overrides, state.group, _KNOB[source]
    _check_no_other_buffer_knob(state, source)
    if not enable:
        ov.all_gather = ov.reduce_scatter = None
        return
    _check_collectives(state, method)
    ov.all_gather = BackendAllGather(source, lambda: g.info.shard_group)
    ov.reduce_scatter = BackendReduceScatter(source, lambda: g.reduce_group)


def _check_no_other_buffer_knob(state: FSDPState, source: BufferSource) -> None:
    """Refuse ``source``'s knob when another knob or a custom comm decides the buffers."""
    ov, method = state.group.overrides, _KNOB[source]
    for comm, kind in ((ov.all_gather, "all_gather"), (ov.reduce_scatter, "reduce_scatter")):
        other = getattr(comm, "source", None)
        if comm is not None and other != source:
            knob = _KNOB[other] if other in _KNOB else f"set_custom_{kind}"
            raise FullyShardError(
                f"{method} on unit {state.name!r}: its {kind.replace('_', '-')} buffers are "
                f"already decided by {knob} ({type(comm).__name__}); the two decide the same "
                f"buffers, use one of them"
            )


def _check_symm_buffers(state: FSDPState, max_input_buffers: int, *, symmetric: bool) -> None:
    """Symmetric reduce-scatter buffers allow one reduction in flight (as FSDP2)."""
    if symmetric and max_input_buffers > 1:
        raise ValueError(
            f"unit {state.name!r}: set_reduce_scatter_max_input_buffers({max_input_buffers}) "
            f"is not supported with set_symm_mem_for_comm (each buffer held would be a "
            f"symmetric-memory segment of its own); keep max_input_buffers=1 with symmetric "
            f"memory"
        )
