"""Helpers shared by the checkpoint tests (no tests here): a small awkward model, its training
step, and ways to look at full weights and optimizer state.

The model has dim-0 sizes that do not divide 2, 3 or 4 (13, 7, 6 -> empty shards on 4 ranks), a
1-D bias, a plain buffer, and an embedding tied to the output head.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from fullshard import fully_shard

VOCAB, DIM, HIDDEN, SEQ, GLOBAL_BATCH = 13, 6, 7, 5, 8


class TinyNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)  # [13, 6]
        self.fc1 = nn.Linear(DIM, HIDDEN)  # [7, 6] + [7]
        self.fc2 = nn.Linear(HIDDEN, DIM)  # [6, 7] + [6]
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        self.head.weight = self.emb.weight  # tied
        self.register_buffer("scale", torch.linspace(0.5, 1.5, DIM))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        h = self.emb(idx)
        h = self.fc2(torch.tanh(self.fc1(h))) * self.scale
        return self.head(h)


def make_model(
    seed: int = 0, mesh: DeviceMesh | None = None, units: bool = True, **policies: Any
) -> TinyNet:
    """TinyNet, fully sharded when torch.distributed is up: fc1, fc2 and the root as units
    (``units=False``: one unit for the whole model, a different layout with the same FQNs).
    ``policies`` go to every ``fully_shard`` call (mp_policy=..., offload_policy=...)."""
    torch.manual_seed(seed)
    model = TinyNet()
    if dist.is_initialized():
        if units:
            fully_shard(model.fc1, mesh=mesh, **policies)
            fully_shard(model.fc2, mesh=mesh, **policies)
        fully_shard(model, mesh=mesh, **policies)
    return model


def make_optimizer(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ), generator=g)
    y = torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ), generator=g)
    return x, y


def loss_of(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    logits = model(x)
    return F.cross_entropy(logits.reshape(-1, VOCAB), y.reshape(-1))


def train_step(model: nn.Module, opt: torch.optim.Optimizer, step: int) -> float:
    """One data-parallel step: each rank takes its slice of the global batch."""
    x, y = batch(step)
    rank, world = dist.get_rank(), dist.get_world_size()
    per = GLOBAL_BATCH // world
    loss = loss_of(model, x[rank * per : (rank + 1) * per], y[rank * per : (rank + 1) * per])
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.item()


def eval_loss(model: nn.Module, step: int) -> float:
    """The loss of the whole global batch ``step`` (same on every rank and world size)."""
    with torch.no_grad():
        return loss_of(model, *batch(step)).item()


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor().detach().clone() if isinstance(t, DTensor) else t.detach().clone()


def full_weights(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: full_tensor(v) for k, v in model.state_dict().items()}


def full_optim_state(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    out = {}
    for fqn, p in model.named_parameters():
        for name, v in opt.state[p].items():
            out[f"{fqn}/{name}"] = full_tensor(v)
    return out


def local_state(model: nn.Module, opt: torch.optim.Optimizer | None) -> dict[str, torch.Tensor]:
    """This rank's local shards of the model and optimizer, for bit-exact round-trip checks."""
    out = {
        f"model/{k}": (v.to_local() if isinstance(v, DTensor) else v).detach().clone()
        for k, v in model.state_dict().items()
    }
    if opt is not None:
        for fqn, p in model.named_parameters():
            for name, v in opt.state[p].items():
                t = v.to_local() if isinstance(v, DTensor) else v
                out[f"optim/{fqn}/{name}"] = t.detach().clone()
    return out


def assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], what: str) -> None:
    if a.keys() != b.keys():
        raise AssertionError(f"{what}: keys differ: {sorted(a.keys() ^ b.keys())}")
    bad = [k for k in a if a[k].dtype != b[k].dtype or not torch.equal(a[k], b[k])]
    if bad:
        raise AssertionError(f"{what}: not bit-exact: {bad}")
