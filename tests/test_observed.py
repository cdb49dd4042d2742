"""Observed = unobserved, and told the truth ([Note: collectives under torch's tools] in
fullshard.engine.collectives): under torch's ``CommDebugMode``, the profiler and the stream
checker the engine runs the same path as without them — the same collectives, algorithms,
engine actions and losses — and ``CommDebugMode`` counts exactly the c10d collectives that
were dispatched (a separate dispatch mode that only records sees the same ones): on the core
path (the CPU fast paths off, what CUDA runs) one all-gather per unit gather and one
reduce-scatter per unit reduction, as FSDP2; on gloo's fast paths what ran instead (p2p
exchanges are sends and receives, which the tool does not count; an all-reduce standing in for
a reduce-scatter is an all-reduce; a unit taking back its own gathered memory runs nothing).
Nothing in ``src/`` touches a torch tool's state."""

from __future__ import annotations

import ast
import contextlib
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor.debug import CommDebugMode
from torch.utils._python_dispatch import TorchDispatchMode

import fullshard
from fullshard import CommPolicy, count_collectives
from fullshard.engine.backend import CPU_CHOICES
from fullshard.engine.events import record_events
from fullshard.engine.streamcheck import check_streams
from fullshard.testing import run_distributed
from parity import GLOBAL_BATCH, batch, loss_fn, make_net, make_optimizer, shard_net

STEPS = 3
TRANSPORTS = ("auto", "p2p", "core")
# c10d ops that are not collectives: CommDebugMode does not count them
_NOT_COLLECTIVES = {"c10d.send", "c10d.recv_", "c10d.recv_any_source_", "c10d.barrier"}
# what each algorithm of the engine's collective records dispatches
_OP_OF = {
    "all_gather": "c10d._allgather_base_",
    "reduce_scatter": "c10d._reduce_scatter_base_",
    "all_reduce": "c10d.allreduce_",
}


class _Dispatched(TorchDispatchMode):
    """Records every c10d op dispatched while active; changes nothing."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func.namespace == "c10d":
            self.ops[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def _comm_debug_mode() -> Iterator[tuple[CommDebugMode, _Dispatched]]:
    """``CommDebugMode`` above a mode recording what is dispatched beneath it."""
    with _Dispatched() as seen, CommDebugMode() as mode:
        yield mode, seen


@contextlib.contextmanager
def _profiled() -> Iterator[None]:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]):
        yield


WATCHERS: dict[str, Callable[[], Any]] = {
    "none": contextlib.nullcontext,
    "CommDebugMode": _comm_debug_mode,
    "profiler": _profiled,
    "stream checker": check_streams,
}


def _counts(mode: CommDebugMode) -> dict[str, int]:
    out = {"all_gather": 0, "reduce_scatter": 0, "all_reduce": 0}
    for op, n in mode.get_comm_counts().items():
        name = str(op)
        kind = (
            "all_gather"
            if "allgather" in name or "all_gather" in name
            else "reduce_scatter"
            if "reduce_scatter" in name
            else "all_reduce"
            if "allreduce" in name or "all_reduce" in name
            else name
        )
        out[kind] = out.get(kind, 0) + n
    return out


def _policy(transport: str) -> CommPolicy:
    """``core``: every CPU fast path off, the path CUDA runs (packed, the plain collectives)."""
    if transport == "core":
        return CommPolicy(cpu_fast_paths_off=CPU_CHOICES)
    return CommPolicy(transport=transport)


def _run(transport: str, watcher: str) -> dict[str, Any]:
    rank, per = dist.get_rank(), GLOBAL_BATCH // dist.get_world_size()
    model = shard_net(make_net(), comm_policy=_policy(transport))
    opt = make_optimizer(model)
    out: dict[str, Any] = {"losses": [], "actions": [], "collectives": [], "counted": []}
    for step in range(STEPS):
        x, y = batch(step)
        x, y = x[rank * per : (rank + 1) * per], y[rank * per : (rank + 1) * per]
        for phase in ("forward", "backward"):
            with record_events() as log, count_collectives() as stats, WATCHERS[watcher]() as w:
                if phase == "forward":
                    loss = loss_fn(model(x), y)
                else:
                    loss.backward()
            actions = [(e.kind, e.unit, e.detail) for e in log if e.kind != "backward_start"]
            out["actions"].append(actions)
            out["collectives"].append([(r.kind, r.algorithm, r.group_size) for r in stats.records])
            if watcher == "CommDebugMode":
                mode, seen = w
                counted = {str(op): n for op, n in mode.get_comm_counts().items() if n}
                ran = Counter(_OP_OF[r.algorithm] for r in stats.records if r.algorithm in _OP_OF)
                out["counted"].append(
                    {
                        "counted": counted,
                        "dispatched": dict(seen.ops),
                        "issued": dict(ran),
                        "p2p": sum(r.algorithm == "p2p" for r in stats.records),
                        "by_kind": _counts(mode),
                        "gathers": sum(e.kind == "gather_issue" for e in log),
                        "reductions": sum(e.kind == "reduce_issue" for e in log),
                    }
                )
        out["losses"].append(loss.item())
        opt.step()
        opt.zero_grad()
    return out


def _all() -> dict[tuple[str, str], dict[str, Any]]:
    return {(t, w): _run(t, w) for t in TRANSPORTS for w in WATCHERS}


def _check_counts(transport: str, world: int, phase: dict[str, Any]) -> None:
    """What ``CommDebugMode`` counted in one forward or backward is what was dispatched."""
    case = f"{transport} on {world} ranks: {phase}"
    dispatched = {k: n for k, n in phase["dispatched"].items() if k not in _NOT_COLLECTIVES}
    assert phase["counted"] == dispatched == phase["issued"], case
    sends, recvs = phase["dispatched"].get("c10d.send", 0), phase["dispatched"].get("c10d.recv_", 0)
    assert (sends > 0) == (phase["p2p"] > 0) and sends == recvs, case
    if transport == "core":  # FSDP2's counts: one per unit gather / unit reduction
        by_kind = phase["by_kind"]
        assert phase["gathers"] and by_kind["all_gather"] == phase["gathers"], case
        assert by_kind["reduce_scatter"] == phase["reductions"], case
        assert by_kind["all_reduce"] == 0, case


@pytest.mark.parametrize("world", [2, 3])
def test_watched_runs_the_same_path(world: int) -> None:
    for rank_out in run_distributed(_all, world, timeout=600):
        for transport in TRANSPORTS:
            plain = rank_out[(transport, "none")]
            for watcher in WATCHERS:
                seen = rank_out[(transport, watcher)]
                case = f"{transport} under {watcher} on {world} ranks"
                assert seen["losses"] == plain["losses"], case
                assert seen["collectives"] == plain["collectives"], case
                assert seen["actions"] == plain["actions"], case
            counted = rank_out[(transport, "CommDebugMode")]["counted"]
            assert len(counted) == 2 * STEPS
            for phase in counted:
                _check_counts(transport, world, phase)
        # on gloo's fast paths the tool sees p2p exchanges as sends and receives (not counted)
        fast = rank_out[("p2p", "CommDebugMode")]["counted"]
        assert any(p["p2p"] for p in fast) and sum(p["by_kind"]["all_gather"] for p in fast) < sum(
            p["gathers"] for p in fast
        )


_TOOL_STATE = ("CommDebugMode", "comm_counts", "comm_module_counts", "_get_current_dispatch_mode")


def test_nothing_in_src_touches_a_tools_state() -> None:
    """No module under src/ names CommDebugMode, its counters or the dispatch-mode stack
    (the engine once rewrote the tool's counters to tell it a story)."""
    src = Path(fullshard.__file__).parent  # the package under test
    found = []
    for path in sorted(src.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import | ast.ImportFrom)
                else [node.attr]
                if isinstance(node, ast.Attribute)
                else [node.id]
                if isinstance(node, ast.Name)
                else []
            )
            if isinstance(node, ast.ImportFrom) and node.module:
                names.append(node.module)
            found += [
                f"{path.relative_to(src)}:{node.lineno} {n}"  # type: ignore[attr-defined]
                for n in names
                if any(t in n for t in (*_TOOL_STATE, "tensor.debug"))
            ]
    assert not found, found
