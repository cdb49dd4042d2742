"""Checkpoint names and shard geometry of a sharded model's weights, for publishing them.

[Note: checkpoint names]
An inference engine loads weights by the names of the model's Hugging Face checkpoint. A trained
model's ``named_parameters()`` may carry the names of wrappers around its modules:
``_fsdp_wrapped_module.`` (FSDP1's wrapper), ``_orig_mod.`` (``torch.compile``) and
``_checkpoint_wrapped_module.`` (activation checkpointing). :func:`checkpoint_name` drops those
path components, and :func:`named_weights` lists each parameter once: a tied weight
(``lm_head.weight`` sharing ``model.embed_tokens.weight``) appears under its first name only, as
``save_pretrained`` writes it.

[Note: shard geometry]
fullshard stores a parameter as a ``DTensor`` with ``Shard(d)`` on its shard mesh dimension
(``Shard(0)`` unless ``shard_placement_fn`` says otherwise), ``Replicate()`` on an HSDP
replicate dimension. Rank ``r`` of the ``k``-rank shard group holds indices
``[r * c, min((r + 1) * c, n))`` of dim ``d`` with ``c = ceil(n / k)`` (``torch.chunk``), so
trailing ranks may hold fewer or none. :class:`Geometry` is that description; a plain tensor
(not sharded) is a group of one rank holding everything. A tensor-parallel parameter (placements
beyond one ``Shard``, e.g. ``(_StridedShard(0), Shard(0))`` under FSDP + TP) holds no box of
rows per rank: :func:`~fullshard.rl.publish` gathers it whole through ``DTensor`` (cast first),
and :func:`~fullshard.rl.shard_rows` refuses it.

[Note: one sender per piece]
Under HSDP every replica holds the same rows, and a weight that is not sharded (a plain
tensor: ``ignored_params``) is whole on every rank. A receiver sent one piece twice would
write it twice (harmless for values, wasted bytes), but an XOR delta applied twice undoes
itself. So each piece has one *primary* holder, the one that sends it: for a ``DTensor``, the
rank at index 0 of every mesh dimension it is replicated over; for a plain tensor, the model's
lead rank (the first rank of its first ``DTensor``'s mesh; the only rank without one).
``send_rows`` and ``ShardDeltas`` send and track only primary pieces, and every training rank
still ends its messages, so a receiver lists every training rank as a sender.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard

__all__ = [
    "WRAPPER_NAMES",
    "Geometry",
    "checkpoint_name",
    "geometry",
    "lead_rank",
    "local_tensor",
    "named_weights",
]

#: Path components of wrappers, dropped from parameter names ([Note: checkpoint names]).
WRAPPER_NAMES: frozenset[str] = frozenset(
    {"_fsdp_wrapped_module", "_orig_mod", "_checkpoint_wrapped_module"}
)


def checkpoint_name(fqn: str) -> str:
    """``fqn`` without wrapper components: ``_orig_mod.layers.0._checkpoint_wrapped_module.w``
    becomes ``layers.0.w``."""
    return ".".join(p for p in fqn.split(".") if p not in WRAPPER_NAMES)


def named_weights(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """``(checkpoint name, parameter)`` for every parameter of ``model``, tied ones once.

    Raises ``ValueError`` if two different parameters end up with the same name.
    """
    out: list[tuple[str, torch.Tensor]] = []
    seen: dict[str, str] = {}
    for fqn, p in model.named_parameters():  # remove_duplicate=True: a tied weight once
        name = checkpoint_name(fqn)
        if name in seen:
            raise ValueError(
                f"parameters {seen[name]!r} and {fqn!r} both publish as {name!r}; "
                "rename one of them"
            )
        seen[name] = fqn
        out.append((name, p))
    return out


@dataclass(frozen=True)
class Geometry:
    """How one parameter is split over its shard group ([Note: shard geometry])."""

    shape: torch.Size  # ND, global
    dim: int  # the sharded dim
    world: int  # ranks of the shard group
    rank: int  # this rank's index in it
    group: dist.ProcessGroup | None  # None: not sharded (world 1)
    primary: bool = True  # this rank sends this piece ([Note: one sender per piece])
    tensor_parallel: bool = False  # placements beyond one Shard: DTensor gathers it whole

    @property
    def chunk(self) -> int:
        """Indices of ``dim`` per rank before tail padding (``ceil(n / world)``)."""
        return math.ceil(self.shape[self.dim] / self.world) if self.shape else 1

    @property
    def row_numel(self) -> int:
        """Elements per index of ``dim`` (the product of the other dims)."""
        return math.prod(s for i, s in enumerate(self.shape) if i != self.dim)

    def start(self, rank: int) -> int:
        """First index of ``dim`` that ``rank`` holds."""
        return min(rank * self.chunk, self.shape[self.dim]) if self.shape else 0

    def rows(self, rank: int) -> int:
        """Indices of ``dim`` that ``rank`` holds (0 for trailing ranks of a short dim)."""
        if not self.shape:
            return 1
        return max(0, min(self.chunk, self.shape[self.dim] - rank * self.chunk))

    def piece_shape(self, rank: int) -> torch.Size:
        """The shape of ``rank``'s piece."""
        shape = list(self.shape)
        if shape:
            shape[self.dim] = self.rows(rank)
        return torch.Size(shape)


def lead_rank(model: nn.Module) -> bool:
    """Whether this rank is ``model``'s lead: the first rank of the mesh of its first
    ``DTensor`` parameter (True without one or without a process group)."""
    for p in model.parameters():
        if isinstance(p, DTensor):
            return int(p.device_mesh.mesh.flatten()[0]) == dist.get_rank()
    return True


def geometry(name: str, param: torch.Tensor, lead: bool = True) -> Geometry:
    """The shard geometry of ``param`` (published as ``name``, for errors); ``lead``: this rank
    sends the plain tensors ([Note: one sender per piece])."""
    if not isinstance(param, DTensor):
        return Geometry(param.shape, 0, 1, 0, None, primary=lead)
    placements = param.placements
    shard = [i for i, p in enumerate(placements) if type(p) is Shard]
    others = [
        p for i, p in enumerate(placements) if i not in shard and not isinstance(p, Replicate)
    ]
    mesh = param.device_mesh
    if len(shard) > 1 or others:  # tensor parallel (and FSDP): no box of rows per rank
        return Geometry(param.shape, 0, 1, 0, None, primary=False, tensor_parallel=True)
    primary = all(mesh.get_local_rank(i) == 0 for i in range(mesh.ndim) if i not in shard)
    if not shard:  # replicated on every mesh dim: every rank holds it whole
        return Geometry(param.shape, 0, 1, 0, None, primary)
    i = shard[0]
    placement = placements[i]
    assert isinstance(placement, Shard)
    dim = placement.dim + param.dim() if placement.dim < 0 else placement.dim
    return Geometry(
        param.shape, dim, mesh.size(i), mesh.get_local_rank(i), mesh.get_group(i), primary
    )


def local_tensor(param: torch.Tensor) -> torch.Tensor:
    """This rank's piece of ``param`` as a plain tensor (the whole tensor if not sharded)."""
    data = param._local_tensor if isinstance(param, DTensor) else param
    return data.detach()
