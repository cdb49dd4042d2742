"""gloo collectives vs point-to-point exchanges, per buffer size, on local ranks.

    python benchmarks/collectives.py --nproc 2
    python benchmarks/collectives.py --nproc 4 --sizes 1 12.6 50

For each size S (MiB, fp32, the full buffer), the median wall time over ``--iters`` of:
gloo's all-gather, all-gather as a p2p exchange (fullshard's ``P2PAllGather(algorithm="p2p")``), gloo's
reduce-scatter, the reduce-scatter as an in-place all-reduce, and as a p2p exchange with the
local sum. The numbers behind [Note: p2p on gloo] in ``src/fullshard/engine/p2p.py``.
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))

import torch
import torch.distributed as dist

from fullshard.engine import collectives as C
from fullshard.engine import p2p
from fullshard.testing import run_distributed

VARIANTS = (
    ("all_gather", "all_gather"),
    ("all_gather", "p2p"),
    ("reduce_scatter", "reduce_scatter"),
    ("reduce_scatter", "all_reduce"),
    ("reduce_scatter", "p2p"),
)


def _time(fn: Callable[[], object], iters: int) -> float:
    times = []
    for _ in range(iters + 2):
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times[2:])


def _one(kind: str, algo: str, full: torch.Tensor, part: torch.Tensor, group: Any) -> None:
    if kind == "all_gather":
        C.all_gather(full, part, group, async_op=False, comm=p2p.P2PAllGather(algorithm=algo))
    else:
        comm = p2p.P2PReduceScatter(algorithm=algo)
        C.reduce_scatter(part, full, group, async_op=False, comm=comm)


def rank_main(sizes: list[float], iters: int) -> dict[str, list[float]]:
    world, group = dist.get_world_size(), dist.group.WORLD
    assert group is not None
    out: dict[str, list[float]] = {}
    for mib in sizes:
        n = int(mib * 2**20 / 4) // world * world
        full, part = torch.randn(n), torch.empty(n // world)
        for kind, algo in VARIANTS:
            fn = functools.partial(_one, kind, algo, full, part, group)
            out.setdefault(f"{kind}:{algo}", []).append(_time(fn, iters))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--sizes", type=float, nargs="+", default=[1.0, 4.0, 12.6, 50.0])
    ap.add_argument("--iters", type=int, default=10)
    args = ap.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    res = run_distributed(rank_main, args.nproc, args.sizes, args.iters, timeout=900)
    print(
        f"command: python benchmarks/collectives.py --nproc {args.nproc} --sizes "
        f"{' '.join(map(str, args.sizes))} --iters {args.iters}"
    )
    print(f"gloo, {args.nproc} ranks, fp32, median ms (slower rank); S = full buffer")
    print(f"{'kind:algorithm':<30}" + "".join(f"{s:>10g} MiB" for s in args.sizes))
    for key in res[0]:
        ms = [max(r[key][i] for r in res) * 1e3 for i in range(len(args.sizes))]
        print(f"{key:<30}" + "".join(f"{m:>14.2f}" for m in ms))
    return 0


if __name__ == "__main__":
    sys.exit(main())
