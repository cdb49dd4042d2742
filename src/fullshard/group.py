"""ParamGroup: one communication unit — its packed buffers and its sharded/unsharded machine.

[Note: packed layouts]
All-gather input: this rank's shards back to back, each padded to ``shard_numel`` elements
(``total`` elements in all). The all-gather output is rank-major, ``[world, total]``; the
copy-out splits its columns per parameter into the unsharded buffer, where parameter ``i``
occupies ``world * shard_numel_i`` contiguous elements — a padded ``[world * c_i, ...]``
tensor whose first ``n_i`` rows are the parameter. The reduce-scatter input is the same
``[world, total]`` layout built from the unsharded gradients (zero padding), so each rank's
output row is exactly its padded gradient shards. These packed buffers are what NCCL (and
the cases listed below) use; gloo skips them, see the next two notes.

[Note: gathering in pieces]
Where all-gathers are p2p exchanges (gloo, see fullshard.collectives), a unit skips the packed
buffer altogether: it allocates the unsharded buffer when the gather is issued, copies its own
shards into their rows, and receives every peer's shard of every parameter straight into that
parameter's row — one message per parameter and peer. No ``[world, total]`` buffer is
allocated and nothing is copied out, which saves a unit-sized buffer and a unit-sized copy per
gather. Packed gathers remain for NCCL, a low-precision wire dtype, and int ``k`` resharding.

[Note: reducing in pieces]
Likewise, where the reduce-scatter is a p2p exchange (gloo on 2 ranks), each parameter's
gradient rows are sent to their owner straight from the unsharded gradient, and the peer's rows
for this rank land in the output shard, where this rank's own rows are added on wait: no packed
``[world, total]`` buffer, no packing copy. The gradients stay alive until then (as the packed
buffer would). fp16's pre-division and a reduce dtype other than the gradients' still pack.

[Note: why storage is resized, not freed]
Autograd saves views of the unsharded parameters for backward. Freeing the unsharded buffer by
``untyped_storage().resize_(0)`` keeps those tensor objects (and the ``nn.Parameter`` leaves
autograd accumulates into) valid; re-gathering resizes the same storage back and refills it,
so the saved views see the parameters again without any re-registration.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from . import collectives as C
from .mesh import MeshInfo
from .param import ShardedParam
from .policies import CommPolicy, MixedPrecisionPolicy, OffloadPolicy
from .quant import dequantize_int8, quantize_int8

__all__ = ["ParamGroup", "ShardedState"]


class ShardedState(enum.Enum):
    """Which form of the parameters the modules currently see."""

    SHARDED = "sharded"
    UNSHARDED = "unsharded"


@dataclass
class _PartialReduce:
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


@dataclass
class _PendingReduce:
    """A reduce-scatter (and, for HSDP, the all-reduce after it) in flight."""

    handle: C.Handle
    output: torch.Tensor  # 1D, this rank's padded gradient shards
    params: list[ShardedParam]
    offsets: list[int]
    replicate_group: dist.ProcessGroup | None
    divide_after: float
    send: object  # what the collective reads (packed input or gradients) until it ends
    what: str  # for error messages
    # HSDP with set_requires_all_reduce(False): keep the reduce-scatter output as a partial
    # sum in ``partial`` (shared with the group) instead of producing gradients.
    partial: _PartialReduce | None = None
    allreduce_issued: bool = False

    def advance(self) -> None:
        """Once the reduce-scatter is done, start the all-reduce across replicas (HSDP)."""
        if self.replicate_group is not None and not self.allreduce_issued:
            self.handle.wait()
            self.send = None
            if self.partial is not None:
                self.partial.drain_into(self.output, self.params)
            self.handle = C.all_reduce(self.output, self.replicate_group, what=self.what)
            self.allreduce_issued = True

    def finish(self) -> None:
        """Wait, then hand every parameter its gradient shard (or keep a partial sum)."""
        self.advance()
        self.handle.wait()
        self.send = None
        if self.replicate_group is None and self.partial is not None:
            self.partial.add(self.output, self.params)
            return
        if self.divide_after != 1.0:
            self.output.div_(self.divide_after)
        for sp, off in zip(self.params, self.offsets):
            sp.make_grad(self.output[off : off + sp.local_numel])


class ParamGroup:
    """The parameters of one ``fully_shard`` unit, communicated together.

    Methods are the verbs of its state machine: :meth:`unshard` (issue the all-gather),
    :meth:`wait_for_unshard` (finish it and expose unsharded parameters), :meth:`reshard`
    (free them) and :meth:`reduce_grads` (pack and reduce-scatter gradients).
    """

    def __init__(
        self,
        params: list[ShardedParam],
        info: MeshInfo,
        device: torch.device,
        mp_policy: MixedPrecisionPolicy,
        offload_policy: OffloadPolicy,
        name: str,
        comm_policy: CommPolicy | None = None,
    ) -> None:
        self.params = params
        self.info = info
        self.device = device  # where unsharded parameters live and compute happens
        self.mp_policy = mp_policy
        self.offload_policy = offload_policy
        self.comm_policy = comm_policy or CommPolicy()
        self.name = name  # the unit's module FQN, for messages
        self.state = ShardedState.SHARDED
        # Knobs (set_* methods of FSDPModule).
        self.reshard_after_backward = True
        self.requires_gradient_sync = True
        self.requires_all_reduce = True
        self.gradient_divide_factor: float | None = None
        self.force_sum_reduction = False
        self._partial = _PartialReduce()  # HSDP accumulation without the all-reduce
        # Post-forward partial reshard (reshard_after_forward=int): kept chunk and its group.
        self.post_forward_group: dist.ProcessGroup | None = None
        self.post_forward_index = 0  # this rank's index within post_forward_group
        self._post_forward_chunk: torch.Tensor | None = None  # 1D [world/k * total]
        # All-gather in flight: (handle, output, input) — gloo reads the input asynchronously;
        # output and input are None when it gathers straight into the unsharded buffer.
        self._gather: tuple[C.Handle, torch.Tensor | None, torch.Tensor | None] | None = None
        self._unsharded_buf: torch.Tensor | None = None  # 1D, see [Note: packed layouts]
        self._grads_seen = 0
        self.backward_done = False  # reduce_grads already ran in this backward
        self._layout_key: list[int] = []  # ids of the params the layout was built for

    # ----------------------------------------------------------------------------- layout
    @property
    def world(self) -> int:
        return self.info.shard_size

    def _compute_dtype(self) -> torch.dtype:
        return self.mp_policy.param_dtype or self.params[0].orig_dtype

    def _accum_dtype(self) -> torch.dtype:
        """Dtype of unsharded gradients accumulated without sync (the reduce dtype)."""
        mp = self.mp_policy
        return mp.reduce_dtype or mp.param_dtype or self.params[0].orig_dtype

    def _wire_reduce_dtype(self) -> torch.dtype:
        return self.comm_policy.reduce_dtype or self._accum_dtype()

    def _wire_gather_dtype(self) -> torch.dtype:
        return self.comm_policy.all_gather_dtype or self._compute_dtype()

    def init_layout(self, on_grad_accumulated: Callable[[ShardedParam], None]) -> None:
        """Allocate the unsharded views (storage freed) and grad hooks; idempotent."""
        key = [id(sp) for sp in self.params]
        if self._layout_key == key or not self.params:
            return
        if self.state is not ShardedState.SHARDED:
            raise RuntimeError(f"unit {self.name!r}: cannot change its parameters while unsharded")
        dtypes = {sp.orig_dtype for sp in self.params}
        if len(dtypes) > 1 and self.mp_policy.param_dtype is None:
            listing = ", ".join(f"{sp.fqn}: {sp.orig_dtype}" for sp in self.params)
            raise ValueError(
                f"unit {self.name!r} mixes parameter dtypes ({listing}); one unit communicates "
                f"one packed buffer. Cast the module to one dtype, set "
                f"MixedPrecisionPolicy(param_dtype=...), or shard the odd parameters in their "
                f"own fully_shard call"
            )
        self.offsets = []
        off = 0
        for sp in self.params:
            self.offsets.append(off)
            off += sp.shard_numel
        self.total = off
        dtype = self._compute_dtype()
        buf = torch.empty(self.world * self.total, dtype=dtype, device=self.device)
        pos = 0
        for sp in self.params:
            region = buf[pos : pos + self.world * sp.shard_numel]
            view = region[: sp.numel].view(sp.orig_shape)
            up = nn.Parameter(view, requires_grad=sp.requires_grad)
            if sp.requires_grad:
                up.register_post_accumulate_grad_hook(lambda _p, sp=sp: on_grad_accumulated(sp))
            sp.unsharded_param = up
            pos += self.world * sp.shard_numel
        buf.untyped_storage().resize_(0)
        self._unsharded_buf = buf
        self._layout_key = key

    def _regions(self) -> list[torch.Tensor]:
        """Per-parameter ``[world, shard_numel]`` views of the unsharded buffer."""
        assert self._unsharded_buf is not None
        out, pos = [], 0
        for sp in self.params:
            n = self.world * sp.shard_numel
            out.append(self._unsharded_buf[pos : pos + n].view(self.world, sp.shard_numel))
            pos += n
        return out

    @property
    def unsharded_bytes_allocated(self) -> int:
        """Bytes currently held by the unsharded buffer (0 when resharded)."""
        if self._unsharded_buf is None:
            return 0
        return self._unsharded_buf.untyped_storage().nbytes()

    # ---------------------------------------------------------------------------- unshard
    def _check_materialised(self) -> None:
        meta = [sp.fqn for sp in self.params if sp.local.is_meta]
        if meta:
            raise RuntimeError(
                f"parameters of unit {self.name!r} are still on the meta device: {meta}. "
                f"Call module.to_empty(device=...) and then reset_parameters() (or load a "
                f"checkpoint) before the forward pass"
            )

    def _pack_shards(self, inp: torch.Tensor) -> torch.Tensor:
        """Copy this rank's shards into ``inp`` (1-D, ``total`` elements; casts to its dtype)."""
        self._check_materialised()
        for sp, off in zip(self.params, self.offsets):
            if sp.local_numel:
                inp[off : off + sp.local_numel].copy_(sp.local.reshape(-1), non_blocking=True)
        return inp

    def _decode(self, out: torch.Tensor) -> torch.Tensor:
        """The gathered ``[world, total]`` rows in compute dtype (dequantised if needed)."""
        dtype = self._compute_dtype()
        if out.dtype == dtype:
            return out.view(self.world, self.total)
        if out.dtype == torch.uint8:  # int8 wire format, see fullshard.quant
            rows = torch.empty(self.world, self.total, dtype=dtype, device=self.device)
            dequantize_int8(out.view(self.world, -1), self.total, self.comm_policy.block_size, rows)
            return rows
        return out.view(self.world, self.total).to(dtype)

    def unshard(self, async_op: bool = True) -> None:
        """Issue the all-gather of this unit's parameters (no-op if unsharded or in flight)."""
        if not self.params or self.state is ShardedState.UNSHARDED or self._gather is not None:
            return
        with torch.no_grad():
            wire = self._wire_gather_dtype()
            if self._post_forward_chunk is not None:  # kept in compute dtype
                inp, self._post_forward_chunk = self._post_forward_chunk, None
                group = self.post_forward_group
                assert group is not None
                out = torch.empty(
                    inp.numel() * dist.get_world_size(group), dtype=inp.dtype, device=self.device
                )
            elif wire == torch.int8:
                group = self.info.shard_group
                full = torch.empty(self.total, dtype=torch.float32, device=self.device)
                inp = quantize_int8(self._pack_shards(full), self.comm_policy.block_size)
                del full
                out = torch.empty(inp.numel() * self.world, dtype=inp.dtype, device=self.device)
            elif wire == self._compute_dtype() and self._gathers_in_pieces():
                self._gather = (self._gather_into_params(), None, None)
                return
            else:
                # Gather in place: this rank's slot of the output is the input (no extra copy).
                group = self.info.shard_group
                out = torch.empty(self.world * self.total, dtype=wire, device=self.device)
                inp = self._pack_shards(out.view(self.world, self.total)[self.info.shard_rank])
            handle = C.all_gather(out, inp, group, async_op=async_op, what=f"unit {self.name!r}")
        self._gather = (handle, out, inp)

    def _gathers_in_pieces(self) -> bool:
        """Whether all-gathers run as a p2p exchange (gloo), which can fill each parameter."""
        return C.auto_algorithm("all_gather", self.info.shard_group, self.device) == "p2p"

    def _gather_into_params(self) -> C.Handle:
        """All-gather straight into the unsharded buffer (see [Note: gathering in pieces])."""
        buf = self._unsharded_buf
        assert buf is not None
        self._check_materialised()
        me = self.info.shard_rank
        with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(buf):
            buf.untyped_storage().resize_(buf.numel() * buf.element_size())
            regions = self._regions()
            for sp, region in zip(self.params, regions):
                if sp.local_numel:
                    region[me, : sp.local_numel].copy_(sp.local.reshape(-1))
        pieces = [
            [region[r, : sp.rank_numel(r)] for sp, region in zip(self.params, regions)]
            for r in range(self.world)
        ]
        nbytes = buf.numel() * buf.element_size()
        what = f"unit {self.name!r}"
        return C.all_gather_pieces(pieces, self.info.shard_group, nbytes=nbytes, what=what)

    def wait_for_unshard(self) -> None:
        """Finish the all-gather (issuing it if needed) and expose the unsharded parameters."""
        if not self.params or self.state is ShardedState.UNSHARDED:
            return
        if self._gather is None:
            self.unshard(async_op=False)
        assert self._gather is not None and self._unsharded_buf is not None
        handle, out, _ = self._gather
        self._gather = None
        handle.wait()
        buf = self._unsharded_buf
        # Refilling the buffer is not a mutation autograd must see: saved views hold the same
        # values they had when saved (see [Note: why storage is resized, not freed]).
        if out is not None:  # gathered into a packed buffer: copy each parameter out
            with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(buf):
                buf.untyped_storage().resize_(buf.numel() * buf.element_size())
                sizes = [sp.shard_numel for sp in self.params]
                torch.split_with_sizes_copy(self._decode(out), sizes, dim=1, out=self._regions())
        for sp in self.params:
            sp.to_unsharded()
        self.state = ShardedState.UNSHARDED

    # ---------------------------------------------------------------------------- reshard
    def reshard(self) -> None:
        """Free the unsharded parameters and register the sharded ones."""
        if self._gather is not None:  # prefetched but never used
            self._gather[0].wait()
            self._gather = None
        if self.state is ShardedState.UNSHARDED:
            for sp in self.params:
                sp.to_sharded()
            self.state = ShardedState.SHARDED
        if self._unsharded_buf is not None:  # also a gather-in-pieces that was never waited on
            self._unsharded_buf.untyped_storage().resize_(0)

    def reshard_partial(self) -> None:
        """Reshard after forward but keep a copy sharded over ``post_forward_group`` (int k)."""
        if self.state is ShardedState.UNSHARDED and self.post_forward_group is not None:
            k = dist.get_world_size(self.post_forward_group)
            rows = self.world // k
            lo = self.post_forward_index * rows
            chunk = torch.empty(rows, self.total, dtype=self._compute_dtype(), device=self.device)
            with torch.no_grad():
                for region, off, sp in zip(self._regions(), self.offsets, self.params):
                    chunk[:, off : off + sp.shard_numel].copy_(region[lo : lo + rows])
            self.reshard()
            self._post_forward_chunk = chunk.view(-1)
        else:
            self.reshard()

    # ---------------------------------------------------------------------------- backward
    def on_grad_accumulated(self) -> bool:
        """Count a parameter whose gradient is ready; True when the whole unit is ready."""
        self._grads_seen += 1
        return self._grads_seen == sum(1 for sp in self.params if sp.requires_grad)

    def reduce_grads(self) -> _PendingReduce | None:
        """Post-backward: reshard, then pack and reduce-scatter the unit's gradients.

        Returns the reduction in flight (``None`` if there is nothing to reduce, e.g. while
        gradient sync is off, in which case gradients accumulate unsharded in reduce dtype).
        """
        self.backward_done = True
        reduce_dtype = self._accum_dtype()
        ready: list[tuple[ShardedParam, torch.Tensor]] = []
        with torch.no_grad():
            for sp in self.params:
                up = sp.unsharded_param
                grad = up.grad if up is not None else None
                if up is not None:
                    up.grad = None
                if grad is not None:
                    if sp.unsharded_accum_grad is not None:
                        sp.unsharded_accum_grad.add_(grad)
                        grad = sp.unsharded_accum_grad
                    elif grad.dtype != reduce_dtype and not self.requires_gradient_sync:
                        grad = grad.to(reduce_dtype)
                elif sp.unsharded_accum_grad is not None:
                    grad = sp.unsharded_accum_grad
                if grad is None:
                    continue
                if self.requires_gradient_sync:
                    sp.unsharded_accum_grad = None
                    ready.append((sp, grad))
                else:
                    sp.unsharded_accum_grad = grad
            del grad  # ``ready`` must hold the only references (see _reduce_scatter)
        if self.reshard_after_backward:
            self.reshard()
        if not ready:
            return None
        return self._reduce_scatter(ready, self._wire_reduce_dtype())

    def _reduce_scatter(
        self, ready: list[tuple[ShardedParam, torch.Tensor]], dtype: torch.dtype
    ) -> _PendingReduce:
        """Reduce-scatter ``ready``'s gradients: straight from the gradients on gloo's 2-rank
        exchange (see [Note: reducing in pieces]), else packed into one buffer — emptying
        ``ready`` as it packs, so each full-size gradient is freed right after its copy (peak:
        the buffer + one gradient)."""
        world = self.world
        offsets, off = [], 0
        for sp, _ in ready:
            offsets.append(off)
            off += sp.shard_numel
        total = off
        factor = self.gradient_divide_factor
        if factor is None:
            factor = float(world * self.info.replicate_size)
        if self.force_sum_reduction:
            factor = 1.0
        # fp16 sums overflow easily: divide by sqrt(factor) before and after the reduction.
        pre = math.sqrt(factor) if dtype == torch.float16 else 1.0
        hsdp = self.info.replicate_size > 1
        replicate = self.info.replicate_group if hsdp and self.requires_all_reduce else None
        partial = self._partial if hsdp else None
        what = f"gradients of unit {self.name!r}"
        group = self.info.shard_group
        if (
            pre == 1.0
            and C.auto_algorithm("reduce_scatter", group, self.device) == "p2p"
            and all(g.dtype == dtype and g.is_contiguous() for _, g in ready)
        ):
            params = [sp for sp, _ in ready]
            flats = [g.view(-1) for _, g in ready]
            ready.clear()
            handle, out = self._reduce_in_pieces(params, flats, offsets, total, dtype, what)
            return _PendingReduce(
                handle, out, params, offsets, replicate, factor, flats, what, partial=partial
            )
        with torch.no_grad():
            send = torch.empty(world, total, dtype=dtype, device=self.device)
            params = [sp for sp, _ in ready]
            grads: list[torch.Tensor | None] = [g for _, g in ready]
            ready.clear()
            for i, (sp, o) in enumerate(zip(params, offsets)):
                dst = send[:, o : o + sp.shard_numel]
                flat = grads[i].reshape(-1)  # type: ignore[union-attr]
                grads[i] = None  # the packed copy is all we need from here on
                full, rem = divmod(sp.numel, sp.shard_numel)
                if full:
                    dst[:full].copy_(flat[: full * sp.shard_numel].view(full, sp.shard_numel))
                if full < world:
                    dst[full, :rem].copy_(flat[full * sp.shard_numel :])
                    dst[full, rem:].zero_()
                    dst[full + 1 :].zero_()
                del flat
            if pre != 1.0:
                send.div_(pre)
            # One rank: the packed buffer already is the result (no copy, no second buffer).
            out = (
                send.view(-1) if world == 1 else torch.empty(total, dtype=dtype, device=self.device)
            )
            handle = C.reduce_scatter(out, send.view(-1), group, what=what)
        return _PendingReduce(
            handle, out, params, offsets, replicate, factor / pre, send, what, partial=partial
        )

    def _reduce_in_pieces(
        self,
        params: list[ShardedParam],
        flats: list[torch.Tensor],
        offsets: list[int],
        total: int,
        dtype: torch.dtype,
        what: str,
    ) -> tuple[C.Handle, torch.Tensor]:
        """Reduce-scatter straight from the flat gradients (see [Note: reducing in pieces]);
        returns the handle and the output shard buffer (``total`` elements)."""
        out = torch.empty(total, dtype=dtype, device=self.device)
        for sp, o in zip(params, offsets):  # padding: never read, but keep it finite
            if sp.local_numel < sp.shard_numel:
                out[o + sp.local_numel : o + sp.shard_numel].zero_()
        pieces = [
            [f[r * sp.shard_numel :][: sp.rank_numel(r)] for sp, f in zip(params, flats)]
            for r in range(self.world)
        ]
        outputs = [out[o : o + sp.local_numel] for sp, o in zip(params, offsets)]
        nbytes = self.world * total * out.element_size()
        group = self.info.shard_group
        return C.reduce_scatter_pieces(pieces, outputs, group, nbytes=nbytes, what=what), out

    def finish_backward(self) -> None:
        """End of backward: drop per-backward counters; free anything still gathered."""
        self._grads_seen = 0
        self.backward_done = False
        self._post_forward_chunk = None
        if self.reshard_after_backward:
            self.reshard()
