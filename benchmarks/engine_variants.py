"""A/B the fullshard engine against variants of itself and torch FSDP2, alternating in one run.

    python benchmarks/engine_variants.py --config comm --steps 12 --repeats 2 \
        fullshard fs-sync fs-collectives fs-rs-allreduce fsdp2 fsdp2-nometer

Variants (each patches the engine inside the rank processes only):

- ``fullshard``: as shipped; ``fsdp2``: torch FSDP2 (metered like in ``fullshard bench``);
- ``fs-sync``: every fullshard collective synchronous (no prefetch/overlap gains);
- ``fs-collectives``: gloo's own all-gather, and the reduce-scatter as a gloo all-reduce of the
  packed buffer (the engine before the p2p exchanges, see [Note: p2p on gloo]);
- ``fs-rs-allreduce``: p2p all-gather, reduce-scatter as a gloo all-reduce;
- ``fs-rs-native``: p2p all-gather, gloo's own reduce-scatter;
- ``fsdp2-nometer``: FSDP2 without the bench's collective wrappers (checks their overhead).

Prints each variant's median step time (slower rank), its ratio to FSDP2 and its peak RSS per
rank (max over ranks and repeats), plus the largest relative loss difference against the first
variant (expect ~0: same math, summed in another order at most).
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

# variant -> the algorithm forced per kind (see fullshard.collectives._algorithm)
_ALGORITHMS = {
    "fs-collectives": {"all_gather": "all_gather", "reduce_scatter": "all_reduce"},
    "fs-rs-allreduce": {"all_gather": "p2p", "reduce_scatter": "all_reduce"},
    "fs-rs-native": {"all_gather": "p2p", "reduce_scatter": "reduce_scatter"},
}


def variant_rank(cfg_dict: dict[str, Any], variant: str) -> dict[str, Any]:

    import fullshard.bench.worker as worker
    import fullshard.collectives as collectives

    orig = collectives._issue
    orig_algorithm = collectives._algorithm

    def forced(kind: str, requested: str, group: Any, device: Any) -> str:
        return _ALGORITHMS[variant].get(kind) or orig_algorithm(kind, requested, group, device)

    class Done:
        """A finished Work: the Handle still runs its completion step (copy-out, local sum)."""

        def wait(self) -> bool:
            return True

    def synchronous(kind: str, *args: Any, **kw: Any) -> Any:
        kw["async_op"] = False
        works = orig(kind, *args, **kw)
        for work in works if isinstance(works, list) else []:  # p2p exchanges return Works
            work.wait()
        return Done()

    if variant in _ALGORITHMS:
        collectives._algorithm = forced  # type: ignore[assignment]
    elif variant == "fs-sync":
        collectives._issue = synchronous
    elif variant == "fsdp2-nometer":
        worker._meter = lambda mode: None  # type: ignore[assignment]
    mode = "fsdp2" if variant.startswith("fsdp2") else "fullshard"
    return worker.run_rank(cfg_dict, mode)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("variants", nargs="+")
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
    base = statistics.median(times["fsdp2"]) if "fsdp2" in times else None
    first = args.variants[0]
    for v in args.variants:
        m = statistics.median(times[v])
        err = max(abs(a - b) / abs(b) for a, b in zip(losses[v], losses[first]))
        ratio = f"{m / base:.2f}x fsdp2" if base else ""
        peak = rss[v] / 2**20
        print(
            f"{v:<20} {m:.3f} s/step  {ratio}  peak RSS {peak:.0f} MiB  "
            f"max rel loss diff vs {first}: {err:.1e}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
