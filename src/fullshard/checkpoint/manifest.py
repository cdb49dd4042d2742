"""The checkpoint manifest: what a checkpoint holds, as JSON, and its validation.

A checkpoint directory holds ``manifest.json`` plus one ``rank_NNNNN.safetensors`` per rank that
had something to write. The manifest maps every tensor (by fully qualified name) to the shards
that make it up: which file, which key in it, where the shard sits in the global tensor, and a
CRC-32 per block of rows. ``docs/checkpoint-format.md`` is the reference; this module is its
only reader and writer.

Everything read from disk is untrusted: :func:`parse_manifest` checks types, file names (plain
names inside the checkpoint directory: no absolute paths, no separators, no ``..``), dtypes,
shapes, that each shard lies inside its tensor and that the shards tile it exactly, before any
tensor byte is read.
"""

from __future__ import annotations

import itertools
import json
import math
import re
from dataclasses import dataclass, field
from typing import Any

import torch

from .safetensors_io import DTYPE_TO_ST, ST_TO_DTYPE

__all__ = [
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "MANIFEST_NAME",
    "CheckpointCorruptedError",
    "CheckpointError",
    "CheckpointMismatchError",
    "Manifest",
    "OptimizerRecord",
    "ShardRecord",
    "TensorRecord",
    "parse_manifest",
    "validate_file_name",
]

FORMAT_NAME = "fullshard-checkpoint"
FORMAT_VERSION = 1
MANIFEST_NAME = "manifest.json"
# No tensor in a checkpoint may exceed this many bytes (64 TiB): rejects crafted absurd shapes.
MAX_TENSOR_BYTES = 1 << 46
MAX_NDIM = 32
_FILE_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,254}$")

Scalar = int | float | bool | str | None


class CheckpointError(ValueError):
    """A checkpoint is missing, malformed, corrupted or does not fit the model."""


class CheckpointCorruptedError(CheckpointError):
    """A checkpoint's files are damaged: unreadable manifest, a missing, truncated or altered
    file, a block checksum mismatch. Another (earlier) checkpoint may still be intact."""


class CheckpointMismatchError(CheckpointError):
    """An intact checkpoint does not fit the model or optimizer it is loaded into.

    ``what`` says what does not fit, ``fix`` how to fix it; ``missing`` (names the model has
    and the checkpoint lacks), ``unexpected`` (names the checkpoint has and the model lacks)
    and ``shapes`` (``"name: checkpoint [..] vs model [..]"``) list every difference; the
    message shows the first few of each.
    """

    def __init__(
        self,
        what: str,
        fix: str,
        *,
        missing: list[str] | None = None,
        unexpected: list[str] | None = None,
        shapes: list[str] | None = None,
    ) -> None:
        self.what, self.fix = what, fix
        self.missing = missing or []
        self.unexpected = unexpected or []
        self.shapes = shapes or []
        super().__init__(f"{what}: {self.differences(8)}. {fix}")

    def differences(self, first: int = 4) -> str:
        """The first ``first`` names of each kind of difference, on one line."""
        parts = [
            f"{what} {_first([repr(n) for n in names] if quote else names, first)}"
            for what, names, quote in (
                ("missing keys", self.missing, True),
                ("unexpected keys", self.unexpected, True),
                ("shape mismatches", self.shapes, False),
            )
            if names
        ]
        return "; ".join(parts)


def _first(items: list[str], n: int) -> str:
    """``[a, b, c] and 7 more``: a list kept to one line."""
    shown = "[" + ", ".join(items[:n]) + "]"
    return shown + (f" and {len(items) - n} more" if len(items) > n else "")


@dataclass(frozen=True, slots=True)
class ShardRecord:
    """One saved piece of a tensor: a box of the global tensor stored under ``key`` in ``file``."""

    file: str  # plain file name inside the checkpoint directory
    key: str  # safetensors key inside ``file``
    offset: tuple[int, ...]  # ND, where the box starts in the global tensor
    shape: tuple[int, ...]  # ND, the box's extent
    rows_per_block: int  # dim-0 rows per checksum block (a 0-d shard is one block)
    crc32: tuple[int, ...]  # one CRC-32 per block of rows

    def to_json(self) -> dict[str, Any]:
        return {
            "file": self.file,
            "key": self.key,
            "offset": list(self.offset),
            "shape": list(self.shape),
            "rows_per_block": self.rows_per_block,
            "crc32": list(self.crc32),
        }


@dataclass(frozen=True, slots=True)
class TensorRecord:
    """A tensor of the checkpoint: its global dtype and shape and the shards that tile it."""

    dtype: torch.dtype
    shape: tuple[int, ...]  # global shape
    sharded: bool  # True when it was a DTensor when saved (informational)
    shards: tuple[ShardRecord, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize

    def to_json(self) -> dict[str, Any]:
        return {
            "dtype": DTYPE_TO_ST[self.dtype],
            "shape": list(self.shape),
            "sharded": self.sharded,
            "shards": [s.to_json() for s in self.shards],
        }


@dataclass(slots=True)
class OptimizerRecord:
    """Optimizer state keyed by parameter FQN, and its param groups (params as FQN lists)."""

    param_groups: list[dict[str, Any]]  # each: {"params": [fqn, ...], "options": {...}}
    state: dict[str, dict[str, TensorRecord | Scalar]]  # fqn -> state name -> value

    def to_json(self) -> dict[str, Any]:
        state: dict[str, Any] = {}
        for fqn, entries in self.state.items():
            state[fqn] = {
                name: {"tensor": v.to_json()} if isinstance(v, TensorRecord) else {"value": v}
                for name, v in entries.items()
            }
        return {"param_groups": self.param_groups, "state": state}


@dataclass(slots=True)
class Manifest:
    """The parsed, validated ``manifest.json`` of one checkpoint."""

    world_size: int
    files: dict[str, dict[str, int]]  # name -> {"bytes": size, "header_crc32": crc}
    model: dict[str, TensorRecord]
    model_aliases: dict[str, str] = field(default_factory=dict)  # tied FQN -> stored FQN
    optimizer: OptimizerRecord | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {
            "format": FORMAT_NAME,
            "version": FORMAT_VERSION,
            "world_size": self.world_size,
            "files": self.files,
            "model": {k: v.to_json() for k, v in self.model.items()},
            "model_aliases": self.model_aliases,
            "optimizer": None if self.optimizer is None else self.optimizer.to_json(),
            "extra": self.extra,
        }

    def dumps(self) -> bytes:
        return json.dumps(self.to_json(), indent=1, sort_keys=False).encode()

    def all_tensors(self) -> list[tuple[str, TensorRecord]]:
        """Every tensor record with a display name (``model/<fqn>``, ``optim/<fqn>/<name>``)."""
        out = [(f"model/{k}", v) for k, v in self.model.items()]
        if self.optimizer is not None:
            for fqn, entries in self.optimizer.state.items():
                out += [
                    (f"optim/{fqn}/{n}", v)
                    for n, v in entries.items()
                    if isinstance(v, TensorRecord)
                ]
        return out


def validate_file_name(name: object, where: str) -> str:
    """Accept only a plain file name inside the checkpoint directory (no paths, no ``..``)."""
    if not isinstance(name, str) or not _FILE_NAME.fullmatch(name) or ".." in name:
        raise CheckpointError(
            f"{where}: file name {name!r} is not allowed; manifest file names must be plain "
            "names inside the checkpoint directory (no absolute paths, separators or '..')"
        )
    return name


def parse_manifest(raw: bytes, where: str) -> Manifest:
    """Parse and validate manifest bytes read from ``where`` (used in error messages)."""
    try:
        doc = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{where} is not valid JSON ({e}); the manifest is corrupted") from e
    p = _Parser(where)
    d = p.obj(doc, "manifest")
    if d.get("format") != FORMAT_NAME or d.get("version") != FORMAT_VERSION:
        raise CheckpointError(
            f"{where}: not a {FORMAT_NAME} v{FORMAT_VERSION} manifest "
            f"(format={d.get('format')!r}, version={d.get('version')!r})"
        )
    world_size = p.int_(d.get("world_size"), "world_size", minimum=1)
    files: dict[str, dict[str, int]] = {}
    for name, info in p.obj(d.get("files"), "files").items():
        validate_file_name(name, where)
        info = p.obj(info, f"files[{name!r}]")
        files[name] = {
            "bytes": p.int_(info.get("bytes"), f"files[{name!r}].bytes"),
            "header_crc32": p.int_(info.get("header_crc32"), f"files[{name!r}].header_crc32"),
        }
    model = {
        p.str_(k, "model key"): p.tensor(v, f"model[{k!r}]", files)
        for k, v in p.obj(d.get("model"), "model").items()
    }
    aliases = {}
    for k, v in p.obj(d.get("model_aliases", {}), "model_aliases").items():
        if p.str_(v, f"model_aliases[{k!r}]") not in model:
            raise CheckpointError(f"{where}: model_aliases[{k!r}] points to missing {v!r}")
        aliases[k] = v
    optimizer = None
    if d.get("optimizer") is not None:
        optimizer = p.optimizer(d["optimizer"], files)
    extra = p.obj(d.get("extra", {}), "extra")
    return Manifest(world_size, files, model, aliases, optimizer, extra)


class _Parser:
    """Typed accessors that raise :class:`CheckpointError` naming the manifest and field."""

    def __init__(self, where: str) -> None:
        self.where = where

    def fail(self, what: str, value: object, expected: str) -> CheckpointError:
        shown = repr(value)
        shown = shown if len(shown) < 120 else shown[:117] + "..."
        return CheckpointError(f"{self.where}: {what} = {shown}, expected {expected}")

    def obj(self, v: object, what: str) -> dict[str, Any]:
        if not isinstance(v, dict):
            raise self.fail(what, v, "a JSON object")
        return v

    def str_(self, v: object, what: str) -> str:
        if not isinstance(v, str):
            raise self.fail(what, v, "a string")
        return v

    def int_(self, v: object, what: str, minimum: int = 0) -> int:
        if not isinstance(v, int) or isinstance(v, bool) or v < minimum:
            raise self.fail(what, v, f"an integer >= {minimum}")
        return v

    def ints(self, v: object, what: str, n: int | None = None) -> tuple[int, ...]:
        if not isinstance(v, list) or len(v) > MAX_NDIM or (n is not None and len(v) != n):
            raise self.fail(what, v, f"a list of {n if n is not None else 'at most 32'} integers")
        return tuple(self.int_(x, what) for x in v)

    def tensor(self, v: object, what: str, files: dict[str, dict[str, int]]) -> TensorRecord:
        d = self.obj(v, what)
        dtype = ST_TO_DTYPE.get(d.get("dtype"))  # type: ignore[arg-type]
        if dtype is None:
            raise self.fail(f"{what}.dtype", d.get("dtype"), f"one of {sorted(ST_TO_DTYPE)}")
        shape = self.ints(d.get("shape"), f"{what}.shape")
        if math.prod(shape) * dtype.itemsize > MAX_TENSOR_BYTES:
            raise self.fail(f"{what}.shape", list(shape), f"at most {MAX_TENSOR_BYTES} bytes")
        raw_shards = d.get("shards")
        if not isinstance(raw_shards, list):
            raise self.fail(f"{what}.shards", raw_shards, "a list")
        shards = tuple(
            self.shard(s, f"{what}.shards[{i}]", shape, dtype, files)
            for i, s in enumerate(raw_shards)
        )
        rec = TensorRecord(dtype, shape, bool(d.get("sharded", False)), shards)
        self.check_tiling(rec, what)
        return rec

    def shard(
        self,
        v: object,
        what: str,
        shape: tuple[int, ...],
        dtype: torch.dtype,
        files: dict[str, dict[str, int]],
    ) -> ShardRecord:
        d = self.obj(v, what)
        file = validate_file_name(d.get("file"), f"{self.where}: {what}.file")
        if file not in files:
            raise self.fail(f"{what}.file", file, "a file listed under 'files'")
        key = self.str_(d.get("key"), f"{what}.key")
        offset = self.ints(d.get("offset"), f"{what}.offset", len(shape))
        sshape = self.ints(d.get("shape"), f"{what}.shape", len(shape))
        for dim, (o, s, g) in enumerate(zip(offset, sshape, shape)):
            if o + s > g:
                raise CheckpointError(
                    f"{self.where}: {what} spans [{o}, {o + s}) on dim {dim} but the tensor has "
                    f"only {g}; the manifest is corrupted or crafted"
                )
        if math.prod(sshape) * dtype.itemsize > files[file]["bytes"]:
            raise CheckpointError(
                f"{self.where}: {what} needs {math.prod(sshape) * dtype.itemsize} bytes but "
                f"{file} has {files[file]['bytes']}; the manifest is corrupted or crafted"
            )
        rpb = self.int_(d.get("rows_per_block"), f"{what}.rows_per_block", minimum=1)
        n_blocks = 1 if not sshape else -(-sshape[0] // rpb)
        crcs = d.get("crc32")
        if not isinstance(crcs, list) or len(crcs) != n_blocks:
            raise self.fail(f"{what}.crc32", crcs, f"a list of {n_blocks} checksums")
        crc = tuple(self.int_(c, f"{what}.crc32") for c in crcs)
        return ShardRecord(file, key, offset, sshape, rpb, crc)

    def check_tiling(self, rec: TensorRecord, what: str) -> None:
        """The shards must cover the tensor exactly once (no gaps, no overlaps)."""
        shards = [s for s in rec.shards if math.prod(s.shape) > 0]
        total = sum(math.prod(s.shape) for s in shards)
        ok = total == math.prod(rec.shape)
        if ok and len(shards) > 1:
            if all(
                s.offset[1:] == (0,) * (len(rec.shape) - 1) and s.shape[1:] == rec.shape[1:]
                for s in shards
            ):
                # dim-0 sharding (the common case): sorted row ranges must chain end to start.
                rows = sorted((s.offset[0], s.shape[0]) for s in shards)
                ok = all(a[0] + a[1] == b[0] for a, b in itertools.pairwise(rows))
            else:
                ok = not any(_overlap(a, b) for i, a in enumerate(shards) for b in shards[i + 1 :])
        if not ok:
            raise CheckpointError(
                f"{self.where}: the shards of {what} do not tile its shape {list(rec.shape)} "
                f"exactly ({total} of {math.prod(rec.shape)} elements, or overlapping)"
            )

    def optimizer(self, v: object, files: dict[str, dict[str, int]]) -> OptimizerRecord:
        d = self.obj(v, "optimizer")
        groups = d.get("param_groups")
        if not isinstance(groups, list):
            raise self.fail("optimizer.param_groups", groups, "a list")
        for i, g in enumerate(groups):
            g = self.obj(g, f"optimizer.param_groups[{i}]")
            params = g.get("params")
            if not isinstance(params, list) or not all(isinstance(x, str) for x in params):
                raise self.fail(f"optimizer.param_groups[{i}].params", params, "a list of FQNs")
            self.obj(g.get("options"), f"optimizer.param_groups[{i}].options")
        state: dict[str, dict[str, TensorRecord | Scalar]] = {}
        for fqn, entries in self.obj(d.get("state"), "optimizer.state").items():
            out: dict[str, TensorRecord | Scalar] = {}
            for name, e in self.obj(entries, f"optimizer.state[{fqn!r}]").items():
                what = f"optimizer.state[{fqn!r}][{name!r}]"
                e = self.obj(e, what)
                if "tensor" in e:
                    out[name] = self.tensor(e["tensor"], what, files)
                elif isinstance(e.get("value"), int | float | bool | str | type(None)):
                    out[name] = e.get("value")
                else:
                    raise self.fail(what, e, "{'tensor': ...} or {'value': scalar}")
            state[fqn] = out
        return OptimizerRecord(groups, state)


def _overlap(a: ShardRecord, b: ShardRecord) -> bool:
    return all(
        ao < bo + bs and bo < ao + as_
        for ao, as_, bo, bs in zip(a.offset, a.shape, b.offset, b.shape)
    )
