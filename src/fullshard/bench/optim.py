"""``fullshard bench --config optim``: the optimizer step of a whole-matrix optimizer, side by side.

The block matrices of a GPT-shaped stack (``n_layer`` blocks of qkv ``3d x d``, proj ``d x d``,
fc ``4d x d``, fc2 ``d x 4d``), fully sharded on local gloo ranks, get random gradients and
are stepped by:

- ``wholetensor``: ``WholeTensor(Muon)``, one owner per matrix (exact);
- ``naive``: every rank all-gathers every gradient and runs Muon on every whole matrix,
  keeping whole copies and momentum of all of them (exact, N x the compute and memory);
- ``adamw``: plain sharded AdamW (element-wise, no exchange: the usual baseline);
- ``sharded_muon``: Muon straight on the row shards (cheap and *wrong*: a different update,
  see docs/optim.md).

Muon is :class:`fullshard.optim.Muon` with its Newton-Schulz iteration in float32, as
``fullshard train`` runs it on a CPU: in bfloat16 (``torch.optim.Muon``'s) the emulated bf16
matmuls of a CPU without bf16 units take ~30x longer and hide what the modes differ in (see
[Note: Newton-Schulz dtype]); ``ns_dtype`` in the config changes it.

Reported per mode: median optimizer-step time (the slowest rank's), optimizer memory per rank
(state plus whole copies) and bytes sent per rank per step. Forward and backward are not run:
only the step is measured.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from fullshard import fully_shard
from fullshard.optim import Muon, WholeTensor
from fullshard.testing import run_distributed

__all__ = ["MODES", "OptimBenchConfig", "main", "run", "table"]

MODES = ("wholetensor", "naive", "adamw", "sharded_muon")


@dataclass(frozen=True, slots=True)
class OptimBenchConfig:
    """The matrices benchmarked and how often each step is timed."""

    n_layer: int = 4
    d_model: int = 128
    steps: int = 4
    warmup: int = 1
    nproc: int = 2
    modes: tuple[str, ...] = MODES
    ns_dtype: str = "float32"  # Muon's Newton-Schulz dtype; "bfloat16" is torch.optim.Muon's


class _Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.proj = nn.Linear(d, d, bias=False)
        self.fc = nn.Linear(d, 4 * d, bias=False)
        self.fc2 = nn.Linear(4 * d, d, bias=False)


class _Naive(torch.optim.Optimizer):
    """All-gather every gradient on every rank, Muon on every whole matrix, keep own rows."""

    def __init__(self, params: list[nn.Parameter], **kwargs: Any) -> None:
        super().__init__(params, {})
        self.whole = [nn.Parameter(p.full_tensor().detach().clone()) for p in params]  # type: ignore[attr-defined]
        self.inner = Muon(self.whole, **kwargs)
        self.sent_bytes = 0

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        self.sent_bytes = 0
        params = self.param_groups[0]["params"]
        for p, w in zip(params, self.whole):
            w.grad = p.grad.full_tensor()  # one all-gather per matrix
            n = dist.get_world_size()
            self.sent_bytes += p.grad._local_tensor.numel() * 4 * (n - 1)
        self.inner.step()
        for p, w in zip(params, self.whole):
            local = p._local_tensor
            rows = -(-p.shape[0] // dist.get_world_size())
            start = min(dist.get_rank() * rows, p.shape[0])
            local.copy_(w[start : start + local.shape[0]])
            w.grad = None


def _state_bytes(opt: torch.optim.Optimizer) -> int:
    if isinstance(opt, WholeTensor):
        return sum(opt.state_bytes().values())
    total = 0
    inner = opt.inner if isinstance(opt, _Naive) else opt
    for entries in inner.state.values():
        for v in entries.values():
            if isinstance(v, torch.Tensor):
                t = v._local_tensor if isinstance(v, DTensor) else v
                total += t.numel() * t.element_size()
    if isinstance(opt, _Naive):
        total += sum(w.numel() * w.element_size() for w in opt.whole)
    return total


def _worker(cfg: OptimBenchConfig, mode: str) -> dict[str, Any]:
    torch.manual_seed(0)
    model = nn.Sequential(*(_Block(cfg.d_model) for _ in range(cfg.n_layer)))
    for block in model:
        fully_shard(block)
    fully_shard(model)
    params = list(model.parameters())
    muon: dict[str, Any] = {"lr": 0.02, "weight_decay": 0.1, "adjust_lr_fn": "match_rms_adamw"}
    muon["ns_dtype"] = cfg.ns_dtype
    opt: torch.optim.Optimizer
    if mode == "wholetensor":
        opt = WholeTensor(Muon, params, **muon)
    elif mode == "naive":
        opt = _Naive(params, **muon)
    elif mode == "adamw":
        opt = torch.optim.AdamW(params, lr=1e-3, foreach=False)
    else:
        opt = Muon(params, **muon)
    times, sent = [], 0
    gen = torch.Generator().manual_seed(1 + dist.get_rank())
    for step in range(cfg.steps):
        for p in params:
            local = p._local_tensor  # type: ignore[attr-defined]
            g = torch.randn(local.shape, generator=gen)
            assert isinstance(p, DTensor)
            p.grad = DTensor.from_local(
                g, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride()
            )
        dist.barrier()
        start = time.perf_counter()
        opt.step()
        dist.barrier()
        if step >= cfg.warmup:
            times.append(time.perf_counter() - start)
        if isinstance(opt, WholeTensor):
            sent = opt.last_step_traffic.sent_bytes
        elif isinstance(opt, _Naive):
            sent = opt.sent_bytes
    return {
        "step_s": statistics.median(times),
        "state_bytes": _state_bytes(opt),
        "sent_bytes": sent,
        "param_bytes": sum(p.numel() * 4 for p in params),
    }


def run(cfg: OptimBenchConfig, *, timeout: float = 3600.0) -> dict[str, Any]:
    """Run every mode of ``cfg`` (one spawn each); return per-mode results (max over ranks)."""
    rows = []
    for mode in cfg.modes:
        per_rank = run_distributed(_worker, cfg.nproc, cfg, mode, timeout=timeout)
        rows.append(
            {
                "mode": mode,
                "step_s": max(r["step_s"] for r in per_rank),
                "state_bytes_per_rank": max(r["state_bytes"] for r in per_rank),
                "sent_bytes_per_rank": max(r["sent_bytes"] for r in per_rank),
                "param_bytes": per_rank[0]["param_bytes"],
            }
        )
    return {"config": asdict(cfg), "rows": rows}


_EXACT = {"wholetensor": "yes", "naive": "yes", "adamw": "n/a (element-wise)", "sharded_muon": "no"}


def table(result: dict[str, Any]) -> str:
    """The results as a Markdown table."""
    c = result["config"]
    mib = 1 << 20
    params = result["rows"][0]["param_bytes"] / mib
    lines = [
        f"optimizer step, {c['n_layer']} blocks x d_model {c['d_model']} "
        f"({params:.1f} MiB of fp32 matrices), {c['nproc']} gloo ranks, median of "
        f"{c['steps'] - c['warmup']} steps, Muon's Newton-Schulz in {c.get('ns_dtype', 'bfloat16')}",
        "",
        "| mode | step s | optimizer memory MiB/rank | sent MiB/rank/step | exact Muon |",
        "|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        lines.append(
            f"| {r['mode']} | {r['step_s']:.3f} | {r['state_bytes_per_rank'] / mib:.2f} | "
            f"{r['sent_bytes_per_rank'] / mib:.2f} | {_EXACT[r['mode']]} |"
        )
    return "\n".join(lines)


def main(args: argparse.Namespace) -> int:
    """``fullshard bench --config optim [--nproc N] [--n-layer L] [--d-model D] [--steps S]
    [--warmup W] [--modes ...] [--json] [--out FILE]``."""
    changes: dict[str, Any] = {}
    for field in ("steps", "warmup", "n_layer", "d_model"):
        if getattr(args, field, None) is not None:
            changes[field] = getattr(args, field)
    if args.nproc:
        changes["nproc"] = int(args.nproc)
    if args.modes:
        changes["modes"] = tuple(m for item in args.modes for m in item.split(",") if m)
    cfg = OptimBenchConfig(**changes)
    bad = [m for m in cfg.modes if m not in MODES]
    if bad or not 0 <= cfg.warmup < cfg.steps:
        print(
            f"fullshard bench --config optim: modes from {list(MODES)}, 0 <= warmup < steps",
            flush=True,
        )
        return 2
    result = run(cfg, timeout=args.timeout)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    if args.json:
        print(json.dumps(result, indent=1))
    else:
        print(table(result))
    return 0
