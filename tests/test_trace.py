"""fullshard.bench.trace: overlap read off a profiler trace (synthetic GPU traces, a real CPU one).

The GPU check (scripts/gpu_check.sh) reports prefetch and copy overlap from real CUDA traces;
here the analysis itself is checked on traces whose answer is known.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from fullshard.bench.trace import copy_overlap, gpu_events, intersection_us, prefetch_overlap, union

CPU_TID, COMPUTE, SIDE = 100, 7, 13


def _trace(side_events: list[tuple[float, float, str]], side_stream: int = SIDE) -> dict[str, Any]:
    """Three units computing 0-10, 10-20, 20-30 on the compute stream; ``side_events`` elsewhere."""
    ev: list[dict[str, Any]] = []
    corr = 0

    def gpu(name: str, cat: str, stream: int, ts: float, dur: float, launch_at: float) -> None:
        nonlocal corr
        corr += 1
        ev.append(
            {
                "ph": "X",
                "cat": "cuda_runtime",
                "name": "cudaLaunchKernel",
                "tid": CPU_TID,
                "ts": launch_at,
                "dur": 0.1,
                "args": {"correlation": corr},
            }
        )
        ev.append(
            {
                "ph": "X",
                "cat": cat,
                "name": name,
                "pid": 0,
                "tid": stream,
                "ts": ts,
                "dur": dur,
                "args": {"stream": stream, "correlation": corr},
            }
        )

    for i in range(3):
        ev.append(
            {
                "ph": "X",
                "cat": "user_annotation",
                "name": f"unit{i}",
                "tid": CPU_TID,
                "ts": 100 + 10 * i,
                "dur": 5,
            }
        )
        for j in range(2):
            gpu(f"gemm{i}{j}", "kernel", COMPUTE, 10 * i + 5 * j, 5, 101 + 10 * i + j)
    for start, end, name in side_events:
        cat = "gpu_memcpy" if name.startswith("Memcpy") else "kernel"
        gpu(name, cat, side_stream, start, end - start, 90)  # launched outside every unit
    return {"traceEvents": ev}


def test_intervals() -> None:
    assert union([(5, 8), (0, 2), (1, 3), (8, 9)]) == [(0, 3), (5, 9)]
    assert intersection_us([(0, 10)], [(2, 3), (5, 20)]) == 6
    assert intersection_us([(0, 1)], []) == 0


def test_events_know_the_ranges_they_were_launched_in() -> None:
    events = gpu_events(_trace([(2, 6, "ncclAllGather")]))
    assert len(events) == 7
    assert {g.ranges for g in events if g.name.startswith("gemm1")} == {("unit1",)}
    assert next(g for g in events if g.name == "ncclAllGather").ranges == ()


def test_prefetch_overlap_is_measured_unit_by_unit() -> None:
    # unit 1's gather runs during unit 0's compute (2-6), unit 2's half inside unit 1 (18-22);
    # a third piece of side work (30-34) runs after every unit.
    side = [(2, 6, "ag1"), (18, 22, "ag2"), (30, 34, "late")]
    r = prefetch_overlap(gpu_events(_trace(side)), ["unit0", "unit1", "unit2"])
    assert r["compute_stream"] == COMPUTE and r["side_streams"] == [SIDE]
    assert r["units"] == 2 and r["units_overlapped"] == 2
    assert r["per_unit_overlap_us"] == [4, 2]
    assert r["side_us"] == 12 and r["side_overlapped_us"] == 8  # 20-22 is under unit 2
    assert r["side_overlapped_fraction"] == pytest.approx(8 / 12)


def test_no_overlap_when_gathers_wait_for_compute() -> None:
    # Serialised: gathers between units (never inside a span), or no side stream at all.
    r = prefetch_overlap(gpu_events(_trace([(30, 34, "ag")])), ["unit0", "unit1", "unit2"])
    assert r["units_overlapped"] == 0 and r["side_overlapped_fraction"] == 0
    r = prefetch_overlap(
        gpu_events(_trace([(2, 6, "ag")], side_stream=COMPUTE)), ["unit0", "unit1", "unit2"]
    )
    assert r["side_streams"] == [] and r["units_overlapped"] == 0
    with pytest.raises(ValueError, match="no kernels"):
        prefetch_overlap(gpu_events(_trace([])), ["nothing"])


def test_copy_overlap() -> None:
    ev = gpu_events(
        _trace(
            [(4, 8, "Memcpy HtoD (Pinned -> Device)"), (40, 42, "Memcpy DtoH (Device -> Pinned)")]
        )
    )
    c = copy_overlap(ev)
    assert c["HtoD"]["copies"] == 1 and c["HtoD"]["overlapped_fraction"] == 1.0
    assert c["DtoH"]["us"] == 2 and c["DtoH"]["overlapped_us"] == 0


def test_reads_a_real_profiler_trace(tmp_path) -> None:
    """The CPU side of torch's own trace format: record_function ranges are found by name."""
    from torch.profiler import ProfilerActivity, profile, record_function

    with profile(activities=[ProfilerActivity.CPU]) as prof, record_function("unit0"):
        torch.ones(4) @ torch.ones(4)
    path = tmp_path / "trace.json"
    prof.export_chrome_trace(str(path))
    assert gpu_events(path) == []  # no GPU here
    import json

    cats = {
        e.get("cat")
        for e in json.loads(path.read_text())["traceEvents"]
        if e.get("name") == "unit0"
    }
    assert "user_annotation" in cats
