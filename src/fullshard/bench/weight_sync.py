"""``fullshard bench --config weight-sync``: weights from N training ranks to an inference rank.

The GPT of ``fullshard.models`` is fully sharded (each block a unit, the root the rest) on
training ranks ``0..N-1`` and trained with AdamW; rank ``N`` holds an inference copy in the
wire dtype (bf16 by default) as a :class:`fullshard.rl.WeightReceiver`. Each repeat trains one
step, then syncs the weights six ways, each timed from a barrier of all ranks to the barrier
after the receiver has applied everything:

- ``full_tensor``: what RL frameworks do today: per weight ``DTensor.full_tensor()`` in the
  training dtype, cast, rank 0 sends it (one all-gather and one message per weight);
- ``publish``: :func:`fullshard.rl.send_full` (one packed gather per bucket of units, cast
  before the gather, the next bucket in flight; rank 0 sends a message per bucket);
- ``colocated``: :func:`fullshard.rl.publish_colocated` (the same gathers, straight into
  per-dtype buckets that rank 0 lends the receiver's process through IPC handles: shared
  memory on the CPU; the receiver views them in place, loads them and acknowledges; "bytes
  to receiver" are the buckets' bytes, shared, not sent);
- ``rows``: :func:`fullshard.rl.send_rows` (every rank sends its own rows: no gather);
- ``delta``: after one more optimizer step, :func:`fullshard.rl.send_deltas` (each rank's
  compressed XOR masks of what changed since the ``rows`` sync; compressed: gloo's default);
- ``delta_raw``: the same after one more step, ``compress=False`` (NCCL's default: the masks
  as they are, no zlib).

Before each of the first three the receiver's weights are zeroed, so each sync writes them all.
After each, the receiver's weights are checked against the trainers' ``full_tensor()`` cast to
the wire dtype, bit for bit (SHA-256 of the bytes). Reported per method: median seconds,
bytes sent to the receiver, bytes and calls of the training ranks' collectives, messages and,
for deltas, the elements that changed.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from fullshard import fully_shard
from fullshard.models import GPT, GPTConfig
from fullshard.rl import (
    DistLink,
    Receivers,
    ShardDeltas,
    SyncReport,
    WeightReceiver,
    named_weights,
    publish_colocated,
    receive,
    receive_colocated,
    send_deltas,
    send_full,
    send_rows,
)
from fullshard.testing import run_distributed

__all__ = ["METHODS", "WeightSyncConfig", "main", "run", "table"]

METHODS = ("full_tensor", "publish", "colocated", "rows", "delta", "delta_raw")


@dataclass(frozen=True, slots=True)
class WeightSyncConfig:
    """The model, the ranks and the repeats of the weight-sync benchmark."""

    n_layer: int = 6
    d_model: int = 512
    n_head: int = 8
    vocab_size: int = 4096
    nproc: int = 2  # training ranks; the receiver is one rank more
    repeats: int = 5
    dtype: str = "bfloat16"  # the wire dtype (and the receiver's)
    lr: float = 1e-5  # AdamW's, RL-sized: most bf16 weights do not change in a step
    bucket_mib: int = 64

    def gpt(self) -> GPTConfig:
        return GPTConfig(
            vocab_size=self.vocab_size, seq_len=64, n_layer=self.n_layer,
            d_model=self.d_model, n_head=self.n_head,
        )  # fmt: skip


def _digest(weights: list[tuple[str, torch.Tensor]]) -> str:
    h = hashlib.sha256()
    for name, t in sorted(weights, key=lambda nt: nt[0]):
        h.update(name.encode())
        h.update(t.contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _train_step(model: nn.Module, opt: torch.optim.Optimizer, vocab: int, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (2, 64), generator=g)
    logits = model(ids)
    F.cross_entropy(logits.view(-1, vocab), ids.view(-1)).backward()
    opt.step()
    opt.zero_grad()


def _per_weight(model: nn.Module, dst: int, dtype: torch.dtype) -> SyncReport:
    """The frameworks' way: ``full_tensor()`` per weight, cast, send from rank 0."""
    report = SyncReport()
    for _, p in named_weights(model):
        full = p.full_tensor().to(dtype)  # type: ignore[attr-defined]
        report.gathers += 1
        report.gather_bytes += p.numel() * p.element_size()
        if dist.get_rank() == 0:
            dist.send(full, dst)
            report.bytes_sent += full.numel() * full.element_size()
            report.messages += 1
    return report


def _timed(fn: Callable[[], SyncReport]) -> tuple[float, SyncReport]:
    dist.barrier()
    t0 = time.perf_counter()
    report = fn()
    dist.barrier()
    return time.perf_counter() - t0, report


def _trainer(cfg: WeightSyncConfig, group: dist.ProcessGroup) -> dict[str, Any]:
    dtype, to, vocab = getattr(torch, cfg.dtype), Receivers((cfg.nproc,)), cfg.vocab_size
    torch.manual_seed(0)
    model = GPT(cfg.gpt())
    mesh = DeviceMesh.from_group(group, "cpu")
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
    bucket = cfg.bucket_mib << 20
    link = DistLink(cfg.nproc) if dist.get_rank() == 0 else None  # rank 0 lends the buckets
    senders: dict[str, Callable[[], SyncReport]] = {
        "full_tensor": lambda: _per_weight(model, cfg.nproc, dtype),
        "publish": lambda: send_full(model, to, dtype=dtype, bucket_bytes=bucket),
        "colocated": lambda: publish_colocated(model, link, dtype=dtype, bucket_bytes=bucket),
        "rows": lambda: send_rows(model, to, dtype=dtype),
    }
    deltas = ShardDeltas(model, dtype=dtype)
    runs: dict[str, list[dict[str, Any]]] = {m: [] for m in METHODS}
    for r in range(cfg.repeats):
        _train_step(model, opt, vocab, seed=2 * r)
        for method in METHODS:
            if method.startswith("delta"):
                deltas.reset()  # the receiver holds the previous sync's weights
                _train_step(model, opt, vocab, seed=2 * r + 1)
                sync = partial(send_deltas, deltas, to, compress=method == "delta")
                seconds, report = _timed(sync)
            else:
                seconds, report = _timed(senders[method])
            oracle = [(n, p.full_tensor().to(dtype)) for n, p in named_weights(model)]  # type: ignore[attr-defined]
            runs[method].append({**asdict(report), "seconds": seconds, "digest": _digest(oracle)})
    numel = sum(p.numel() for _, p in named_weights(model))
    return {"runs": runs, "numel": numel}


def _receiver(cfg: WeightSyncConfig) -> dict[str, Any]:
    dtype = getattr(torch, cfg.dtype)
    receiver = WeightReceiver(GPT(cfg.gpt()).to(dtype))
    trainers = tuple(range(cfg.nproc))
    link = DistLink(0)
    runs: dict[str, list[dict[str, Any]]] = {m: [] for m in METHODS}
    for _ in range(cfg.repeats):
        for method in METHODS:
            if not method.startswith("delta"):
                for t in receiver.weights.values():
                    t.zero_()
            if method == "full_tensor":
                seconds, report = _timed(lambda: _recv_per_weight(receiver))
            elif method == "colocated":
                seconds, report = _timed(lambda: receive_colocated(link, receiver))
            else:
                srcs = (0,) if method == "publish" else trainers
                seconds, report = _timed(lambda: receive(receiver, srcs))  # noqa: B023
            digest = _digest(list(receiver.weights.items()))
            runs[method].append({**asdict(report), "seconds": seconds, "digest": digest})
    return {"runs": runs}


def _recv_per_weight(receiver: WeightReceiver) -> SyncReport:
    report = SyncReport()
    for t in receiver.weights.values():  # the trainers' named_weights order
        buf = torch.empty_like(t)
        dist.recv(buf, 0)
        t.copy_(buf)
        report.messages += 1
        report.bytes_received += buf.numel() * buf.element_size()
    return report


def _worker(cfg: WeightSyncConfig) -> dict[str, Any]:
    group = dist.new_group(list(range(cfg.nproc)))  # every rank creates it; trainers use it
    return _receiver(cfg) if dist.get_rank() == cfg.nproc else _trainer(cfg, group)


def run(cfg: WeightSyncConfig, *, timeout: float = 3600.0) -> dict[str, Any]:
    """Run the benchmark (one spawn of ``nproc + 1`` ranks); return per-method results."""
    per_rank = run_distributed(_worker, cfg.nproc + 1, cfg, timeout=timeout)
    trainers, receiver = per_rank[:-1], per_rank[-1]
    rows = []
    for method in METHODS:
        runs = [t["runs"][method] for t in trainers]
        got = receiver["runs"][method]
        rows.append(
            {
                "method": method,
                "seconds": statistics.median(r["seconds"] for r in runs[0]),
                "bytes_to_receiver": sum(rank[-1]["bytes_sent"] for rank in runs),
                "gather_bytes": runs[0][-1]["gather_bytes"],  # per rank
                "collective_calls": runs[0][-1]["gathers"],
                "messages": sum(rank[-1]["messages"] for rank in runs),
                "changed": sum(rank[-1]["changed"] for rank in runs),
                "weights_equal": all(
                    got[i]["digest"] == runs[0][i]["digest"] for i in range(cfg.repeats)
                ),
            }
        )
    return {"config": asdict(cfg), "numel": trainers[0]["numel"], "rows": rows}


def table(result: dict[str, Any]) -> str:
    """The results as a Markdown table."""
    c, mib = result["config"], 1 << 20
    wire = result["numel"] * getattr(torch, c["dtype"]).itemsize / mib
    lines = [
        f"weight sync, GPT {c['n_layer']} blocks x d_model {c['d_model']}, vocab "
        f"{c['vocab_size']} ({result['numel'] / 1e6:.1f}M params, {wire:.1f} MiB in "
        f"{c['dtype']}), {c['nproc']} training ranks -> 1 receiver on gloo, median of "
        f"{c['repeats']} repeats, AdamW lr {c['lr']:g}; bytes and calls of the last repeat",
        "",
        "| method | seconds | MiB to receiver | MiB gathered/rank | collective calls | messages "
        "| elements changed | receiver == full_tensor() |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        changed = f"{r['changed']:,}" if r["method"].startswith("delta") else "-"
        lines.append(
            f"| {r['method']} | {r['seconds']:.4f} | {r['bytes_to_receiver'] / mib:.2f} | "
            f"{r['gather_bytes'] / mib:.2f} | {r['collective_calls']} | {r['messages']} | "
            f"{changed} | {'yes' if r['weights_equal'] else 'NO'} |"
        )
    return "\n".join(lines)


def main(args: argparse.Namespace) -> int:
    """``fullshard bench --config weight-sync [--nproc N] [--n-layer L] [--d-model D]
    [--repeats R] [--json] [--out FILE] [--markdown FILE]``."""
    changes: dict[str, Any] = {}
    for field in ("n_layer", "d_model", "repeats"):
        if getattr(args, field, None) is not None:
            changes[field] = getattr(args, field)
    if args.nproc:
        changes["nproc"] = int(args.nproc)
    cfg = WeightSyncConfig(**changes)
    if cfg.nproc < 1 or cfg.d_model % cfg.n_head:
        print("fullshard bench --config weight-sync: --nproc >= 1, d_model % 8 == 0", flush=True)
        return 2
    result = run(cfg, timeout=args.timeout)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(table(result) + "\n")
    print(json.dumps(result, indent=1) if args.json else table(result))
    if not all(r["weights_equal"] for r in result["rows"]):
        print("fullshard bench: weight check FAILED", flush=True)
        return 1
    return 0
