"""Shared pieces of the FSDP1 tests: a small model, data, and one training loop that runs
torch's FSDP1 and fullshard's ``FullyShardedDataParallel`` alike, so each test compares the
two doing the same thing in one spawn.

The model has uneven sizes (13, 10, 7 over 2 or 4 ranks), a buffer, a LayerNorm per block, and
blocks that auto-wrap policies pick out.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.fsdp import FullStateDictConfig, MixedPrecision, StateDictType
from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP
from torch.distributed.fsdp.wrap import ModuleWrapPolicy

from fullshard.fsdp1 import FullyShardedDataParallel as OurFSDP

VOCAB, DIM, HIDDEN, SEQ, GLOBAL_BATCH = 13, 10, 7, 5, 8
ENGINES: dict[str, Any] = {"torch": TorchFSDP, "fullshard": OurFSDP}
BF16 = MixedPrecision(param_dtype=torch.bfloat16, buffer_dtype=torch.bfloat16)
CPU = torch.device("cpu")


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.up = nn.Linear(DIM, HIDDEN)
        self.down = nn.Linear(HIDDEN, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x))))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList([Block(), Block()])
        self.head = nn.Linear(DIM, VOCAB)
        self.register_buffer("scale", torch.full((DIM,), 1.5))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.embed(idx) * self.scale
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def make_net(seed: int = 0) -> Net:
    torch.manual_seed(seed)
    return Net()


def wrap(engine: str, model: nn.Module | None = None, **kwargs: Any) -> nn.Module:
    """The model (``Net`` by default) under ``engine``'s FSDP1, blocks auto-wrapped, on the CPU
    with the original parameters (unless ``kwargs`` say otherwise)."""
    kwargs.setdefault("auto_wrap_policy", ModuleWrapPolicy({Block}))
    kwargs.setdefault("device_id", CPU)
    kwargs.setdefault("use_orig_params", True)
    return ENGINES[engine](make_net() if model is None else model, **kwargs)  # type: ignore[no-any-return]


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's slice of the global batch of ``step``."""
    g = torch.Generator().manual_seed(100 + step)
    x = torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ), generator=g)
    y = torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ), generator=g)
    rank, world = dist.get_rank(), dist.get_world_size()
    per = GLOBAL_BATCH // world
    return x[rank * per : (rank + 1) * per], y[rank * per : (rank + 1) * per]


def loss_of(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(model(x).float().reshape(-1, VOCAB), y.reshape(-1))


def train(
    model: nn.Module,
    steps: int,
    *,
    micro: int = 1,
    clip: float | None = None,
    after_backward: Callable[[nn.Module], None] | None = None,
    optim: torch.optim.Optimizer | None = None,
    first_step: int = 0,
    norms: list[torch.Tensor] | None = None,
) -> tuple[list[float], torch.optim.Optimizer]:
    """AdamW steps on the global batch (``micro`` micro-batches, all but the last under
    ``no_sync()``); returns the global losses (and the optimizer). With ``clip``, the norms
    ``clip_grad_norm_`` returns are appended to ``norms``."""
    opt = optim or torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    losses = []
    for step in range(first_step, first_step + steps):
        x, y = batch(step)
        n = x.shape[0] // micro
        total = torch.zeros(())
        for i in range(micro):
            xs, ys = x[i * n : (i + 1) * n], y[i * n : (i + 1) * n]
            sync = i == micro - 1
            with model.no_sync() if not sync else _nothing():  # type: ignore[operator]
                loss = loss_of(model, xs, ys) / micro
                loss.backward()
            total += loss.detach()
        if after_backward is not None:
            after_backward(model)
        if clip is not None:
            norm = model.clip_grad_norm_(clip)  # type: ignore[operator]
            if norms is not None:
                norms.append(norm)
        opt.step()
        opt.zero_grad()
        dist.all_reduce(total)
        losses.append(total.item() / dist.get_world_size())
    return losses, opt


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *_: object) -> None:
        return None


def full_state(model: nn.Module, cls: Any | None = None) -> dict[str, torch.Tensor]:
    """The model's FULL_STATE_DICT on every rank (``cls``: the FSDP class that made it)."""
    cls = cls or type(model)
    config = FullStateDictConfig(rank0_only=False)
    with cls.state_dict_type(model, StateDictType.FULL_STATE_DICT, config):
        return {k: v.detach().clone() for k, v in model.state_dict().items()}


def full_grads(model: nn.Module, cls: Any | None = None) -> dict[str, torch.Tensor]:
    """Every parameter's full gradient (``summon_full_params(with_grads=True)``), by clean
    name."""
    cls = cls or type(model)
    with cls.summon_full_params(model, with_grads=True, writeback=False):
        return {
            n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None
        }


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """The largest absolute difference between two state dicts with the same keys."""
    assert list(a) == list(b), (list(a), list(b))
    return max(((a[k].float() - b[k].float()).abs().max().item() for k in a), default=0.0)


def local_shard(t: torch.Tensor) -> torch.Tensor:
    """This rank's piece of a ShardedTensor (torch's FSDP1) or DTensor (fullshard), or the
    tensor itself."""
    if hasattr(t, "local_shards"):
        shards = t.local_shards()  # type: ignore[operator]
        return shards[0].tensor if shards else torch.empty(0)
    if hasattr(t, "to_local"):
        return t.to_local()  # type: ignore[operator,no-any-return]
    return t
