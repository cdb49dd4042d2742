"""Sharded save: every rank writes only its own shards, in parallel; rank 0 publishes.

``save`` takes a synchronous snapshot of what this rank owns (the local shards of the model's
DTensors, the optimizer state keyed by parameter FQN, plain tensors on rank 0 only), writes it to
``rank_NNNNN.safetensors`` with a CRC-32 per block of rows, and publishes the directory
atomically (see [Note: atomic publish] in durability.py). With ``async_save=True`` the snapshot
is a host-memory copy and the writing and publishing run in a background thread; the next save
(and interpreter exit) waits for it.
"""

from __future__ import annotations

import atexit
import json
import math
import os
import shutil
import threading
import time
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from . import durability
from .manifest import Manifest, OptimizerRecord, ShardRecord, TensorRecord, parse_manifest
from .safetensors_io import DTYPE_TO_ST, tensor_bytes, write_header
from .shards import is_writer, local_box, local_data, model_aliases, rank_and_world

__all__ = ["SaveHandle", "save", "wait_for_pending_save"]

# Rows are checksummed in blocks of about this many bytes, so a reader that needs a few rows of
# a shard reads and verifies only the blocks holding them (see docs/checkpoint-format.md).
BLOCK_BYTES = 4 << 20
# Test hook: seconds to sleep in the middle of writing a rank file (crash-safety tests).
_DELAY_ENV = "FULLSHARD_CKPT_TEST_WRITE_DELAY_S"


@dataclass(slots=True)
class _Piece:
    """One box of one tensor that this rank writes."""

    name: str  # "model/<fqn>" or "optim/<fqn>/<state name>": safetensors key and display name
    data: torch.Tensor  # the box's values (this rank's local shard, or the whole plain tensor)
    offset: tuple[int, ...]


@dataclass(slots=True)
class _Snapshot:
    """Everything a save needs after the synchronous part, identical in layout on every rank."""

    tensors: dict[str, tuple[torch.dtype, tuple[int, ...], bool]]  # name -> dtype, shape, sharded
    pieces: list[_Piece]
    aliases: dict[str, str]
    optim_groups: list[dict[str, Any]] | None
    optim_scalars: dict[str, dict[str, Any]] = field(default_factory=dict)
    optim_tensor_names: dict[str, dict[str, str]] = field(default_factory=dict)  # fqn->state->name


class SaveHandle:
    """A save in flight. :meth:`wait` blocks until it is published and re-raises its error."""

    def __init__(self, path: Path, thread: threading.Thread | None = None) -> None:
        self.path = path
        self._thread = thread
        self._error: BaseException | None = None

    def done(self) -> bool:
        """True when the save has finished (successfully or not)."""
        return self._thread is None or not self._thread.is_alive()

    def wait(self) -> Path:
        """Block until the checkpoint is published; return its path or raise the save's error."""
        if self._thread is not None:
            self._thread.join()
        global _PENDING
        if _PENDING is self:
            _PENDING = None
        if self._error is not None:
            raise self._error
        return self.path


_PENDING: SaveHandle | None = None


def wait_for_pending_save() -> None:
    """Wait for the background save started by ``save(..., async_save=True)``, if any."""
    if _PENDING is not None:
        _PENDING.wait()


atexit.register(wait_for_pending_save)


def save(
    path: str | os.PathLike[str],
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    extra: dict[str, Any] | None = None,
    async_save: bool = False,
    overwrite: bool = False,
    keep_last: int | None = None,
) -> SaveHandle:
    """Save ``model`` (and ``optimizer``) sharded into the checkpoint directory ``path``.

    Collective: every rank calls it with the same arguments. Each rank writes only the shards it
    owns; nothing is gathered. ``extra`` is a JSON-able dict stored in the manifest as given by
    rank 0 (use :func:`fullshard.checkpoint.rng_state_to_json` for RNG states). With
    ``async_save=True`` the shards are copied to host memory now and written in a background
    thread: call ``handle.wait()`` before relying on the checkpoint (the next save waits for
    it). ``keep_last=K`` deletes all but the newest K complete checkpoints next to ``path``
    after publishing. Returns a :class:`SaveHandle` (already finished unless async).
    """
    wait_for_pending_save()
    final = Path(path)
    extra = dict(extra or {})
    try:
        json.dumps(extra, allow_nan=True)
    except (TypeError, ValueError) as e:
        raise TypeError(
            f"save({final}): extra must be JSON-serialisable ({e}); convert tensors and RNG "
            "states first, e.g. with fullshard.checkpoint.rng_state_to_json()"
        ) from None
    snap = _snapshot(model, optimizer, copy=async_save)
    group = durability.coordination_group()
    handle = SaveHandle(final)
    args = (snap, final, extra, group, overwrite, keep_last)
    if not async_save:
        _write_and_publish(*args)
        return handle

    def run() -> None:
        try:
            _write_and_publish(*args)
        except BaseException as e:  # handed to wait()
            handle._error = e

    global _PENDING
    handle._thread = threading.Thread(target=run, name=f"fullshard-save-{final.name}", daemon=True)
    _PENDING = handle
    handle._thread.start()
    return handle


def _snapshot(model: nn.Module, optimizer: torch.optim.Optimizer | None, copy: bool) -> _Snapshot:
    def take(name: str, t: torch.Tensor, pieces: list[_Piece]) -> None:
        offset, _ = local_box(t, name)
        if is_writer(t):
            data = local_data(t).detach()
            pieces.append(_Piece(name, data.to("cpu", copy=True) if copy else data, offset))

    sd = model.state_dict()
    aliases = {a: f for a, f in model_aliases(model).items() if a in sd and f in sd}
    tensors: dict[str, tuple[torch.dtype, tuple[int, ...], bool]] = {}
    pieces: list[_Piece] = []
    for fqn, t in sd.items():
        if fqn in aliases:
            continue
        name = f"model/{fqn}"
        tensors[name] = (t.dtype, tuple(t.shape), isinstance(t, DTensor))
        take(name, t, pieces)
    snap = _Snapshot(tensors, pieces, aliases, None)
    if optimizer is None:
        return snap
    fqn_of = {id(p): fqn for fqn, p in model.named_parameters()}
    snap.optim_groups = []
    # The state comes through the optimizer's own state_dict() (keyed by position), not from
    # optimizer.state: an optimizer that keeps its state elsewhere (fullshard.optim.WholeTensor
    # holds each tensor's state whole on one owner rank) presents it there in sharded form.
    packed = optimizer.state_dict()["state"]
    position = 0
    for gi, group in enumerate(optimizer.param_groups):
        fqns: list[str] = []
        for p in group["params"]:
            found = fqn_of.get(id(p))
            if found is None:
                raise ValueError(
                    f"optimizer param_groups[{gi}] holds a parameter of shape {list(p.shape)} "
                    "that is not in model.named_parameters(); pass the model it optimizes"
                )
            fqn = found
            fqns.append(fqn)
            entries = packed.get(position, {})
            position += 1
            for state_name, v in entries.items():
                where = f"optimizer state {fqn!r}[{state_name!r}]"
                if isinstance(v, torch.Tensor):
                    name = f"optim/{fqn}/{state_name}"
                    sharded = isinstance(v, DTensor)
                    tensors[name] = (v.dtype, tuple(v.shape), sharded)
                    snap.optim_tensor_names.setdefault(fqn, {})[state_name] = name
                    take(name, v, pieces)
                else:
                    snap.optim_scalars.setdefault(fqn, {})[state_name] = _json_scalar(v, where)
        options = {
            k: encode_option(v, f"optimizer param_groups[{gi}][{k!r}]")
            for k, v in group.items()
            if k != "params"
        }
        snap.optim_groups.append({"params": fqns, "options": options})
    return snap


def encode_option(v: Any, where: str) -> Any:
    """A param-group option as JSON (tuples become lists, 0-d tensors a tagged dict)."""
    if isinstance(v, torch.Tensor):
        if v.numel() != 1 or v.dim() != 0:
            raise TypeError(
                f"{where}: only 0-d tensors can be saved as options, got {list(v.shape)}"
            )
        return {"__tensor__": v.item(), "dtype": DTYPE_TO_ST[v.dtype]}
    if isinstance(v, list | tuple):
        return [encode_option(x, where) for x in v]
    return _json_scalar(v, where)


def _json_scalar(v: Any, where: str) -> Any:
    if v is None or isinstance(v, bool | int | float | str):
        return v
    raise TypeError(f"{where}: {type(v).__name__} is not a JSON scalar; cannot be checkpointed")


def _write_and_publish(
    snap: _Snapshot,
    final: Path,
    extra: dict[str, Any],
    group: object | None,
    overwrite: bool,
    keep_last: int | None,
) -> None:
    rank, world = rank_and_world()
    tmp = durability.partial_dir(final)
    _step(rank == 0, lambda: durability.prepare_partial(final, overwrite=overwrite), group, final)
    part = tmp / f"rank_{rank:05d}.part.json"
    _step(True, lambda: _write_rank(tmp, rank, snap.pieces, part), group, final, cleanup=tmp)

    def finish() -> None:
        manifest = _merge(tmp, world, snap, extra)
        durability.publish(tmp, final, manifest)
        durability.clean_partial(final.parent)
        if keep_last is not None:
            durability.rotate(final.parent, keep_last)

    _step(rank == 0, finish, group, final, cleanup=tmp)


def _step(
    active: bool, fn: Any, group: object | None, final: Path, cleanup: Path | None = None
) -> None:
    """Run ``fn`` where ``active``, then make every rank agree it succeeded everywhere."""
    error: BaseException | None = None
    if active:
        try:
            fn()
        except BaseException as e:
            error = e
    if durability.all_ok(error is None, group):
        return
    if cleanup is not None:
        if rank_and_world()[0] == 0:
            shutil.rmtree(cleanup, ignore_errors=True)
        durability.all_ok(True, group)  # every rank returns after the cleanup, not during it
    if error is not None:
        raise error
    raise RuntimeError(f"saving {final} failed on another rank (see its error); nothing published")


def _write_rank(tmp: Path, rank: int, pieces: list[_Piece], part: Path) -> None:
    """Write this rank's safetensors file (fsynced) and a JSON part describing its shards."""
    file_name = f"rank_{rank:05d}.safetensors"
    records: list[dict[str, Any]] = []
    info: dict[str, int] | None = None
    if pieces:
        delay = float(os.environ.get(_DELAY_ENV, "0") or 0)
        path = tmp / file_name
        with open(path, "wb") as f:
            entries = [(p.name, p.data.dtype, tuple(p.data.shape)) for p in pieces]
            _, head = write_header(f, entries, {"format": "pt", "fullshard_rank": str(rank)})
            for i, p in enumerate(pieces):
                rows_per_block, crcs = _write_blocks(f, p.data)
                shard = ShardRecord(
                    file_name, p.name, p.offset, tuple(p.data.shape), rows_per_block, crcs
                )
                records.append({"name": p.name, "shard": shard.to_json()})
                if delay and i == 0:
                    f.flush()
                    time.sleep(delay)
            f.flush()
            os.fsync(f.fileno())
        info = {"bytes": path.stat().st_size, "header_crc32": zlib.crc32(head)}
    doc = {"rank": rank, "file": file_name if pieces else None, "info": info, "shards": records}
    durability.write_durable(part, json.dumps(doc).encode())
    durability.fsync_dir(tmp)


def _write_blocks(f: Any, data: torch.Tensor) -> tuple[int, tuple[int, ...]]:
    """Write ``data``'s bytes in blocks of rows; return rows per block and each block's CRC-32."""
    raw = tensor_bytes(data)
    if data.dim() == 0:
        f.write(raw)
        return 1, (zlib.crc32(raw),)
    row_bytes = math.prod(data.shape[1:]) * data.dtype.itemsize
    rows_per_block = max(1, BLOCK_BYTES // max(row_bytes, 1))
    step = rows_per_block * row_bytes
    crcs = []
    for start in range(0, len(raw), step):
        chunk = raw[start : start + step]
        crcs.append(zlib.crc32(chunk))
        f.write(chunk)
    return rows_per_block, tuple(crcs)


def _merge(tmp: Path, world: int, snap: _Snapshot, extra: dict[str, Any]) -> bytes:
    """(rank 0) Combine the ranks' parts into the manifest; validate it as a reader would."""
    files: dict[str, dict[str, int]] = {}
    shards: dict[str, list[ShardRecord]] = {name: [] for name in snap.tensors}
    for r in range(world):
        part = tmp / f"rank_{r:05d}.part.json"
        doc = json.loads(part.read_bytes())
        if doc["file"] is not None:
            files[doc["file"]] = doc["info"]
        for rec in doc["shards"]:
            if rec["name"] not in shards:
                raise RuntimeError(
                    f"rank {r} saved {rec['name']!r}, which rank 0 does not have; every rank "
                    "must hold the same model structure and optimizer state keys"
                )
            s = rec["shard"]
            shards[rec["name"]].append(
                ShardRecord(
                    s["file"],
                    s["key"],
                    tuple(s["offset"]),
                    tuple(s["shape"]),
                    s["rows_per_block"],
                    tuple(s["crc32"]),
                )
            )
        part.unlink()

    def record(name: str) -> TensorRecord:
        dtype, shape, sharded = snap.tensors[name]
        return TensorRecord(
            dtype, shape, sharded, tuple(sorted(shards[name], key=lambda s: s.offset))
        )

    model = {n.removeprefix("model/"): record(n) for n in snap.tensors if n.startswith("model/")}
    optim = None
    if snap.optim_groups is not None:
        state: dict[str, dict[str, Any]] = {}
        for fqn, names in snap.optim_tensor_names.items():
            state.setdefault(fqn, {}).update({k: record(n) for k, n in names.items()})
        for fqn, scalars in snap.optim_scalars.items():
            state.setdefault(fqn, {}).update(scalars)
        optim = OptimizerRecord(snap.optim_groups, state)
    raw = Manifest(world, files, model, snap.aliases, optim, extra).dumps()
    parse_manifest(raw, str(tmp))  # never publish what load would reject
    return raw
