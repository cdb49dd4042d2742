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

[Note: the placement lives here]
Everything that depends on *how* a parameter is split across the shard group is a method of
this class: the padded per-rank size (``shard_numel``), each rank's unpadded piece
(:meth:`rank_numel`), writing this rank's shard into a communication slot
(:meth:`copy_local_into`), reading the unsharded parameter out of its gathered region
(:meth:`unsharded_view`) and cutting an unsharded gradient into per-rank pieces
(:meth:`grad_pieces`, :meth:`pack_grad`). The gather and reduce code (``fullshard.gather``,
``fullshard.reduce``) only moves those pieces, so another placement (``Shard(d)``, a
tensor-parallel DTensor, a tensor owned by one rank) is a change to this class alone.
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

    # ------------------------------------------------------------------ placement (layout)
    def copy_local_into(self, slot: torch.Tensor) -> None:
        """Write this rank's shard into ``slot`` (1-D, ``shard_numel`` elements; the padding
        is left as it is). Casts to ``slot``'s dtype and device (the H2D copy under offload)."""
        if self.local_numel:
            slot[: self.local_numel].copy_(self.local.reshape(-1), non_blocking=True)

    def rank_piece(self, slot: torch.Tensor, rank: int) -> torch.Tensor:
        """The part of a padded 1-D ``slot`` that carries shard rank ``rank``'s elements."""
        return slot[: self.rank_numel(rank)]

    def unsharded_view(self, region: torch.Tensor) -> torch.Tensor:
        """The unsharded parameter inside its gathered ``[world, shard_numel]`` region.

        ``Shard(0)`` makes it a plain view: the region is rank-major, so the first ``numel``
        elements are the parameter's rows in order.
        """
        return region.reshape(-1)[: self.numel].view(self.orig_shape)

    def grad_pieces(self, flat_grad: torch.Tensor) -> list[torch.Tensor]:
        """Per shard rank, the 1-D piece of the (flat, unsharded) gradient it reduces."""
        n = self.shard_numel
        return [flat_grad[r * n :][: self.rank_numel(r)] for r in range(self.info.shard_size)]

    def pack_grad(self, grad: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy the unsharded ``grad`` into ``dst`` (``[world, shard_numel]``), zero-padded."""
        world, n = dst.shape[0], self.shard_numel
        flat = grad.reshape(-1)
        full, rem = divmod(self.numel, n)
        if full:
            dst[:full].copy_(flat[: full * n].view(full, n))
        if full < world:
            dst[full, :rem].copy_(flat[full * n :])
            dst[full, rem:].zero_()
            dst[full + 1 :].zero_()

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
        if local_grad.dtype != self.orig_dtype:
            local_grad = local_grad.to(self.orig_dtype)
        local_grad = local_grad.view(self.local_shape)
        grad = self.sharded_param.grad
        if grad is None:
            if local_grad.device != self.local.device:
                local_grad = local_grad.to(self.local.device)
            # The gradient has the parameter's mesh, placements, shape, stride and dtype: reuse
            # its spec instead of ``DTensor.from_local`` (an autograd Function and a new spec
            # per gradient per step were a third of a small unit's step time).
            self.sharded_param.grad = _dtensor_like(local_grad, self.sharded_param)
        else:
            assert isinstance(grad, DTensor)
            grad._local_tensor.add_(local_grad.to(grad._local_tensor.device))


def _dtensor_like(local: torch.Tensor, like: torch.Tensor) -> DTensor:
    """A DTensor with ``like``'s spec around ``local`` (no autograd, no checks)."""
    assert isinstance(like, DTensor)
    # DTensor.__init__ is a no-op behind a dynamo guard; __new__ alone builds the tensor.
    return DTensor.__new__(DTensor, local, like._spec, requires_grad=False)
