"""Tensor parallelism for the trainer's models: a DTensor TP plan per block, applied from outside.

Megatron's split, per transformer block: the first projection of attention and of the MLP is
column-parallel (each TP rank computes its heads / its slice of the hidden width), the second
row-parallel (partial outputs all-reduced), so a block costs one all-reduce in forward and one
in backward per sub-layer. Embeddings, norms and the output head stay whole on every TP rank
(sharded over data parallelism only); the loss is computed on full logits.

- Hugging Face Llama-family layers (``self_attn.{q,k,v,o}_proj``, ``mlp.{gate,up,down}_proj``:
  Llama, Mistral, Qwen2/3, ...) reshape by ``head_dim`` with ``-1`` heads, so they run on their
  local heads unchanged.
- The built-in GPT fuses q, k and v in one ``qkv`` Linear (rows q | k | v). A contiguous row
  shard of it holds no whole heads, and parameter names and shapes must not change (a
  checkpoint written under one layout resumes under another), so its output is all-gathered
  over TP (one ``[B, T, 3C]`` activation gather per block) and each TP rank runs attention on its
  own heads before the row-parallel ``proj``; see :func:`_gpt_attention_forward`.

Parameters become TP DTensors on ``mesh["tp"]``; ``fully_shard`` then shards their local
tensors over the data-parallel mesh (fullshard's [Note: composing with DTensor parallelism]).
"""

from __future__ import annotations

import types
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    parallelize_module,
)

from fullshard.models import GPT, Attention

__all__ = ["LLAMA_PLAN", "apply_tp", "supports_tp", "tp_sizes"]

# Llama-family decoder layer: module path -> style name.
LLAMA_PLAN = {
    "self_attn.q_proj": "colwise",
    "self_attn.k_proj": "colwise",
    "self_attn.v_proj": "colwise",
    "self_attn.o_proj": "rowwise",
    "mlp.gate_proj": "colwise",
    "mlp.up_proj": "colwise",
    "mlp.down_proj": "rowwise",
}
_STYLES = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}


def supports_tp(model: nn.Module, layers: list[nn.Module]) -> bool:
    """Whether :func:`apply_tp` has a plan for ``model`` (the GPT or a Llama-family model)."""
    if isinstance(model, GPT):
        return True
    return bool(layers) and all(_has_llama_layout(layer) for layer in layers)


def _has_llama_layout(layer: nn.Module) -> bool:
    names = {name for name, _ in layer.named_modules()}
    return all(path in names for path in LLAMA_PLAN)


def tp_sizes(model: nn.Module) -> dict[str, int]:
    """What TP splits, by the flag or config key that sets it: ``--tp`` must divide each."""
    if isinstance(model, GPT):
        cfg = model.cfg
        return {"--n-head": cfg.n_head, "the MLP width": int(cfg.mlp_ratio * cfg.d_model)}
    config: Any = getattr(model, "config", None)
    heads = int(getattr(config, "num_attention_heads", 0) or 0)
    kv = int(getattr(config, "num_key_value_heads", 0) or heads)
    width = int(getattr(config, "intermediate_size", 0) or 0)
    return {
        "num_attention_heads": heads,
        "num_key_value_heads": kv,
        "intermediate_size": width,
    }


def apply_tp(model: nn.Module, layers: list[nn.Module], tp_mesh: DeviceMesh) -> None:
    """Split every block of ``model`` over ``tp_mesh`` (before ``fully_shard``)."""
    if isinstance(model, GPT):
        for block in layers:
            _gpt_block(block, tp_mesh)
        return
    if not supports_tp(model, layers):
        raise ValueError(
            f"--tp: no tensor-parallel plan for {type(model).__name__} (needs Llama-style "
            f"{', '.join(LLAMA_PLAN)} in every decoder layer); use --tp 1"
        )
    plan = {path: _STYLES[style]() for path, style in LLAMA_PLAN.items()}
    for layer in layers:
        parallelize_module(layer, tp_mesh, plan)  # type: ignore[arg-type]


def _gpt_block(block: nn.Module, tp_mesh: DeviceMesh) -> None:
    attn = block.attn
    assert isinstance(attn, Attention), type(attn)
    plan = {
        # qkv's output stays a DTensor (Shard(-1)): the forward below gathers it.
        "attn.qkv": ColwiseParallel(use_local_output=False),
        "attn.proj": RowwiseParallel(),
        "mlp.fc": ColwiseParallel(),
        "mlp.proj": RowwiseParallel(),
    }
    parallelize_module(block, tp_mesh, plan)  # type: ignore[arg-type]
    tp, rank = tp_mesh.size(), tp_mesh.get_local_rank()
    attn.forward = types.MethodType(  # type: ignore[method-assign]
        lambda self, x: _gpt_attention_forward(self, x, tp=tp, rank=rank), attn
    )


def _gpt_attention_forward(attn: Attention, x: torch.Tensor, *, tp: int, rank: int) -> torch.Tensor:
    """:class:`fullshard.models.Attention`'s forward on this TP rank's heads.

    ``qkv`` is column-parallel (its output a ``Shard(-1)`` DTensor of contiguous rows, no whole
    heads): gathered to the full ``[B, T, 3C]`` (backward: the per-rank partial gradients
    reduce-scattered back, hence ``grad_placements=Partial``), each rank takes its heads of q,
    k and v, and ``proj`` (row-parallel) sums the ranks' partial outputs.
    """
    b, t, c = x.shape
    qkv = attn.qkv(x)
    assert isinstance(qkv, DTensor)
    full = qkv.redistribute(placements=[Replicate()]).to_local(grad_placements=[Partial()])
    heads = attn.n_head // tp
    mine = slice(rank * heads, (rank + 1) * heads)
    q, k, v = (
        part.view(b, t, attn.n_head, c // attn.n_head)[:, :, mine].transpose(1, 2)
        for part in full.split(c, dim=2)
    )
    y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # [B, heads, T, C / n_head]
    return attn.proj(y.transpose(1, 2).reshape(b, t, heads * (c // attn.n_head)))
