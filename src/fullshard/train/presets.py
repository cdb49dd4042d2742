"""Presets: plain functions that return a :class:`TrainConfig`; flags and --config override them.

- ``tiny``: seconds on 2 CPU cores; what the tests run.
- ``small``: the default; a few minutes on 2 CPU cores, and the loss visibly falls.
- ``gpt2-124m``: GPT-2 small's shape (12 x 768, 1024 context, 50304 vocab) for GPUs.
- ``llama-1b`` / ``llama-8b``: Llama 3.2 1B / Llama 3.1 8B shapes as Hugging Face models built
  from a config (no download), bf16, activation checkpointing; for GPUs.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from fullshard.train.config import ConfigError, TrainConfig

__all__ = ["PRESETS", "get_preset"]


def tiny() -> TrainConfig:
    """A 2-block, 64-wide GPT on 64-byte windows: trains in seconds (tests use it)."""
    return TrainConfig(
        preset="tiny",
        n_layer=2,
        d_model=64,
        n_head=4,
        seq_len=64,
        global_batch=8,
        micro_batch=2,
        max_steps=40,
        lr=3e-3,
        warmup_steps=5,
        eval_every=20,
        eval_batches=2,
        ckpt_every=10,
        log_every=5,
        sample_tokens=80,
    )


def small() -> TrainConfig:
    """The default: a 4-block, 256-wide GPT (3.2M parameters); minutes on 2 CPU cores."""
    return TrainConfig(preset="small")


def gpt2_124m() -> TrainConfig:
    """GPT-2 small (124M parameters with its 50304-entry vocabulary), for GPUs."""
    return TrainConfig(
        preset="gpt2-124m",
        vocab_size=50304,
        n_layer=12,
        d_model=768,
        n_head=12,
        seq_len=1024,
        global_batch=64,
        micro_batch=8,
        max_steps=5000,
        lr=6e-4,
        warmup_steps=200,
        mixed_precision="bf16",
        eval_every=250,
        eval_batches=8,
        ckpt_every=500,
        sample_tokens=400,
    )


def _llama(preset: str, hf: dict[str, Any], micro_batch: int) -> TrainConfig:
    base: dict[str, Any] = {
        "model_type": "llama",
        "vocab_size": 128256,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "rope_theta": 500000.0,
        "rms_norm_eps": 1e-5,
        "max_position_embeddings": 8192,
        "hidden_act": "silu",
    }
    return TrainConfig(
        preset=preset,
        hf_config=json.dumps(base | hf),
        seq_len=2048,
        global_batch=64,
        micro_batch=micro_batch,
        max_steps=10000,
        lr=3e-4,
        warmup_steps=500,
        mixed_precision="bf16",
        activation_checkpointing=True,
        eval_every=500,
        eval_batches=8,
        ckpt_every=500,
        sample_tokens=400,
    )


def llama_1b() -> TrainConfig:
    """Llama 3.2 1B's shape (16 layers x 2048, GQA 32/8 heads, tied embeddings), for GPUs."""
    hf = {"hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16}
    return _llama("llama-1b", hf | {"tie_word_embeddings": True}, micro_batch=4)


def llama_8b() -> TrainConfig:
    """Llama 3.1 8B's shape (32 layers x 4096, GQA 32/8 heads), for GPUs."""
    hf = {"hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32}
    return _llama("llama-8b", hf | {"tie_word_embeddings": False}, micro_batch=1)


PRESETS: dict[str, Callable[[], TrainConfig]] = {
    "tiny": tiny,
    "small": small,
    "gpt2-124m": gpt2_124m,
    "llama-1b": llama_1b,
    "llama-8b": llama_8b,
}


def get_preset(name: str) -> TrainConfig:
    """The preset called ``name``, or a :class:`ConfigError` listing the known ones."""
    if name not in PRESETS:
        import difflib

        close = difflib.get_close_matches(name, PRESETS, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ConfigError(
            f"--preset: unknown preset {name!r}{hint}; choose one of {', '.join(PRESETS)}"
        )
    return PRESETS[name]()
