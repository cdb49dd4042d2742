"""Stream order, checked on the CPU ([Note: checking stream order on the CPU] in
fullshard.engine.streamcheck): the whole engine parity matrix runs under the checker with no
unordered access (that removing any stream call of the engine makes a checked case fail is
``tests/test_stream_mutations.py``)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from fullshard.engine.streamcheck import (
    COMPUTE,
    LogicalStream,
    check_streams,
    current_logical,
    on_logical,
)
from fullshard.testing import run_distributed
from parity import make_net, make_optimizer, shard_net, sharded_step
from test_engine import _run_cases

_RESIZE = torch.UntypedStorage.resize_


def _matrix_checked() -> dict[str, Any]:
    with check_streams() as checker:
        results = _run_cases()
    return {
        "cases": sorted(results),
        "violations": checker.violations[:5],
        "count": len(checker.violations),
        "accesses": checker.accesses,
        "streams": sorted(checker.clocks),
    }


@pytest.mark.parametrize("world", [2, 3])
def test_parity_matrix_runs_in_stream_order(world: int) -> None:
    for r in run_distributed(_matrix_checked, world, timeout=900):
        assert r["cases"], "the matrix ran nothing"
        assert r["accesses"] > 1000, r["accesses"]
        assert {COMPUTE, "gather", "reduce"} <= set(r["streams"]), r["streams"]
        assert r["count"] == 0, f"{r['count']} unordered accesses, e.g. {r['violations']}"


def _two_steps_checked(cases: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Two training steps per case and transport (packed, p2p) under the stream checker: each
    ``"case/transport"`` maps to (the first violations, the logical streams seen)."""
    from fullshard import CommPolicy

    out: dict[str, Any] = {}
    for name, kwargs in cases.items():
        for transport in ("packed", "p2p"):
            model = shard_net(make_net(), comm_policy=CommPolicy(transport=transport), **kwargs)
            opt = make_optimizer(model)
            with check_streams() as checker:
                for step in range(2):
                    sharded_step(model, opt, step)
            out[f"{name}/{transport}"] = (checker.violations[:3], sorted(checker.clocks))
    return out


def _features_checked() -> dict[str, Any]:
    """Two steps of each feature whose stream work the parity matrix does not reach, under the
    checker on 4 ranks: HSDP (its all-reduce across replicas in flight while the next unit
    computes), CPU offload, bf16 gathers with fp32 reductions, fp16 reductions (divided
    around the sum), each with either transport."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh

    from fullshard import CPUOffloadPolicy, MixedPrecisionPolicy

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    cases: dict[str, dict[str, Any]] = {
        "hsdp": {"mesh": mesh},
        "offload": {"offload_policy": CPUOffloadPolicy(pin_memory=False)},
        "bf16": {
            "mp_policy": MixedPrecisionPolicy(
                param_dtype=torch.bfloat16, reduce_dtype=torch.float32
            )
        },
        "fp16_reduce": {"mp_policy": MixedPrecisionPolicy(reduce_dtype=torch.float16)},
    }
    return _two_steps_checked(cases)


def test_features_run_in_stream_order() -> None:
    results = run_distributed(_features_checked, 4, timeout=600)
    for r in results:
        assert len(r) == 8, sorted(r)
        for case, (violations, streams) in r.items():
            assert violations == [], f"{case}: {violations}"
            assert {COMPUTE, "gather", "reduce"} <= set(streams), (case, streams)
            if case.startswith("offload"):
                assert "offload" in streams, (case, streams)


def _one_rank_checked() -> dict[str, list[str]]:
    """Two steps at world size 1 where a unit still enters the side streams: a bf16 gather (the
    cast on the gather stream) and CPU offload, packed and in pieces, under the checker."""
    import torch

    from fullshard import CPUOffloadPolicy, MixedPrecisionPolicy

    cases: dict[str, dict[str, Any]] = {
        "bf16": {"mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16)},
        "offload": {"offload_policy": CPUOffloadPolicy(pin_memory=False)},
    }
    return {case: violations for case, (violations, _) in _two_steps_checked(cases).items()}


def test_one_rank_orders_its_local_copies() -> None:
    """On one rank no collective runs, so no ``work.wait()`` orders the compute stream after
    the side stream's copy: the handle's own wait does ([Note: a handle without a
    collective] in fullshard.engine.collectives)."""
    results = run_distributed(_one_rank_checked, 1, timeout=300)[0]
    assert len(results) == 4, results
    for case, violations in results.items():
        assert violations == [], f"{case}: {violations}"


def test_a_free_the_code_did_not_announce_is_checked() -> None:
    """A storage resized to 0 bytes counts as freed even without ``freed()``: freeing memory
    another stream still reads, with no wait, is a violation; after a wait it is none."""
    for wait in (False, True):
        t = torch.ones(8)
        side = LogicalStream("side")
        with check_streams() as checker:
            with on_logical(side):
                t.sum()  # the side stream reads t
            if wait:
                current_logical().wait_stream(side)
            t.untyped_storage().resize_(0)  # freed on the compute stream, unannounced
        frees = [v for v in checker.violations if "free (resize_(0))" in v]
        assert (frees == []) == wait, checker.violations
    assert torch.UntypedStorage.resize_ is _RESIZE  # put back on exit


def test_a_new_storage_at_a_dead_ones_address_starts_clean() -> None:
    """Storages are told apart by their address, which a storage deallocated (its last tensor
    gone) may leave to a new one: the new storage has no history, so writing it on another
    stream is no violation (it once made the stream cases report a race now and then); the
    storage still alive keeps its history."""
    side = LogicalStream("side")
    with check_streams() as checker:
        old = torch.ones(1024)
        address = old.untyped_storage()._cdata
        with on_logical(side):
            old.sum()  # the side stream reads it, then it is gone
        del old
        kept, new = [], torch.zeros(1024)
        while new.untyped_storage()._cdata != address and len(kept) < 1000:
            kept.append(new)  # another address: keep it so the next tries elsewhere
            new = torch.zeros(1024)
        assert new.untyped_storage()._cdata == address, "no storage reused the address"
        new.fill_(1.0)  # written on the compute stream, unordered with the dead one's read
        assert checker.violations == [], checker.violations
        with on_logical(side):
            new.sum()
        new.fill_(2.0)  # the same storage, still alive: unordered with its read, reported
    assert any("writes a storage that 'side' read" in v for v in checker.violations), checker
