"""Full (unsharded) state dicts: gather a sharded model, or shard a full one into it.

- :func:`get_full_state_dict` all-gathers one tensor at a time (``DTensor.full_tensor``) and
  keeps it only where asked (rank 0 by default, moved to CPU by default), so the extra device
  memory is one full tensor and non-keeping ranks hold nothing.
- :func:`load_full_state_dict` takes a full state dict present on every rank (e.g. memory-mapped)
  and keeps only each rank's shard; :func:`load_full_state_dict_from_file` does the same from
  safetensors files (one file, a Hugging Face index JSON, or a directory holding either), each
  rank reading only the rows of its own shards from disk.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from .loading import apply_model_state
from .manifest import CheckpointError, validate_file_name
from .safetensors_io import HeaderEntry, bytes_to_tensor, read_header, read_range
from .shards import Box, model_aliases, rank_and_world, slices

__all__ = ["get_full_state_dict", "load_full_state_dict", "load_full_state_dict_from_file"]


def get_full_state_dict(
    model: nn.Module, *, cpu_offload: bool = True, rank0_only: bool = True
) -> dict[str, torch.Tensor]:
    """Gather ``model.state_dict()`` into full tensors, one tensor at a time.

    Collective: every rank must call it. Returns the full state dict on rank 0 (on every rank
    when ``rank0_only=False``) and ``{}`` elsewhere. With ``cpu_offload`` each gathered tensor is
    moved to CPU before the next is gathered. Tied entries share one tensor, as in the model.
    Plain (non-DTensor) entries are copied, so the result never aliases the model.
    """
    rank, _ = rank_and_world()
    keep = rank == 0 or not rank0_only
    aliases = model_aliases(model)
    out: dict[str, torch.Tensor] = {}
    sd = model.state_dict()
    for fqn, t in sd.items():
        if fqn in aliases and aliases[fqn] in sd:  # tied: gathered once (same order on all ranks)
            if keep:
                out[fqn] = out[aliases[fqn]]
            continue
        full = t.full_tensor() if isinstance(t, DTensor) else t.detach().clone()
        if keep:
            out[fqn] = full.cpu() if cpu_offload else full
        del full
    return out


def load_full_state_dict(
    model: nn.Module, full_sd: dict[str, torch.Tensor], *, strict: bool = True
) -> None:
    """Load full tensors into a (sharded) model; each rank copies only the rows it holds.

    Every rank passes the full state dict (tensors may be memory-mapped or on any device).
    A tied key missing from ``full_sd`` is filled from the key it is tied to.
    """

    def source(fqn: str) -> Callable[[Box], torch.Tensor] | None:
        t = full_sd.get(fqn)
        if t is None:
            return None
        return lambda box: t.detach()[slices(box)].contiguous()

    shapes = {k: tuple(v.shape) for k, v in full_sd.items()}
    apply_model_state(model, source, shapes, "full state dict", strict=strict)


def load_full_state_dict_from_file(
    model: nn.Module, path: str | os.PathLike[str], *, strict: bool = True
) -> None:
    """Load full weights from safetensors into a (sharded) model, reading only local rows.

    ``path`` is a ``.safetensors`` file, a Hugging Face ``*.safetensors.index.json``, or a
    directory containing one of those (``model.safetensors`` or ``model.safetensors.index.json``).
    """
    entries = _open_safetensors(Path(path))

    def source(fqn: str) -> Callable[[Box], torch.Tensor] | None:
        found = entries.get(fqn)
        if found is None:
            return None
        return lambda box: _read_box(found[0], found[1], box)

    shapes = {k: v[1].shape for k, v in entries.items()}
    apply_model_state(model, source, shapes, str(path), strict=strict)


def _open_safetensors(path: Path) -> dict[str, tuple[Path, HeaderEntry]]:
    if path.is_dir():
        candidates = [path / "model.safetensors.index.json", path / "model.safetensors"]
        candidates += sorted(path.glob("*.safetensors.index.json")) + sorted(
            path.glob("*.safetensors")
        )
        found = next((c for c in candidates if c.is_file()), None)
        if found is None:
            raise CheckpointError(f"no .safetensors file or index JSON in {path}")
        path = found
    files = [path]
    if path.name.endswith(".json"):
        try:
            weight_map = json.loads(path.read_bytes())["weight_map"]
        except (ValueError, KeyError, TypeError) as e:
            raise CheckpointError(f"{path} is not a safetensors index JSON ({e})") from e
        names = sorted(set(weight_map.values()))
        files = [path.parent / validate_file_name(n, str(path)) for n in names]
    out: dict[str, tuple[Path, HeaderEntry]] = {}
    for f in files:
        entries, _, _ = read_header(f)
        for key, entry in entries.items():
            out[key] = (f, entry)
    return out


def _read_box(path: Path, e: HeaderEntry, box: Box) -> torch.Tensor:
    """Read the rows of ``box`` from one tensor of a safetensors file, then cut the other dims."""
    offset, shape = box
    if any(s == 0 for s in shape):
        return torch.empty(shape, dtype=e.dtype)
    if not e.shape:
        return bytes_to_tensor(read_range(path, e.begin, e.end - e.begin), e.dtype, ())
    row_bytes = (e.end - e.begin) // e.shape[0]
    raw = read_range(path, e.begin + offset[0] * row_bytes, shape[0] * row_bytes)
    rows = bytes_to_tensor(raw, e.dtype, (shape[0], *e.shape[1:]))
    return rows[(slice(None), *slices(box)[1:])].contiguous()
