"""The GPU check's colocated rows: :func:`fullshard.rl.publish_colocated` hands an engine
process (spawned, on the same GPU) the RL Llama's weights as bf16 buckets through CUDA IPC
handles (shared memory under ``--dry-run``). Timed (median of ``--rl-repeats``, each ending
when the engine has loaded and acknowledged every bucket) against ``publish()`` into a receiver
in the trainer's own process; then the engine shares its weights back (IPC again) and the
trainer compares them with ``publish()``'s bit for bit, and the engine reports whether every
weight it loaded was a view inside its bucket (no copy) on the trainer's device.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import statistics
from collections.abc import Iterator
from multiprocessing.connection import Connection
from typing import Any

import torch
from gpu_check_common import Ctx
from gpu_check_report import Row
from gpu_check_rl import WIRE, _batch, _median_s, _model, _seconds, _step

from fullshard.rl import WeightReceiver, colocated_buckets, publish, publish_colocated

BUCKET_BYTES = 64 << 20


def _sync(conn: Connection, receiver: WeightReceiver) -> dict[str, Any]:
    """One publication on the engine's side, each view checked against its bucket."""
    out: dict[str, Any] = {"buckets": 0, "copies": [], "devices": set()}
    for bucket in colocated_buckets(conn):
        flat = bucket.tensor
        lo, hi = flat.data_ptr(), flat.data_ptr() + flat.numel() * flat.element_size()
        for name, view in bucket.named_tensors():
            end = view.data_ptr() + view.numel() * view.element_size()
            if not lo <= view.data_ptr() <= end <= hi:
                out["copies"].append(name)
            receiver.apply_full(name, view)
        out["buckets"] += 1
        out["devices"].add(str(flat.device))
    return out


def engine(conn: Connection, spec: dict[str, tuple[tuple[int, ...], torch.dtype]]) -> None:
    """The engine's process: a bf16 copy of the weights on the GPU (the CPU without one),
    loaded by every publication the trainer announces; at the end, shared back for the check."""
    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    weights = {
        n: torch.zeros(shape, dtype=dtype, device=device) for n, (shape, dtype) in spec.items()
    }
    receiver = WeightReceiver(weights)
    while (order := conn.recv()) == "sync":
        conn.send(_sync(conn, receiver))
    if order == "share":
        conn.send(weights)  # ForkingPickler: CUDA IPC / shared memory again
        conn.recv()  # the trainer has compared: the tensors may go


@contextlib.contextmanager
def engine_process(spec: dict[str, Any]) -> Iterator[Connection]:
    """An :func:`engine` process on a pipe, joined (or killed after 60 s) when the block ends."""
    spawn = mp.get_context("spawn")
    ours, theirs = spawn.Pipe()
    proc = spawn.Process(target=engine, args=(theirs, spec), daemon=True)
    proc.start()
    try:
        yield ours
    finally:
        proc.join(timeout=60)
        if proc.is_alive():
            proc.kill()


def differ_then_stop(conn: Connection, local: dict[str, torch.Tensor]) -> list[str]:
    """The names of the weights the engine shares back (through IPC again) that differ from
    ``local``'s; then the engine is told to stop."""
    conn.send("share")
    theirs = conn.recv()
    differ = [n for n in local if not torch.equal(theirs[n], local[n])]
    del theirs
    conn.send("stop")
    return differ


def _colocated(ctx: Ctx, model: Any, conn: Connection) -> tuple[float, list[dict[str, Any]]]:
    """publish_colocated's median seconds over the repeats (after one untimed) and what the
    engine saw each time."""
    seen: list[dict[str, Any]] = []

    def once() -> None:
        conn.send("sync")
        publish_colocated(model, conn, dtype=WIRE, bucket_bytes=BUCKET_BYTES)
        seen.append(conn.recv())

    once()
    seconds = statistics.median(_seconds(ctx, once) for _ in range(ctx.args.rl_repeats))
    return seconds, seen


def check_colocated(ctx: Ctx) -> list[Row]:
    model, opt, _ = _model(ctx)
    _step(model, opt, _batch(ctx, 1))
    local = {n: t.clone() for n, t in publish(model, dtype=WIRE)}  # the reference weights
    spec = {n: (tuple(t.shape), t.dtype) for n, t in local.items()}
    with engine_process(spec) as conn:
        into = WeightReceiver({n: torch.empty_like(t) for n, t in local.items()})
        in_process_s = _median_s(
            ctx, lambda: into.load(publish(model, dtype=WIRE)), ctx.args.rl_repeats
        )
        colocated_s, seen = _colocated(ctx, model, conn)
        differ = differ_then_stop(conn, local)
    copies = sorted({n for s in seen for n in s["copies"]})
    devices = sorted({d for s in seen for d in s["devices"]})
    nbytes = sum(t.numel() * t.element_size() for t in local.values())
    ctx.details["colocated"] = {
        "seconds": colocated_s, "in_process_s": in_process_s, "buckets": seen[-1]["buckets"],
        "differ": differ, "copies": copies, "devices": devices, "bytes": nbytes,
    }  # fmt: skip
    return _rows(ctx, ctx.details["colocated"], len(local))


def _rows(ctx: Ctx, d: dict[str, Any], weights: int) -> list[Row]:
    want = "cuda:0" if ctx.cuda else "cpu"
    ok = not d["differ"] and not d["copies"] and d["devices"] == [want]
    bad = d["differ"][:2] + d["copies"][:2]
    return [
        Row(
            "RL colocated: publish_colocated to an engine process, bf16 (ms, median)",
            f"{d['seconds'] * 1e3:.2f} ({d['bytes'] / d['seconds'] / 1e9:.1f} GB/s, "
            f"{d['buckets']} buckets)",
            f"{d['in_process_s'] * 1e3:.2f} (publish into a receiver in-process)",
            f"{'CUDA IPC' if ctx.cuda else 'shared memory'}, buckets of {BUCKET_BYTES >> 20} MiB, "
            f"until the engine acknowledged every bucket; median of {ctx.args.rl_repeats}",
            "INFO",
        ),
        Row(
            "RL colocated: engine == publish(), bit for bit, views in the buckets",
            f"{weights - len(d['differ'])}/{weights} weights equal",
            "(reference)",
            f"{len(d['copies'])} copies; buckets on {', '.join(d['devices'])}"
            + (f"; bad: {', '.join(bad)}" if bad else ""),
            "PASS" if ok else "FAIL",
        ),
    ]
