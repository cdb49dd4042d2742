"""Composition, continued: frozen parameters of another dtype in a unit, torch.compile.

Every case trains against one process on the same global batch (fp32: rel. loss < 1e-5 at
every step, full weights < 1e-4). One spawn of 2 ranks runs every case.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch._dynamo.utils import counters

from fullshard import count_collectives, fully_shard
from fullshard.api import _all_states
from fullshard.testing import run_distributed
from parity import DIM, GLOBAL_BATCH, VOCAB, batch, full_state, loss_fn

STEPS = 3
LOSS_TOL, WEIGHT_TOL = 1e-5, 1e-4


class MixedBlock(nn.Module):
    """fp32 trainable layers beside a frozen bf16 weight (e.g. a quantised base model)."""

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(DIM, 14)
        self.down = nn.Linear(14, DIM)
        self.frozen = nn.Parameter(torch.randn(DIM, DIM).to(torch.bfloat16), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(x))) + F.linear(x, self.frozen.float())


class MixedNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList([MixedBlock() for _ in range(2)])
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.embed(idx)
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def _net() -> MixedNet:
    torch.manual_seed(0)
    return MixedNet()


def _train(model: nn.Module, rank: int, world: int) -> list[float]:
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    per = GLOBAL_BATCH // world
    losses = []
    for step in range(STEPS):
        x, y = batch(step)
        loss = loss_fn(model(x[rank * per : (rank + 1) * per]), y[rank * per : (rank + 1) * per])
        loss.backward()
        opt.step()
        opt.zero_grad()
        total = loss.detach().clone()
        if world > 1:
            dist.all_reduce(total)
            total /= world
        losses.append(total.item())
    return losses


def _errors(model: nn.Module, losses: list[float], ref: tuple[list[float], dict]) -> tuple:
    ref_losses, ref_state = ref
    state = full_state(model)
    loss_err = max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses))
    w_err = max((state[k].float() - v.float()).abs().max().item() for k, v in ref_state.items())
    return loss_err, w_err


def _shard(model: MixedNet) -> MixedNet:
    for b in model.blocks:
        fully_shard(b)
    fully_shard(model)
    return model


def _cases() -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    out: dict = {}
    reference = _net()
    ref = (_train(reference, 0, 1), full_state(reference))

    # 1. A frozen bf16 parameter beside fp32 trainable ones: one all-gather per dtype.
    net = _shard(_net())
    out["frozen_dtype"] = str(net.blocks[0].frozen.dtype)
    with count_collectives() as stats:
        losses = _train(net, rank, world)
    out["mixed"] = _errors(net, losses, ref)
    out["mixed_gather_dtypes"] = sorted({str(r.dtype) for r in stats.records if r.kind == "all_gather"})
    out["mixed_unsharded"] = sum(st.group.unsharded_bytes_allocated for st in _all_states(net))
    # Two trainable dtypes in one unit would need two reductions: refused, naming them.
    bad = _net()
    bad.blocks[0].down.to(torch.float64)
    with pytest.raises(ValueError, match="trainable parameters of several dtypes") as e:
        _shard(bad)(batch(0)[0])
    out["refused"] = str(e.value)

    # 2a. Per-block torch.compile before fully_shard (torchtitan's order).
    net = _net()
    for b in net.blocks:
        b.compile(backend="aot_eager")
    out["compile_blocks"] = _errors(_shard(net), _train(net, rank, world), ref)

    # 2b. The whole sharded model compiled (graph breaks at the unit hooks).
    net = _shard(_net())
    compiled = torch.compile(net, backend="aot_eager")
    counters["stats"].clear()
    losses = _train(compiled, rank, world)
    out["compile_model"] = _errors(net, losses, ref)
    out["graphs"] = counters["stats"]["unique_graphs"]
    return out


def _check(out: dict, name: str) -> None:
    loss_err, w_err = out[name]
    assert loss_err < LOSS_TOL, (name, loss_err)
    assert w_err < WEIGHT_TOL, (name, w_err)


def test_mixed_dtypes_and_compile() -> None:
    results = run_distributed(_cases, 2)
    for r in results:
        assert r["frozen_dtype"] == "torch.bfloat16"
        assert r["mixed_gather_dtypes"] == ["torch.bfloat16", "torch.float32"]
        assert r["mixed_unsharded"] == 0
        assert "blocks.0.down.weight: torch.float64" in r["refused"], r["refused"]
        assert "param_dtype" in r["refused"]
        assert r["graphs"] > 0  # something was compiled between the unit hooks
        for name in ("mixed", "compile_blocks", "compile_model"):
            _check(r, name)
