"""Shared pieces of the parity tests: a small awkward model and a reference-vs-sharded trainer.

The model has everything that breaks naive sharding: dim-0 sizes that don't divide the world
size (13, 7, 3), a parameter smaller than the world size, 1-D parameters, a frozen layer inside
a unit, an unused branch, an embedding tied to the output head across units, an optional
activation-checkpointed block and a block called twice.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.placement_types import _StridedShard
from torch.utils.checkpoint import checkpoint

from fullshard.checkpoint.shards import local_box
from fullshard.engine.events import EngineEvent

VOCAB, DIM, HIDDEN, SEQ, GLOBAL_BATCH = 13, 10, 7, 6, 24


class Block(nn.Module):
    def __init__(self, frozen: bool = False, unused: bool = False, ckpt: bool = False) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.up = nn.Linear(DIM, HIDDEN)
        self.down = nn.Linear(HIDDEN, DIM)
        self.small = nn.Parameter(torch.randn(3) * 0.1)  # fewer elements than ranks
        self.frozen = nn.Linear(DIM, DIM) if frozen else None
        if self.frozen is not None:
            self.frozen.requires_grad_(False)
        self.unused = nn.Linear(DIM, 3) if unused else None  # never called
        self.ckpt = ckpt

    def _body(self, x: torch.Tensor) -> torch.Tensor:
        h = self.down(F.gelu(self.up(self.norm(x))))
        h = torch.cat([h[..., :3] * (1 + self.small), h[..., 3:]], dim=-1)
        if self.frozen is not None:
            h = h + self.frozen(x)
        return x + h

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.ckpt:
            return checkpoint(self._body, x, use_reentrant=False)
        return self._body(x)


class Net(nn.Module):
    def __init__(self, reuse: bool = False, ckpt: bool = False, mixed: bool = False) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList([Block(frozen=True, ckpt=ckpt), Block(unused=True), Block()])
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        self.head.weight = self.embed.weight  # tied across units (embed is its own unit)
        self.reuse = reuse
        if mixed:
            freeze_mixed(self)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.embed(idx)
        for block in self.blocks:
            x = block(x)
        if self.reuse:
            x = self.blocks[2](x)  # a unit called twice in one forward
        return self.head(self.norm(x))


def freeze_mixed(model: Net) -> None:
    """``requires_grad`` mixed within and across units, every unit keeping one trainable
    parameter: the first block's ``up`` weight, the second block's linears, the root's norm.
    The sharded runs call it after ``fully_shard`` (on the registered sharded parameters)."""
    model.blocks[0].up.weight.requires_grad_(False)
    for lin in (model.blocks[1].up, model.blocks[1].down):
        lin.requires_grad_(False)
    model.norm.requires_grad_(False)


def make_net(seed: int = 0, **kwargs: bool) -> Net:
    torch.manual_seed(seed)
    return Net(**kwargs)


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ), generator=g)
    y = torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ), generator=g)
    return x, y


def loss_fn(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


def make_optimizer(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def reference_run(steps: int, **model_kwargs: bool) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Single-process training on the full global batch."""
    model = make_net(**model_kwargs)
    opt = make_optimizer(model)
    losses = []
    for step in range(steps):
        x, y = batch(step)
        loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def full_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """Gather every DTensor in the state dict (test helper, not the checkpoint path)."""
    out = {}
    for k, v in model.state_dict().items():
        out[k] = _full(v, k).detach().clone() if isinstance(v, DTensor) else v.detach().clone()
    return out


def _full(t: DTensor, what: str) -> torch.Tensor:
    """``t.full_tensor()``; but torch 2.9's DTensor redistributes a ``_StridedShard`` (a dim TP
    and dp both shard, FSDP2's layout too) to the wrong rows, so such a tensor on every rank's
    mesh is put together from each rank's box instead (what fullshard's checkpoints write)."""
    strided = any(isinstance(p, _StridedShard) for p in t.placements)
    if not strided or t.device_mesh.size() != dist.get_world_size():
        return t.full_tensor()
    start, shape = local_box(t, what)
    boxes: list = [None] * dist.get_world_size()
    dist.all_gather_object(boxes, (start, shape, t.to_local().detach()))
    full = torch.empty(t.shape, dtype=t.dtype)
    for st, sh, local in boxes:
        full[tuple(slice(a, a + b) for a, b in zip(st, sh))] = local
    return full


def sharded_step(
    model: nn.Module, opt: torch.optim.Optimizer, step: int, micro_batches: int = 1
) -> float:
    """One optimizer step on this rank's slice of the global batch; returns the global loss."""
    rank, world = dist.get_rank(), dist.get_world_size()
    x, y = batch(step)
    per_rank = GLOBAL_BATCH // world
    if per_rank * world != GLOBAL_BATCH or per_rank % micro_batches:
        raise ValueError(
            f"global batch {GLOBAL_BATCH} does not split into {world} x {micro_batches}"
        )
    x, y = x[rank * per_rank : (rank + 1) * per_rank], y[rank * per_rank : (rank + 1) * per_rank]
    per_micro = per_rank // micro_batches
    total = torch.zeros(())
    for i in range(micro_batches):
        last = i == micro_batches - 1
        model.set_requires_gradient_sync(last)  # type: ignore[operator]
        xs, ys = x[i * per_micro : (i + 1) * per_micro], y[i * per_micro : (i + 1) * per_micro]
        loss = loss_fn(model(xs), ys) / micro_batches
        loss.backward()
        total += loss.detach()
    opt.step()
    opt.zero_grad()
    dist.all_reduce(total)
    return (total / world).item()


def shard_net(model: Net, **fully_shard_kwargs: object) -> Net:
    from fullshard import fully_shard

    fully_shard(model.embed, **fully_shard_kwargs)  # type: ignore[arg-type]
    for block in model.blocks:
        fully_shard(block, **fully_shard_kwargs)  # type: ignore[arg-type]
    fully_shard(model, **fully_shard_kwargs)  # type: ignore[arg-type]
    return model


def reused_gathers(log: list[EngineEvent]) -> int:
    """Gathers in ``log`` that took back their unit's pooled memory instead of communicating
    ([Note: taking back a unit's own gathered memory] in ``fullshard.engine.pool``). ZeRO-3's theory
    counts them as all-gathers."""
    return sum(e.kind == "gather_issue" and e.detail == "reused" for e in log)
