"""The receiving side: an inference model's weights, in its own layout, updated in place.

[Note: pieces and layouts]
Everything that arrives is a *piece*: a box of a global tensor, given by where it starts in
each dim (``offsets``) and its shape — a full tensor (offsets all zero), one training rank's
rows (``ShardRows``, ``DeltaRows``), or part of them. The receiver holds, per weight, one local
tensor that is itself a box of the global tensor: the whole tensor, or the rows an inference
rank keeps (its own row split, :meth:`WeightReceiver.row_split`). Applying a piece writes (or
XORs, for a delta) the intersection of the two boxes, so any training layout meets any
inference layout without either knowing the other's.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import torch
from torch import nn

from .delta import DeltaRows, bits
from .names import named_weights
from .weights import ShardRows

__all__ = ["WeightReceiver"]


@dataclass(frozen=True)
class _Slot:
    tensor: torch.Tensor  # the receiver's own (local) tensor of the weight
    offsets: tuple[int, ...]  # where it starts in the global tensor, per dim


def _intersect(
    slot: _Slot, offsets: tuple[int, ...], shape: torch.Size | tuple[int, ...]
) -> tuple[list[slice], list[slice]] | None:
    """The overlap of a piece with a slot as (slot index, piece index); None if empty."""
    if len(offsets) != slot.tensor.dim():
        return None if slot.tensor.dim() else ([], [])
    mine: list[slice] = []
    theirs: list[slice] = []
    for lo, size, po, psize in zip(slot.offsets, slot.tensor.shape, offsets, shape, strict=True):
        a, b = max(lo, po), min(lo + size, po + psize)
        if a >= b:
            return None
        mine.append(slice(a - lo, b - lo))
        theirs.append(slice(a - po, b - po))
    return mine, theirs


class WeightReceiver:
    """An inference rank's weights by checkpoint name, updated in place from published pieces.

    ``weights`` maps checkpoint names to this rank's tensors (an ``nn.Module`` gives its
    parameters, tied ones once, wrapper prefixes dropped). ``offsets`` says where each tensor
    starts in the global weight (per dim; all zeros, the default, for full tensors). Pieces
    from any training layout are applied to the overlap ([Note: pieces and layouts]); the
    ``apply_*`` methods return the number of elements written.
    """

    def __init__(
        self,
        weights: nn.Module | Mapping[str, torch.Tensor],
        *,
        offsets: Mapping[str, tuple[int, ...]] | None = None,
    ) -> None:
        named = named_weights(weights) if isinstance(weights, nn.Module) else weights.items()
        offsets = offsets or {}
        self._slots: dict[str, _Slot] = {}
        for name, t in named:
            off = tuple(offsets.get(name, (0,) * t.dim()))
            if len(off) != t.dim():
                raise ValueError(f"offsets of {name!r} are {off}, but it has {t.dim()} dims")
            self._slots[name] = _Slot(t.detach(), off)

    @classmethod
    def row_split(
        cls, weights: nn.Module | Mapping[str, torch.Tensor], index: int, count: int
    ) -> WeightReceiver:
        """A receiver holding copies of rows ``index`` of ``count`` (``torch.chunk`` of dim 0)
        of each full tensor in ``weights``: an inference rank's own row split."""
        if not 0 <= index < count:
            raise ValueError(f"index {index} is not in [0, {count})")
        full = named_weights(weights) if isinstance(weights, nn.Module) else weights.items()
        local: dict[str, torch.Tensor] = {}
        offsets: dict[str, tuple[int, ...]] = {}
        for name, t in full:
            if t.dim() == 0:
                local[name], offsets[name] = t.detach().clone(), ()
                continue
            chunk = -(-t.shape[0] // count)
            start = min(index * chunk, t.shape[0])
            local[name] = t.detach()[start : start + chunk].clone()
            offsets[name] = (start,) + (0,) * (t.dim() - 1)
        return cls(local, offsets=offsets)

    @property
    def weights(self) -> dict[str, torch.Tensor]:
        """This rank's tensor of each weight, by checkpoint name."""
        return {name: s.tensor for name, s in self._slots.items()}

    def offsets(self, name: str) -> tuple[int, ...]:
        """Where this rank's tensor of ``name`` starts in the global weight, per dim."""
        return self._slot(name).offsets

    def _slot(self, name: str) -> _Slot:
        slot = self._slots.get(name)
        if slot is None:
            known = sorted(self._slots)[:4]
            raise KeyError(f"the receiver holds no weight {name!r} (it holds {known}, ...)")
        return slot

    def apply_piece(self, name: str, piece: torch.Tensor, offsets: tuple[int, ...]) -> int:
        """Copy the overlap of ``piece`` (starting at ``offsets``) into the weight ``name``,
        cast to the receiver's dtype."""
        slot = self._slot(name)
        hit = _intersect(slot, offsets, piece.shape)
        if hit is None:
            return 0
        mine, theirs = hit
        dst = slot.tensor[tuple(mine)]
        dst.copy_(piece[tuple(theirs)])
        return dst.numel()

    def apply_xor(
        self, name: str, mask: torch.Tensor, offsets: tuple[int, ...], dtype: torch.dtype
    ) -> int:
        """XOR ``mask`` (bit patterns of ``dtype``) into the overlap: a delta, bit for bit."""
        slot = self._slot(name)
        if slot.tensor.dtype != dtype:
            raise ValueError(
                f"a delta of {name!r} in {dtype} cannot apply to the receiver's "
                f"{slot.tensor.dtype}: hold the weights in the publication's dtype"
            )
        hit = _intersect(slot, offsets, mask.shape)
        if hit is None:
            return 0
        mine, theirs = hit
        dst = bits(slot.tensor)[tuple(mine)]
        dst.bitwise_xor_(mask[tuple(theirs)].to(dst.device))
        return dst.numel()

    def apply_full(self, name: str, tensor: torch.Tensor) -> int:
        """Copy the full weight ``name`` (this rank keeps its part of it)."""
        return self.apply_piece(name, tensor, (0,) * tensor.dim())

    def apply_rows(self, rows: ShardRows) -> int:
        """Copy one training rank's rows (:func:`fullshard.rl.shard_rows`)."""
        return self.apply_piece(rows.name, rows.local, rows.offsets)

    def apply_delta(self, delta: DeltaRows) -> int:
        """XOR one training rank's delta (:meth:`fullshard.rl.ShardDeltas.delta`) into place."""
        return self.apply_xor(delta.name, delta.mask, delta.offsets, delta.dtype)

    def load(self, named: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Apply full weights as :func:`fullshard.rl.publish` yields them; return the count."""
        n = 0
        for name, tensor in named:
            self.apply_full(name, tensor)
            n += 1
        return n
