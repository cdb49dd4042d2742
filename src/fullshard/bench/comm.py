"""Count the collectives a mode issues: calls, bytes and time blocked, per kind, per step.

Bytes are the full (unsharded) buffer of each collective — the all-gather's output, the
reduce-scatter's input, the all-reduce's tensor — so ZeRO-3's theory is 3 x parameter bytes per
step (all-gather in forward and in backward, reduce-scatter in backward) and DDP's is 1 x.

Python-level engines (torch FSDP2 and FSDP1, DeepSpeed, and fullshard unless its own counter
answers) are metered by wrapping the ``torch.distributed`` functions they call at call time,
and the references to them an engine bound at start-up (DeepSpeed's torch backend holds its
all-gather and reduce-scatter functions). Time blocked is the wall time spent inside those
calls plus inside ``Work.wait()``. DDP issues its all-reduces from C++, so its calls and bytes
come from its reducer's bucket layout and its blocked time is not observable.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["KINDS", "CommMeter", "ddp_comm_per_step"]

KINDS: tuple[str, ...] = ("all_gather", "reduce_scatter", "all_reduce")

# torch.distributed function -> (kind, index of the full-size tensor argument, its keyword name)
_PATCHED: dict[str, tuple[str, int, str]] = {
    "all_gather_into_tensor": ("all_gather", 0, "output_tensor"),
    "all_gather": ("all_gather", 0, "tensor_list"),  # torch's FSDP1 on gloo: a list out
    "all_gather_single": ("all_gather", 0, "output_tensor"),
    "reduce_scatter_tensor": ("reduce_scatter", 1, "input"),
    "reduce_scatter_single": ("reduce_scatter", 1, "input"),
    "all_reduce": ("all_reduce", 0, "tensor"),
}


def _nbytes(t: Any) -> int:
    if isinstance(t, (list, tuple)):
        return sum(_nbytes(x) for x in t)
    return int(t.numel() * t.element_size()) if isinstance(t, torch.Tensor) else 0


class CommMeter:
    """Patch ``torch.distributed``'s collectives to count them while installed."""

    def __init__(self) -> None:
        self.calls = dict.fromkeys(KINDS, 0)
        self.bytes = dict.fromkeys(KINDS, 0)
        self.blocked_s = 0.0
        self._orig: list[tuple[Any, str, Callable[..., Any]]] = []  # (owner, attribute, original)
        self._orig_wait: Any = None

    def reset(self) -> None:
        self.calls = dict.fromkeys(KINDS, 0)
        self.bytes = dict.fromkeys(KINDS, 0)
        self.blocked_s = 0.0

    def _wrap(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        """``fn`` (``torch.distributed``'s function ``name``, or a reference to it) counted."""
        kind, idx, kw = _PATCHED[name]

        def counted(*args: Any, **kwargs: Any) -> Any:
            t = kwargs.get(kw, args[idx] if len(args) > idx else None)
            self.calls[kind] += 1
            self.bytes[kind] += _nbytes(t)
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.blocked_s += time.perf_counter() - t0

        counted.__wrapped__ = fn  # type: ignore[attr-defined]
        return counted

    def install(self, also: Iterable[tuple[Any, str, str]] = ()) -> CommMeter:
        """Wrap ``torch.distributed``'s collectives, and each ``(owner, attribute, name)`` in
        ``also``: a reference to the collective ``name`` that an engine bound at start-up (it
        never looks the function up again, so wrapping ``torch.distributed`` misses it)."""
        targets = [(dist, name, name) for name in _PATCHED] + list(also)
        for owner, attr, name in targets:
            fn = getattr(owner, attr, None)
            if fn is not None:
                self._orig.append((owner, attr, fn))
                setattr(owner, attr, self._wrap(name, fn))
        work_cls = dist.distributed_c10d.Work
        orig_wait = work_cls.wait
        self._orig_wait = orig_wait

        def wait(work: Any, *args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return orig_wait(work, *args, **kwargs)
            finally:
                self.blocked_s += time.perf_counter() - t0

        try:
            work_cls.wait = wait  # type: ignore[method-assign,assignment]
        except (AttributeError, TypeError):  # a sealed extension type: count calls only
            self._orig_wait = None
        return self

    def uninstall(self) -> None:
        for owner, attr, fn in reversed(self._orig):
            setattr(owner, attr, fn)
        self._orig.clear()
        if self._orig_wait is not None:
            dist.distributed_c10d.Work.wait = self._orig_wait  # type: ignore[method-assign]
            self._orig_wait = None

    def snapshot(self) -> dict[str, Any]:
        return {"calls": dict(self.calls), "bytes": dict(self.bytes), "blocked_s": self.blocked_s}


def ddp_comm_per_step(ddp_model: Any) -> dict[str, Any]:
    """DDP's all-reduce calls and bytes per step, read from its reducer's buckets (C++ side)."""
    calls = dict.fromkeys(KINDS, 0)
    nbytes = dict.fromkeys(KINDS, 0)
    try:
        data = ddp_model._get_ddp_logging_data()
        sizes = [int(s) for s in str(data.get("bucket_sizes", "")).split(",") if s.strip()]
    except Exception:  # private API: degrade to "unknown" rather than fail the benchmark
        sizes = []
    if sizes:
        calls["all_reduce"] = len(sizes)
        nbytes["all_reduce"] = sum(sizes)
    return {"calls": calls, "bytes": nbytes, "blocked_s": None}
