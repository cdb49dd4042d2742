"""Overlap read off a ``torch.profiler`` trace: which GPU work ran at the same time as which.

A trace exported by ``torch.profiler.profile(...).export_chrome_trace(path)`` holds, besides
CPU operators, one event per GPU kernel, memcpy and memset with its stream and start/end, and a
``correlation`` id that links it to the CPU-side launch (``cudaLaunchKernel``, ``cudaMemcpyAsync``,
...). :func:`gpu_events` joins the two, so every GPU event knows the ``record_function`` ranges
that were open on the launching thread: wrap unit ``i``'s forward in ``record_function(f"unit{i}")``
and its kernels are the ones launched inside it, wherever and whenever they ran.

:func:`prefetch_overlap` then answers "did unit i+1's all-gather run during unit i's compute?"
without assuming how an engine schedules it: the compute stream is the one the units' kernels
ran on, everything on other streams is the engine's side work (all-gathers, their copies), and
the answer is the time side work spent inside each unit's compute span. :func:`copy_overlap`
does the same for host<->device copies (CPU offload). All times are microseconds.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "GpuEvent",
    "copy_overlap",
    "gpu_events",
    "intersection_us",
    "prefetch_overlap",
    "union",
]

_GPU_CATS = {"kernel": "kernel", "gpu_memcpy": "memcpy", "memcpy": "memcpy"}
_GPU_CATS |= {"gpu_memset": "memset", "memset": "memset"}
_LAUNCH_CATS = {"cuda_runtime", "cuda_driver", "runtime", "driver"}
_RANGE_CATS = {"user_annotation"}  # record_function ranges (operators are not needed)


@dataclass(frozen=True)
class GpuEvent:
    """One kernel, memcpy or memset as it ran on the device."""

    name: str
    kind: str  # "kernel" | "memcpy" | "memset"
    stream: int
    start: float  # µs, trace clock
    end: float
    ranges: tuple[str, ...]  # names of the CPU ranges open around its launch, outermost first


def _stream(e: dict[str, Any]) -> int:
    s = e.get("args", {}).get("stream", e.get("tid", -1))
    if isinstance(s, str):  # older traces: tid "stream 7"
        s = s.rsplit(" ", 1)[-1]
    try:
        return int(s)
    except (TypeError, ValueError):
        return -1


def gpu_events(trace: dict[str, Any] | str | Path) -> list[GpuEvent]:
    """Every GPU event of ``trace`` (a chrome-trace dict or file), in start order."""
    data: dict[str, Any] = trace if isinstance(trace, dict) else json.loads(Path(trace).read_text())
    events = [e for e in data.get("traceEvents", []) if e.get("ph") == "X"]
    launches: dict[Any, tuple[Any, float]] = {}  # correlation -> (thread, launch time)
    ranges: dict[Any, list[tuple[float, float, str]]] = {}  # thread -> (start, end, name)
    gpu: list[dict[str, Any]] = []
    for e in events:
        cat = str(e.get("cat", "")).lower()
        if cat in _GPU_CATS:
            gpu.append(e)
        elif cat in _LAUNCH_CATS and "correlation" in e.get("args", {}):
            launches[e["args"]["correlation"]] = (e.get("tid"), float(e["ts"]))
        elif cat in _RANGE_CATS:
            start = float(e["ts"])
            ranges.setdefault(e.get("tid"), []).append(
                (start, start + float(e.get("dur", 0)), e["name"])
            )
    out = []
    for e in gpu:
        tid, at = launches.get(e.get("args", {}).get("correlation"), (None, None))
        open_ = []
        if at is not None:
            open_ = sorted(
                (r for r in ranges.get(tid, []) if r[0] <= at <= r[1]), key=lambda r: r[0]
            )
        start = float(e["ts"])
        out.append(
            GpuEvent(
                name=e.get("name", ""),
                kind=_GPU_CATS[str(e.get("cat", "")).lower()],
                stream=_stream(e),
                start=start,
                end=start + float(e.get("dur", 0)),
                ranges=tuple(r[2] for r in open_),
            )
        )
    return sorted(out, key=lambda g: g.start)


def union(intervals: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    """Merge ``(start, end)`` intervals into disjoint ones, sorted."""
    merged: list[tuple[float, float]] = []
    for s, e in sorted(intervals):
        if merged and s <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], e))
        elif e > s:
            merged.append((s, e))
    return merged


def intersection_us(a: Iterable[tuple[float, float]], b: Iterable[tuple[float, float]]) -> float:
    """Total time covered by both interval sets."""
    ua, ub = union(a), union(b)
    total, j = 0.0, 0
    for s, e in ua:
        while j < len(ub) and ub[j][1] <= s:
            j += 1
        k = j
        while k < len(ub) and ub[k][0] < e:
            total += min(e, ub[k][1]) - max(s, ub[k][0])
            k += 1
    return total


def _span(events: Sequence[GpuEvent]) -> list[tuple[float, float]]:
    return [(g.start, g.end) for g in events]


def _top_names(events: Sequence[GpuEvent], n: int = 3) -> list[str]:
    busy: dict[str, float] = {}
    for g in events:
        busy[g.name[:60]] = busy.get(g.name[:60], 0.0) + g.end - g.start
    return sorted(busy, key=lambda name: -busy[name])[:n]


def prefetch_overlap(events: Sequence[GpuEvent], unit_ranges: Sequence[str]) -> dict[str, Any]:
    """How much side-stream work ran during each unit's compute, unit by unit.

    ``unit_ranges[i]`` is the name of the CPU range that wrapped unit ``i``'s forward. Unit
    ``i``'s compute span runs from the first to the last kernel launched in it on the compute
    stream (the stream most of those kernels used). Side work is every GPU event on another
    stream. An engine that prefetches runs unit ``i + 1``'s all-gather (and its copies) on its
    side stream inside unit ``i``'s span; one that does not leaves ``units_overlapped`` at 0.
    """
    by_unit = [[g for g in events if name in g.ranges] for name in unit_ranges]
    streams = Counter(g.stream for unit in by_unit for g in unit if g.kind == "kernel")
    if not streams:
        raise ValueError(f"no kernels were launched inside the ranges {list(unit_ranges)[:3]}...")
    compute = streams.most_common(1)[0][0]
    side = [g for g in events if g.stream != compute]
    spans = []
    for unit in by_unit:
        ks = [g for g in unit if g.stream == compute]
        spans.append((min(g.start for g in ks), max(g.end for g in ks)) if ks else None)
    per_unit = [
        intersection_us(_span(side), [span]) if span is not None else 0.0
        for span in spans[:-1]  # the last unit has no next unit to prefetch
    ]
    compute_busy = _span([g for g in events if g.stream == compute and g.kind == "kernel"])
    side_us = sum(e - s for s, e in union(_span(side)))
    overlapped = intersection_us(_span(side), compute_busy)
    return {
        "compute_stream": compute,
        "side_streams": sorted({g.stream for g in side}),
        "units": len(per_unit),
        "units_overlapped": sum(1 for x in per_unit if x > 0),
        "per_unit_overlap_us": per_unit,
        "side_us": side_us,
        "side_overlapped_us": overlapped,
        "side_overlapped_fraction": overlapped / side_us if side_us else 0.0,
        "side_top": _top_names(side),
    }


def copy_overlap(events: Sequence[GpuEvent]) -> dict[str, Any]:
    """Host<->device copies (``Memcpy HtoD`` / ``DtoH``) and how much of them ran under kernels
    on other streams: 0 when copies share the compute stream (they then serialise with it)."""
    out: dict[str, Any] = {}
    for direction in ("HtoD", "DtoH"):
        copies = [g for g in events if g.kind == "memcpy" and direction in g.name]
        total = sum(e - s for s, e in union(_span(copies)))
        hidden = 0.0
        for stream in {g.stream for g in copies}:
            mine = [g for g in copies if g.stream == stream]
            others = [g for g in events if g.kind == "kernel" and g.stream != stream]
            hidden += intersection_us(_span(mine), _span(others))
        hidden = min(hidden, total)  # copies on several streams may overlap the same kernels
        out[direction] = {
            "copies": len(copies),
            "us": total,
            "overlapped_us": hidden,
            "overlapped_fraction": hidden / total if total else 0.0,
            "streams": sorted({g.stream for g in copies}),
        }
    return out
