"""The distributed cases of ``tests/test_rl_colocated.py`` (importable, so forkserver ranks can
run them): training ranks hand engine processes their weights through shared buckets.

``colocated_world`` runs on 4 gloo ranks: trainers 0-1 (one mesh) and engines 2-3, every
trainer ``r`` handing its own engine ``2 + r`` the full weights (verl's colocated layout), over
two publications between training steps; then trainer 0 alone (a one-rank mesh) hands engine 2
a model of mixed dtypes. Every engine is a process of its own: the buckets reach it only
through their IPC handles (shared memory on the CPU).
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from fullshard import fully_shard
from fullshard.rl import (
    DistLink,
    WeightReceiver,
    colocated_buckets,
    publish_colocated,
    receive_colocated,
)
from rl_sync_cases import full_weights, make_llama, shard_llama, train

ROUNDS = 2
BUCKET_BYTES = 1 << 12  # 4 KiB: several buckets per publication
HOLD_S = 0.03  # an engine holds each bucket this long before loading it


class _Cast(nn.Module):
    """A linear layer in its own dtype that takes and returns float32."""

    def __init__(self, n_in: int, n_out: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.lin = nn.Linear(n_in, n_out).to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x.to(self.lin.weight.dtype)).float()


def mixed_model() -> nn.Module:
    """Units in float32 and bfloat16 (one dtype per unit), a 3000-element weight among them:
    larger than one bucket."""
    torch.manual_seed(3)
    return nn.Sequential(
        _Cast(12, 250, torch.float32), _Cast(250, 12, torch.bfloat16), _Cast(12, 4, torch.float32)
    )


def _checked_engine(link: DistLink, receiver: WeightReceiver) -> dict[str, Any]:
    """Receive one publication bucket by bucket, checking that every view lies in its bucket's
    shared storage (no copy) and that no bucket changes while the engine holds it (held
    ``HOLD_S`` before loading: a trainer that reused it before the ack would show here)."""
    out: dict[str, Any] = {"buckets": 0, "views": 0, "copies": [], "overwritten": []}
    out["shared"], out["dtypes"] = True, set()
    for bucket in colocated_buckets(link):
        flat = bucket.tensor
        lo = flat.data_ptr()
        hi = lo + flat.numel() * flat.element_size()
        seen = flat[: bucket.numel].clone()
        time.sleep(HOLD_S)
        for name, view in bucket.named_tensors():
            end = view.data_ptr() + view.numel() * view.element_size()
            same = view.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr()
            if not (same and lo <= view.data_ptr() and end <= hi):
                out["copies"].append(name)
            receiver.apply_full(name, view)
            out["views"] += 1
        if not torch.equal(flat[: bucket.numel], seen):
            out["overwritten"].append(bucket.seq)
        out["shared"] &= flat.is_shared()
        out["dtypes"].add(str(bucket.dtype))
        out["buckets"] += 1
    return out


def _names(into: list[str], named: Iterable[tuple[str, torch.Tensor]]) -> None:
    into.extend(n for n, _ in named)


def _snapshot(receiver: WeightReceiver) -> dict[str, torch.Tensor]:
    return {n: t.clone() for n, t in receiver.weights.items()}


def _engine(rank: int) -> dict[str, Any]:
    link = DistLink(rank - 2)
    receiver = WeightReceiver(make_llama(seed=7, dtype=torch.bfloat16))
    out: dict[str, Any] = {"stages": [], "checks": [], "reports": [], "loaded": []}
    for _ in range(ROUNDS):
        if rank == 2:  # the buckets themselves, checked
            out["checks"].append(_checked_engine(link, receiver))
        else:  # the library's loop, a WeightReceiver and an engine's load callback
            names: list[str] = []
            load = partial(_names, names)
            out["reports"].append(receive_colocated(link, receiver, load=load))
            out["loaded"].append(names)
        out["stages"].append(_snapshot(receiver))
    dist.barrier()
    if rank == 2:  # world size 1, mixed dtypes, a ring of one bucket per dtype
        mixed = WeightReceiver(
            {n: torch.zeros_like(p) for n, p in mixed_model().named_parameters()}
        )
        out["checks"].append(_checked_engine(link, mixed))
        out["stages"].append(_snapshot(mixed))
    return out


def _trainer(rank: int, trainers: dist.ProcessGroup, alone: dist.ProcessGroup) -> dict[str, Any]:
    link = DistLink(rank + 2)
    model = make_llama()
    shard_llama(model, DeviceMesh.from_group(trainers, "cpu"))
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3)
    out: dict[str, Any] = {"stages": [], "reports": [], "events": [], "rank": rank}
    for i in range(ROUNDS):
        train(model, opt, 1 + i, seed=30 + i)
        events: list[tuple[str, int]] = []
        report = publish_colocated(
            model, link, dtype=torch.bfloat16, bucket_bytes=BUCKET_BYTES, events=events
        )
        out["reports"].append(report)
        out["events"].append(events)
        out["stages"].append(full_weights(model, torch.bfloat16))
    dist.barrier()
    if rank == 0:
        out.update(_trainer_alone(link, alone))
    return out


def _trainer_alone(link: DistLink, alone: dist.ProcessGroup) -> dict[str, Any]:
    """World size 1: a mixed-dtype model, trained, published in each weight's own dtype."""
    model = mixed_model()
    mesh = DeviceMesh.from_group(alone, "cpu")
    for unit in model:
        fully_shard(unit, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(4)
    for _ in range(2):
        model(torch.randn(8, 12, generator=g)).square().mean().backward()
        opt.step()
        opt.zero_grad()
    events: list[tuple[str, int]] = []
    report = publish_colocated(model, link, bucket_bytes=1 << 10, buffers=1, events=events)
    oracle = {
        n: (p.full_tensor() if isinstance(p, DTensor) else p.detach())
        for n, p in model.named_parameters()
    }
    return {"alone_report": report, "alone_events": events, "alone_oracle": oracle}


def colocated_world() -> dict[str, Any]:
    """4 ranks: trainers 0-1, engines 2-3 (see the module's docstring). Pair 0-2 shares CPU
    buckets by file descriptor (Linux's default), pair 1-3 by file name (``file_system``)."""
    trainers = dist.new_group([0, 1])  # new_group is collective: every rank makes both
    alone = dist.new_group([0])
    rank = dist.get_rank()
    if rank in (1, 3):
        torch.multiprocessing.set_sharing_strategy("file_system")
    out = _engine(rank) if rank >= 2 else _trainer(rank, trainers, alone)
    out["strategy"] = torch.multiprocessing.get_sharing_strategy()
    return out
