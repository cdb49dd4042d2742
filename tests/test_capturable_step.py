"""A capturable step ([Note: a capturable step] in ``fullshard.engine.kept``): with
``set_keep_unsharded_storage(True)`` and manual backward finalization, the engine creates no
tensor, resizes no storage and makes no host wait over steady-state steps (forward, loss,
backward, ``finalize_backward``), at world sizes 1 and 2, and trains bit for bit as the
default path does.

Engine work is told from the model's by the Python stack: an op counts as the engine's when
the innermost frame outside torch and the standard library is in ``src/fullshard`` (the
model's forward and autograd's backward kernels are entered from the test's frames; the
engine's hooks, collectives and reductions from the engine's). A created tensor is an op
output whose storage is none of the op's inputs' (views, in-place and ``out=`` ops create
none). Host waits: ``_local_scalar_dense`` / ``is_nonzero`` / ``equal`` (``.item()``,
``bool(t)``), and ``synchronize`` on the engine's streams and events (on the CPU its logical
ones, where CUDA would block the host).

Claimed for the core path, the one CUDA runs: on gloo, ``CommPolicy(cpu_fast_paths_off=
CPU_CHOICES)`` switches off the CPU's own transports and pools ([Note: the host strategy]).
The bit-identical check needs no GPU; the capture itself is ``scripts/gpu_check.sh``'s
``graph`` line and ``tests/test_gpu.py::test_cuda_graph_captures_a_step``.

The public ``set_keep_unsharded_storage`` / ``set_manual_backward_finalization`` are torch
2.15's API (refused on older torch, as torch's ``FSDPModule`` lacks them): the test sets the
same engine state directly, so it runs on every supported torch.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import fullshard
from fullshard import CommPolicy, MixedPrecisionPolicy
from fullshard.engine import finalize_backward, set_manual_backward_finalization
from fullshard.engine.backend import CPU_CHOICES
from fullshard.engine.streamcheck import LogicalEvent, LogicalStream
from fullshard.module import unit_state
from fullshard.testing import run_distributed
from parity import GLOBAL_BATCH, batch, loss_fn, make_net, shard_net

WARMUP, COUNTED = 3, 3
_PKG = os.path.dirname(fullshard.__file__)
_NOT_ENGINE = (os.path.join(_PKG, "models.py"), os.path.join(_PKG, "testing.py"))
_SKIP = (os.path.dirname(torch.__file__), os.path.dirname(contextlib.__file__), __file__)
_SYNCS = {
    torch.ops.aten._local_scalar_dense.default,
    torch.ops.aten.is_nonzero.default,
    torch.ops.aten.equal.default,
}


def _engine_caller() -> str | None:
    """``file:line`` of the innermost frame outside torch, the standard library and this
    test, if it is the engine's (see the module docstring)."""
    f = sys._getframe(2)
    while f is not None and f.f_code.co_filename.startswith(_SKIP):
        f = f.f_back
    if f is None:
        return None
    name = f.f_code.co_filename
    if not name.startswith(_PKG) or name in _NOT_ENGINE:
        return None
    return f"{os.path.relpath(name, _PKG)}:{f.f_lineno}"


def _storages(tree: Any) -> set[int]:
    return {t.untyped_storage()._cdata for t in tree_leaves(tree) if isinstance(t, torch.Tensor)}


class EngineWork(TorchDispatchMode):
    """Records the tensors engine code creates and the host waits it makes."""

    def __init__(self) -> None:
        super().__init__()
        self.created: list[str] = []
        self.syncs: list[str] = []
        self.engine_ops = 0  # every op the engine issued: shows the attribution sees it

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        where = _engine_caller()
        if where is not None:
            self.engine_ops += 1
            if func in _SYNCS:
                self.syncs.append(f"{func} at {where}")
            elif _storages(out) - _storages((args, kwargs)):
                self.created.append(f"{func} at {where}")
        return out


@contextlib.contextmanager
def counting() -> Iterator[EngineWork]:
    """:class:`EngineWork` plus storage resizes and stream/event host waits from the engine."""
    mode = EngineWork()
    saved = (torch.UntypedStorage.resize_, LogicalEvent.synchronize, LogicalStream.synchronize)

    def resize(storage: torch.UntypedStorage, size: int) -> Any:
        mode.created.append(f"UntypedStorage.resize_({size}) at {_engine_caller()}")
        return saved[0](storage, size)

    def event_sync(self: Any) -> None:
        mode.syncs.append("LogicalEvent.synchronize")

    def stream_sync(self: Any) -> None:
        mode.syncs.append("LogicalStream.synchronize")

    torch.UntypedStorage.resize_ = resize  # type: ignore[method-assign,assignment]
    LogicalEvent.synchronize = event_sync  # type: ignore[method-assign]
    LogicalStream.synchronize = stream_sync  # type: ignore[method-assign]
    try:
        with mode:
            yield mode
    finally:
        torch.UntypedStorage.resize_ = saved[0]  # type: ignore[method-assign]
        LogicalEvent.synchronize, LogicalStream.synchronize = saved[1], saved[2]  # type: ignore[method-assign]


def make_capturable(model: nn.Module) -> None:
    """``set_keep_unsharded_storage(True)`` on every unit and manual finalization on the root."""
    for m in model.modules():
        if isinstance(m, fullshard.FSDPModule):
            st = unit_state(m)
            for g in (st.group, *st.group.subgroups):
                g.keep_unsharded_storage = True
    set_manual_backward_finalization(unit_state(model), True)


def _train(case: dict[str, Any], capturable: bool) -> dict[str, Any]:
    world, rank = dist.get_world_size(), dist.get_rank()
    model = shard_net(make_net(), **case)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    if capturable:
        make_capturable(model)
    created, syncs, engine_ops = [], [], 0
    per = GLOBAL_BATCH // world
    for s in range(WARMUP + COUNTED):
        x, y = (t[rank * per : (rank + 1) * per] for t in batch(s))
        with counting() if capturable and s >= WARMUP else contextlib.nullcontext() as seen:
            loss = loss_fn(model(x), y)
            loss.backward()
            if capturable:
                finalize_backward(unit_state(model), False)
        if seen is not None:
            created += seen.created
            syncs += seen.syncs
            engine_ops += seen.engine_ops
        opt.step()
        opt.zero_grad(set_to_none=not capturable)  # steady state: the gradients exist
    state = {k: v.full_tensor() for k, v in model.state_dict().items()}
    return {"created": created, "syncs": syncs, "ops": engine_ops, "state": state}


def _cases() -> dict[str, dict[str, Any]]:
    core = CommPolicy(cpu_fast_paths_off=CPU_CHOICES)  # the path CUDA runs
    return {
        "fp32": {"comm_policy": core},
        "bf16": {"comm_policy": core, "mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16)},
    }


def _worker() -> dict[str, Any]:
    out = {}
    for name, case in _cases().items():
        out[name] = (_train(case, True), _train(case, False))
    return out


def test_steady_state_allocates_and_syncs_nothing() -> None:
    for world in (1, 2):
        for rank, result in enumerate(run_distributed(_worker, world, timeout=300)):
            for name, (cap, default) in result.items():
                where = f"world {world}, rank {rank}, {name}"
                assert cap["created"] == [], f"{where}: the engine created {cap['created']}"
                assert cap["syncs"] == [], f"{where}: the engine waited on the host {cap['syncs']}"
                if world > 1 or name != "fp32":  # fp32 on one rank: the local transport
                    assert cap["ops"] > 0, f"{where}: no engine op seen"  # moves nothing
                for k, v in default["state"].items():
                    assert torch.equal(cap["state"][k], v), f"{where}: {k} differs"
