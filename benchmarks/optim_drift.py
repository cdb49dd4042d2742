"""How far a whole-matrix optimizer drifts when it is run on row shards, vs WholeTensor.

    python benchmarks/optim_drift.py --nproc 2 4

Trains tests/test_optim.py's model (tied embedding/head, 9 block matrices, 1-D norms) for 6
steps with Muon on the block matrices and AdamW on the rest, the whole batch on every rank, and
prints the largest weight difference from one process running the same optimizers unsharded:
``torch.optim.Muon`` straight on fullshard's and on torch FSDP2's shards, and
``WholeTensor(torch.optim.Muon)`` under fullshard. The numbers in docs/optim.md.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))

import test_optim as T
from fullshard.testing import run_distributed


def _fsdp2_model() -> T.Net:
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = T.Net()
    for b in model.blocks:
        fully_shard(b)
    fully_shard(model)
    return model


CASES = {
    "Muon on fullshard shards": ("plain_muon", T.make_model),
    "Muon on FSDP2 shards": ("plain_muon", _fsdp2_model),
    "WholeTensor(Muon) on fullshard": ("muon", T.make_model),
}


def _worker(case: str) -> dict[str, torch.Tensor] | str:
    """One case in a fresh process group (a failed DTensor op can leave collectives pending)."""
    kind, make = CASES[case]
    model = make()
    opt = T.make_optimizer(model, kind, sharded=kind == "muon")
    try:
        for step in range(T.STEPS):
            T.train_step(model, opt, step)
    except RuntimeError as e:  # DTensor cannot run some of Muon's in-place ops
        return str(e).splitlines()[0][:90]
    return T.full_weights(model)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nproc", type=int, nargs="+", default=[2, 4])
    args = p.parse_args()
    ref = T.reference("muon")["final"]
    print("| ranks | optimizer | max abs weight difference from one process |")
    print("|---|---|---|")
    for n in args.nproc:
        for name in CASES:
            weights = run_distributed(_worker, n, name, timeout=600)[0]
            if isinstance(weights, str):
                print(f"| {n} | {name} | fails: `{weights}` |")
                continue
            diff = max((weights[k] - ref[k]).abs().max().item() for k in ref)
            print(f"| {n} | {name} | {diff:.1e} |")


if __name__ == "__main__":
    main()
