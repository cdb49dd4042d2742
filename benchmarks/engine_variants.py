"""A/B the fullshard engine against variants of itself and torch FSDP2, alternating in one run.

    python benchmarks/engine_variants.py --config comm --steps 12 --repeats 2 \
        fullshard fs-sync fs-rs-as-allreduce fsdp2 fsdp2-nometer

Variants (each patches the engine inside the rank processes only):

- ``fullshard``: as shipped; ``fsdp2``: torch FSDP2 (metered like in ``fullshard bench``);
- ``fs-sync``: every fullshard collective synchronous (no prefetch/overlap gains);
- ``fs-rs-as-allreduce``: fullshard's reduce-scatter issued as a gloo all-reduce of the packed
  buffer, this rank's row copied out on wait (gloo's reduce-scatter is slower). Main's engine
  now does this itself on gloo, so there the variant changes nothing;
- ``fsdp2-nometer``: FSDP2 without the bench's collective wrappers (checks their overhead).

Prints each variant's median step time (slower rank) and its ratio to FSDP2, plus the largest
relative loss difference against the first variant (expect 0: same math).
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


class _AllReduceAsReduceScatter:
    """A Work-like handle: wait for the all-reduce, then copy this rank's row to the output."""

    def __init__(self, work: Any, out: Any, inp: Any, group: Any) -> None:
        import torch.distributed as dist

        self.work, self.out, self.inp = work, out, inp
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)

    def wait(self, *args: Any, **kwargs: Any) -> bool:
        if self.work is not None:
            self.work.wait()
            self.work = None
            self.out.copy_(self.inp.view(self.world, -1)[self.rank])
        return True


def variant_rank(cfg_dict: dict[str, Any], variant: str) -> dict[str, Any]:
    import torch.distributed as dist

    import fullshard.bench.worker as worker
    import fullshard.collectives as collectives

    orig = collectives._issue

    def rs_as_allreduce(kind: str, *args: Any, **kw: Any) -> Any:
        if kind != "reduce_scatter":
            return orig(kind, *args, **kw)
        out, inp = args
        work = dist.all_reduce(inp, op=kw["op"], group=kw.get("group"), async_op=True)
        handle = _AllReduceAsReduceScatter(work, out, inp, kw.get("group"))
        if not kw.get("async_op", False):
            handle.wait()
            return None
        return handle

    def synchronous(kind: str, *args: Any, **kw: Any) -> Any:
        kw["async_op"] = False
        orig(kind, *args, **kw)
        return None

    if variant == "fs-rs-as-allreduce":
        collectives._issue = rs_as_allreduce
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
    args = ap.parse_args()
    cfg = get_config(args.config).replace(steps=args.steps, warmup=args.warmup)
    os.environ.update(MALLOC_ENV)
    times: dict[str, list[float]] = {v: [] for v in args.variants}
    losses: dict[str, list[float]] = {}
    for r in range(args.repeats):
        for v in args.variants if r % 2 == 0 else args.variants[::-1]:
            ranks = run_distributed(variant_rank, 2, asdict(cfg), v, timeout=1800)
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
        print(f"{v:<20} {m:.3f} s/step  {ratio}  max rel loss diff vs {first}: {err:.1e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
