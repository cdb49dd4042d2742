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
memory: [Note: gradient memory lent for the next forward] in ``fullshard.engine.pool``), ``fsdp2``
(torch FSDP2) and ``ddp`` (torch DDP).
Each step is timed on every rank and the slower rank's time is kept. Prints each mode's
median step time, the median per-step ratio of every mode to the last one named with its
quartiles and a 95% bootstrap interval, and the last step's loss of each (the same data and
seed: expect equal losses). ``--save FILE`` also writes the per-step times as JSON;
``--pool FILE ...`` reports several saved invocations together (the modes they all have).

It measures time only. Memory needs a process of its own per mode: ``fullshard bench``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))

from fullshard.bench.configs import BenchConfig, get_config
from fullshard.engine.hooks import STATE_ATTR
from fullshard.memory.tracker import MALLOC_ENV
from fullshard.testing import run_distributed

# mode -> (the bench worker's mode, AdamW on the local shards)
MODES = {
    "fullshard": ("fullshard", True),
    "fs-dtensor-step": ("fullshard", False),
    "fs-rs2": ("fullshard", True),  # set_reduce_scatter_max_input_buffers(2)
    "fs-no-lend": ("fullshard", True),  # host.lends = False once lazy init made the pool
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
                nets[m].__dict__[STATE_ATTR]._context().host.lends = False
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), y.view(-1))
            loss.backward()
            opts[m].step()
            opts[m].zero_grad(set_to_none=True)
            times[m].append(time.perf_counter() - t0)
            losses[m].append(float(loss.detach()))
    return times, losses


def median_ci(ratios: list[float], draws: int = 2000, seed: int = 0) -> tuple[float, float]:
    """95% bootstrap interval of the median of ``ratios`` (resampled with replacement; fixed
    seed, so a rerun on the same numbers prints the same interval)."""
    rng = random.Random(seed)
    meds = sorted(statistics.median(rng.choices(ratios, k=len(ratios))) for _ in range(draws))
    return meds[int(0.025 * draws)], meds[int(0.975 * draws) - 1]


def report(runs: list[dict[str, list[float]]], modes: list[str]) -> None:
    """Print each mode's median step time and its per-step ratios to the last mode, pooled over
    ``runs`` (each run's steps are compared with that run's own steps only)."""
    base = modes[-1]
    for m in modes:
        times = [t for run in runs for t in run[m]]
        ratios = [a / b for run in runs for a, b in zip(run[m], run[base])]
        q1, _, q3 = statistics.quantiles(ratios, n=4)
        lo, hi = median_ci(ratios)
        print(
            f"{m:<16} {statistics.median(times):.3f} s/step  "
            f"vs {base}: median per-step ratio {statistics.median(ratios):.3f} "
            f"(quartiles {q1:.3f}-{q3:.3f}, 95% CI of the median {lo:.3f}-{hi:.3f}, "
            f"{len(ratios)} steps)"
        )


def pool(files: list[Path]) -> int:
    """Report the runs saved by ``--save`` together (they must name the same modes)."""
    saved = [json.loads(f.read_text()) for f in files]
    # the modes every file has, in the first file's order (the last one stays the baseline
    # only if every file has it last)
    modes = [m for m in saved[0]["per_step_s"] if all(m in run["per_step_s"] for run in saved)]
    if len(modes) < 2:
        named = {str(f): list(run["per_step_s"]) for f, run in zip(files, saved)}
        sys.exit(f"--pool: fewer than two modes are in every file ({named})")
    for run in saved:
        print(run["command"])
    if any(list(run["per_step_s"]) != modes for run in saved):
        print(f"pooling the modes every file has: {', '.join(modes)}")
    report([{m: run["per_step_s"][m] for m in modes} for run in saved], modes)
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("modes", nargs="*", help=f"two or more of {', '.join(MODES)}")
    ap.add_argument("--config", default="comm", help="a fullshard bench config (default comm)")
    ap.add_argument("--steps", type=int, default=40, help="steps per mode (default 40)")
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps per mode (default 3)")
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--save", type=Path, help="write the per-step times here (JSON)")
    ap.add_argument(
        "--pool", type=Path, nargs="+", help="run nothing: report these --save files together"
    )
    args = ap.parse_args()
    if args.pool:
        if args.modes:
            ap.error("--pool reports saved runs: name no modes")
        return pool(args.pool)
    if len(set(args.modes)) != len(args.modes) or len(args.modes) < 2:
        ap.error("name at least two different modes")
    if unknown := [m for m in args.modes if m not in MODES]:
        ap.error(f"unknown mode(s) {unknown}; choose from {', '.join(MODES)}")
    cfg = get_config(args.config).replace(steps=args.steps, warmup=args.warmup)
    os.environ.update(MALLOC_ENV)  # as fullshard bench: freed buffers leave RSS
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    ranks = run_distributed(interleaved_rank, args.nproc, asdict(cfg), args.modes, timeout=3600)
    per_step = {
        m: [max(r[0][m][i] for r in ranks) for i in range(args.warmup, args.steps)]
        for m in args.modes
    }
    command = (
        f"python benchmarks/interleaved.py --config {args.config} --steps {args.steps} "
        f"--warmup {args.warmup} --nproc {args.nproc} {' '.join(args.modes)}"
    )
    print(command)
    if args.save is not None:
        args.save.write_text(json.dumps({"command": command, "per_step_s": per_step}, indent=1))
    report([per_step], args.modes)
    print("last loss: " + ", ".join(f"{m} {ranks[0][1][m][-1]:.6f}" for m in args.modes))
    return 0


if __name__ == "__main__":
    sys.exit(main())
