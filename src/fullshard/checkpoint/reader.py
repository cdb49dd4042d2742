"""Reading a checkpoint: the validated manifest, verified files, and any box of any tensor.

:class:`CheckpointReader` is what load, export and inspect share. It reads only the bytes it is
asked for: ``read_box`` finds the saved shards that overlap the requested box, reads the blocks
of rows that hold the overlap (one ``pread`` per shard), checks each block's CRC-32 and copies the
overlap out. Before the first read from a file it checks the file's size and header checksum
against the manifest and that every shard the manifest places in it is there with the expected
dtype and shape, so corruption and truncation are reported with the file and tensor named, never
turned into wrong weights.
"""

from __future__ import annotations

import os
import zlib
from pathlib import Path

import torch

from .durability import resolve_checkpoint
from .manifest import (
    MANIFEST_NAME,
    CheckpointCorruptedError,
    CheckpointError,
    Manifest,
    ShardRecord,
    TensorRecord,
    parse_manifest,
)
from .safetensors_io import (
    HeaderEntry,
    SafetensorsError,
    bytes_to_tensor,
    read_header,
    read_into,
    read_range,
    tensor_bytes,
)
from .shards import Box, intersect, slices

__all__ = ["CheckpointReader"]

MAX_MANIFEST_BYTES = 1 << 30
_FIX = "restore the file from a copy or load an earlier checkpoint (see latest_checkpoint)"


class CheckpointReader:
    """Read-only access to one checkpoint directory (or the newest one under a root)."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = resolve_checkpoint(path)
        mpath = self.path / MANIFEST_NAME
        size = mpath.stat().st_size
        if size > MAX_MANIFEST_BYTES:
            raise CheckpointCorruptedError(
                f"{mpath} is {size} bytes, over the {MAX_MANIFEST_BYTES} limit"
            )
        try:
            self.manifest: Manifest = parse_manifest(mpath.read_bytes(), str(mpath))
        except CheckpointError as e:
            raise CheckpointCorruptedError(str(e)) from e
        self._headers: dict[str, dict[str, HeaderEntry]] = {}
        # file -> the (tensor name, record, shard) it holds, in manifest order
        self._by_file: dict[str, list[tuple[str, TensorRecord, ShardRecord]]] = {
            name: [] for name in self.manifest.files
        }
        for tname, rec in self.manifest.all_tensors():
            for s in rec.shards:
                self._by_file[s.file].append((tname, rec, s))

    def check_file(self, name: str) -> dict[str, HeaderEntry]:
        """Verify ``name`` against the manifest (size, header CRC, dtypes, shapes); cached."""
        if name in self._headers:
            return self._headers[name]
        path = self.path / name
        want = self.manifest.files[name]
        held = self._tensors_in(name)  # for messages
        try:
            size = path.stat().st_size
        except FileNotFoundError:
            raise CheckpointCorruptedError(f"{path} is missing; it holds {held}. {_FIX}") from None
        if size != want["bytes"]:
            kind = "truncated" if size < want["bytes"] else "longer than recorded"
            raise CheckpointCorruptedError(
                f"{path} is {kind}: {size} bytes on disk, manifest says {want['bytes']}; it "
                f"holds {held}. {_FIX}"
            )
        try:
            entries, _, head = read_header(path)
        except SafetensorsError as e:
            raise CheckpointCorruptedError(f"{e}; it holds {held}. {_FIX}") from e
        if zlib.crc32(head) != want["header_crc32"]:
            raise CheckpointCorruptedError(
                f"{path}: header checksum {zlib.crc32(head):#010x} != manifest "
                f"{want['header_crc32']:#010x}; the file is corrupted. It holds {held}. {_FIX}"
            )
        for tname, rec, s in self._by_file[name]:
            entry = entries.get(s.key)
            if entry is None or entry.dtype != rec.dtype or entry.shape != s.shape:
                got = "missing" if entry is None else f"{entry.dtype} {list(entry.shape)}"
                raise CheckpointCorruptedError(
                    f"{path}: tensor {tname} (key {s.key!r}) should be {rec.dtype} "
                    f"{list(s.shape)} but the file has {got}. {_FIX}"
                )
        self._headers[name] = entries
        return entries

    def _tensors_in(self, name: str) -> str:
        names = [t for t, _, _ in self._by_file[name]]
        shown = ", ".join(names[:8]) + (f" and {len(names) - 8} more" if len(names) > 8 else "")
        return f"tensors [{shown}]"

    def read_box(
        self, rec: TensorRecord, name: str, box: Box, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The values of box ``(offset, shape)`` of tensor ``rec`` (``name`` for messages).

        ``out``, if given, is a contiguous tensor of the box's shape and ``rec``'s dtype to fill
        (lets a caller reuse one buffer for many tensors).
        """
        offset, shape = box
        if out is None:
            out = torch.empty(shape, dtype=rec.dtype)
        elif tuple(out.shape) != tuple(shape) or out.dtype != rec.dtype or not out.is_contiguous():
            raise ValueError(
                f"out must be contiguous {rec.dtype} {list(shape)}, got {out.dtype} {list(out.shape)}"
            )
        if out.numel() == 0:
            return out
        for s in rec.shards:
            overlap = intersect(box, (s.offset, s.shape))
            if overlap is None:
                continue
            if s.shape and self._read_whole_rows_into(out, box, s, name, overlap):
                continue
            if s.shape:
                rows = self._read_rows(
                    s, name, overlap[0][0] - s.offset[0], overlap[1][0], rec.dtype
                )
                sub = rows[(slice(None), *slices(overlap, s.offset)[1:])]
            else:
                sub = self._read_rows(s, name, 0, 1, rec.dtype)
            out[slices(overlap, offset)] = sub
        return out

    def read_full(
        self, rec: TensorRecord, name: str, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The whole tensor ``rec`` (into ``out`` if given, see :meth:`read_box`)."""
        return self.read_box(rec, name, ((0,) * len(rec.shape), rec.shape), out)

    def _read_whole_rows_into(
        self, out: torch.Tensor, box: Box, s: ShardRecord, name: str, overlap: Box
    ) -> bool:
        """Fast path: read the overlap straight into ``out`` (no staging buffer) when it is
        whole rows of both ``out`` and the shard and starts and ends on block boundaries, as
        when reading a whole tensor or loading at the world size it was saved with."""
        (o_lo, *_), (o_rows, *o_rest) = overlap
        row0 = o_lo - s.offset[0]
        end = row0 + o_rows
        if (
            tuple(o_rest) != s.shape[1:]
            or tuple(o_rest) != tuple(box[1][1:])
            or row0 % s.rows_per_block
            or (end % s.rows_per_block and end != s.shape[0])
        ):
            return False
        entry = self.check_file(s.file)[s.key]
        row_bytes = (entry.end - entry.begin) // s.shape[0]
        dest_rows = out[o_lo - box[0][0] : o_lo - box[0][0] + o_rows]  # contiguous rows of out
        dest = tensor_bytes(dest_rows)
        path = self.path / s.file
        read_into(path, entry.begin + row0 * row_bytes, dest)
        for b in range(row0 // s.rows_per_block, -(-end // s.rows_per_block)):
            r0 = b * s.rows_per_block
            r1 = min(r0 + s.rows_per_block, s.shape[0])
            chunk = dest[(r0 - row0) * row_bytes : (r1 - row0) * row_bytes]
            self._verify(chunk, s.crc32[b], s, name, (r0, r1), path)
        return True

    def _read_rows(
        self, s: ShardRecord, name: str, row0: int, nrows: int, dtype: torch.dtype
    ) -> torch.Tensor:
        """Rows ``[row0, row0 + nrows)`` of shard ``s``, reading and verifying whole blocks."""
        entry = self.check_file(s.file)[s.key]
        path = self.path / s.file
        if not s.shape:  # 0-d: one block
            raw = read_range(path, entry.begin, entry.end - entry.begin)
            self._verify(raw, s.crc32[0], s, name, (0, 1), path)
            return bytes_to_tensor(raw, dtype, ())
        row_bytes = (entry.end - entry.begin) // s.shape[0]
        b0 = row0 // s.rows_per_block
        b1 = -(-(row0 + nrows) // s.rows_per_block)
        first_row = b0 * s.rows_per_block
        last_row = min(b1 * s.rows_per_block, s.shape[0])
        raw = read_range(
            path, entry.begin + first_row * row_bytes, (last_row - first_row) * row_bytes
        )
        for b in range(b0, b1):
            r0 = b * s.rows_per_block
            r1 = min(r0 + s.rows_per_block, s.shape[0])
            chunk = memoryview(raw)[(r0 - first_row) * row_bytes : (r1 - first_row) * row_bytes]
            self._verify(chunk, s.crc32[b], s, name, (r0, r1), path)
        rows = bytes_to_tensor(raw, dtype, (last_row - first_row, *s.shape[1:]))
        return rows[row0 - first_row : row0 - first_row + nrows]

    @staticmethod
    def _verify(
        raw: bytes | bytearray | memoryview,
        want: int,
        s: ShardRecord,
        name: str,
        rows: tuple[int, int],
        path: Path,
    ) -> None:
        got = zlib.crc32(raw)
        if got != want:
            raise CheckpointCorruptedError(
                f"checksum mismatch in {path} for tensor {name} (key {s.key!r}, rows "
                f"[{rows[0]}, {rows[1]}) of the shard at offset {list(s.offset)}): expected "
                f"crc32 {want:#010x}, got {got:#010x}. The file is corrupted; {_FIX}"
            )

    def verify(self) -> dict[str, str]:
        """Check every file and every block checksum; return ``{file: "ok" | error message}``."""
        status: dict[str, str] = {}
        for name in self.manifest.files:
            try:
                self.check_file(name)
                for tname, rec, s in self._by_file[name]:
                    rows = s.shape[0] if s.shape else 1
                    for row in range(0, rows, s.rows_per_block):  # one block at a time
                        self._read_rows(s, tname, row, min(s.rows_per_block, rows - row), rec.dtype)
                status[name] = "ok"
            except (CheckpointError, SafetensorsError, OSError) as e:
                status[name] = str(e)
        return status
