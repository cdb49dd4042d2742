"""FSDP2's tensor-subclass all-gather extension: what a local shard says to gather.

[Note: the all-gather extension]
A parameter whose local shard is a tensor subclass defining ``fsdp_pre_all_gather`` and
``fsdp_post_all_gather`` (torch's protocol, e.g. torchao's float8 training weights) decides
what goes on the wire. Before each gather the unit calls

    inputs, metadata = shard.fsdp_pre_all_gather(mesh, outer_size, outer_stride, module, mp_policy)

(or the old one-argument form ``fsdp_pre_all_gather(mesh)``) and all-gathers each of the
``inputs`` on its own (each in its own dtype; inputs shorter than the padded shard on dim 0
are zero-padded), then calls

    unsharded, inner = shard.fsdp_post_all_gather(outputs, metadata, param_dtype)

the first time (``outputs``: every input gathered rank-major, ``[world * rows, ...]``), making
the unsharded parameter from ``unsharded`` (trimmed to the parameter's shape, as FSDP2 does),
and ``fsdp_post_all_gather(outputs, metadata, param_dtype, out=unsharded_param)`` after that,
with the storages of ``inner`` reallocated first (they are freed at reshard). ``outputs`` are
the same tensors on every gather (their storage freed at reshard and reallocated before the
next gather), as in FSDP2: an extension that computes with its gathered output as it is
(float8 weights) returns a view of it the first time and finds ``out`` refilled in place
after. Gradients are
reduced like any other parameter's. Such parameters sit outside the unit's packed buffer
(:class:`~fullshard.engine.group.ParamGroup` keeps them in ``extended``). As in FSDP2:

- ``mesh`` is the 1-D shard mesh; ``outer_size`` / ``outer_stride`` are the shape the shard
  group splits (a tensor-parallel parameter's *local* TP shape);
- ``Shard(d > 0)``: each input must have the shard's shape; the gathered pieces are joined
  along ``d`` (trailing ranks' padding dropped: uneven sizes work, which FSDP2 refuses), so
  ``outputs`` have the unsharded (local) shape;
- a tensor-parallel parameter (its DTensor's local tensor defines the protocol): the
  unsharded parameter is the TP DTensor around what ``fsdp_post_all_gather`` returns, and
  ``out=`` receives that DTensor (unwrap ``out._local_tensor``, as torchao does).

With int ``reshard_after_forward`` such parameters reshard fully. A custom all-gather
(``set_custom_all_gather``, or the backend buffers of ``set_symm_mem_for_comm`` /
``set_allocate_memory_from_process_group_for_comm``) allocates and runs each input's gather
too, as FSDP2's does (FSDP2 packs every input of the unit into one gather; fullshard issues
one per input, each through the comm); a custom reduce-scatter reduces their gradients with
the unit's others.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from . import collectives as C
from .overrides import allocate
from .param import ShardedParam
from .streamcheck import freed
from .unit import CommUnit

__all__ = ["ExtensionGather", "check_extension", "has_extension"]


def has_extension(local: torch.Tensor) -> bool:
    """Whether ``local`` (a local shard) defines FSDP2's all-gather extension."""
    return hasattr(local, "fsdp_pre_all_gather") or hasattr(local, "fsdp_post_all_gather")


def check_extension(sp: ShardedParam) -> None:
    """Refuse what the extension path does not handle, naming the parameter."""
    local = sp.local
    if not (hasattr(local, "fsdp_pre_all_gather") and hasattr(local, "fsdp_post_all_gather")):
        raise TypeError(
            f"parameter {sp.fqn!r} ({type(local).__name__}) defines only one of "
            f"fsdp_pre_all_gather / fsdp_post_all_gather; the all-gather extension needs both"
        )


@dataclass
class _Gathered:
    """One parameter's gathers in flight."""

    sp: ShardedParam
    handles: list[C.Handle]
    outputs: list[torch.Tensor]  # the kept outputs, each [world, *input shape]
    received: list[torch.Tensor]  # a custom all-gather's own buffers (copied into outputs)
    metadata: Any


class ExtensionGather:
    """The unit's extension parameters: issue their gathers, finish them, free them."""

    def __init__(self, params: list[ShardedParam], on_grad: Callable[[ShardedParam], None]):
        for sp in params:
            check_extension(sp)
        self.params = params
        self._on_grad = on_grad
        self._inner: dict[int, tuple[torch.Tensor, ...]] = {}  # id(sp) -> freed at reshard
        # id(sp) -> its all-gather outputs, 1-D: kept from one gather to the next (storage
        # freed at reshard), so every fsdp_post_all_gather sees the same tensors, as in FSDP2
        self._outputs: dict[int, list[torch.Tensor]] = {}
        self._pending: list[_Gathered] = []

    def start(self, g: CommUnit) -> None:
        """Call every shard's pre-all-gather and issue one all-gather per returned input."""
        world, group = g.world, g.info.shard_group
        comm = g.overrides.all_gather  # a custom AllGather runs these gathers too
        mesh = g.info.mesh
        if mesh.ndim == 2:  # HSDP: the extension sees the shard mesh, as in FSDP2
            assert mesh.mesh_dim_names is not None
            mesh = mesh[mesh.mesh_dim_names[-1]]
        for sp in self.params:
            local = sp.local
            if local.device != g.device:  # offload: gather from the compute device
                local = local.to(g.device, non_blocking=True)
            pre = local.fsdp_pre_all_gather  # type: ignore[attr-defined]
            if len(inspect.signature(pre).parameters) == 1:
                inputs, metadata = pre(mesh)
            else:
                module = sp.refs[0][0]
                stride = torch.empty(sp.data_shape, device="meta").stride()
                inputs, metadata = pre(mesh, sp.data_shape, stride, module, g.mp_policy)
            sends = [_padded(t, sp) for t in inputs]
            kept = self._kept_outputs(sp, [(world * t.numel(), t.dtype) for t in sends], g.device)
            handles, received = [], []
            what = f"unit {g.name!r}, parameter {sp.fqn!r} (all-gather extension)"
            for send, out in zip(sends, kept):
                if comm is not None:  # a custom all-gather gathers into what it allocates
                    out = allocate(comm, out.numel(), out.dtype, g.device)
                    received.append(out)
                with g.comm.streams.use("gather"):
                    handles.append(
                        C.all_gather(
                            out,
                            send.view(-1),
                            group,
                            what=what,
                            comm=comm or g.transport.all_gather,
                        )
                    )
            outputs = [out.view(world, *send.shape) for send, out in zip(sends, kept)]
            self._pending.append(_Gathered(sp, handles, outputs, received, metadata))

    def _kept_outputs(
        self, sp: ShardedParam, sizes: list[tuple[int, torch.dtype]], device: torch.device
    ) -> list[torch.Tensor]:
        """``sp``'s all-gather outputs with storage (the same tensors each gather while the
        inputs keep their sizes and dtypes; new ones when they change)."""
        kept = self._outputs.get(id(sp))
        if kept is None or [(t.numel(), t.dtype) for t in kept] != sizes:
            kept = [torch.empty(n, dtype=dtype, device=device) for n, dtype in sizes]
            self._outputs[id(sp)] = kept
        for t in kept:
            t.untyped_storage().resize_(t.numel() * t.element_size())
        return kept

    def finish(self, g: CommUnit) -> None:
        """Wait for the gathers and build (first time) or refill the unsharded parameters."""
        pending, self._pending = self._pending, []
        dtype = g.mp_policy.param_dtype
        for item in pending:
            for h in item.handles:
                h.wait()
            for out, got in zip(item.outputs, item.received):
                out.view(-1).copy_(got)
            sp, local = item.sp, item.sp.local
            post = local.fsdp_post_all_gather  # type: ignore[attr-defined]
            outputs = tuple(_joined(out, sp) for out in item.outputs)
            with torch.no_grad():
                if sp.unsharded_param is None:
                    full, inner = post(outputs, item.metadata, dtype or sp.orig_dtype)
                    stride = torch.empty(sp.data_shape, device="meta").stride()
                    # ``.data``: a version counter of its own, so refilling the kept outputs
                    # (which ``full`` may alias) does not look like an in-place write to
                    # autograd (see [Note: one version counter per unsharded parameter])
                    data = torch.as_strided(full, sp.data_shape, stride, 0).data
                    up = nn.Parameter(sp.as_unsharded(data), requires_grad=sp.requires_grad)
                    sp.unsharded_param = up
                    if sp.requires_grad:
                        sp.hook_grad(self._on_grad)
                    self._inner[id(sp)] = tuple(inner)
                else:
                    for t in self._inner[id(sp)]:
                        t.untyped_storage().resize_(t.numel() * t.element_size())
                    with torch.autograd._unsafe_preserve_version_counter(sp.unsharded_param):
                        post(outputs, item.metadata, dtype or sp.orig_dtype, out=sp.unsharded_param)

    def wait_dropped(self) -> None:
        """A prefetch never used: wait for its gathers and forget them."""
        for item in self._pending:
            for h in item.handles:
                h.wait()
        self._pending = []

    def release(self) -> None:
        """Free the unsharded inner tensors and the gather outputs (storage resized to 0;
        the objects stay valid for the next gather)."""
        for t in self._held():
            freed(t.untyped_storage(), "an extension's gathered tensor")
            t.untyped_storage().resize_(0)

    def _held(self) -> list[torch.Tensor]:
        return [t for inner in self._inner.values() for t in inner] + [
            t for kept in self._outputs.values() for t in kept
        ]

    @property
    def bytes_allocated(self) -> int:
        storages = {t.untyped_storage().data_ptr(): t.untyped_storage() for t in self._held()}
        return sum(st.nbytes() for st in storages.values())


def _padded(t: torch.Tensor, sp: ShardedParam) -> torch.Tensor:
    """``t`` (an all-gather input) contiguous and zero-padded to ``chunk_rows`` on the
    sharded dim (dim 0, or the parameter's ``Shard(d)``)."""
    t = t.contiguous()
    dim, rows = sp.dim, sp.chunk_rows
    if dim == 0 and (t.dim() == 0 or t.shape[0] > rows):
        raise ValueError(
            f"fsdp_pre_all_gather of {sp.fqn!r} returned an input of shape {tuple(t.shape)}; "
            f"each input must have at most {rows} rows on dim 0 (the padded shard)"
        )
    if dim and t.shape != sp.local_shape:
        raise ValueError(
            f"fsdp_pre_all_gather of {sp.fqn!r} (sharded on dim {dim}) returned an input of "
            f"shape {tuple(t.shape)}; with Shard({dim}) each input must have the shard's "
            f"shape {tuple(sp.local_shape)} (its pieces are joined along dim {dim})"
        )
    if t.shape[dim] == rows:
        return t
    shape = list(t.shape)
    shape[dim] = rows
    out = t.new_zeros(shape)
    out.narrow(dim, 0, t.shape[dim]).copy_(t)
    return out


def _joined(out: torch.Tensor, sp: ShardedParam) -> torch.Tensor:
    """A gathered ``[world, *padded input]`` tensor as ``fsdp_post_all_gather`` sees it:
    rank-major on dim 0 (``[world * rows, ...]``, padding kept, as FSDP2), or for
    ``Shard(d > 0)`` the ranks' unpadded pieces joined along ``d`` (the unsharded shape)."""
    if sp.dim == 0:
        return out.view(-1, *out.shape[2:])
    pieces = [out[r].narrow(sp.dim, 0, sp.rank_rows(r)) for r in range(out.shape[0])]
    return torch.cat(pieces, dim=sp.dim)
