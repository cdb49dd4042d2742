"""Per-unit CPU cost of the engine on one rank: 64 units of LayerNorm(32) + Linear(32, 32),
fullshard against the bare model, CPU time (``time.process_time``, less load-sensitive than
wall time), best of two 60-step runs each. For A/B of two checkouts, alternate them:

    for i in 1 2 3 4; do
        PYTHONPATH=src python benchmarks/unit_cost.py new 2963$i
        PYTHONPATH=/path/to/other/checkout/src python benchmarks/unit_cost.py old 2964$i
    done

Arguments: a label to print, and a free TCP port for the one-rank gloo group.
"""

from __future__ import annotations

import os
import sys
import time

import torch
import torch.distributed as dist
from torch import nn

UNITS, WIDTH, STEPS = 64, 32, 60


def main() -> None:
    label = sys.argv[1] if len(sys.argv) > 1 else "fullshard"
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", sys.argv[2] if len(sys.argv) > 2 else "29611")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=0, world_size=1)
    from fullshard import fully_shard

    def net() -> nn.Sequential:
        return nn.Sequential(
            *[nn.Sequential(nn.LayerNorm(WIDTH), nn.Linear(WIDTH, WIDTH)) for _ in range(UNITS)]
        )

    torch.manual_seed(0)
    model, bare = net(), net()
    for block in model:
        fully_shard(block)
    fully_shard(model)
    opts = {
        "fullshard": (model, torch.optim.SGD(model.parameters(), lr=1e-3)),
        "bare": (bare, torch.optim.SGD(bare.parameters(), lr=1e-3)),
    }
    x = torch.randn(4, WIDTH)

    def step(m: nn.Module, opt: torch.optim.Optimizer) -> None:
        m(x).sum().backward()
        opt.step()
        opt.zero_grad()

    for m, opt in opts.values():
        for _ in range(5):
            step(m, opt)
    best: dict[str, float] = {}
    for name in ("fullshard", "bare") * 2:
        m, opt = opts[name]
        t = time.process_time()
        for _ in range(STEPS):
            step(m, opt)
        ms = (time.process_time() - t) / STEPS * 1e3
        best[name] = min(best.get(name, ms), ms)
    f, b = best["fullshard"], best["bare"]
    print(
        f"{label} cpu ms/step fullshard {f:.2f} bare {b:.2f} per-unit us {(f - b) / UNITS * 1e3:.1f}"
    )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
