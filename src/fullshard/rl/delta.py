"""Shard-local deltas: what changed in each rank's rows since the last publication.

[Note: XOR deltas]
A weight's new value in the wire dtype is its old value's bit pattern XOR a mask; where an
element did not change the mask is zero. Each rank keeps the bit patterns it last published
(one copy of its shards in the wire dtype) and :meth:`ShardDeltas.delta` hands out the masks of
its own rows, with no communication between the training ranks. A receiver holding the old
weights in the same dtype XORs the mask into its bits and has the new weights bit for bit —
no rounding, whatever the optimizer did. In RL post-training with a small learning rate most
bf16 elements do not change from one step to the next, so the masks are mostly zero bytes;
:func:`encode_xor` stores them as byte planes (all the elements' high bytes, then the next
bytes: the sign and exponent bytes, zero far more often, are not interleaved with the busy
mantissa bytes) and compresses them with zlib. That pays on a slow link (gloo over a network);
on NCCL the masks travel raw (``send_deltas``'s ``compress``), since zlib on one CPU thread is
slower than the link.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from .weights import ShardRows, shard_rows

__all__ = ["DeltaRows", "ShardDeltas", "bits", "decode_xor", "encode_xor"]

_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def bits(t: torch.Tensor) -> torch.Tensor:
    """``t``'s bit patterns: a view as the integer dtype of the same width."""
    try:
        return t.view(_INT_OF_SIZE[t.element_size()])
    except KeyError:
        raise ValueError(f"no integer dtype of {t.element_size()} bytes for {t.dtype}") from None


def encode_xor(mask: torch.Tensor, level: int = 1) -> bytes:
    """Compress an XOR mask ([Note: XOR deltas]): its byte planes through zlib at ``level``."""
    size = mask.element_size()
    by_element = mask.detach().cpu().contiguous().view(torch.uint8).numpy().reshape(-1, size)
    planes = np.empty((size, by_element.shape[0]), dtype=np.uint8)
    for k in range(size):  # column copies: ~10x faster than a strided transpose
        planes[k] = by_element[:, k]
    return zlib.compress(planes.tobytes(), level)


def decode_xor(payload: bytes | memoryview, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
    """The mask :func:`encode_xor` compressed, as integers of ``dtype``'s width in ``shape``."""
    size = dtype.itemsize
    planes = np.frombuffer(zlib.decompress(payload), dtype=np.uint8).reshape(size, -1)
    if not planes.size:
        return torch.zeros(shape, dtype=_INT_OF_SIZE[size])
    by_element = np.empty((planes.shape[1], size), dtype=np.uint8)
    for k in range(size):
        by_element[:, k] = planes[k]
    return torch.from_numpy(by_element).view(_INT_OF_SIZE[size]).view(shape)


@dataclass(frozen=True)
class DeltaRows:
    """The XOR mask of one rank's rows ``[start, stop)`` of dim ``dim`` of weight ``name``."""

    name: str
    shape: torch.Size  # ND, global
    dtype: torch.dtype  # the wire dtype the mask applies to
    dim: int
    start: int
    stop: int
    mask: torch.Tensor  # ND integers of the dtype's width, the piece's shape
    changed: int  # elements whose bits changed

    @property
    def offsets(self) -> tuple[int, ...]:
        """Where the piece starts in the global tensor, per dim."""
        return tuple(self.start if i == self.dim else 0 for i in range(len(self.shape)))

    def encode(self) -> bytes:
        """The compressed mask (:func:`encode_xor`), what travels."""
        return encode_xor(self.mask)


class ShardDeltas:
    """Per rank, the changes of its own rows of ``model``'s weights since the last publication.

    Create it (or call :meth:`reset`) right after the receivers got the weights in full: that
    state is the base. Each :meth:`delta` returns what changed since the base (or since the
    previous delta) and makes the current weights the new base. Memory: one copy of this
    rank's shards in the wire ``dtype`` (each weight's own when ``None``). No communication:
    every rank may call it alone ([Note: XOR deltas]). Only the rows this rank sends are
    tracked: under HSDP the first replica's ranks report the changes, the others none ([Note:
    one sender per piece] in ``fullshard.rl.names``), since a mask applied twice undoes itself.
    """

    def __init__(self, model: nn.Module, *, dtype: torch.dtype | None = None) -> None:
        self.model = model
        self.dtype = dtype
        self._base: dict[str, torch.Tensor] = {}
        self.reset()

    def reset(self) -> None:
        """Make the weights as they are now the base (after a full publication)."""
        self._base = {r.name: bits(r.local).clone() for r in self._rows()}

    def _rows(self) -> list[ShardRows]:
        """The rows this rank sends ([Note: one sender per piece] in ``fullshard.rl.names``)."""
        return [r for r in shard_rows(self.model, dtype=self.dtype) if r.primary]

    def delta(self, *, to_host: bool = False) -> list[DeltaRows]:
        """This rank's XOR masks since the base, one per weight; the weights become the base.

        One host sync in all (the changed-element counts of every weight come back together),
        none per weight. ``to_host``: the masks come back in host memory, in the same copy as
        the counts (for compressing them); else they stay on the weights' device."""
        rows, masks, counts = [], [], []
        for r in self._rows():
            base = self._base.get(r.name)
            new = bits(r.local)
            if base is None or base.shape != new.shape:
                raise RuntimeError(
                    f"weight {r.name!r} changed shape or appeared since the base; call reset() "
                    "after publishing the weights in full"
                )
            mask = torch.bitwise_xor(new, base)
            base.copy_(new)
            rows.append(r)
            masks.append(mask)
            counts.append(torch.count_nonzero(mask))
        if not rows:
            return []
        changed, masks = _to_host(torch.stack(counts), masks, to_host)
        return [
            DeltaRows(r.name, r.shape, r.dtype, r.dim, r.start, r.stop, mask, n)
            for r, mask, n in zip(rows, masks, changed, strict=True)
        ]


def _to_host(
    counts: torch.Tensor, masks: list[torch.Tensor], with_masks: bool
) -> tuple[list[int], list[torch.Tensor]]:
    """``counts`` as ints and ``masks`` (in host memory if ``with_masks``): one host read."""
    if not with_masks or all(m.device.type == "cpu" for m in masks):
        return counts.tolist(), masks
    return _packed_to_host(counts, masks)


def _packed_to_host(
    counts: torch.Tensor, masks: list[torch.Tensor]
) -> tuple[list[int], list[torch.Tensor]]:
    """``counts`` and ``masks`` in one device-to-host copy: the masks packed after the counts
    (int64), each at a multiple of 8 bytes so that it views as its own dtype."""
    device = counts.device
    parts, spans, at = [counts.view(torch.uint8)], [], counts.numel() * 8
    for m in masks:
        n = m.numel() * m.element_size()
        parts.append(m.reshape(-1).view(torch.uint8).to(device))
        pad = -n % 8
        if pad:
            parts.append(torch.zeros(pad, dtype=torch.uint8, device=device))
        spans.append((at, n))
        at += n + pad
    host = torch.cat(parts).cpu()
    out = [
        host[a : a + n].view(m.dtype).view(m.shape) for (a, n), m in zip(spans, masks, strict=True)
    ]
    return host[: counts.numel() * 8].view(torch.int64).tolist(), out
