"""Gradient-norm clipping over sharded (DTensor) gradients."""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from .engine import all_reduce

__all__ = ["clip_grad_norm_"]


def _local(g: torch.Tensor) -> torch.Tensor:
    return g._local_tensor if isinstance(g, DTensor) else g


def clip_grad_norm_(
    parameters: Iterable[torch.Tensor] | torch.Tensor,
    max_norm: float,
    norm_type: float = 2.0,
    error_if_nonfinite: bool = False,
    foreach: bool | None = None,
) -> torch.Tensor:
    """Clip gradients in place so their global ``norm_type`` norm is at most ``max_norm``.

    Works on fullshard's DTensor gradients (and plain, replicated ones): each rank reduces its
    local shards, then one all-reduce per mesh dimension that shards (SUM of ``|g|^p``, or MAX
    for ``inf``) gives the global norm — the value ``torch.nn.utils.clip_grad_norm_`` would
    compute on the unsharded gradients. Returns that norm (a plain scalar tensor). A non-finite
    norm is returned as is (and clipping is skipped for it) unless ``error_if_nonfinite``.
    """
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    grads = [p.grad for p in parameters if p.grad is not None]
    p = float(norm_type)
    if p <= 0:
        raise ValueError(f"norm_type must be positive (or inf), got {norm_type}")
    if not grads:
        return torch.zeros(())
    device = _local(grads[0]).device
    # Group the partial results by the process groups they must be reduced over.
    partial: dict[tuple[int, ...], torch.Tensor] = {}
    groups: dict[tuple[int, ...], list[dist.ProcessGroup]] = {}
    for g in grads:
        key: tuple[int, ...] = ()
        pgs: list[dist.ProcessGroup] = []
        if isinstance(g, DTensor):
            for dim, placement in enumerate(g.placements):
                if isinstance(placement, (Shard, _StridedShard)):  # not a Shard subclass
                    pg = g.device_mesh.get_group(dim)
                    key += (id(pg),)
                    pgs.append(pg)
        local = _local(g).detach().float()
        if math.isinf(p):
            val = local.abs().max() if local.numel() else torch.zeros((), device=device)
            partial[key] = torch.maximum(partial.get(key, torch.zeros((), device=device)), val)
        else:
            val = (local.abs() ** p).sum() if p != 2 else (local * local).sum()
            partial[key] = partial.get(key, torch.zeros((), device=device)) + val
        groups[key] = pgs
    op = dist.ReduceOp.MAX if math.isinf(p) else dist.ReduceOp.SUM
    total = torch.zeros((), device=device)
    for key, value in partial.items():
        for pg in groups[key]:
            all_reduce(value, pg, op=op, async_op=False)
        total = torch.maximum(total, value) if math.isinf(p) else total + value
    norm = total if math.isinf(p) else total ** (1.0 / p)
    if not torch.isfinite(norm):
        if error_if_nonfinite:
            raise RuntimeError(
                f"the total norm of order {norm_type} of the gradients is {norm.item()}; "
                f"check the loss for inf/nan or lower the learning rate"
            )
        return norm
    coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    locals_ = [_local(g) for g in grads]
    if foreach is False:
        for t in locals_:
            t.mul_(coef.to(t.dtype))
    else:
        torch._foreach_mul_(locals_, coef)
    return norm
