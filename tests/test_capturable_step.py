"""A capturable step ([Note: a capturable step] in ``fullshard.engine.kept``): with
``set_keep_unsharded_storage(True)`` and manual backward finalization
(:func:`fullshard.capture.make_capturable`), the engine creates no tensor, resizes no storage
and makes no host wait over steady-state steps (forward, loss, backward, finalize), at world
sizes 1 and 2 (at 2 also with two backward passes per step whose reductions all stay in
flight), and trains bit for bit as the default path does.

How engine work is told from the model's, and what counts, is
:func:`fullshard.capture.count_engine_work`'s docstring (the Python stack; new storages; host
waits). Claimed for the core path, the one CUDA runs: on gloo, ``CommPolicy(
cpu_fast_paths_off=CPU_CHOICES)`` switches off the CPU's own transports and pools ([Note: the
host strategy]), which keep allocating. The capture itself needs CUDA: ``scripts/
gpu_check.sh``'s ``graph`` line and ``tests/test_gpu.py::test_cuda_graph_replays_a_step``.
"""

from __future__ import annotations

import contextlib
from typing import Any

import pytest
import torch
import torch.distributed as dist

from fullshard import CommPolicy, FSDPModule, MixedPrecisionPolicy
from fullshard.capture import count_engine_work, finalize, make_capturable
from fullshard.engine.backend import CPU_CHOICES
from fullshard.module import unit_state
from fullshard.testing import run_distributed
from parity import GLOBAL_BATCH, batch, loss_fn, make_net, shard_net

WARMUP, COUNTED = 3, 3


def _train(case: dict[str, Any], capturable: bool, backwards: int = 1) -> dict[str, Any]:
    world, rank = dist.get_world_size(), dist.get_rank()
    model = shard_net(make_net(), **case)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    if capturable:
        make_capturable(model)
    if backwards > 1:  # every reduction of the first backward still in flight at the second
        for m in model.modules():  # (set_reduce_scatter_max_input_buffers, on every torch)
            if isinstance(m, FSDPModule):
                unit_state(m).group.overrides.max_input_buffers = 64
    created, syncs, ops = [], [], 0
    per = GLOBAL_BATCH // world
    for s in range(WARMUP + COUNTED):
        x, y = (t[rank * per : (rank + 1) * per] for t in batch(s))
        counted = capturable and s >= WARMUP
        with count_engine_work() if counted else contextlib.nullcontext() as seen:
            for half in range(backwards):  # several: each reduces, the last still in flight
                n = len(x) // backwards
                loss = loss_fn(model(x[half * n : (half + 1) * n]), y[half * n : (half + 1) * n])
                loss.backward()
            if capturable:
                finalize(model)
        if seen is not None:
            created, syncs, ops = created + seen.created, syncs + seen.syncs, ops + seen.ops
        opt.step()
        opt.zero_grad(set_to_none=not capturable)  # steady state: the gradients exist
    state = {k: v.full_tensor() for k, v in model.state_dict().items()}
    return {"created": created, "syncs": syncs, "ops": ops, "state": state}


def _cases() -> dict[str, dict[str, Any]]:
    core = CommPolicy(cpu_fast_paths_off=CPU_CHOICES)  # the path CUDA runs
    bf16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    return {"fp32": {"comm_policy": core}, "bf16": {"comm_policy": core, "mp_policy": bf16}}


def _worker() -> dict[str, Any]:
    out = {name: (_train(case, True), _train(case, False)) for name, case in _cases().items()}
    if dist.get_world_size() > 1:  # manual finalization leaves reductions in flight: a unit's
        # next reduction must not write into the buffers the last one still uses
        case = _cases()["fp32"]
        out["two backwards"] = (_train(case, True, 2), _train(case, False, 2))
    return out


@pytest.mark.parametrize("world", [1, 2])
def test_steady_state_allocates_and_syncs_nothing(world: int) -> None:
    for rank, result in enumerate(run_distributed(_worker, world, timeout=300)):
        for name, (cap, default) in result.items():
            where = f"world {world}, rank {rank}, {name}"
            assert cap["created"] == [], f"{where}: the engine created {cap['created']}"
            assert cap["syncs"] == [], f"{where}: the engine waited on the host: {cap['syncs']}"
            if world > 1 or name != "fp32":  # fp32 on one rank: the local transport, no work
                assert cap["ops"] > 0, f"{where}: no engine op seen"
            for k, v in default["state"].items():
                assert torch.equal(cap["state"][k], v), f"{where}: {k} differs from the default"


def test_make_capturable_refuses_a_plain_module() -> None:
    with pytest.raises(TypeError, match="call fully_shard on it"):
        make_capturable(torch.nn.Linear(2, 2))
