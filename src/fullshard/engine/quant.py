"""Block-wise int8 quantisation for low-precision all-gathers (see ``CommPolicy``).

A rank's packed shard of ``n`` elements is split into blocks of ``block`` elements; each block
is scaled by ``absmax / 127`` and rounded to int8. The wire format of one rank is a byte
buffer ``[n int8 values | ceil(n / block) fp32 scales]``, so one all-gather moves both.
Round-trip error per element is at most half a quantisation step: ``absmax_block / 254``.
"""

from __future__ import annotations

import math

import torch

__all__ = ["dequantize_int8", "int8_wire_bytes", "quantize_int8"]


def int8_wire_bytes(numel: int, block: int) -> int:
    """Bytes one rank sends for ``numel`` elements."""
    return numel + 4 * math.ceil(numel / block)


def quantize_int8(x: torch.Tensor, block: int) -> torch.Tensor:
    """Quantise 1-D ``x`` to the int8 wire format (a uint8 byte buffer)."""
    n = x.numel()
    nblocks = math.ceil(n / block)
    padded = torch.zeros(nblocks * block, dtype=torch.float32, device=x.device)
    padded[:n].copy_(x)
    blocks = padded.view(nblocks, block)
    scales = blocks.abs().amax(dim=1).clamp_min(1e-30) / 127.0
    q = torch.round(blocks / scales[:, None]).clamp_(-127, 127).to(torch.int8)
    out = torch.empty(int8_wire_bytes(n, block), dtype=torch.uint8, device=x.device)
    out[:n].copy_(q.view(-1)[:n].view(torch.uint8))
    out[n:].copy_(scales.view(torch.uint8))
    return out


def dequantize_int8(wire: torch.Tensor, numel: int, block: int, out: torch.Tensor) -> None:
    """Decode ``wire`` rows (``[ranks, int8_wire_bytes]``) into ``out`` (``[ranks, numel]``)."""
    nblocks = math.ceil(numel / block)
    ranks = wire.shape[0]
    q = wire[:, :numel].contiguous().view(torch.int8).to(torch.float32)
    scales = wire[:, numel:].contiguous().view(torch.float32).view(ranks, nblocks)
    pad = nblocks * block - numel
    if pad:
        q = torch.nn.functional.pad(q, (0, pad))
    deq = q.view(ranks, nblocks, block) * scales[:, :, None]
    out.copy_(deq.view(ranks, nblocks * block)[:, :numel])
