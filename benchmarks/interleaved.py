"""Step-interleaved A/B: every mode trains its own copy of the model in the same processes,
one step each in turn, so the machine's drift hits every mode alike.

    python benchmarks/interleaved.py --config comm --steps 40 fullshard fsdp2 ddp

On this project's shared 2-core VMs a whole run's step time drifts 10-20% from one run to the
next, which hides differences of a few percent between runs in fresh processes (what
``fullshard bench`` and ``benchmarks/engine_variants.py`` alternate). Here the modes take turns
every step (A B C, C B A, ...) inside one pair of processes, and each step's time is compared
with the other modes' steps around it: the median of the per-step ratios resolves ~1%.

Modes: ``fullshard`` (as ``fullshard bench`` runs it: AdamW on the local shards),
``fs-dtensor-step`` (AdamW on the DTensors), ``fs-rs2`` (two reductions in flight:
``set_reduce_scatter_max_input_buffers(2)``), ``fs-no-lend`` (the CPU pool lends no gradient
memory: [Note: gradient memory lent for the next forward] in ``fullshard.pool``), ``fsdp2``
(torch FSDP2) and ``ddp`` (torch DDP).
Each step is timed on every rank and the slower rank's time is kept. Prints each mode's
median step time, the median per-step ratio of every mode to the last one named, and the
last step's loss of each (the same data and seed: expect equal losses).

It measures time only. Memory needs a process of its own per mode: ``fullshard bench``.
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

from fullshard.bench.configs import BenchConfig, get_config
from fullshard.hooks import STATE_ATTR
from fullshard.memory.tracker import MALLOC_ENV
from fullshard.testing import run_distributed

# mode -> (the bench worker's mode, AdamW on the local shards)
MODES = {
    "fullshard": ("fullshard", True),
    "fs-dtensor-step": ("fullshard", False),
    "fs-rs2": ("fullshard", True),  # set_reduce_scatter_max_input_buffers(2)
    "fs-no-lend": ("fullshard", True),  # pool.lends = False once lazy init made the pool
    "fsdp2": ("fsdp2", True),
    "ddp": ("ddp", True),
}


def interleaved_rank(
    cfg_dict: dict[str, Any], modes: list[str]
) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """Build every mode's model on this rank, then step them in turn; return per-step times
    and losses per mode."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    import fullshard.bench.worker as worker
    from fullshard.models import GPT

    fields = {k: tuple(v) if isinstance(v, list) else v for k, v in cfg_dict.items()}
    cfg = BenchConfig(**fields)
    rank, world = dist.get_rank(), dist.get_world_size()
    batches = worker.make_batches(cfg, cfg.global_batch(world), rank, world)
    nets, opts = {}, {}
    for m in modes:
        mode, local = MODES[m]
        torch.manual_seed(cfg.seed)
        nets[m] = worker.wrap(GPT(worker.model_config(cfg)), mode, cfg.reshard_after_forward)
        if m == "fs-rs2":
            nets[m].set_reduce_scatter_max_input_buffers(2)  # type: ignore[operator]
        opts[m] = worker.make_optimizer(nets[m], cfg.replace(local_step=local), mode)
    times: dict[str, list[float]] = {m: [] for m in modes}
    losses: dict[str, list[float]] = {m: [] for m in modes}
    for step, (x, y) in enumerate(batches):
        for m in modes if step % 2 == 0 else modes[::-1]:
            t0 = time.perf_counter()
            logits = nets[m](x)
            if step == 0 and m == "fs-no-lend":  # before the first backward plans any slab
                nets[m].__dict__[STATE_ATTR]._context().pool.lends = False
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), y.view(-1))
            loss.backward()
            opts[m].step()
            opts[m].zero_grad(set_to_none=True)
            times[m].append(time.perf_counter() - t0)
            losses[m].append(float(loss.detach()))
    return times, losses


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("modes", nargs="+", choices=sorted(MODES))
    ap.add_argument("--config", default="comm", help="a fullshard bench config (default comm)")
    ap.add_argument("--steps", type=int, default=40, help="steps per mode (default 40)")
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps per mode (default 3)")
    ap.add_argument("--nproc", type=int, default=2)
    args = ap.parse_args()
    if len(set(args.modes)) != len(args.modes) or len(args.modes) < 2:
        ap.error("name at least two different modes")
    cfg = get_config(args.config).replace(steps=args.steps, warmup=args.warmup)
    os.environ.update(MALLOC_ENV)  # as fullshard bench: freed buffers leave RSS
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    ranks = run_distributed(interleaved_rank, args.nproc, asdict(cfg), args.modes, timeout=3600)
    per_step = {
        m: [max(r[0][m][i] for r in ranks) for i in range(args.warmup, args.steps)]
        for m in args.modes
    }
    print(
        f"python benchmarks/interleaved.py --config {args.config} --steps {args.steps} "
        f"--warmup {args.warmup} --nproc {args.nproc} {' '.join(args.modes)}"
    )
    base = args.modes[-1]
    for m in args.modes:
        ratios = [a / b for a, b in zip(per_step[m], per_step[base])]
        q1, _, q3 = statistics.quantiles(ratios, n=4)
        print(
            f"{m:<16} {statistics.median(per_step[m]):.3f} s/step  "
            f"vs {base}: median per-step ratio {statistics.median(ratios):.3f} "
            f"(quartiles {q1:.3f}-{q3:.3f}, {len(ratios)} steps)  "
            f"last loss {ranks[0][1][m][-1]:.6f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
