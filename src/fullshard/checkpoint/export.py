"""Export a checkpoint's full model: one safetensors file (or a sharded set), or a model directory.

:func:`export` streams: it writes the safetensors header first (every shape is known from the
manifest), then assembles, converts and writes one tensor at a time, so its peak memory is about
the largest tensor, not the model.

:func:`export_hf` (``fullshard ckpt export CKPT --hf DIR``) writes a model directory holding
``config.json``, the weights as safetensors shards with ``model.safetensors.index.json``, and
the run's tokenizer files when it had a tokenizer:

- a Hugging Face causal LM (trained with ``--hf-config`` / ``--hf-model``) loads with
  ``transformers.AutoModelForCausalLM.from_pretrained(DIR)``;
- fullshard's built-in GPT writes ``{"model_type": "fullshard_gpt", ...}`` (its
  :class:`~fullshard.models.GPTConfig` fields) and loads with
  ``fullshard.train.models.load_exported(DIR)``.

What the model is comes from the checkpoint itself: ``fullshard train`` records it in the
manifest's ``extra["model"]`` (``{"kind": "hf" | "gpt", "config": {...}}``); tokenizer files
come from ``RUN_DIR/tokenizer/`` beside ``RUN_DIR/checkpoints/``. A checkpoint saved by other
code can pass the description as ``model=`` (the CLI's ``--model-config config.json``).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from .manifest import CheckpointError, TensorRecord
from .reader import CheckpointReader
from .safetensors_io import tensor_bytes, write_header

__all__ = ["GPT_MODEL_TYPE", "export", "export_hf", "refuse_overwrite"]

#: ``model_type`` of an exported fullshard GPT's config.json.
GPT_MODEL_TYPE = "fullshard_gpt"
_WEIGHT_FILES = ("*.safetensors", "*.safetensors.tmp", "model.safetensors.index.json")


def refuse_overwrite(out: Path, force: bool) -> None:
    """Raise :class:`CheckpointError` if ``out`` exists (a non-empty dir or a file), unless ``force``."""
    exists = out.is_file() or (out.is_dir() and any(out.iterdir()))
    if exists and not force:
        raise CheckpointError(
            f"{out} already exists; pass --force to overwrite it, or pick another output"
        )


_Item = tuple[str, TensorRecord, str]  # (name in the file, record, stored name)


def _split(
    items: list[_Item], nbytes: Callable[[TensorRecord], int], max_shard_size: int
) -> list[list[_Item]]:
    """``items`` in order, cut into files of at most ``max_shard_size`` bytes (a larger
    tensor gets a file of its own)."""
    groups: list[list[_Item]] = [[]]
    size = 0
    for item in items:
        n = nbytes(item[1])
        if groups[-1] and size + n > max_shard_size:
            groups.append([])
            size = 0
        groups[-1].append(item)
        size += n
    return groups


def _shard_names(out: Path, n: int) -> list[Path]:
    """``out`` itself, or Hugging Face's ``-0000i-of-0000n`` names beside it."""
    if n == 1:
        return [out]
    stem = out.name.removesuffix(".safetensors")
    return [out.with_name(f"{stem}-{i + 1:05d}-of-{n:05d}.safetensors") for i in range(n)]


def export(
    path: str | os.PathLike[str],
    out: str | os.PathLike[str],
    *,
    dtype: torch.dtype | None = None,
    max_shard_size: int = 5 * 10**9,
    overwrite: bool = False,
) -> list[Path]:
    """Write the checkpoint's full model weights to safetensors; return the files written.

    Floating-point tensors are cast to ``dtype`` when given. Streams one tensor at a time.
    An existing ``out`` is refused (:class:`CheckpointError`) unless ``overwrite``.
    """
    reader = CheckpointReader(path)
    m = reader.manifest
    out = Path(out)
    if out.is_dir():
        raise CheckpointError(f"{out} is a directory; give a .safetensors file, or use --hf DIR")
    refuse_overwrite(out, overwrite)
    # (name in the file, record, stored name); tied names are written as copies
    items = [(k, rec, k) for k, rec in m.model.items()]
    items += [(alias, m.model[src], src) for alias, src in m.model_aliases.items()]

    def out_dtype(rec: TensorRecord) -> torch.dtype:
        return dtype if dtype is not None and rec.dtype.is_floating_point else rec.dtype

    def out_bytes(rec: TensorRecord) -> int:
        return rec.nbytes // rec.dtype.itemsize * out_dtype(rec).itemsize

    groups = _split(items, out_bytes, max_shard_size)
    names = _shard_names(out, len(groups))
    for name in m.files:  # sizes, header checksums, dtypes, shapes: fail before writing
        reader.check_file(name)
    # Two buffers reused for every tensor (read, and cast when --dtype changes it): allocating
    # and freeing one per tensor lets malloc keep freed blocks and RSS creep past one tensor.
    read_buf = torch.empty(max((r.nbytes for _, r, _ in items), default=0), dtype=torch.uint8)
    cast_buf = torch.empty(
        max((out_bytes(r) for _, r, _ in items if out_dtype(r) != r.dtype), default=0),
        dtype=torch.uint8,
    )
    made_dir = not out.parent.exists()
    out.parent.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    try:
        for target, group in zip(names, groups):
            tmp = target.with_name(target.name + ".tmp")
            written.append(tmp)
            with open(tmp, "wb") as f:
                entries = [(k, out_dtype(r), r.shape) for k, r, _ in group]
                write_header(f, entries, {"format": "pt"})
                for _, rec, src in group:
                    buf = _view(read_buf, rec.dtype, rec.shape)
                    t = reader.read_full(rec, f"model/{src}", buf)
                    if out_dtype(rec) != rec.dtype:
                        t = _view(cast_buf, out_dtype(rec), rec.shape).copy_(t)
                    f.write(tensor_bytes(t))
            os.replace(tmp, target)
            written[-1] = target
    except BaseException:  # e.g. a corrupted block found mid-stream: leave nothing behind
        for path in written:
            path.unlink(missing_ok=True)
        if made_dir:
            with contextlib.suppress(OSError):
                out.parent.rmdir()
        raise
    if len(groups) > 1:
        index = {
            "metadata": {"total_size": sum(out_bytes(r) for _, r, _ in items)},
            "weight_map": {k: names[i].name for i, g in enumerate(groups) for k, _, _ in g},
        }
        index_path = out.with_name(out.name + ".index.json")
        index_path.write_text(json.dumps(index, indent=2))
        return [*names, index_path]
    return names


def _view(buf: torch.Tensor, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """The first bytes of the uint8 ``buf`` as a contiguous ``dtype`` tensor of ``shape``."""
    n = math.prod(shape) * dtype.itemsize
    return buf[:n].view(dtype).view(shape) if n else torch.empty(shape, dtype=dtype)


def _model_description(reader: CheckpointReader, model: dict[str, Any] | None) -> dict[str, Any]:
    desc = model if model is not None else reader.manifest.extra.get("model")
    if not isinstance(desc, dict) or desc.get("kind") not in ("hf", "gpt"):
        raise CheckpointError(
            f"{reader.path} does not say what model it holds (no extra['model'], as fullshard "
            "train records since 0.1): pass --model-config CONFIG.json (a Hugging Face "
            "config.json), or export the plain weights with 'fullshard ckpt export CKPT "
            "OUT.safetensors'"
        )
    return desc


def _config_json(desc: dict[str, Any], dtype: torch.dtype) -> dict[str, Any]:
    config = dict(desc["config"])
    if desc["kind"] == "gpt":
        return {"model_type": GPT_MODEL_TYPE, **config, "dtype": str(dtype).removeprefix("torch.")}
    if "model_type" not in config:
        raise CheckpointError("the model config has no 'model_type'; it is not a HF config")
    name = str(dtype).removeprefix("torch.")
    config["dtype"] = name  # transformers >= 4.56 reads dtype, older ones torch_dtype
    config["torch_dtype"] = name
    config["use_cache"] = True  # training turned the KV cache off; generation wants it
    return config


def _run_dir_of(ckpt: Path) -> Path | None:
    return ckpt.parent.parent if ckpt.parent.name == "checkpoints" else None


def export_hf(
    path: str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    *,
    dtype: torch.dtype | None = None,
    max_shard_size: int = 5 * 10**9,
    force: bool = False,
    model: dict[str, Any] | None = None,
) -> list[Path]:
    """Write the checkpoint at ``path`` as a model directory ``out_dir``; return the files.

    ``dtype`` casts floating-point weights (default: as stored). ``force`` replaces an
    existing ``out_dir``'s weights, config and tokenizer files; without it an existing,
    non-empty ``out_dir`` is refused. ``model`` describes the model when the checkpoint does
    not (``{"kind": "hf", "config": {...}}``).
    """
    reader = CheckpointReader(path)
    desc = _model_description(reader, model)
    out = Path(out_dir)
    refuse_overwrite(out, force)
    if out.is_file():
        raise CheckpointError(f"--hf {out}: is a file; give a directory")
    stored = {r.dtype for r in reader.manifest.model.values() if r.dtype.is_floating_point}
    weights_dtype = dtype or (stored.pop() if len(stored) == 1 else torch.float32)
    if out.is_dir():  # --force: drop old weights, so no stale shard outlives its index
        for pattern in _WEIGHT_FILES:
            for old in out.glob(pattern):
                old.unlink()
    out.mkdir(parents=True, exist_ok=True)
    files = export(
        reader.path,
        out / "model.safetensors",
        dtype=dtype,
        max_shard_size=max_shard_size,
        overwrite=True,
    )
    index_path = out / "model.safetensors.index.json"
    if index_path not in files:  # one shard: write the index anyway (tools expect one)
        m = reader.manifest
        names = [*m.model, *m.model_aliases]
        total = files[0].stat().st_size
        index = {
            "metadata": {"total_size": total},
            "weight_map": dict.fromkeys(names, files[0].name),
        }
        index_path.write_text(json.dumps(index, indent=2))
        files.append(index_path)
    config_path = out / "config.json"
    config_path.write_text(json.dumps(_config_json(desc, weights_dtype), indent=2) + "\n")
    files.append(config_path)
    run_dir = _run_dir_of(reader.path)
    tokenizer = run_dir / "tokenizer" if run_dir is not None else None
    if tokenizer is not None and tokenizer.is_dir():
        for f in sorted(tokenizer.iterdir()):
            if f.is_file():
                shutil.copyfile(f, out / f.name)
                files.append(out / f.name)
    return files
