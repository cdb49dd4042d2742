"""Hugging Face causal-LM models built from a config (``--hf-config``): no download, ever.

The config is a ``config.json`` path, a directory holding one, or inline JSON; it must name a
``model_type`` that ``transformers`` knows (``llama``, ``qwen2``, ``mistral``, ``gpt2``, ...).
Local pretrained weights (``--hf-weights``) are read from ``.safetensors`` files. The model
stays free of parallelism; :mod:`fullshard.train.parallelize` shards it from outside.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

__all__ = ["HFError", "build", "decoder_layers", "load_weights", "parse_config"]


class HFError(ValueError):
    """The Hugging Face config or weights are unusable; the message names the flag."""


def parse_config(spec: str) -> dict[str, Any]:
    """``--hf-config`` as a dict: inline JSON, a JSON file, or a directory with config.json."""
    text = spec.strip()
    if text.startswith("{"):
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as e:
            raise HFError(f"--hf-config: inline JSON does not parse: {e}") from None
    else:
        path = Path(spec).expanduser()
        if path.is_dir():
            path = path / "config.json"
        if not path.is_file():
            raise HFError(
                f"--hf-config: {spec!r} is neither inline JSON (starting with '{{') nor a "
                "config.json file or a directory holding one"
            )
        try:
            raw = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise HFError(f"--hf-config {path}: not valid JSON: {e}") from None
    if not isinstance(raw, dict) or "model_type" not in raw:
        raise HFError(
            "--hf-config must be a JSON object with a 'model_type' (e.g. "
            '\'{"model_type": "llama", "hidden_size": 64, ...}\')'
        )
    return raw


def _transformers() -> Any:
    try:
        import transformers
    except ImportError:
        raise HFError(
            "--hf-config needs the transformers package: pip install 'fullshard[hf]'"
        ) from None
    return transformers


def make_config(raw: dict[str, Any]) -> Any:
    """A ``transformers`` ``PretrainedConfig`` from :func:`parse_config`'s dict."""
    transformers = _transformers()
    fields = dict(raw)
    model_type = fields.pop("model_type")
    for key in ("architectures", "transformers_version", "torch_dtype", "dtype"):
        fields.pop(key, None)
    try:
        return transformers.AutoConfig.for_model(model_type, **fields)
    except (ValueError, KeyError) as e:
        raise HFError(
            f"--hf-config: transformers cannot build model_type {model_type!r}: {e}"
        ) from None


def vocab_and_context(raw: dict[str, Any]) -> tuple[int, int | None]:
    """The config's vocabulary size and maximum context (``None`` when it sets none)."""
    config = make_config(raw)
    context = getattr(config, "max_position_embeddings", None) or getattr(
        config, "n_positions", None
    )
    return int(config.vocab_size), context


def build(raw: dict[str, Any]) -> nn.Module:
    """A randomly initialised causal LM (in the current default device/dtype context)."""
    transformers = _transformers()
    config = make_config(raw)
    try:
        model = transformers.AutoModelForCausalLM.from_config(config)
    except ValueError as e:
        raise HFError(f"--hf-config: {config.model_type!r} has no causal-LM head: {e}") from None
    model.config.use_cache = False
    return model


def from_pretrained(path: str | Path) -> nn.Module:
    """``AutoModelForCausalLM.from_pretrained`` on a local directory only (eval mode)."""
    transformers = _transformers()
    model = transformers.AutoModelForCausalLM.from_pretrained(str(path), local_files_only=True)
    return model.eval()


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The repeated decoder layers: the longest ``ModuleList`` of one class (model.layers, h)."""
    best: list[nn.Module] = []
    for module in model.modules():
        if isinstance(module, nn.ModuleList) and len(module) > len(best):
            kinds = {type(m) for m in module}
            if len(kinds) == 1:
                best = list(module)
    if not best:
        raise HFError(f"cannot find the decoder layers of {type(model).__name__}")
    return best


def load_weights(model: nn.Module, path: str) -> None:
    """Load ``--hf-weights`` (a .safetensors file or a folder of them) into an unsharded model."""
    from safetensors.torch import load_file

    root = Path(path).expanduser()
    files = sorted(root.glob("*.safetensors")) if root.is_dir() else [root]
    if not files or not all(f.is_file() for f in files):
        raise HFError(f"--hf-weights: no .safetensors files at {path!r}")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        state.update(load_file(str(f)))
    result = model.load_state_dict(state, strict=False)
    tied = {"lm_head.weight"} if getattr(model.config, "tie_word_embeddings", False) else set()
    missing = sorted(set(result.missing_keys) - tied)
    if missing or result.unexpected_keys:
        raise HFError(
            f"--hf-weights {path}: does not match --hf-config: missing {missing[:8]}, "
            f"unexpected {sorted(result.unexpected_keys)[:8]}"
        )


def init_weights(model: nn.Module) -> None:
    """Re-initialise every parameter in place (after ``to_empty`` on a meta-built model)."""
    init = getattr(model, "_init_weights", None)  # the per-module hook every HF model defines
    if init is None:
        raise HFError(f"{type(model).__name__} has no _init_weights; use --init cpu")
    model.apply(init)
