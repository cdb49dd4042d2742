"""Profiler labels ([Note: profiler labels] in fullshard.engine.labels): a torch.profiler trace of one
training step holds every label for every unit, named by its FQN; outside a profiler none is
opened."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.profiler import ProfilerActivity, profile

from fullshard import fully_shard
from fullshard.engine.labels import LABELS
from fullshard.testing import run_distributed


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.Sequential(*[nn.Linear(16, 16) for _ in range(2)])
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.blocks(x)))


def _step(model: nn.Module) -> None:
    model(torch.randn(4, 16)).sum().backward()


def _labels() -> dict[str, list[str]]:
    model = _Net()
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    _step(model)  # lazy init and the first step outside the profiler
    opened: list[str] = []
    real = torch.profiler.record_function

    class Spy(real):  # type: ignore[misc, valid-type]
        def __init__(self, name: str, *args: object) -> None:
            opened.append(name)
            super().__init__(name, *args)

    torch.profiler.record_function = Spy  # type: ignore[misc]
    try:
        _step(model)  # no profiler: no label opened
        quiet = list(opened)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            _step(model)
    finally:
        torch.profiler.record_function = real  # type: ignore[misc]
    names = sorted({e.name for e in prof.events() if e.name.startswith("fullshard::")})
    dist.barrier()
    return {"names": names, "quiet": quiet}


def test_every_label_for_every_unit_in_a_trace() -> None:
    r = run_distributed(_labels, 2)[0]
    assert r["quiet"] == [], f"labels opened outside a profiler: {r['quiet']}"
    units = ["blocks.0", "blocks.1", "_Net (root)"]
    # the root keeps its parameters after forward: its reshard comes with post-backward, and
    # nothing is copied out (every placement is a view of the gathered buffer)
    want = {
        f"fullshard::{what} ({unit})"
        for what in LABELS
        for unit in units
        if what != "all_gather_copy_out"
    }
    missing = sorted(want - set(r["names"]))
    assert not missing, f"missing from the trace: {missing}; it has {r['names']}"
    assert {n for n in r["names"] if "copy_out" in n} <= {
        f"fullshard::all_gather_copy_out ({u})" for u in units
    }
