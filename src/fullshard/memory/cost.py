"""What each op of a (fake) training step costs: matmul FLOPs, attention FLOPs, bytes moved.

:class:`OpCost` is a ``TorchDispatchMode`` that the planner runs beside
:class:`~fullshard.memory.tracker.LiveTensorBytes` over its fake-tensor step, so the time model
(:mod:`fullshard.memory.timing`) prices the real model's ops rather than a formula of its
shape. Three counters, each a running total the planner reads at every segment boundary:

- ``mm_flops``: ``mm`` / ``addmm`` / ``bmm`` / ``baddbmm`` (torch's own formulas,
  :data:`torch.utils.flop_counter.flop_registry`: 2 FLOPs per multiply-add).
- ``attn_flops``: scaled-dot-product attention, forward and backward, CUDA kernels and the CPU
  one alike (``4 b h s_q s_k d`` forward, 2.5x that backward, as torch counts; causal masking
  not discounted, as torch and torchtitan's MFU do not).
- ``mem_bytes``: every other op that produces new storage (views, in-place metadata ops and
  factory ops move nothing): the bytes of its tensor inputs plus its outputs, the HBM traffic
  of an unfused elementwise / reduction kernel. ``hidden_mem_bytes`` is the part of it on
  tensors of the residual stream's shape (``classify`` says which), which sequence
  parallelism divides by the TP degree.
- ``mm_operand_bytes``: the matmuls' tensor inputs, what float8 training casts.
- ``causal_attn_flops``: the part of ``attn_flops`` computed with ``is_causal``: a causal
  kernel skips the masked half of the tiles, which the time model accounts for.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.flop_counter import flop_registry

__all__ = ["OpCost", "attention_flops"]

aten = torch.ops.aten

_MM = {aten.mm, aten.addmm, aten.bmm, aten.baddbmm}
_ATTN_FWD = {
    aten._scaled_dot_product_flash_attention,
    aten._scaled_dot_product_efficient_attention,
    aten._scaled_dot_product_cudnn_attention,
    aten._scaled_dot_product_flash_attention_for_cpu,
}
_ATTN_BWD = {
    aten._scaled_dot_product_flash_attention_backward,
    aten._scaled_dot_product_efficient_attention_backward,
    aten._scaled_dot_product_cudnn_attention_backward,
    aten._scaled_dot_product_flash_attention_for_cpu_backward,
}
# Ops that allocate but move (almost) nothing, or only set up metadata.
_FREE = {
    aten.empty,
    aten.empty_like,
    aten.empty_strided,
    aten.zeros,
    aten.ones,
    aten.full,
    aten.arange,
    aten.scalar_tensor,
    aten.detach,
    aten.lift_fresh,
    aten._to_copy,  # counted below only when it changes dtype
    aten._unsafe_view,  # a view the schema does not mark as one
}


def attention_flops(q: torch.Size, k: torch.Size, v: torch.Size) -> int:
    """Forward FLOPs of ``softmax(q k^T) v`` for ``[b, h, s, d]`` shapes (no causal discount)."""
    b, h, s_q, d = q
    s_k, d_v = k[-2], v[-1]
    return 2 * b * h * s_q * s_k * d + 2 * b * h * s_q * s_k * d_v


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class OpCost(TorchDispatchMode):
    """Running totals of matmul FLOPs, attention FLOPs and bytes moved by every other op."""

    def __init__(
        self,
        classify: Callable[[torch.Tensor], bool] | None = None,
        on_matmul_input: Callable[[torch.Tensor], None] | None = None,
    ) -> None:
        super().__init__()
        self.mm_flops = 0
        self.attn_flops = 0
        self.mem_bytes = 0
        self.hidden_mem_bytes = 0
        self.mm_operand_bytes = 0  # the matmuls' tensor inputs (what float8 casts)
        self.causal_attn_flops = 0  # the part of attn_flops under a causal mask
        self.classify = classify
        self.on_matmul_input = on_matmul_input  # called with each residual-stream mm input

    def totals(self) -> tuple[int, int, int, int, int, int]:
        return (
            self.mm_flops,
            self.attn_flops,
            self.mem_bytes,
            self.hidden_mem_bytes,
            self.mm_operand_bytes,
            self.causal_attn_flops,
        )

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        packet = func.overloadpacket
        if packet in _MM:
            self.mm_flops += int(flop_registry[packet](*args, **kwargs, out_val=out))
            self.mm_operand_bytes += sum(_nbytes(t) for t in args if isinstance(t, torch.Tensor))
            x = args[1] if packet is aten.addmm else args[0]
            if self.on_matmul_input is not None and self.classify is not None and self.classify(x):
                self.on_matmul_input(x)
        elif packet in _ATTN_FWD:
            f = attention_flops(args[0].shape, args[1].shape, args[2].shape)
            self.attn_flops += f
            self.causal_attn_flops += f if _arg(func, args, kwargs, "is_causal") else 0
        elif packet in _ATTN_BWD:
            q, k, v = args[1:4]
            f = int(2.5 * attention_flops(q.shape, k.shape, v.shape))
            self.attn_flops += f
            self.causal_attn_flops += f if _arg(func, args, kwargs, "is_causal") else 0
        elif not _is_view(func) and (packet not in _FREE or _casts(packet, args, out)):
            outs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
            if not outs:  # queries (prim.device, sizes): no kernel
                return out
            ins = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
            moved = [*ins, *outs]
            self.mem_bytes += sum(_nbytes(t) for t in moved)
            if self.classify is not None:
                self.hidden_mem_bytes += sum(_nbytes(t) for t in moved if self.classify(t))
        return out


def _arg(func: Any, args: Any, kwargs: dict[str, Any], name: str) -> Any:
    """The value of the argument ``name`` of this call (``None`` when the op has none)."""
    for i, a in enumerate(func._schema.arguments):
        if a.name == name:
            if name in kwargs:
                return kwargs[name]
            return args[i] if i < len(args) else a.default_value
    return None


def _is_view(func: Any) -> bool:
    schema = func._schema
    rets = schema.returns
    return bool(rets) and all(r.alias_info is not None and not r.alias_info.is_write for r in rets)


def _casts(packet: Any, args: Any, out: Any) -> bool:
    return (
        packet is aten._to_copy
        and isinstance(out, torch.Tensor)
        and isinstance(args[0], torch.Tensor)
        and args[0].dtype != out.dtype
    )
