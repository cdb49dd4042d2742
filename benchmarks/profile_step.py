"""Where does a step's time go? Phase times per rank and a torch.profiler table of rank 0.

    python benchmarks/profile_step.py --config comm --modes fullshard fsdp2 --steps 8

Per mode, prints forward / backward / optimizer seconds (median over the profiled steps, slower
rank), time blocked in collectives, and rank 0's top operators by self CPU time.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))

import torch
import torch.distributed as dist
import torch.nn.functional as F

from fullshard.bench.comm import CommMeter
from fullshard.bench.configs import BenchConfig, get_config
from fullshard.bench.worker import make_batches, make_optimizer, model_config, wrap
from fullshard.memory.tracker import MALLOC_ENV
from fullshard.models import GPT
from fullshard.testing import run_distributed


def profile_rank(cfg_dict: dict[str, Any], mode: str, rows: int) -> dict[str, Any]:
    cfg = BenchConfig(**{k: tuple(v) if isinstance(v, list) else v for k, v in cfg_dict.items()})
    rank, world = dist.get_rank(), dist.get_world_size()
    batches = make_batches(cfg, cfg.global_batch(world), rank, world)
    torch.manual_seed(cfg.seed)
    net = wrap(GPT(model_config(cfg)), mode, cfg.reshard_after_forward)
    opt = make_optimizer(net, cfg, mode)  # as in fullshard bench
    meter = CommMeter().install()
    phases: dict[str, list[float]] = {"forward": [], "backward": [], "optimizer": [], "blocked": []}
    prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
    for step, (x, y) in enumerate(batches):
        if step == cfg.warmup:
            prof.start()
        meter.reset()
        t0 = time.perf_counter()
        logits = net(x)
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), y.view(-1))
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        opt.step()
        opt.zero_grad(set_to_none=True)
        t3 = time.perf_counter()
        if step >= cfg.warmup:
            for k, v in zip(phases, (t1 - t0, t2 - t1, t3 - t2, meter.blocked_s)):
                phases[k].append(v)
    prof.stop()
    meter.uninstall()
    table = ""
    if rank == 0:
        table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows)
    return {"phases": phases, "table": table}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default="comm")
    ap.add_argument("--modes", nargs="+", default=["fullshard", "fsdp2"])
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--rows", type=int, default=20)
    args = ap.parse_args()
    cfg = get_config(args.config).replace(steps=args.steps, warmup=args.warmup)
    os.environ.update(MALLOC_ENV)  # the allocator settings fullshard bench runs with
    for mode in args.modes:
        ranks = run_distributed(profile_rank, 2, asdict(cfg), mode, args.rows, timeout=1800)
        print(f"== {mode} ({args.config}): seconds per step, median of steps, slower rank")
        for k in ranks[0]["phases"]:
            print(f"  {k:<10} {max(statistics.median(r['phases'][k]) for r in ranks):.3f}")
        print(ranks[0]["table"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
