"""A/B fullshard's transports against each other and torch FSDP2, alternating in one run.

    python benchmarks/engine_variants.py --config comm --steps 12 --repeats 2 \
        fullshard fs-packed fs-p2p fsdp2 ddp

Variants (each is a public setting, nothing is patched):

- ``fullshard``: as shipped (``CommPolicy(transport="auto")``);
- ``fs-packed``: ``transport="packed"`` — one packed buffer per collective, the NCCL path;
- ``fs-p2p``: ``transport="p2p"`` — every gather and reduction in pieces (on more than 2
  ranks the reduce-scatter needs scratch; see fullshard.engine.transport);
- ``fs-dtensor-step``: as shipped, but AdamW steps on the DTensors (no
  ``fullshard.optim.local_step``), as it must under FSDP2;
- ``fsdp2``: torch FSDP2 (metered like in ``fullshard bench``);
- ``ddp``: torch DDP (the step time ZeRO-3 is held to on ``speed`` and ``comm``).

Prints each variant's median step time (slower rank), its ratios to FSDP2 and DDP (those run)
and its peak RSS per rank (max over ranks and repeats), plus the largest relative loss
difference against the first variant (expect ~0: same math, summed in another order at most).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))

from fullshard.bench.configs import get_config
from fullshard.memory.tracker import MALLOC_ENV
from fullshard.testing import run_distributed

# variant -> (bench mode, fullshard transport, local optimizer step)
VARIANTS = {
    "fullshard": ("fullshard", "auto", True),
    "fs-packed": ("fullshard", "packed", True),
    "fs-p2p": ("fullshard", "p2p", True),
    "fs-dtensor-step": ("fullshard", "auto", False),
    "fsdp2": ("fsdp2", "auto", True),
    "ddp": ("ddp", "auto", True),
}


def variant_rank(cfg_dict: dict[str, Any], variant: str) -> dict[str, Any]:
    """Run one variant on this rank (the bench worker with the variant's settings)."""
    import fullshard.bench.worker as worker

    mode, transport, local = VARIANTS[variant]
    return worker.run_rank(dict(cfg_dict, transport=transport, local_step=local), mode)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("variants", nargs="+", choices=sorted(VARIANTS))
    ap.add_argument("--config", default="comm")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--nproc", type=int, default=2)
    args = ap.parse_args()
    cfg = get_config(args.config).replace(steps=args.steps, warmup=args.warmup)
    os.environ.update(MALLOC_ENV)
    times: dict[str, list[float]] = {v: [] for v in args.variants}
    rss: dict[str, int] = dict.fromkeys(args.variants, 0)
    losses: dict[str, list[float]] = {}
    for r in range(args.repeats):
        for v in args.variants if r % 2 == 0 else args.variants[::-1]:
            ranks = run_distributed(variant_rank, args.nproc, asdict(cfg), v, timeout=1800)
            rss[v] = max([rss[v]] + [rk["peak_rss_bytes"] for rk in ranks])
            n = len(ranks[0]["step_s"])
            times[v] += [max(rk["step_s"][i] for rk in ranks) for i in range(n)]
            losses[v] = [
                statistics.fmean(rk["losses"][i] for rk in ranks) for i in range(cfg.steps)
            ]
            print(f"repeat {r} {v:<20} load {os.getloadavg()[0]:.1f}", file=sys.stderr)
    bases = {b: statistics.median(times[b]) for b in ("fsdp2", "ddp") if b in times}
    first = args.variants[0]
    for v in args.variants:
        m = statistics.median(times[v])
        err = max(abs(a - b) / abs(b) for a, b in zip(losses[v], losses[first]))
        ratio = "  ".join(f"{m / t:.2f}x {b}" for b, t in bases.items())
        peak = rss[v] / 2**20
        print(
            f"{v:<20} {m:.3f} s/step  {ratio}  peak RSS {peak:.0f} MiB  "
            f"max rel loss diff vs {first}: {err:.1e}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
