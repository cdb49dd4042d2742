"""What the GPU check's checks share: where they run (:class:`Ctx`) and small helpers.

Every check runs on CUDA/NCCL at its real sizes, or, under ``--dry-run``, on the CPU (gloo) at
tiny sizes through the same code: only what needs a GPU (pinned memory, CUDA streams in a
trace, ``max_memory_allocated``) takes another branch, chosen here by ``Ctx.device``.
"""

from __future__ import annotations

import argparse
import gc
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any

import torch
from torch import nn

from fullshard.peers import load_fully_shard

ENGINES = ("fullshard", "fsdp2")
#: The Llama of --dry-run (2 layers x 64, GQA 4/2 heads, 512 tokens): the Llama-1B check and
#: the llama-1b preset's training run, at a size the CPU trains in seconds.
TINY_LLAMA: dict[str, Any] = {
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 512,
    "tie_word_embeddings": True,
}


@dataclass
class Ctx:
    """Where and how big the checks run, and where they leave what they found."""

    device: str  # "cuda" or "cpu" (--dry-run)
    dry: bool
    mesh: Any  # the one-rank DeviceMesh both engines shard over
    trace_dir: Path  # the profiler traces
    work: Path  # what the checks leave beside the report (the out folder, or a temp one)
    args: argparse.Namespace
    deadline: float  # time.monotonic() by which the whole run must be over
    details: dict[str, Any] = field(default_factory=dict)  # goes into gpu_check.json

    @property
    def cuda(self) -> bool:
        return self.device == "cuda"

    def time_left(self) -> float:
        return self.deadline - time.monotonic()

    def sync(self) -> float:
        """Wait for the device; the time after."""
        if self.cuda:
            torch.cuda.synchronize()
        return time.perf_counter()


def policies(engine: str) -> tuple[Any, Any]:
    """(MixedPrecisionPolicy, CPUOffloadPolicy) classes of ``engine``."""
    if engine == "fullshard":
        from fullshard import CPUOffloadPolicy, MixedPrecisionPolicy
    else:
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy
    return MixedPrecisionPolicy, CPUOffloadPolicy


def bf16_policy(engine: str) -> Any:
    mp, _ = policies(engine)
    return mp(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


def shard(
    ctx: Ctx, model: nn.Module, units: list[nn.Module], engine: str, **kwargs: Any
) -> nn.Module:
    """``engine``'s ``fully_shard`` on each unit, then the root, over the one-rank mesh."""
    fully_shard = load_fully_shard(engine)
    for unit in units:
        fully_shard(unit, mesh=ctx.mesh, **kwargs)
    fully_shard(model, mesh=ctx.mesh, **kwargs)
    return model


def rel(a: list[float], b: list[float]) -> float:
    """The largest relative difference of ``a`` from ``b``, element by element."""
    return max(abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a, b))


def profile(ctx: Ctx, step: Callable[[], object], path: Path) -> list[Any]:
    """Run ``step`` once under torch.profiler; the GPU events of its trace (none on the CPU)."""
    from torch.profiler import ProfilerActivity, profile

    from fullshard.bench.trace import gpu_events

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if ctx.cuda else [])
    ctx.sync()
    with profile(activities=activities) as prof:
        step()
        ctx.sync()
    prof.export_chrome_trace(str(path))
    return gpu_events(path)


class PeakBytes:
    """Peak tensor bytes of a block: ``torch.cuda.max_memory_allocated`` above its start on
    CUDA; on the CPU the peak of live tensor bytes, the same quantity counted op by op
    (:class:`fullshard.memory.tracker.LiveTensorBytes`)."""

    def __init__(self, ctx: Ctx) -> None:
        self.cuda = ctx.cuda
        self.base = 0
        self.bytes = 0
        self.meter: Any = None

    def __enter__(self) -> PeakBytes:
        gc.collect()
        if self.cuda:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
            self.base = torch.cuda.memory_allocated()
        else:
            from fullshard.memory.tracker import LiveTensorBytes

            self.meter = LiveTensorBytes().__enter__()
        return self

    def __exit__(
        self, kind: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self.cuda:
            self.bytes = torch.cuda.max_memory_allocated() - self.base
        else:
            self.meter.__exit__(kind, e, tb)
            self.bytes = self.meter.peak
