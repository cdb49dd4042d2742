"""Measure the per-rank peak of real sharded training steps, in the units the planner predicts.

:func:`measure_rank` runs on each rank of a :func:`fullshard.testing.run_distributed` group:
it builds the GPT, shards it (fullshard or torch FSDP2, blocks then root), and trains a few
steps with AdamW under :class:`~fullshard.memory.tracker.LiveTensorBytes`. The peak counts every
live tensor storage after setup (sharded parameters are counted from the start; optimizer
states from their lazy creation in step 1), exactly what ``fullshard plan`` predicts and what
``torch.cuda.max_memory_allocated`` reports on a GPU. RSS would add the interpreter, libraries
and allocator caching (hundreds of MiB that do not scale with the model), so it is not the
quantity to check a tensor-memory prediction against.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from fullshard.memory.ac import checkpointed
from fullshard.memory.tracker import LiveTensorBytes
from fullshard.models import GPT, GPTConfig
from fullshard.peers import load_fully_shard

__all__ = ["measure_rank"]


def _shard(model: GPT, engine: str, reshard_after_forward: bool) -> None:
    fully_shard = load_fully_shard(engine)
    for block in model.blocks:
        fully_shard(block, reshard_after_forward=reshard_after_forward)
    fully_shard(model, reshard_after_forward=reshard_after_forward)


def measure_rank(
    model_cfg: dict[str, Any],
    batch: int,
    seq: int,
    engine: str = "fullshard",
    steps: int = 3,
    reshard_after_forward: bool = True,
    ac: str = "none",
) -> dict[str, Any]:
    """Train ``steps`` steps on this rank; return the peak live tensor bytes and where it was.
    ``ac``: activation checkpointing of each block as the planner traces it
    (:mod:`fullshard.memory.ac`)."""
    cfg = GPTConfig(**model_cfg)
    torch.manual_seed(0)
    model = GPT(cfg)
    _shard(model, engine, reshard_after_forward)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1)
    gen = torch.Generator().manual_seed(dist.get_rank() if dist.is_initialized() else 0)
    data = [torch.randint(0, cfg.vocab_size, (batch, seq + 1), generator=gen) for _ in range(steps)]
    tracker = LiveTensorBytes()
    model.register_forward_pre_hook(lambda m, a: setattr(tracker, "label", "forward"))
    with tracker, checkpointed(list(model.blocks), ac):
        tracker.track(model.parameters(), "param")
        tracker.track(data, "data")
        tracker.reset_peak()
        for step, rows in enumerate(data):
            x, y = rows[:, :-1], rows[:, 1:]
            logits = model(x)
            tracker.label = f"loss (step {step + 1})"
            loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1))
            del logits
            tracker.label = f"backward (step {step + 1})"
            loss.backward()
            del loss
            tracker.label = f"optimizer step (step {step + 1})"
            opt.step()
            opt.zero_grad(set_to_none=True)
    return {
        "peak_bytes": tracker.peak,
        "peak_at": tracker.peak_label,
        "peak_by_category": tracker.peak_by_category,
        "end_bytes": tracker.current,
    }
