"""Model construction for the trainer: our GPT or a Hugging Face causal LM, behind one face.

Everything the loop needs from a model is here: build it (on the CPU, or with parameters on
the meta device for models too big to build whole on every rank), find its sharding units,
run it to logits, and sample from it. Models never import fullshard.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from fullshard.train import hf
from fullshard.train.config import TrainConfig
from fullshard.train.model import GPT, GPTConfig

__all__ = [
    "Units",
    "build_model",
    "count_parameters",
    "describe",
    "generate",
    "load_exported",
    "logits_of",
    "units_of",
]

META_INIT_THRESHOLD = 1_000_000_000  # parameters; above it --init auto builds on meta


@contextlib.contextmanager
def _params_on_meta() -> Iterator[None]:
    """Create parameters on the meta device but buffers for real (rotary tables and the like).

    Buffers computed in ``__init__`` (HF's ``inv_freq``) cannot be recovered after
    ``to_empty``; keeping them real lets :func:`materialize` restore them.
    """
    original = nn.Module.register_parameter

    def register(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        original(module, name, param)
        if param is not None and not param.is_meta:  # a tied (already meta) one stays tied
            kind = type(param)
            meta = param.to("meta")
            module._parameters[name] = kind(meta, requires_grad=param.requires_grad)

    setattr(nn.Module, "register_parameter", register)  # noqa: B010 (patching a method)
    try:
        yield
    finally:
        setattr(nn.Module, "register_parameter", original)  # noqa: B010


def gpt_config(cfg: TrainConfig) -> GPTConfig:
    """The GPT shape of a train config."""
    return GPTConfig(
        vocab_size=cfg.vocab_size,
        seq_len=cfg.seq_len,
        n_layer=cfg.n_layer,
        d_model=cfg.d_model,
        n_head=cfg.n_head,
        mlp_ratio=cfg.mlp_ratio,
        tie_embeddings=cfg.tie_embeddings,
    )


def build_model(cfg: TrainConfig, *, meta: bool = False) -> nn.Module:
    """The model of ``cfg``, initialised from the current RNG (or with meta parameters)."""
    ctx = _params_on_meta() if meta else contextlib.nullcontext()
    with ctx:
        if cfg.uses_hf:
            model = hf.build(hf.parse_config(cfg.hf_config_source))
        else:
            model = GPT(gpt_config(cfg))
    if cfg.hf_weights_source and not meta:
        hf.load_weights(model, cfg.hf_weights_source)
    return model


def count_parameters(cfg: TrainConfig) -> int:
    """Unique parameters of ``cfg``'s model (built on meta: free)."""
    with torch.device("meta"):
        model = (
            hf.build(hf.parse_config(cfg.hf_config_source)) if cfg.uses_hf else GPT(gpt_config(cfg))
        )
    return sum(p.numel() for p in model.parameters())


def vocab_size_of(cfg: TrainConfig) -> int:
    """Vocabulary size of ``cfg``'s model."""
    if cfg.uses_hf:
        return hf.vocab_and_context(hf.parse_config(cfg.hf_config_source))[0]
    return cfg.vocab_size


def materialize(model: nn.Module, device: torch.device) -> None:
    """Allocate a meta-built (sharded) model on ``device`` and initialise its parameters."""
    buffers = {name: b.detach().clone() for name, b in model.named_buffers()}
    model.to_empty(device=device)
    with torch.no_grad(), warnings.catch_warnings():
        # Initialising DTensor shards on a CPU mesh works; torch warns that it may not.
        warnings.filterwarnings("ignore", message="DTensor random operators")
        for name, b in model.named_buffers():
            b.copy_(buffers[name])
        if isinstance(model, GPT):
            model.reset_parameters()
        else:
            hf.init_weights(model)


@dataclass
class Units:
    """How a model splits into fully_shard units (bottom-up; the root wraps the rest)."""

    layers: list[nn.Module]  # the repeated blocks, one unit each
    embeddings: nn.Module | None  # its own unit when not tied to the output head


def units_of(model: nn.Module) -> Units:
    """The sharding units of a GPT or HF causal LM, the torchtitan way."""
    if isinstance(model, GPT):
        return Units(
            layers=list(model.blocks), embeddings=None if model.cfg.tie_embeddings else model.embed
        )
    get_in = getattr(model, "get_input_embeddings", None)
    get_out = getattr(model, "get_output_embeddings", None)
    emb = get_in() if get_in else None
    out = get_out() if get_out else None
    tied = emb is not None and out is not None and out.weight is emb.weight
    return Units(layers=hf.decoder_layers(model), embeddings=None if tied else emb)


def logits_of(model: nn.Module, idx: torch.Tensor) -> torch.Tensor:
    """``[B, T, vocab]`` logits of either model kind."""
    if isinstance(model, GPT):
        return model(idx)
    return model(input_ids=idx, use_cache=False).logits


@torch.no_grad()
def generate(
    model: nn.Module,
    prompt: list[int],
    *,
    n_tokens: int,
    context: int,
    temperature: float,
    vocab_limit: int,
    seed: int,
    device: torch.device,
) -> list[int]:
    """Sample ``n_tokens`` after ``prompt`` (top-k 40); every rank must call it (collectives).

    Sampling uses a seeded generator, so every rank draws the same tokens and the ranks'
    forwards stay in lockstep.
    """
    gen = torch.Generator().manual_seed(seed)
    tokens = list(prompt) or [ord("\n")]
    for _ in range(n_tokens):
        idx = torch.tensor([tokens[-context:]], device=device)
        logits = logits_of(model, idx)[0, -1, :vocab_limit].float().cpu() / temperature
        top = torch.topk(logits, min(40, vocab_limit))
        probs = torch.softmax(top.values, dim=-1)
        tokens.append(int(top.indices[torch.multinomial(probs, 1, generator=gen)]))
    return tokens[len(prompt) :]


def describe(model: nn.Module) -> dict[str, Any]:
    """What the model is, JSON-able, for a checkpoint's ``extra["model"]`` (export reads it).

    ``{"kind": "gpt", "config": GPTConfig fields}`` or ``{"kind": "hf", "config": the
    Hugging Face config as config.json holds it}``.
    """
    if isinstance(model, GPT):
        return {"kind": "gpt", "config": dataclasses.asdict(model.cfg)}
    config = model.config.to_dict()  # type: ignore[union-attr,operator]
    config["architectures"] = [type(model).__name__]
    return {"kind": "hf", "config": config}


def load_exported(path: str | os.PathLike[str]) -> nn.Module:
    """Load a model directory written by ``fullshard ckpt export CKPT --hf DIR`` (eval mode).

    A Hugging Face model loads through ``transformers.AutoModelForCausalLM.from_pretrained``;
    fullshard's GPT (``config.json`` with ``"model_type": "fullshard_gpt"``) is rebuilt from its
    config and the safetensors shards. ::

        from fullshard.train.models import load_exported
        model = load_exported("exported/")
        logits = model(torch.tensor([[1, 2, 3]]))   # GPT; an HF model returns .logits
    """
    from safetensors.torch import load_file

    from fullshard.checkpoint.export import GPT_MODEL_TYPE

    root = Path(path)
    config_path = root / "config.json"
    if not config_path.is_file():
        raise FileNotFoundError(
            f"{root}: no config.json; write the directory with fullshard ckpt export CKPT --hf DIR"
        )
    config = json.loads(config_path.read_text())
    if config.get("model_type") != GPT_MODEL_TYPE:
        return hf.from_pretrained(root)
    names = {f.name for f in dataclasses.fields(GPTConfig)}
    model = GPT(GPTConfig(**{k: v for k, v in config.items() if k in names}))
    index = json.loads((root / "model.safetensors.index.json").read_text())
    state: dict[str, torch.Tensor] = {}
    for shard in sorted(set(index["weight_map"].values())):
        state.update(load_file(str(root / shard)))
    model.load_state_dict(state)
    return model.eval()
