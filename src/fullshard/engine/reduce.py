"""The gradient side of a unit: collect unsharded gradients, reduce-scatter, hand out shards.

[Note: HSDP]
On a 2-D (replicate, shard) mesh the reduce-scatter over the shard group is followed by an
all-reduce of the output over the replicate group. ``set_requires_all_reduce(False)`` keeps
the reduce-scatter outputs as a partial sum instead (``PartialReduce``); the first reduction
with the all-reduce on adds it back.

[Note: unused parameters]
A unit reduce-scatters the gradients its parameters received, and its post-backward fires
once every trainable parameter has one. When ranks use different parameters (mixture of
experts, multi-modal branches) they would issue different reductions at different times.
``set_reduce_scatter_unused_params(True)`` (FSDP2's meaning) makes a parameter without a
gradient contribute zeros, so every rank reduces the same parameters; and because the
post-backward trigger counts gradients, which now differ per rank, such a unit's reduction
always waits for the end-of-backward callback, which completes units in module order on
every rank. The cost: those units' reductions do not overlap backward compute.

[Note: the all-reduce hook]
``set_all_reduce_hook`` (FSDP2) runs on the unit's reduced output (1-D, padded: this rank's
gradient shards back to back), after the HSDP all-reduce, before the shards are handed out. As
in FSDP2 on fp32/bf16 the output is already divided (a mean) when the hook sees it; with fp16's
split division only the pre-division is done and the rest follows the hook. A micro-step that
keeps a partial sum (``set_requires_all_reduce(False)``) runs no hook. With
``set_force_sum_reduction_for_comms(True)`` the hook sees the sum and the division follows it,
as in FSDP2 (fullshard's collectives are always sums with a separate division, so that knob
changes nothing else).

Without a stream the hook runs on the compute stream when the reduction finishes. With
``stream=`` (never with HSDP, as FSDP2) it runs on that stream ([Note: a user's stream] in
``fullshard.engine.streams``) as FSDP2's lines do: the hook stream waits for the
reduce-scatter (the handle is waited on while that stream is current), the division and the
hook run there, an event is recorded, and the compute stream waits for that event before the
shards are handed out. It starts where HSDP's all-reduce would (``StepContext.make_room``
:meth:`PendingReduce.advance`), so a hook's collective (torchft's cross-replica all-reduce)
stays in flight through the next unit's backward, and the packed input is kept until the
compute stream has waited.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.distributed as dist

from . import collectives as C
from .events import emit
from .kept import KeptBuffers
from .labels import labelled
from .overrides import CommOverrides, allocate
from .param import ShardedParam, dtensor_like
from .streams import CommStreams, current_stream, on_stream
from .unit import CommUnit

__all__ = [
    "GradDivision",
    "PartialReduce",
    "PendingReduce",
    "ReduceUnit",
    "Reduction",
    "collect_grads",
    "direct_output_nbytes",
    "fp16_pre_divide",
    "grad_division",
    "hand_out_local",
    "reduce_output",
    "start_reduce",
]


@dataclass
class PartialReduce:
    """Reduce-scatter outputs summed over micro-steps that skipped the HSDP all-reduce."""

    total: torch.Tensor | None = None
    params: list[ShardedParam] | None = None

    def add(self, output: torch.Tensor, params: list[ShardedParam]) -> None:
        self._check(params)
        if self.total is None:
            self.total, self.params = output, params
        else:
            self.total.add_(output)

    def drain_into(self, output: torch.Tensor, params: list[ShardedParam]) -> None:
        if self.total is not None:
            self._check(params)
            output.add_(self.total)
        self.total, self.params = None, None

    def _check(self, params: list[ShardedParam]) -> None:
        if self.params is not None and [id(p) for p in params] != [id(p) for p in self.params]:
            raise RuntimeError(
                "the parameters with gradients changed between micro-steps that skipped the "
                "all-reduce (set_requires_all_reduce(False)); keep the same parameters in use"
            )


class ReduceUnit(CommUnit, Protocol):
    """What the reduction reads of a unit (``ParamGroup`` is one), beyond ``CommUnit``."""

    @property
    def own_params(self) -> list[ShardedParam]:
        """The parameters whose gradients this group reduces itself."""

    @property
    def subgroups(self) -> Sequence[object]:
        """Child groups (per dtype or mesh), which reduce their own gradients."""

    @property
    def partial(self) -> PartialReduce:
        """HSDP sums kept across micro-steps without the all-reduce."""

    @property
    def reduce_group(self) -> dist.ProcessGroup: ...

    @property
    def pin_memory(self) -> bool: ...

    def accum_dtype(self) -> torch.dtype: ...

    def wire_reduce_dtype(self) -> torch.dtype: ...

    def unsharded_nbytes(self) -> int: ...

    @property
    def keep_unsharded_storage(self) -> bool: ...

    @property
    def kept(self) -> KeptBuffers:
        """The buffers kept across steps ([Note: a capturable step] in ``fullshard.engine.kept``)."""


@dataclass
class PendingReduce:
    """A reduce-scatter (and, for HSDP, the all-reduce after it) in flight."""

    unit: str
    handle: C.Handle
    output: torch.Tensor  # 1D, this rank's padded gradient shards
    params: list[ShardedParam]
    offsets: list[int]
    replicate_group: dist.ProcessGroup | None
    division: GradDivision
    send: object  # what the collective reads (packed input or gradients) until it ends
    what: str  # for error messages
    streams: CommStreams
    offload: bool = False
    pin: bool = False
    # HSDP with set_requires_all_reduce(False): keep the reduce-scatter output as a partial
    # sum in ``partial`` (shared with the group) instead of producing gradients.
    partial: PartialReduce | None = None
    allreduce_issued: bool = False
    overrides: CommOverrides | None = None  # the unit's, for the all-reduce hook
    nbytes: int = 0  # the unit's unsharded bytes (the host strategy's room for reductions)
    hooked: Any = None  # the hook stream's event once the hook ran there (advance)
    # the unit's kept buffers and the ones this reduction took ([Note: a capturable step])
    kept: tuple[KeptBuffers, tuple[torch.Tensor, ...]] | None = None

    @property
    def continues(self) -> bool:
        """Whether work that follows the reduce-scatter off the compute stream is still to
        start (:meth:`advance`): the all-reduce across replicas (HSDP), or the all-reduce hook
        on its own stream."""
        if self.replicate_group is not None:
            return not self.allreduce_issued
        return self._hook_stream() is not None and self.hooked is None

    def advance(self) -> None:
        """Once the reduce-scatter is done, start the all-reduce across replicas (HSDP), or
        run the all-reduce hook on its stream ([Note: the all-reduce hook])."""
        if self.replicate_group is not None and not self.allreduce_issued:
            self.handle.wait()
            self.send = None
            if self.partial is not None:
                self.partial.drain_into(self.output, self.params)
            with self.streams.use("reduce"):
                self.handle = C.all_reduce(self.output, self.replicate_group, what=self.what)
            self.allreduce_issued = True
            emit("allreduce_issue", self.unit)
        stream = self._hook_stream()
        if stream is not None and self.hooked is None:
            with on_stream(stream):
                self.handle.wait()  # the hook stream waits for the reduce-scatter
                self._divide_and_hook()
                self.hooked = stream.record_event()

    def _hook_stream(self) -> Any:
        """The stream the all-reduce hook runs on, if the unit gave it one (never with HSDP:
        ``set_all_reduce_hook`` refuses a stream there, as FSDP2)."""
        o = self.overrides
        if o is None or o.all_reduce_hook is None or self.partial is not None:
            return None
        return o.hook_stream

    def _divide_and_hook(self) -> None:
        """Divide the reduced output and run the all-reduce hook on it, in the order [Note:
        the all-reduce hook] says, on the current stream."""
        hook = self.overrides.all_reduce_hook if self.overrides is not None else None
        post, mean_first = self.division.post, self.division.hook_sees_mean
        if post != 1.0 and (hook is None or mean_first):
            self.output.div_(post)
        if hook is not None:
            hook(self.output)
            if post != 1.0 and not mean_first:
                self.output.div_(post)

    def discard(self) -> None:
        """Wait for everything in flight; the results are dropped (``reset_iter_state``)."""
        self.handle.wait()
        self._wait_hook()
        self._give_back(handed=False)

    def _give_back(self, handed: bool) -> None:
        """The collective has been waited on: the kept buffers are free again, or forgotten
        if the output became gradients (``handed``; [Note: a capturable step])."""
        if self.kept is not None:
            kept, bufs = self.kept
            if handed:  # the output (bufs[0]; the input too where it is the output)
                kept.forget(bufs[0])
            kept.give_back(*bufs)
            self.kept = None

    def _wait_hook(self) -> bool:
        """The current stream waits for the hook's stream, if the hook ran there."""
        if self.hooked is None:
            return False
        current_stream(self.output.device).wait_event(self.hooked)  # the hand-out waits
        return True

    @labelled("reduce_scatter_wait", unit_attr="unit")
    def finish(self) -> None:
        """Wait, then hand every parameter its gradient shard (or keep a partial sum)."""
        self.advance()
        self.handle.wait()
        emit("reduce_wait", self.unit)
        hooked = self._wait_hook()
        self.send = None  # the compute stream has waited for the collective: safe to free
        if self.replicate_group is None and self.partial is not None:
            self._give_back(handed=self.partial.total is None)  # the first becomes the sum
            self.partial.add(self.output, self.params)
            return
        if not hooked:
            self._divide_and_hook()
        # a shard without a gradient yet becomes one as it is: the output is handed over
        self._give_back(handed=any(sp.sharded_param.grad is None for sp in self.params))
        for sp, off in zip(self.params, self.offsets):
            shard = self.output[off : off + sp.local_numel]
            # a CPU run copies too ([Note: the offload copy on the CPU] in
            # fullshard.engine.streams), but moves nothing between devices
            if self.offload:
                # Cast on the device (as FSDP2), so the host never computes on a copy in flight;
                # where the host reads the gradient at once (added into an existing one, or a
                # post-accumulate-grad hook), wait for the copy first.
                shard = shard.to(sp.orig_dtype)
                if shard.device.type != "cpu":
                    emit("d2h", self.unit, nbytes=shard.numel() * shard.element_size())
                shard = self.streams.to_host(shard, self.pin)
                if sp.reads_grad_on_arrival():
                    self.streams.wait_host_copies()
            sp.make_grad(shard)


def collect_grads(g: ReduceUnit) -> list[tuple[ShardedParam, torch.Tensor]]:
    """Take the unit's unsharded gradients off its parameters.

    With gradient sync on, returns ``(param, gradient)`` pairs to reduce (accumulated
    gradients from skipped micro-steps added in). With it off, gradients are accumulated
    unsharded (in the reduce dtype) and nothing is returned.
    """
    reduce_dtype = g.accum_dtype()
    # see [Note: unused parameters]
    unused_as_zeros = (
        g.overrides.reduce_scatter_unused_params and g.overrides.requires_gradient_sync
    )
    ready: list[tuple[ShardedParam, torch.Tensor]] = []
    with torch.no_grad():
        for sp in g.own_params:
            up = sp.unsharded_param
            grad = up.grad if up is not None else None
            if up is not None:
                up.grad = None
            if grad is not None:
                grad = sp.grad_data(grad, reduce_dtype)
            if grad is not None:
                if sp.unsharded_accum_grad is not None:
                    sp.unsharded_accum_grad.add_(grad)
                    grad = sp.unsharded_accum_grad
                elif grad.dtype != reduce_dtype and not g.overrides.requires_gradient_sync:
                    grad = grad.to(reduce_dtype)
            elif sp.unsharded_accum_grad is not None:
                grad = sp.unsharded_accum_grad
            elif unused_as_zeros and sp.requires_grad and up is not None:
                grad = torch.zeros(sp.data_shape, dtype=up.dtype, device=g.device)
            if grad is None:
                continue
            if g.overrides.requires_gradient_sync:
                sp.unsharded_accum_grad = None
                ready.append((sp, grad))
            else:
                sp.unsharded_accum_grad = grad
        del grad  # ``ready`` must hold the only references (see _reduce_packed)
    return ready


def fp16_pre_divide(factor: float) -> float:
    """What fp16 gradients are divided by before the reduction (the rest of ``factor`` after
    it): fp16 sums overflow easily, so about the square root of ``factor``, rounded up to a
    power of two so the division itself is exact (as FSDP2 splits it)."""
    if factor <= 1.0:
        return 1.0
    return 2.0 ** math.ceil(math.log2(factor) / 2)


@dataclass(frozen=True)
class GradDivision:
    """How a unit's reduced gradients are divided: ``pre`` before the reduction, ``post``
    after it (``pre * post`` is the whole factor), and whether an all-reduce hook runs after
    the division (it sees the mean) or before ``post`` (it sees the sum)."""

    pre: float
    post: float
    hook_sees_mean: bool

    @property
    def factor(self) -> float:
        """The whole factor (exactly ``pre * post``: ``pre`` is a power of two)."""
        return self.pre * self.post


def grad_division(g: ReduceUnit, dtype: torch.dtype) -> GradDivision:
    """The one place a unit's gradient division is decided, for every transport (packed, a
    plug-in's, local) and every shard group size.

    The factor is ``set_gradient_divide_factor``'s, else the data-parallel size (shard x
    replicate ranks: the mean). fp16 (``dtype``, the dtype reduced in) splits it around the
    reduction (:func:`fp16_pre_divide`). ``set_force_sum_reduction_for_comms`` changes only
    when an all-reduce hook runs (see [Note: the all-reduce hook]), never the factor: as in
    FSDP2, the gradients are divided by it all the same.
    """
    factor = g.overrides.gradient_divide_factor
    if factor is None:
        factor = float(g.world * g.info.replicate_size)
    fp16 = dtype == torch.float16
    pre = fp16_pre_divide(factor) if fp16 else 1.0
    return GradDivision(pre, factor / pre, not fp16 and not g.overrides.force_sum_reduction)


@dataclass
class Reduction:
    """One unit's gradients about to be reduced: what every way of reducing them reads."""

    params: list[ShardedParam]
    grads: list[torch.Tensor | None]  # each dropped once it is packed or sent
    offsets: list[int]  # each parameter's first element in the packed row
    total: int  # elements of one rank's packed row
    dtype: torch.dtype  # the dtype reduced in
    what: str  # for errors


def start_reduce(g: ReduceUnit, ready: list[tuple[ShardedParam, torch.Tensor]]) -> PendingReduce:
    """Reduce-scatter ``ready``'s gradients the way the unit's transport says; empties
    ``ready`` (so the caller holds no gradient references)."""
    dtype = g.wire_reduce_dtype()
    offsets, off = [], 0
    for sp, _ in ready:
        offsets.append(off)
        off += sp.shard_numel
    division = grad_division(g, dtype)
    hsdp = g.info.replicate_size > 1
    params = [sp for sp, _ in ready]
    r = Reduction(
        params, [grad for _, grad in ready], offsets, off, dtype, f"gradients of unit {g.name!r}"
    )
    ready.clear()
    # the unit's transport, decided once (transport.decide): a plug-in's own way
    # of reducing (None where it cannot send these gradients as they are), else packed
    reduce = g.transport.reduce
    with torch.no_grad():
        sent = reduce(g, r) if reduce else None
        if sent is None:
            emit("reduce_issue", g.name, "packed")
            sent = _reduce_packed(g, r, division.pre)
    handle, out, send = sent
    return PendingReduce(
        g.name,
        handle,
        out,
        params,
        offsets,
        g.info.replicate_group if hsdp and g.overrides.requires_all_reduce else None,
        division,
        send,
        r.what,
        g.comm.streams,
        offload=g.offloaded,
        pin=g.pin_memory,
        partial=g.partial if hsdp else None,
        overrides=g.overrides,
        nbytes=g.unsharded_nbytes(),
        kept=_taken(g, out, send),
    )


def _taken(
    g: ReduceUnit, out: torch.Tensor, send: object
) -> tuple[KeptBuffers, tuple[torch.Tensor, ...]] | None:
    """What :attr:`PendingReduce.kept` holds: only with kept buffers (it keeps ``send``
    referenced until the reduction finishes)."""
    if not g.keep_unsharded_storage:
        return None
    return g.kept, (out, *([send] if isinstance(send, torch.Tensor) else []))


def _reduce_packed(
    g: ReduceUnit, r: Reduction, pre: float
) -> tuple[C.Handle, torch.Tensor, object]:
    """Pack the gradients into one ``[world, total]`` buffer and reduce-scatter it.

    Packing runs on the compute stream and drops each full-size gradient right after its copy
    (peak: the buffer + one gradient); only the collective runs on the reduce stream.
    """
    world, total, dtype, grads = g.world, r.total, r.dtype, r.grads
    comm = g.overrides.reduce_scatter  # custom ReduceScatter: allocates, runs the collective
    keep = g.keep_unsharded_storage and comm is None  # [Note: a capturable step]
    n = world * total
    send = g.kept.take(keep, "reduce_in", n, dtype, lambda: allocate(comm, n, dtype, g.device))
    send = send.view(world, total)
    for i, (sp, o) in enumerate(zip(r.params, r.offsets)):
        grad = grads[i]
        assert grad is not None
        grads[i] = None  # the packed copy is all we need from here on
        sp.pack_grad(grad, send[:, o : o + sp.shard_numel])
        del grad
    if pre != 1.0:
        send.div_(pre)
    # One rank: the packed buffer already is the result (no copy, no second buffer).
    if world == 1:
        out = send.view(-1)
    else:
        out = (
            allocate(comm, total, dtype, g.device)
            if comm is not None
            else reduce_output(g, total, dtype)
        )
    with g.comm.streams.use("reduce"):
        handle = C.reduce_scatter(
            out, send.view(-1), g.reduce_group, what=r.what, comm=comm or g.transport.reduce_scatter
        )
    return handle, out, send


def direct_output_nbytes(g: ReduceUnit) -> int:
    """Bytes of the reduce-scatter output ``g``'s backward allocates (every parameter with a
    gradient) when that output becomes the gradient shards as it is, else 0 (the outputs are
    temporaries): what the host strategy may carve from memory it holds ([Note: the host
    strategy] in ``fullshard.engine.host``).
    """
    if (
        g.transport.local
        or not g.overrides.requires_gradient_sync
        or g.world == 1
        or g.subgroups
        or g.offloaded
        or g.overrides.reduce_scatter is not None
    ):
        return 0
    grads = [sp for sp in g.own_params if sp.requires_grad]
    if not grads:
        return 0
    dtype = g.wire_reduce_dtype()
    # not cast to the parameter's dtype, not added into gradients that already exist (then
    # the outputs are temporaries)
    if any(sp.orig_dtype != dtype or sp.sharded_param.grad is not None for sp in grads):
        return 0
    return sum(sp.shard_numel for sp in grads) * dtype.itemsize


def reduce_output(g: ReduceUnit, numel: int, dtype: torch.dtype) -> torch.Tensor:
    """The reduce-scatter output (it becomes the gradient shards): fresh, or from memory the
    host strategy holds for it ([Note: the host strategy] in ``fullshard.engine.host``)."""
    host = g.comm.host
    out = host.grad_output(g, numel, dtype) if host is not None else None
    if out is not None:
        return out
    make = lambda: torch.empty(numel, dtype=dtype, device=g.device)  # noqa: E731
    # not kept under offload: the copy to the host may still read it when the next one starts
    keep = g.keep_unsharded_storage and not g.offloaded
    return g.kept.take(keep, "reduce_out", numel, dtype, make)


def hand_out_local(g: ReduceUnit, ready: list[tuple[ShardedParam, torch.Tensor]]) -> None:
    """Local transport (one rank, unsharded parameters alias the shards): each gradient is
    its shard's gradient as it is (see [Note: a shard group of one rank] in
    ``fullshard.engine.transport``), divided as any reduction's (:func:`grad_division`); empties
    ``ready``."""
    factor = grad_division(g, g.wire_reduce_dtype()).factor
    emit("reduce_issue", g.name, "local")
    with torch.no_grad():
        for sp, grad in ready:
            if factor != 1.0:
                grad.div_(factor)  # autograd's accumulated tensor: nobody else holds it
            param = sp.sharded_param
            if param.grad is None:  # the shard's gradient is this tensor (no view, no copy)
                param.grad = dtensor_like(grad, param)
                sp.run_post_accumulate_grad_hooks()
            else:
                sp.make_grad(grad)
    ready.clear()
