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
with the storages of ``inner`` reallocated first (they are freed at reshard). Gradients are
reduced like any other parameter's. Such parameters sit outside the unit's packed buffer
(:class:`~fullshard.group.ParamGroup` keeps them in ``extended``); ``Shard(0)`` only, and not
for tensor-parallel DTensors or int ``reshard_after_forward`` (which keep FSDP2's limits).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from . import collectives as C

if TYPE_CHECKING:
    from .group import ParamGroup
    from .param import ShardedParam

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
    if sp.dim != 0 or sp.tp_mesh is not None:
        raise NotImplementedError(
            f"parameter {sp.fqn!r} uses the fsdp_pre_all_gather extension with "
            f"{'a tensor-parallel DTensor' if sp.tp_mesh is not None else f'Shard({sp.dim})'}; "
            f"the extension is supported for Shard(0) of plain parameters only"
        )


@dataclass
class _Gathered:
    """One parameter's gathers in flight."""

    sp: ShardedParam
    handles: list[C.Handle]
    outputs: list[torch.Tensor]  # each [world * rows, *rest]
    metadata: Any


class ExtensionGather:
    """The unit's extension parameters: issue their gathers, finish them, free them."""

    def __init__(self, params: list[ShardedParam], on_grad: Callable[[ShardedParam], None]):
        for sp in params:
            check_extension(sp)
        self.params = params
        self._on_grad = on_grad
        self._inner: dict[int, tuple[torch.Tensor, ...]] = {}  # id(sp) -> freed at reshard
        self._pending: list[_Gathered] = []

    def start(self, g: ParamGroup) -> None:
        """Call every shard's pre-all-gather and issue one all-gather per returned input."""
        world, group = g.world, g.info.shard_group
        for sp in self.params:
            local = sp.local
            if local.device != g.device:  # offload: gather from the compute device
                local = local.to(g.device, non_blocking=True)
            pre = local.fsdp_pre_all_gather  # type: ignore[attr-defined]
            if len(inspect.signature(pre).parameters) == 1:
                inputs, metadata = pre(g.info.mesh)
            else:
                module = sp.refs[0][0]
                stride = torch.empty(sp.orig_shape, device="meta").stride()
                inputs, metadata = pre(g.info.mesh, sp.orig_shape, stride, module, g.mp_policy)
            handles, outputs = [], []
            for t in inputs:
                send = _padded(t, sp.chunk_rows, sp.fqn)
                shape = (world * sp.chunk_rows, *send.shape[1:])
                out = torch.empty(shape, dtype=send.dtype, device=g.device)
                what = f"unit {g.name!r}, parameter {sp.fqn!r} (all-gather extension)"
                with g.streams.use("gather"):
                    handles.append(C.all_gather(out.view(-1), send.view(-1), group, what=what))
                outputs.append(out)
            self._pending.append(_Gathered(sp, handles, outputs, metadata))

    def finish(self, g: ParamGroup) -> None:
        """Wait for the gathers and build (first time) or refill the unsharded parameters."""
        pending, self._pending = self._pending, []
        dtype = g.mp_policy.param_dtype
        for item in pending:
            for h in item.handles:
                h.wait()
            sp, local = item.sp, item.sp.local
            post = local.fsdp_post_all_gather  # type: ignore[attr-defined]
            outputs = tuple(item.outputs)
            with torch.no_grad():
                if sp.unsharded_param is None:
                    full, inner = post(outputs, item.metadata, dtype or sp.orig_dtype)
                    stride = torch.empty(sp.orig_shape, device="meta").stride()
                    data = torch.as_strided(full, sp.orig_shape, stride, 0)
                    up = nn.Parameter(data, requires_grad=sp.requires_grad)
                    if sp.requires_grad:
                        up.register_post_accumulate_grad_hook(lambda _p, sp=sp: self._on_grad(sp))
                    sp.unsharded_param = up
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
        """Free the unsharded inner tensors (storage resized to 0; the objects stay valid)."""
        for inner in self._inner.values():
            for t in inner:
                t.untyped_storage().resize_(0)

    @property
    def bytes_allocated(self) -> int:
        return sum(t.untyped_storage().nbytes() for inner in self._inner.values() for t in inner)


def _padded(t: torch.Tensor, rows: int, fqn: str) -> torch.Tensor:
    """``t`` (an all-gather input) as a contiguous ``[rows, ...]`` tensor, zero-padded."""
    t = t.contiguous()
    if t.dim() == 0 or t.shape[0] > rows:
        raise ValueError(
            f"fsdp_pre_all_gather of {fqn!r} returned an input of shape {tuple(t.shape)}; "
            f"each input must have at most {rows} rows on dim 0 (the padded shard)"
        )
    if t.shape[0] == rows:
        return t
    out = t.new_zeros((rows, *t.shape[1:]))
    out[: t.shape[0]].copy_(t)
    return out
