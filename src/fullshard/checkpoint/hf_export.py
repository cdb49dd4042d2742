"""``fullshard ckpt export CKPT --hf DIR``: a checkpoint as a loadable model directory.

The directory holds ``config.json``, the weights as safetensors shards with
``model.safetensors.index.json``, and the run's tokenizer files when it had a tokenizer:

- a Hugging Face causal LM (trained with ``--hf-config`` / ``--hf-model``) loads with
  ``transformers.AutoModelForCausalLM.from_pretrained(DIR)``;
- fullshard's built-in GPT writes ``{"model_type": "fullshard_gpt", ...}`` (its
  :class:`~fullshard.train.model.GPTConfig` fields) and loads with
  ``fullshard.train.models.load_exported(DIR)``.

What the model is comes from the checkpoint itself: ``fullshard train`` records it in the
manifest's ``extra["model"]`` (``{"kind": "hf" | "gpt", "config": {...}}``); tokenizer files
come from ``RUN_DIR/tokenizer/`` beside ``RUN_DIR/checkpoints/``. A checkpoint saved by other
code can pass the description as ``model=`` (the CLI's ``--model-config config.json``).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch

from .manifest import CheckpointError
from .reader import CheckpointReader

__all__ = ["GPT_MODEL_TYPE", "export_hf", "refuse_overwrite"]

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
    from .cli import export  # the streaming writer; cli imports nothing from here at load

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
