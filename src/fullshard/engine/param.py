"""ShardedParam: one parameter's life cycle between its sharded and unsharded forms.

The sharded form is what users and optimizers see: an ``nn.Parameter`` wrapping a ``DTensor``
(``Shard(0)``, or ``(Replicate(), Shard(0))`` for HSDP; see the notes below for ``Shard(d)``
and tensor parallel) registered on every module that
references the parameter. Rank ``r`` holds rows ``[r * c, min((r + 1) * c, n))`` of dim 0 with
``c = ceil(n / world)`` — ``torch.chunk`` semantics, the same as DTensor — so trailing ranks
may hold fewer rows or none. In communication buffers every rank's piece is padded at the
tail to ``c`` rows (``shard_numel`` elements), which makes a parameter's unsharded form a plain
view of a padded ``[world * c, ...]`` region.

The unsharded form is an ``nn.Parameter`` view into its unit's packed unsharded buffer; the
unit (:class:`fullshard.engine.group.ParamGroup`) owns that buffer and swaps which form the modules
see. This object carries no communication logic.

[Note: the placement lives here]
Everything that depends on *how* a parameter is split across the shard group is a method of
this class: the padded per-rank size (``shard_numel``), each rank's unpadded piece
(:meth:`rank_numel`), writing this rank's shard into a communication slot
(:meth:`copy_local_into`), reading the unsharded parameter out of its gathered region
(:meth:`unsharded_view`) and cutting an unsharded gradient into per-rank pieces
(:meth:`grad_pieces`, :meth:`pack_grad`). The gather and reduce code (``fullshard.engine.gather``,
``fullshard.engine.reduce``) only moves those pieces, so another placement (``Shard(d)``, a
tensor-parallel DTensor, a tensor owned by one rank) is a change to this class alone.
``Shard(d > 0)`` (``shard_placement_fn``) splits dim ``d`` the same way; its unsharded form
is not a view of the gathered region, so it is a separate tensor that :meth:`copy_out` fills
after each gather (:meth:`free_unsharded` releases it), and :meth:`grad_pieces` /
:meth:`pack_grad` copy each rank's gradient piece out of the strided gradient.

[Note: composing with DTensor parallelism]
A parameter that is already a ``DTensor`` on other mesh dims (tensor or expert parallel, on
``mesh["tp"]`` beside the unit's ``mesh["dp"]``) is sharded like a plain one, but on its
*local* tensor (``data_shape``). The sharded form is a ``DTensor`` on the concatenated mesh
``(dp..., tp...)`` with placements ``(dp placement, *tp placements)``; where TP already
shards the same dim, the dp placement is ``_StridedShard(dim, split_factor)`` (FSDP2's
convention: dp's chunks interleave inside each TP chunk). The unsharded form wraps the
gathered local tensor in the TP ``DTensor`` again, so TP modules see what they expect, and
:meth:`grad_data` unwraps its gradient. The unit's communication runs over dp only; a gradient
autograd leaves in other placements than the parameter's (``Partial()`` on tp for a
TP-replicated norm weight under sequence parallelism) is redistributed first, over tp; one
that sums (from ``Partial()``) runs in the unit's reduce dtype
(``MixedPrecisionPolicy.reduce_dtype``), cast before it on the local tensor (so on every
torch, whatever DTensor's cast rules), as torch 2.15's FSDP2 (pytorch/pytorch#190626); in
``param_dtype`` that all-reduce would round bf16 sums.
With ``dp_mesh_dims`` (FSDP2's full-SPMD-mesh form) the parameter is a DTensor on the *full*
mesh with ``Replicate()`` on the dp dims; the sharded form stays on that mesh with each dp
shard dim's placement replaced (``_StridedShard`` where a later mesh dim shards the same
tensor dim), and gradients keep their dp placements (the reduction handles those dims).
"""

from __future__ import annotations

import math
import os
import weakref
from collections.abc import Callable

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from .compat import concatenate_meshes
from .errors import FullyShardError
from .mesh import MeshInfo
from .streamcheck import freed

__all__ = ["ShardedParam", "dtensor_like"]


def set_param(module: nn.Module, name: str, param: nn.Parameter) -> None:
    """Register ``param`` as ``module.<name>``: directly, or through the module's own
    ``__setattr__`` where its class overrides it (as FSDP2 and FSDP1 do, so such a module sees
    the swaps), unless ``FSDP_USE_UNSAFE_SETATTR=1`` (FSDP1's switch) says not to."""
    if (
        getattr(module.__setattr__, "__func__", None) is nn.Module.__setattr__
        or os.environ.get("FSDP_USE_UNSAFE_SETATTR", "") == "1"
    ):
        module._parameters[name] = param
    else:
        setattr(module, name, param)


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
        placement: Shard | None = None,
    ) -> None:
        if param.dim() == 0:  # FSDP2's message (it names the attribute), then fullshard's
            raise ValueError(
                f"fully_shard doesn't support scalar parameters. Change {fqn.rpartition('.')[2]} "
                f"to a 1D tensor with numel equal to 1.\n"
                f"parameter {fqn!r} is 0-dimensional; fully_shard shards dim 0 (as FSDP2 does). "
                f"Store it with shape (1,) or pass it in ignored_params=..."
            )
        self.fqn = fqn
        # Every (module, attribute name) registering this parameter — more than one when tied.
        self.refs: list[tuple[nn.Module, str]] = []
        self.orig_shape: torch.Size = param.shape  # ND, global (what users see)
        self.orig_dtype: torch.dtype = param.dtype
        # MixedPrecisionPolicy.param_dtype_override_fn kept it in its own dtype (set by init)
        self.keeps_own_dtype = False
        self.info = info
        # A parameter that is already a DTensor on other mesh dims (tensor parallel): its
        # *local* tensor is what this object shards over the data-parallel group, and the
        # unsharded form is that DTensor again ([Note: composing with DTensor parallelism]).
        self.tp_mesh: DeviceMesh | None = None
        self.tp_placements: tuple[Placement, ...] = ()
        data: torch.Tensor = param
        if isinstance(param, DTensor):
            self.tp_mesh, self.tp_placements = param.device_mesh, tuple(param.placements)
            data = param._local_tensor
        self.data_shape: torch.Size = data.shape  # ND, what the shard group splits
        dim = 0 if placement is None else placement.dim
        dim = dim + data.dim() if dim < 0 else dim
        if not 0 <= dim < data.dim():
            raise FullyShardError(  # FSDP2's AssertionError, its message first
                f"Shard dim {dim} is invalid for {data.dim()}D tensor: {param.shape}\n"
                f"shard_placement_fn returned {placement} for {fqn!r}, but it has "
                f"{data.dim()} dims (shape {tuple(data.shape)}); return Shard(d) with "
                f"-{data.dim()} <= d < {data.dim()}"
            )
        self.dim = dim  # the sharded dim (Shard(dim)); dim > 0 needs copies, see below
        world, rank = info.shard_size, info.shard_rank
        rows = data.shape[dim]
        self.chunk_rows = math.ceil(rows / world)  # rows of dim per rank after tail padding
        self.row_numel = math.prod(s for i, s in enumerate(data.shape) if i != dim)
        self.shard_numel = self.chunk_rows * self.row_numel  # padded elements per rank
        self.local_rows = self.rank_rows(rank)
        self.local_shape = self._shape_with(self.local_rows)
        self.local_numel = self.local_rows * self.row_numel
        self.numel = data.numel()
        self.spmd_mesh, self.spmd_placements = self._spmd(data)
        local = self._cut_local(data, rank * self.chunk_rows, device, pin_memory)
        self.sharded_param = nn.Parameter(
            self._wrap_sharded(local), requires_grad=param.requires_grad
        )
        # the flag both parameters had at the last sync_requires_grad
        self._synced_requires_grad = param.requires_grad
        # The user's original Parameter, to recognise it when a module outside this unit still
        # holds it (tied weights across units). Weak: it must not keep full-size memory alive.
        self._orig_ref = weakref.ref(param)
        # Set by the owning ParamGroup once its unsharded buffer exists.
        self.unsharded_param: nn.Parameter | None = None
        # Whether ``unsharded_param`` has the post-accumulate-grad hook that counts it for its
        # unit's post-backward (registered once, when it first requires grad).
        self.grad_hooked = False
        # Shard(dim > 0): the unsharded data is not a view of the gathered region but a
        # separate tensor filled by copy_out (storage resized to 0 while sharded).
        self.unsharded_data: torch.Tensor | None = None
        # Unsharded gradient accumulated across micro-steps without sync (in reduce dtype).
        self.unsharded_accum_grad: torch.Tensor | None = None

    def _cut_local(
        self, data: torch.Tensor, start: int, device: torch.device, pin_memory: bool
    ) -> torch.Tensor:
        """This rank's rows of ``data`` (from row ``start``), a contiguous copy on ``device``
        (pinned where an accelerator can use it); on meta, an empty meta tensor."""
        with torch.no_grad():
            if data.device.type == "meta":
                return torch.empty(self.local_shape, dtype=data.dtype, device="meta")
            rows = data.shape[self.dim]
            local = data.detach().narrow(self.dim, min(start, rows), self.local_rows)
            local = local.to(device, copy=True).contiguous()
            # Pinned host memory only helps (and only exists) with an accelerator.
            if pin_memory and local.device.type == "cpu" and torch.cuda.is_available():
                local = local.pin_memory()
            return local

    @property
    def requires_grad(self) -> bool:
        """Whether the parameter is trainable: the registered sharded parameter's flag, which
        users set (``requires_grad_``) before or after ``fully_shard``; see [Note: requires_grad
        set after fully_shard]."""
        return self.sharded_param.requires_grad

    # [Note: requires_grad set after fully_shard]
    # Users freeze and unfreeze parameters through the registered parameters, often after
    # ``fully_shard`` (FSDP2's own tests freeze between ``fully_shard`` and the first forward,
    # or unfreeze later to fine-tune more; an evaluation pass may be written as
    # ``requires_grad_(False)``, forward, ``requires_grad_(True)``). Which parameter is
    # registered depends on the moment: the sharded one, or the unsharded one while the unit
    # is gathered (the root after its forward). The module computes with the unsharded one and
    # the optimizer sees the sharded one, so the unit makes the two agree
    # (``ShardedParam.sync_requires_grad``: the one changed since the last sync wins) before
    # each forward and whenever it registers the sharded parameters again: a frozen parameter
    # gets no gradient (nor an optimizer update: optimizers step every parameter with a
    # gradient), an unfrozen one gets its gradient hook, and the count that fires
    # post-backward follows.
    def sync_requires_grad(self) -> bool:
        """Make the sharded and the unsharded parameter agree on ``requires_grad``: the one
        changed since the last sync wins (the unsharded one is what the module registers while
        the unit is gathered, e.g. the root after its forward, so a ``requires_grad_`` then
        lands there). Returns whether either flag changed."""
        up, last = self.unsharded_param, self._synced_requires_grad
        s = self.sharded_param.requires_grad
        u = s if up is None else up.requires_grad
        want = u if s == last else s
        if up is not None and u != want:
            up.requires_grad_(want)
        if s != want:
            self.sharded_param.requires_grad_(want)
        self._synced_requires_grad = want
        return want != last or u != s

    def _shape_with(self, rows: int) -> torch.Size:
        shape = list(self.data_shape)
        shape[self.dim] = rows
        return torch.Size(shape)

    def _spmd(self, data: torch.Tensor) -> tuple[DeviceMesh, tuple[Placement, ...]]:
        """The mesh and placements of the sharded DTensor (see the Note on composition)."""
        dp: list[Placement] = [
            Shard(self.dim) if isinstance(p, Shard) else p for p in self.info.placements
        ]
        if self.tp_mesh is None:
            return self.info.mesh, tuple(dp)
        if self.info.spmd is not None:
            return self._spmd_full_mesh(data)
        # A dim the TP placements shard already is split again by dp: torch's _StridedShard
        # records that the dp chunks interleave inside each TP chunk (FSDP2 does the same).
        split = math.prod(
            self.tp_mesh.size(i)
            for i, p in enumerate(self.tp_placements)
            if isinstance(p, Shard) and (p.dim + data.dim() if p.dim < 0 else p.dim) == self.dim
        )
        if split > 1:
            dp[-1] = _StridedShard(self.dim, split_factor=split)
        mesh = concatenate_meshes([self.info.mesh, self.tp_mesh])
        return mesh, (*dp, *self.tp_placements)

    def _spmd_full_mesh(self, data: torch.Tensor) -> tuple[DeviceMesh, tuple[Placement, ...]]:
        """``dp_mesh_dims``: the parameter's own full mesh, each dp shard dim's ``Replicate``
        replaced by ``Shard(dim)`` — ``_StridedShard`` where a later mesh dim shards the same
        tensor dim — and several dp shard dims merged into their flattened mesh (FSDP2's
        layout)."""
        spmd = self.info.spmd
        assert spmd is not None and self.tp_mesh is not None
        mesh, orig = spmd.mesh, self.tp_placements
        placements = list(orig)
        for i in spmd.shard_dims:
            split = 1
            for j in range(i + 1, mesh.ndim):
                p = orig[j]
                if isinstance(p, (Shard, _StridedShard)) and _norm(p.dim, data.dim()) == self.dim:
                    split *= mesh.size(j)
            strided = _StridedShard(self.dim, split_factor=split)
            placements[i] = strided if split > 1 else Shard(self.dim)
        if len(spmd.shard_dims) == 1:  # replicate dims keep their Replicate()
            return mesh, tuple(placements)
        names = mesh.mesh_dim_names
        assert names is not None
        meshes: list[DeviceMesh] = []
        out: list[Placement] = []
        for i, name in enumerate(names):
            if i == spmd.shard_dims[0]:
                meshes.append(self.info.mesh)  # flattened; (replicate, shard) for HSDP
                out.extend(self.info.placements[:-1])
                out.append(placements[i])
            elif i not in spmd.dp_dims:
                meshes.append(mesh[name])
                out.append(placements[i])
        return concatenate_meshes(meshes), tuple(out)

    def _wrap_sharded(self, local: torch.Tensor) -> DTensor:
        return DTensor.from_local(
            local,
            self.spmd_mesh,
            self.spmd_placements,
            run_check=False,
            shape=self.orig_shape,
            stride=_contiguous_stride(self.orig_shape),
        )

    def rank_rows(self, rank: int) -> int:
        """Rows of shard rank ``rank``'s unpadded chunk (``local_rows`` on that rank)."""
        return max(0, min(self.chunk_rows, self.data_shape[self.dim] - rank * self.chunk_rows))

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
        """The unsharded parameter's data for its gathered ``[world, shard_numel]`` region.

        ``Shard(0)`` makes it a plain view: the region is rank-major, so the first ``numel``
        elements are the parameter's rows in order. ``Shard(d)`` with ``d > 0`` cannot be a
        view: it is a separate tensor (storage resized to 0 until :meth:`copy_out` fills it).
        A tensor-parallel parameter's data is wrapped in its TP DTensor again.
        """
        if self.dim == 0:
            data = region.reshape(-1)[: self.numel].view(self.data_shape)
        else:
            data = torch.empty(self.data_shape, dtype=region.dtype, device=region.device)
            data.untyped_storage().resize_(0)
            self.unsharded_data = data
        return self.as_unsharded(data)

    def as_unsharded(self, data: torch.Tensor) -> torch.Tensor:
        """The unsharded parameter around its (``data_shape``) data: the data itself, or a
        tensor-parallel parameter's DTensor again."""
        if self.tp_mesh is None:
            return data
        return DTensor.from_local(
            data,
            self.tp_mesh,
            self.tp_placements,
            run_check=False,
            shape=self.orig_shape,
            stride=_contiguous_stride(self.orig_shape),
        )

    def _rank_narrow(self, t: torch.Tensor, rank: int) -> torch.Tensor:
        """Shard rank ``rank``'s rows of the unsharded (``data_shape``) tensor ``t``."""
        start = min(rank * self.chunk_rows, self.data_shape[self.dim])
        return t.narrow(self.dim, start, self.rank_rows(rank))

    def copy_out(self, region: torch.Tensor) -> None:
        """Fill the unsharded data from the gathered region (``Shard(d > 0)`` only)."""
        data = self.unsharded_data
        if data is None:
            return
        with torch.autograd._unsafe_preserve_version_counter(data):
            data.untyped_storage().resize_(data.numel() * data.element_size())
            for r in range(self.info.shard_size):
                rows = self.rank_rows(r)
                if rows:
                    piece = region[r, : self.rank_numel(r)].view(self._shape_with(rows))
                    self._rank_narrow(data, r).copy_(piece)

    def free_unsharded(self) -> None:
        """Release the separate unsharded data (``Shard(d > 0)``); views need nothing."""
        if self.unsharded_data is not None:
            freed(self.unsharded_data.untyped_storage(), f"{self.fqn!r}'s unsharded data")
            self.unsharded_data.untyped_storage().resize_(0)

    @property
    def unsharded_data_bytes(self) -> int:
        """Bytes held by the separate unsharded data (0 for views and when freed)."""
        data = self.unsharded_data
        return 0 if data is None else data.untyped_storage().nbytes()

    def grad_data(self, grad: torch.Tensor, reduce_dtype: torch.dtype) -> torch.Tensor:
        """The plain tensor to reduce from an unsharded gradient (a TP DTensor's local data,
        redistributed to the parameter's TP placements first if autograd left it otherwise,
        in ``reduce_dtype``: see [Note: composing with DTensor parallelism])."""
        if not isinstance(grad, DTensor):
            return grad
        target = self.tp_placements
        if self.info.spmd is not None:  # dp dims keep theirs: the reduction below handles them
            dp = self.info.spmd.dp_dims
            target = tuple(grad.placements[i] if i in dp else p for i, p in enumerate(target))
        if tuple(grad.placements) != target:
            summed = any(a.is_partial() and a != b for a, b in zip(grad.placements, target))
            if summed and grad.dtype != reduce_dtype:  # a reduction: in the reduce dtype
                grad = DTensor.from_local(
                    grad._local_tensor.to(reduce_dtype),
                    grad.device_mesh,
                    grad.placements,
                    run_check=False,
                    shape=grad.shape,
                    stride=grad.stride(),
                )
            grad = grad.redistribute(placements=target)
        return grad._local_tensor

    def grad_pieces(self, flat_grad: torch.Tensor) -> list[torch.Tensor]:
        """Per shard rank, the 1-D piece of the (flat, unsharded) gradient it reduces."""
        world = self.info.shard_size
        if self.dim:  # not contiguous in the gradient: each piece is a packed copy
            grad = flat_grad.view(self.data_shape)
            return [self._rank_narrow(grad, r).contiguous().view(-1) for r in range(world)]
        n = self.shard_numel
        return [flat_grad[r * n :][: self.rank_numel(r)] for r in range(world)]

    def pack_grad(self, grad: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy the unsharded ``grad`` into ``dst`` (``[world, shard_numel]``), zero-padded."""
        world, n = dst.shape[0], self.shard_numel
        if self.dim:
            grad = grad.view(self.data_shape)
            for r in range(world):
                rows, m = self.rank_rows(r), self.rank_numel(r)
                if rows:
                    dst[r, :m].view(self._shape_with(rows)).copy_(self._rank_narrow(grad, r))
                dst[r, m:].zero_()
            return
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
        set_param(module, name, self.sharded_param)

    def sync_from_modules(self) -> None:
        """Adopt the parameter currently registered on the first module that holds it.

        ``module.to_empty(...)``, ``load_state_dict(assign=True)`` or ``_apply`` may have
        replaced the registered Parameter; tied references are pointed at the new one.
        """
        module, name = self.refs[0]
        current = module._parameters[name]
        if current is self.sharded_param:
            # ``module.to(torch.float64)`` / ``.half()`` casts in place (``param.data = ...``):
            # the unit rebuilds its layout for the new dtype.
            self.orig_dtype = current.dtype
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
        self.orig_dtype = current.dtype
        self.sharded_param = current
        for m, n in self.refs:
            set_param(m, n, current)

    def to_sharded(self) -> None:
        """Register the sharded DTensor parameter on every referencing module."""
        for module, name in self.refs:
            set_param(module, name, self.sharded_param)

    # [Note: one version counter per unsharded parameter]
    # A unit's unsharded parameters are views of its one buffer, and views share their base's
    # version counter: an in-place write to one (a forward pre-hook clamping a weight under
    # no_grad, nn.Embedding's max_norm) would bump them all, and autograd would then refuse
    # the backward of every other parameter of the unit saved before the write ("modified by
    # an inplace operation"), where FSDP2, whose unsharded parameters are separate tensors,
    # runs. So each is made from its view's ``.data`` (``fullshard.engine.group`` passes it): the
    # same memory, its own counter. A write into one bumps only its own, which is also how a
    # unit tells that its pooled memory no longer holds its gather ([Note: taking back a
    # unit's own gathered memory] in fullshard.engine.pool).
    def make_unsharded(
        self, data: torch.Tensor, on_grad_accumulated: Callable[[ShardedParam], None]
    ) -> None:
        """Make the unsharded ``nn.Parameter`` around ``data`` (a new leaf, hooked for its
        unit's post-backward when it requires grad)."""
        self.unsharded_param = nn.Parameter(data, requires_grad=self.requires_grad)
        self.grad_hooked = False  # a new leaf: no hook yet
        if self.requires_grad:
            self.hook_grad(on_grad_accumulated)

    def hook_grad(self, on_grad_accumulated: Callable[[ShardedParam], None]) -> None:
        """Have the unsharded parameter's accumulated gradients call ``on_grad_accumulated``
        (the unit's bound method, held weakly: [Note: a gradient hook holds its unit weakly];
        the unit counts them to fire its post-backward); once per unsharded parameter."""
        assert self.unsharded_param is not None
        self.unsharded_param.register_post_accumulate_grad_hook(
            _weak_grad_hook(self, on_grad_accumulated)
        )
        self.grad_hooked = True

    def to_unsharded(self) -> None:
        """Register the unsharded parameter (a view into the unit's buffer)."""
        assert self.unsharded_param is not None
        for module, name in self.refs:
            set_param(module, name, self.unsharded_param)

    def make_grad(self, local_grad: torch.Tensor) -> None:
        """Set (or accumulate into) the sharded gradient from this rank's reduced shard."""
        local_grad = local_grad.view(self.local_shape)
        grad = self.sharded_param.grad
        if grad is None:
            local_grad = local_grad.to(self.orig_dtype)
            if local_grad.device != self.local.device:
                local_grad = local_grad.to(self.local.device)
            # The gradient has the parameter's mesh, placements, shape, stride and dtype: reuse
            # its spec instead of ``DTensor.from_local`` (an autograd Function and a new spec
            # per gradient per step were a third of a small unit's step time).
            self.sharded_param.grad = dtensor_like(local_grad, self.sharded_param)
        else:
            assert isinstance(grad, DTensor)
            into = grad._local_tensor
            # a narrower shard is upcast inside the add, exactly: no cast copy ([Note: a
            # capturable step] in fullshard.engine.kept); a wider one rounds first, as before
            if torch.promote_types(into.dtype, local_grad.dtype) != into.dtype:
                local_grad = local_grad.to(into.dtype)
            into.add_(local_grad.to(into.device))
        self.run_post_accumulate_grad_hooks()

    def reads_grad_on_arrival(self) -> bool:
        """Whether :meth:`make_grad` reads the new shard at once: it is added into an existing
        gradient, or a post-accumulate-grad hook sees it."""
        hooks = getattr(self.sharded_param, "_post_accumulate_grad_hooks", None)
        return self.sharded_param.grad is not None or bool(hooks)

    def run_post_accumulate_grad_hooks(self) -> None:
        """Run the hooks users registered on the sharded parameter with
        ``register_post_accumulate_grad_hook`` (optimizers in backward do): autograd never
        accumulates into it, so the engine calls them once the reduced gradient shard is its
        ``.grad``, as FSDP2 does."""
        hooks = getattr(self.sharded_param, "_post_accumulate_grad_hooks", None)
        for hook in (hooks or {}).values():
            hook(self.sharded_param)


# [Note: a gradient hook holds its unit weakly]
# torch keeps a parameter's post-accumulate-grad hooks in C++ (the tensor's autograd meta holds
# the dict of hooks), where the garbage collector cannot see them. A hook that held its
# ShardedParam or its unit strongly would close a cycle through C++ (parameter -> hook ->
# ShardedParam or unit -> parameter) that no ``gc.collect()`` breaks: every model that ran a
# forward would stay in memory, parameters, gradients and all, for the life of the process.
# So the hook holds both weakly; it only fires in a backward, while the model is alive.
def _weak_grad_hook(
    sp: ShardedParam, on_grad_accumulated: Callable[[ShardedParam], None]
) -> Callable[[torch.Tensor], None]:
    """The unsharded parameter's post-accumulate-grad hook: ``on_grad_accumulated(sp)`` (a
    bound method: its unit's), with ``sp`` and the method's object held weakly (see the
    Note). A closure, not a callable object: it runs for every parameter every backward."""
    sp_ref = weakref.ref(sp)
    unit_ref = weakref.ref(on_grad_accumulated.__self__)  # type: ignore[attr-defined]
    func = on_grad_accumulated.__func__  # type: ignore[attr-defined]

    def hook(_param: torch.Tensor) -> None:
        unit, param = unit_ref(), sp_ref()
        if unit is not None and param is not None:
            func(unit, param)

    return hook


def _norm(dim: int, ndim: int) -> int:
    return dim + ndim if dim < 0 else dim


def dtensor_like(
    local: torch.Tensor, like: torch.Tensor, cls: type[DTensor] | None = None
) -> DTensor:
    """A DTensor with ``like``'s spec around ``local`` (no autograd, no checks), of class
    ``cls``, by default ``like``'s (a gradient keeps its parameter's ``DTensor`` subclass, such
    as the FSDP1 wrapper's: [Note: use_orig_params writeback] in fullshard.fsdp1.writeback)."""
    assert isinstance(like, DTensor)
    # DTensor.__init__ is a no-op behind a dynamo guard; __new__ alone builds the tensor.
    return DTensor.__new__(cls or type(like), local, like._spec, requires_grad=False)
