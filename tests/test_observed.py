"""Observed = unobserved ([Note: collectives under torch's tools] in
fullshard.engine.observed): under torch's ``CommDebugMode``, the profiler and the stream
checker the engine runs the same path as without them — the same collectives, algorithms,
engine actions and losses — and ``CommDebugMode`` counts one all-gather per unit gather and
one reduce-scatter per unit reduction, whatever moved the bytes (p2p exchanges, an all-reduce
standing in for a reduce-scatter, a unit taking back its own gathered memory)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor.debug import CommDebugMode

from fullshard import CommPolicy, count_collectives
from fullshard.engine.events import record_events
from fullshard.engine.streamcheck import check_streams
from fullshard.testing import run_distributed
from parity import GLOBAL_BATCH, batch, loss_fn, make_net, make_optimizer, shard_net

STEPS = 3


@contextlib.contextmanager
def _profiled() -> Iterator[None]:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]):
        yield


WATCHERS: dict[str, Callable[[], Any]] = {
    "none": contextlib.nullcontext,
    "CommDebugMode": CommDebugMode,
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


def _run(transport: str, watcher: str) -> dict[str, Any]:
    rank, per = dist.get_rank(), GLOBAL_BATCH // dist.get_world_size()
    model = shard_net(make_net(), comm_policy=CommPolicy(transport=transport))
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
            if isinstance(w, CommDebugMode):
                gathers = sum(e.kind == "gather_issue" for e in log)
                reductions = sum(e.kind == "reduce_issue" for e in log)
                out["counted"].append((_counts(w), gathers, reductions))
        out["losses"].append(loss.item())
        opt.step()
        opt.zero_grad()
    return out


def _all() -> dict[tuple[str, str], dict[str, Any]]:
    return {(t, w): _run(t, w) for t in ("auto", "p2p") for w in WATCHERS}


@pytest.mark.parametrize("world", [2, 3])
def test_watched_runs_the_same_path(world: int) -> None:
    for rank_out in run_distributed(_all, world, timeout=600):
        for transport in ("auto", "p2p"):
            plain = rank_out[(transport, "none")]
            for watcher in WATCHERS:
                seen = rank_out[(transport, watcher)]
                case = f"{transport} under {watcher} on {world} ranks"
                assert seen["losses"] == plain["losses"], case
                assert seen["collectives"] == plain["collectives"], case
                assert seen["actions"] == plain["actions"], case
            counted = rank_out[(transport, "CommDebugMode")]["counted"]
            assert len(counted) == 2 * STEPS
            for counts, gathers, reductions in counted:
                assert gathers and counts["all_gather"] == gathers, (transport, counts, gathers)
                assert counts["reduce_scatter"] == reductions, (transport, counts, reductions)
                assert counts["all_reduce"] == 0, (transport, counts)
