"""A small, strict reader and streaming writer for the safetensors file format.

The format (https://github.com/huggingface/safetensors) is an 8-byte little-endian header length
``N``, ``N`` bytes of JSON (``{key: {"dtype", "shape", "data_offsets": [begin, end]}}`` plus an
optional ``"__metadata__"`` of strings), then the raw little-endian tensor bytes. It holds no
code, so parsing it cannot execute anything.

We read and write it ourselves rather than through ``safetensors.safe_open`` for two reasons:

- Reads are exact byte ranges (``os.pread``): a rank that needs rows ``[a, b)`` of a shard reads
  those rows and nothing else, and nothing stays memory-mapped (a mapping's touched pages count
  towards RSS, which would defeat the bounded-memory export).
- Writes stream tensor by tensor and compute checksums on the way, so an export never holds the
  whole model and a save never rereads what it wrote.

Files written here load with ``safetensors.torch.load_file`` (the tests check this).
"""

from __future__ import annotations

import json
import os
import struct
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import torch

__all__ = [
    "DTYPE_TO_ST",
    "ST_TO_DTYPE",
    "HeaderEntry",
    "SafetensorsError",
    "bytes_to_tensor",
    "read_header",
    "read_into",
    "read_range",
    "tensor_bytes",
    "write_header",
]

# The largest header we accept; real headers are kilobytes. Guards against a crafted length.
MAX_HEADER_BYTES = 100 * 1024 * 1024

DTYPE_TO_ST: dict[torch.dtype, str] = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.uint16: "U16",
    torch.uint32: "U32",
    torch.uint64: "U64",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
}
ST_TO_DTYPE: dict[str, torch.dtype] = {v: k for k, v in DTYPE_TO_ST.items()}

if sys.byteorder != "little":  # pragma: no cover - every platform torch ships for
    raise ImportError("fullshard.checkpoint needs a little-endian host (safetensors is LE)")


class SafetensorsError(ValueError):
    """A safetensors file is malformed, truncated or does not match what was expected."""


@dataclass(frozen=True, slots=True)
class HeaderEntry:
    """One tensor's entry in a safetensors header; ``begin``/``end`` are absolute file offsets."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int
    end: int


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """The raw bytes of ``t`` (made contiguous) without copying when it already is."""
    flat = t.detach().reshape(-1)
    if not flat.is_contiguous():
        flat = flat.contiguous()
    if flat.device.type != "cpu":
        flat = flat.cpu()
    array: Any = flat.view(torch.uint8).numpy()
    return memoryview(array).cast("B")


def bytes_to_tensor(buf: bytearray, dtype: torch.dtype, shape: Iterable[int]) -> torch.Tensor:
    """A tensor over ``buf`` (little-endian ``dtype`` values); it shares ``buf``'s memory."""
    shape = tuple(shape)
    if len(buf) == 0:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(buf, dtype=torch.uint8).view(dtype).reshape(shape)


def write_header(
    f: BinaryIO, entries: list[tuple[str, torch.dtype, tuple[int, ...]]], metadata: dict[str, str]
) -> tuple[int, bytes]:
    """Write the header for ``entries`` laid out back to back in order.

    Returns ``(data_bytes, header_bytes)``: the size of the data section that must follow and
    the bytes just written (length prefix + JSON), for checksumming. The caller then writes each
    tensor's bytes in the same order.
    """
    header: dict[str, object] = {"__metadata__": metadata} if metadata else {}
    offset = 0
    for key, dtype, shape in entries:
        if key in header:
            raise ValueError(f"duplicate safetensors key {key!r}")
        nbytes = _numel(shape) * dtype.itemsize
        header[key] = {
            "dtype": DTYPE_TO_ST[dtype],
            "shape": list(shape),
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data section starts 8-byte aligned, as safetensors does
    head = struct.pack("<Q", len(raw)) + raw
    f.write(head)
    return offset, head


def read_header(path: Path) -> tuple[dict[str, HeaderEntry], int, bytes]:
    """Parse and validate the header of ``path``.

    Returns ``(entries, data_start, raw_header_bytes)``; ``raw_header_bytes`` covers the length
    prefix and the JSON, for checksumming. Every entry is checked against the file size, so a
    truncated file is reported here, naming the tensors whose bytes are missing.
    """
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            prefix = f.read(8)
            if len(prefix) < 8:
                raise SafetensorsError(f"{path}: {size} bytes, too short for a safetensors file")
            (n,) = struct.unpack("<Q", prefix)
            if n > MAX_HEADER_BYTES or 8 + n > size:
                raise SafetensorsError(
                    f"{path}: header length {n} is invalid for a {size}-byte file "
                    "(truncated or not a safetensors file)"
                )
            raw = f.read(n)
    except OSError as e:
        raise SafetensorsError(f"cannot read {path}: {e}") from e
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise SafetensorsError(f"{path}: header is not valid JSON ({e}); file is corrupted") from e
    if not isinstance(header, dict):
        raise SafetensorsError(f"{path}: header is not a JSON object; file is corrupted")
    data_start = 8 + n
    entries: dict[str, HeaderEntry] = {}
    truncated: list[str] = []
    for key, spec in header.items():
        if key == "__metadata__":
            continue
        entry = _parse_entry(path, key, spec, data_start)
        if entry.end > size:
            truncated.append(f"{key} (needs bytes up to {entry.end}, file has {size})")
        entries[key] = entry
    if truncated:
        raise SafetensorsError(
            f"{path} is truncated: {size} bytes on disk; missing data of tensors: "
            + ", ".join(truncated)
        )
    return entries, data_start, prefix + raw


def _parse_entry(path: Path, key: str, spec: object, data_start: int) -> HeaderEntry:
    bad = f"{path}: header entry {key!r} is malformed: {spec!r}"
    if not isinstance(spec, dict):
        raise SafetensorsError(bad)
    dtype = ST_TO_DTYPE.get(spec.get("dtype"))  # type: ignore[arg-type]
    shape = spec.get("shape")
    offsets = spec.get("data_offsets")
    if (
        dtype is None or not _is_int_list(shape) or not _is_int_list(offsets) or len(offsets) != 2  # type: ignore[arg-type]
    ):
        raise SafetensorsError(bad)
    assert isinstance(shape, list) and isinstance(offsets, list)
    begin, end = offsets
    if end - begin != _numel(shape) * dtype.itemsize:
        raise SafetensorsError(f"{bad} (byte range does not match shape x dtype)")
    return HeaderEntry(dtype, tuple(shape), data_start + begin, data_start + end)


def read_range(path: Path, begin: int, length: int) -> bytearray:
    """Read exactly ``length`` bytes at absolute offset ``begin`` of ``path``."""
    buf = bytearray(length)
    read_into(path, begin, memoryview(buf))
    return buf


def read_into(path: Path, begin: int, dest: memoryview) -> None:
    """Fill ``dest`` (a writable byte buffer) with the bytes of ``path`` from ``begin``."""
    length = len(dest)
    fd = os.open(path, os.O_RDONLY)
    try:
        got = 0
        while got < length:
            n = os.preadv(fd, [dest[got : got + (64 << 20)]], begin + got)
            if n <= 0:
                raise SafetensorsError(
                    f"{path}: unexpected end of file at byte {begin + got} "
                    f"(wanted {length} bytes from {begin}); file is truncated"
                )
            got += n
    finally:
        os.close(fd)


def _is_int_list(x: object) -> bool:
    return isinstance(x, list) and all(
        isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in x
    )


def _numel(shape: Iterable[int]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n
