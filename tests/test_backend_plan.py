"""The backend plan ([Note: the backend plan] in fullshard.engine.backend): what each device/backend
gets, and every CPU special case switched off on its own (``CommPolicy.cpu_fast_paths_off``)
training exactly as with it on, while the choice visibly changes what the engine does."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from fullshard import CommPolicy, count_collectives, fully_shard
from fullshard.engine import mesh as mesh_module
from fullshard.engine.backend import (
    CPU_CHOICES,
    SMALL_UNIT_WINDOW_BYTES,
    BackendPlan,
    serving_backend,
)
from fullshard.engine.compat import STORAGE_SWAP
from fullshard.engine.events import record_events
from fullshard.engine.hooks import STATE_ATTR
from fullshard.testing import run_distributed
from parity import GLOBAL_BATCH, batch, loss_fn, make_net, shard_net

STEPS = 3
BIG = 512  # Linear(512, 512): 1 MiB fp32, a unit above P2P_MIN_BYTES (gathered in pieces)


def test_the_backend_serving_each_device_is_planned_for(monkeypatch: pytest.MonkeyPatch) -> None:
    """``init_process_group()`` without a backend ("undefined") and per-device backend strings
    plan as the backend that serves the device: gloo's fast paths on the CPU, NCCL's plain path
    on CUDA; the default mesh is CUDA's wherever NCCL serves a visible GPU."""
    gloo, nccl = BackendPlan.choose("cpu", "gloo"), BackendPlan.choose("cuda", "nccl")
    for backend in ("undefined", "cpu:gloo,cuda:nccl", "cuda:nccl, cpu:gloo"):
        assert BackendPlan.choose("cpu", backend) == gloo, backend
        assert BackendPlan.choose("cuda", backend) == nccl, backend
    assert serving_backend("undefined", "cpu") == "gloo"
    assert serving_backend("undefined", "cuda") == "nccl"
    assert serving_backend("cpu:gloo,cuda:nccl", "cuda") == "nccl"
    assert not BackendPlan.choose("cpu", "fake").pieces  # no gloo: no gloo fast path
    # a live group reporting "undefined" (as torch's does after a bare init_process_group())
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "undefined")
    assert BackendPlan.for_group(object(), torch.device("cpu")) == gloo  # type: ignore[arg-type]
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    want = {"undefined": "cuda", "nccl": "cuda", "cpu:gloo,cuda:nccl": "cuda", "gloo": "cpu"}
    for backend, device in want.items():
        monkeypatch.setattr(dist, "get_backend", lambda group=None, b=backend: b)
        assert mesh_module._device_type() == device, backend
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert mesh_module._device_type() == "cpu"


def test_plans_per_device_and_backend() -> None:
    cpu = BackendPlan.choose("cpu", "gloo")
    assert cpu.pieces and cpu.p2p_collectives and cpu.window_bytes == SMALL_UNIT_WINDOW_BYTES
    # recycling needs UntypedStorage._swap_data_ptr_ (torch 2.12): off on older torch
    assert cpu.buffer_pool == cpu.grad_slabs == STORAGE_SWAP
    cuda = BackendPlan.choose("cuda", "nccl")  # the plain path: FSDP2's
    assert (cuda.pieces, cuda.p2p_collectives, cuda.window_bytes) == (False, False, 0)
    assert (cuda.buffer_pool, cuda.grad_slabs) == (False, False)
    assert cuda.algorithm("all_gather", 2, 1 << 30) == "all_gather"
    assert cpu.algorithm("all_gather", 2, 1 << 30) == "p2p"
    assert cpu.algorithm("reduce_scatter", 4, 1 << 30) == "all_reduce"
    off = {c: BackendPlan.choose("cpu", "gloo", (c,)) for c in CPU_CHOICES}
    assert not off["pieces"].pieces and off["pieces"].p2p_collectives
    assert not off["p2p_collectives"].p2p_collectives
    assert off["p2p_collectives"].algorithm("all_gather", 2, 1 << 30) == "all_gather"
    assert off["small_unit_window"].window_bytes == 0
    assert not off["buffer_pool"].buffer_pool and not off["buffer_pool"].grad_slabs
    assert not off["grad_slabs"].grad_slabs and off["grad_slabs"].buffer_pool == STORAGE_SWAP
    with pytest.raises(ValueError, match=r"\['windows'\].*choose from"):
        CommPolicy(cpu_fast_paths_off=("windows",))


class _Big(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(1)
        self.blocks = nn.Sequential(*[nn.Linear(BIG, BIG) for _ in range(2)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.blocks(x)).pow(2).mean()


def _big_batch(step: int) -> torch.Tensor:
    return torch.randn(8, BIG, generator=torch.Generator().manual_seed(step))


def _observe(model: nn.Module, step_fn: Any) -> dict[str, Any]:
    losses, events, algos = [], [], set()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(STEPS):
        with record_events() as log, count_collectives() as stats:
            loss = step_fn(model, step)
            loss.backward()
        opt.step()
        opt.zero_grad()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(total.item() / dist.get_world_size())
        events += [(e.kind, e.detail) for e in log]
        algos |= {(r.kind, r.algorithm) for r in stats.records}
    ctx = model.__dict__[STATE_ATTR].ctx
    return {
        "losses": losses,
        "pieces": ("gather_issue", "pieces") in events,
        "recycled": ("unshard_alloc", "recycled") in events or ("gather_issue", "reused") in events,
        "p2p": any(a in ("p2p", "all_reduce") for _, a in algos),
        "window": ctx.host.window.window_bytes if ctx.host and ctx.host.window else 0,
        "slabs": ctx.host.pool.slabs_started if ctx.host and ctx.host.pool else 0,
        "host": ctx.host is not None,  # [Note: the host strategy]: None is the core alone
    }


def _small_step(model: nn.Module, step: int) -> torch.Tensor:
    rank, per = dist.get_rank(), GLOBAL_BATCH // dist.get_world_size()
    x, y = batch(step)
    return loss_fn(model(x[rank * per : (rank + 1) * per]), y[rank * per : (rank + 1) * per])


def _big_step(model: nn.Module, step: int) -> torch.Tensor:
    rank = dist.get_rank()
    return model(_big_batch(step)[rank * 4 : (rank + 1) * 4])


def _runs() -> dict[tuple[str, tuple[str, ...]], dict[str, Any]]:
    out = {}
    for off in [(), *((c,) for c in CPU_CHOICES), CPU_CHOICES]:
        policy = CommPolicy(cpu_fast_paths_off=off)
        out[("small", off)] = _observe(shard_net(make_net(), comm_policy=policy), _small_step)
        big = _Big()
        for block in big.blocks:
            fully_shard(block, comm_policy=policy)
        fully_shard(big, comm_policy=policy)
        out[("big", off)] = _observe(big, _big_step)
    return out


def _references() -> dict[str, list[float]]:
    """One process, the whole global batch, the same SGD."""
    out = {}
    for name, model in (("small", make_net()), ("big", _Big())):
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        losses = []
        for step in range(STEPS):
            if name == "small":
                x, y = batch(step)
                loss = loss_fn(model(x), y)
            else:
                loss = model(_big_batch(step))
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        out[name] = losses
    return out


def test_each_cpu_choice_switched_off_trains_the_same() -> None:
    runs = run_distributed(_runs, 2, timeout=600)[0]
    ref = _references()
    for (model, off), r in runs.items():
        where = f"{model} model, off={off}"
        assert r["losses"] == pytest.approx(ref[model], rel=1e-5), where
    on_small, on_big = runs[("small", ())], runs[("big", ())]
    # every choice is in use when on ...
    assert on_big["pieces"] and on_small["p2p"]
    assert bool(on_small["recycled"]) == STORAGE_SWAP  # the pool needs torch 2.12
    assert on_small["window"] == SMALL_UNIT_WINDOW_BYTES
    # ... and gone when switched off
    assert not runs[("big", ("pieces",))]["pieces"]
    assert not runs[("small", ("p2p_collectives",))]["p2p"]
    assert runs[("small", ("small_unit_window",))]["window"] == 0
    assert not runs[("small", ("buffer_pool",))]["recycled"]
    for model in ("small", "big"):
        assert runs[(model, ("grad_slabs",))]["slabs"] == 0
        assert runs[(model, ("buffer_pool",))]["slabs"] == 0
        # all of them off: no host strategy at all, the core alone ([Note: the host strategy])
        core = runs[(model, CPU_CHOICES)]
        assert core["host"] is False and on_small["host"] is True
        assert not (core["pieces"] or core["recycled"] or core["p2p"] or core["window"])
