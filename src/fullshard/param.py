"""ShardedParam: one parameter's life cycle between its sharded and unsharded forms.

The sharded form is what users and optimizers see: an ``nn.Parameter`` wrapping a ``DTensor``
(``Shard(0)``, or ``(Replicate(), Shard(0))`` for HSDP) registered on every module that
references the parameter. Rank ``r`` holds rows ``[r * c, min((r + 1) * c, n))`` of dim 0 with
``c = ceil(n / world)`` — ``torch.chunk`` semantics, the same as DTensor — so trailing ranks
may hold fewer rows or none. In communication buffers every rank's piece is padded at the
tail to ``c`` rows (``shard_numel`` elements), which makes a parameter's unsharded form a plain
view of a padded ``[world * c, ...]`` region.

The unsharded form is an ``nn.Parameter`` view into its unit's packed unsharded buffer; the
unit (:class:`fullshard.group.ParamGroup`) owns that buffer and swaps which form the modules
see. This object carries no communication logic.
"""

from __future__ import annotations

import math
import weakref

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from .mesh import MeshInfo

__all__ = ["ShardedParam"]


def _contiguous_stride(shape: torch.Size) -> tuple[int, ...]:
    stride, acc = [], 1
    for size in reversed(shape):
        stride.append(acc)
        acc *= max(size, 1)
    return tuple(reversed(stride))


class ShardedParam:
    """Sharded storage and metadata of one parameter (see the module docstring)."""

    def __init__(
        self,
        param: nn.Parameter,
        fqn: str,
        info: MeshInfo,
        device: torch.device,
        *,
        pin_memory: bool = False,
    ) -> None:
        if param.dim() == 0:
            raise ValueError(
                f"parameter {fqn!r} is 0-dimensional; fully_shard shards dim 0 (as FSDP2 does). "
                f"Store it with shape (1,) or pass it in ignored_params=..."
            )
        self.fqn = fqn
        # Every (module, attribute name) registering this parameter — more than one when tied.
        self.refs: list[tuple[nn.Module, str]] = []
        self.orig_shape: torch.Size = param.shape  # ND, global
        self.orig_dtype: torch.dtype = param.dtype
        self.requires_grad: bool = param.requires_grad
        self.info = info
        world, rank = info.shard_size, info.shard_rank
        rows = param.shape[0]
        self.chunk_rows = math.ceil(rows / world)  # rows per rank after tail padding
        self.row_numel = math.prod(param.shape[1:])
        self.shard_numel = self.chunk_rows * self.row_numel  # padded elements per rank
        self.local_rows = self.rank_rows(rank)
        self.local_shape = torch.Size((self.local_rows, *param.shape[1:]))
        self.local_numel = self.local_rows * self.row_numel
        self.numel = param.numel()
        start = rank * self.chunk_rows
        with torch.no_grad():
            if param.device.type == "meta":
                local = torch.empty(self.local_shape, dtype=param.dtype, device="meta")
            else:
                local = param.detach()[start : start + self.local_rows].to(device, copy=True)
                local = local.contiguous()
                # Pinned host memory only helps (and only exists) with an accelerator.
                if pin_memory and local.device.type == "cpu" and torch.cuda.is_available():
                    local = local.pin_memory()
        dtensor = DTensor.from_local(
            local,
            info.mesh,
            info.placements,
            run_check=False,
            shape=param.shape,
            stride=_contiguous_stride(param.shape),
        )
        self.sharded_param = nn.Parameter(dtensor, requires_grad=param.requires_grad)
        # The user's original Parameter, to recognise it when a module outside this unit still
        # holds it (tied weights across units). Weak: it must not keep full-size memory alive.
        self._orig_ref = weakref.ref(param)
        # Set by the owning ParamGroup once its unsharded buffer exists.
        self.unsharded_param: nn.Parameter | None = None
        # Unsharded gradient accumulated across micro-steps without sync (in reduce dtype).
        self.unsharded_accum_grad: torch.Tensor | None = None

    def rank_rows(self, rank: int) -> int:
        """Rows of shard rank ``rank``'s unpadded chunk (``local_rows`` on that rank)."""
        return max(0, min(self.chunk_rows, self.orig_shape[0] - rank * self.chunk_rows))

    def rank_numel(self, rank: int) -> int:
        """Elements of shard rank ``rank``'s unpadded chunk (``local_numel`` on that rank)."""
        return self.rank_rows(rank) * self.row_numel

    def is_original(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` is the user's Parameter this ShardedParam was made from."""
        return self._orig_ref() is tensor

    @property
    def local(self) -> torch.Tensor:
        """This rank's unpadded shard (a plain tensor sharing the DTensor's storage)."""
        dtensor = self.sharded_param
        assert isinstance(dtensor, DTensor)
        return dtensor._local_tensor

    def add_ref(self, module: nn.Module, name: str) -> None:
        """Record that ``module.<name>`` registers this parameter and point it at the shard."""
        if not any(m is module and n == name for m, n in self.refs):
            self.refs.append((module, name))
        module._parameters[name] = self.sharded_param

    def sync_from_modules(self) -> None:
        """Adopt the parameter currently registered on the first module that holds it.

        ``module.to_empty(...)``, ``load_state_dict(assign=True)`` or ``_apply`` may have
        replaced the registered Parameter; tied references are pointed at the new one.
        """
        module, name = self.refs[0]
        current = module._parameters[name]
        if current is self.sharded_param:
            return
        if not isinstance(current, DTensor) or current.shape != self.orig_shape:
            raise RuntimeError(
                f"parameter {self.fqn!r} was replaced by a "
                f"{type(current).__name__} of shape {tuple(current.shape) if current is not None else None}"
                f" after fully_shard; expected a DTensor of shape {tuple(self.orig_shape)}. "
                f"Modify sharded parameters in place (or through load_state_dict) instead."
            )
        if not isinstance(current, nn.Parameter):
            current = nn.Parameter(current, requires_grad=self.requires_grad)
        self.sharded_param = current
        for m, n in self.refs:
            m._parameters[n] = current

    def to_sharded(self) -> None:
        """Register the sharded DTensor parameter on every referencing module."""
        for module, name in self.refs:
            module._parameters[name] = self.sharded_param

    def to_unsharded(self) -> None:
        """Register the unsharded parameter (a view into the unit's buffer)."""
        assert self.unsharded_param is not None
        for module, name in self.refs:
            module._parameters[name] = self.unsharded_param

    def make_grad(self, local_grad: torch.Tensor) -> None:
        """Set (or accumulate into) the sharded gradient from this rank's reduced shard."""
        local_grad = local_grad.to(self.orig_dtype).view(self.local_shape)
        grad = self.sharded_param.grad
        if grad is None:
            if local_grad.device != self.local.device:
                local_grad = local_grad.to(self.local.device)
            self.sharded_param.grad = DTensor.from_local(
                local_grad,
                self.info.mesh,
                self.info.placements,
                run_check=False,
                shape=self.orig_shape,
                stride=_contiguous_stride(self.orig_shape),
            )
        else:
            assert isinstance(grad, DTensor)
            grad._local_tensor.add_(local_grad.to(grad._local_tensor.device))
