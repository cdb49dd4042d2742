"""Example models shared by the trainer, the benchmarks and the memory planner.

Free of any parallelism: this module imports nothing from fullshard, and sharding is applied
from outside (blocks first, then the root).

- :class:`GPT`: a byte-level GPT (pre-norm blocks, learned positions, optional tied
  input/output embeddings), trained by ``fullshard train`` and benchmarked by ``fullshard bench``.
- :class:`TinyUnits`: many tiny blocks whose compute is negligible, so a sharded step's time is
  the engine's per-unit overhead (``fullshard bench --config overhead``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["GPT", "GPTConfig", "TinyUnits"]


@dataclass(kw_only=True)
class GPTConfig:
    """Shape of a :class:`GPT`."""

    vocab_size: int = 256
    seq_len: int = 256
    n_layer: int = 6
    d_model: int = 512
    n_head: int = 8
    mlp_ratio: float = 4.0
    tie_embeddings: bool = True

    def __post_init__(self) -> None:
        if self.d_model % self.n_head != 0:
            raise ValueError(
                f"d_model ({self.d_model}) must be divisible by n_head ({self.n_head})"
            )
        for name in ("vocab_size", "seq_len", "n_layer", "d_model", "n_head"):
            if getattr(self, name) <= 0:
                raise ValueError(f"GPTConfig.{name} must be positive, got {getattr(self, name)}")


class Attention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        q = q.view(b, t, self.n_head, c // self.n_head).transpose(1, 2)
        k = k.view(b, t, self.n_head, c // self.n_head).transpose(1, 2)
        v = v.view(b, t, self.n_head, c // self.n_head).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).contiguous().view(b, t, c))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        hidden = int(cfg.mlp_ratio * cfg.d_model)
        self.fc = nn.Linear(cfg.d_model, hidden)
        self.proj = nn.Linear(hidden, cfg.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x)))


class Block(nn.Module):
    """One pre-norm transformer block: the natural fully_shard unit."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.attn = Attention(cfg)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """Decoder-only transformer: ``forward(idx[B, T]) -> logits[B, T, vocab]``."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.norm = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.head.weight = self.embed.weight
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """(Re)initialise every parameter; works on real, meta-materialised and sharded params."""
        std = 0.02
        proj_std = std / math.sqrt(2 * self.cfg.n_layer)
        for name, p in self.named_parameters():
            if p.dim() >= 2:
                nn.init.normal_(p, mean=0.0, std=proj_std if name.endswith("proj.weight") else std)
            elif name.endswith("bias"):
                nn.init.zeros_(p)
            else:  # LayerNorm weight
                nn.init.ones_(p)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        if t > self.cfg.seq_len:
            raise ValueError(f"sequence length {t} exceeds the model's seq_len {self.cfg.seq_len}")
        pos = torch.arange(t, device=idx.device)
        x = self.embed(idx) + self.pos(pos)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))

    def num_parameters(self) -> int:
        """Number of unique parameters (tied weights counted once)."""
        return sum(p.numel() for p in self.parameters())


class TinyUnits(nn.Module):
    """``units`` blocks of ``LayerNorm(width)`` + ``Linear(width, width)``, applied in sequence.

    ``forward(x[B, width]) -> [B, width]``. Each block (``self.blocks[i]``) is meant to be one
    sharding unit; the root holds no parameters of its own.
    """

    def __init__(self, units: int = 64, width: int = 32) -> None:
        super().__init__()
        if units < 1 or width < 1:
            raise ValueError(f"TinyUnits needs units >= 1 and width >= 1, got {units}, {width}")
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.LayerNorm(width), nn.Linear(width, width)) for _ in range(units)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x
