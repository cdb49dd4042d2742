"""Checks that need the world size, the data or the filesystem, run before any process spawns.

Each failure is a :class:`ConfigError` whose message names the flag and the fix, so a bad
command costs a second, not a launch. (Checks a config can do alone are in its
``__post_init__``.)

[Note: checks write nothing] A refused command leaves the run directory as it found it: the
checks create no directory (they probe the nearest existing one), tokenize ``--data`` without
caching it, and never touch ``config.toml``. What they would have written is done by
:func:`commit` once every check has passed.
"""

from __future__ import annotations

import dataclasses
import errno
import importlib.util
import os
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from fullshard.train import data as data_mod
from fullshard.train import hf
from fullshard.train.config import ConfigError, TrainConfig, check_batch, replace
from fullshard.train.degrees import Degrees, check_reshard, check_tp_shapes, resolve
from fullshard.train.models import count_parameters, vocab_size_of
from fullshard.train.tokenized import PendingCache, cached_stream

if TYPE_CHECKING:
    from fullshard.checkpoint import CheckpointMismatchError
    from fullshard.train.guard import OptimizerMismatch

__all__ = ["Checked", "commit", "default_nproc", "uses_cuda", "validate"]


@dataclass(frozen=True)
class Checked:
    """What validation learned on the way (printed before launch)."""

    world_size: int
    n_tokens: int
    n_params: int
    degrees: Degrees
    data_cache: PendingCache | None = field(default=None, repr=False, compare=False)
    """``--data`` as the checks tokenized it, for :func:`commit` to cache."""


def default_nproc(cfg: TrainConfig) -> int:
    """``--nproc 0``: the product of the degrees when ``--dp-shard`` is given (``--dp-replicate
    2 --dp-shard 2``: 4 ranks), else every GPU when training on CUDA, else 2 CPU ranks."""
    if cfg.dp_shard:
        return cfg.dp_replicate * cfg.dp_shard * cfg.tp
    if uses_cuda(cfg):
        return torch.cuda.device_count()
    return 2


def uses_cuda(cfg: TrainConfig) -> bool:
    return cfg.device == "cuda" or (cfg.device == "auto" and torch.cuda.is_available())


def _host_memory_bytes() -> int:
    """Memory available to new processes now (MemAvailable), else physical memory, else 0."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 0


def _check_host_memory(cfg: TrainConfig, world: int, n_params: int, vocab: int) -> None:
    """Refuse a CPU run that clearly cannot fit in this host's memory (a rough lower bound).

    Per rank: fp32 parameters, gradients and two AdamW moments, sharded (16 bytes/parameter/
    rank); one full fp32 copy while building when not built on meta; the logits, their fp32
    copy and gradient (12 bytes x tokens x vocab); and layer activations (~70 bytes x tokens
    x width per layer in fp32, ~4 with activation checkpointing). ``fullshard plan`` predicts
    a step's peak properly.
    """
    hidden, layers = cfg.d_model, cfg.n_layer
    if cfg.uses_hf:
        hf_cfg = hf.make_config(hf.parse_config(cfg.hf_config_source))
        hidden = int(getattr(hf_cfg, "hidden_size", 0) or getattr(hf_cfg, "n_embd", 0) or hidden)
        layers = int(
            getattr(hf_cfg, "num_hidden_layers", 0) or getattr(hf_cfg, "n_layer", 0) or layers
        )
    tokens = cfg.micro_batch * cfg.seq_len
    per_layer = (4 if cfg.activation_checkpointing else 70) * tokens * hidden
    build = 0 if n_params > 1e9 or cfg.init == "meta" else 4 * n_params
    per_rank = 16 * n_params / world + build + 12 * tokens * vocab + per_layer * layers
    host = _host_memory_bytes()
    if host and per_rank * world > 0.9 * host:
        raise ConfigError(
            f"--preset {cfg.preset}: {n_params / 1e9:.2f}B parameters at --micro-batch "
            f"{cfg.micro_batch} x --seq-len {cfg.seq_len} need at least "
            f"{per_rank * world / 2**30:.0f} GiB on this CPU-only host, which has "
            f"{host / 2**30:.0f} GiB available; train it on GPUs, lower --micro-batch or "
            "--seq-len, or pick --preset small"
        )


def _check_run_dir(cfg: TrainConfig) -> None:
    """The run directory and its checkpoints/ can be written, or created: probed in the
    nearest directory that exists (see [Note: checks write nothing])."""
    run_dir = Path(cfg.resolved_run_dir())
    for where in (run_dir, run_dir / "checkpoints"):
        existing = where
        while not existing.exists() and existing != existing.parent:
            existing = existing.parent
        try:
            if not existing.is_dir():
                raise NotADirectoryError(errno.ENOTDIR, "a file, not a directory")
            probe = existing / f".write-test-{uuid.uuid4().hex}"
            probe.write_text("ok")
            probe.unlink()
        except OSError as e:
            what = f"--run-dir {run_dir}" if where == run_dir else f"--run-dir {run_dir}: {where}"
            why = "is not writable" if existing == where else f"cannot be created in {existing}"
            raise ConfigError(
                f"{what} {why} ({e.strerror or e}); make it writable or pick another --run-dir"
            ) from None


def commit(cfg: TrainConfig, checked: Checked) -> Checked:
    """After every check passed: create the run directory and its checkpoints/, and cache the
    data the checks tokenized. Returns ``checked`` without the data (the launcher keeps no
    copy of it). ``config.toml`` is the caller's (the launcher's, or rank 0's)."""
    run_dir = Path(cfg.resolved_run_dir())
    try:
        (run_dir / "checkpoints").mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(
            f"--run-dir {run_dir}: cannot create it ({e.strerror or e}); pick another --run-dir"
        ) from None
    if checked.data_cache is not None:
        checked.data_cache.write()
    return dataclasses.replace(checked, data_cache=None)


def _check_resume(cfg: TrainConfig) -> None:
    """What the ranks will resume from exists, is intact (headers) and fits the model."""
    from fullshard.checkpoint import (
        CheckpointCorruptedError,
        CheckpointError,
        CheckpointMismatchError,
        list_checkpoints,
    )
    from fullshard.train.guard import OptimizerMismatch, check_resume_checkpoint

    run_dir = Path(cfg.resolved_run_dir())
    own = list_checkpoints(run_dir / "checkpoints")[::-1]  # newest first
    if cfg.resume == "never":
        if own:
            raise ConfigError(
                f"--resume never, but {run_dir}/checkpoints already holds checkpoints; use "
                "--resume auto to continue that run, a new --run-dir, or delete the old one"
            )
        return
    auto = cfg.resume == "auto"
    candidates = own if auto else [Path(cfg.resume)]
    for i, path in enumerate(candidates):
        try:
            check_resume_checkpoint(cfg, str(path))  # a checkpoint, or a run/root dir holding one
            return
        except CheckpointMismatchError as e:
            raise ConfigError(_mismatch_message(cfg, e, path, auto=auto)) from None
        except OptimizerMismatch as e:
            raise ConfigError(_optimizer_message(cfg, e, path, auto=auto)) from None
        except CheckpointCorruptedError as e:
            if auto and i + 1 < len(candidates):
                continue  # the ranks fall back to an older one, and say so
            what = "every checkpoint of this run is damaged; the oldest: " if auto else ""
            raise ConfigError(
                f"--resume {cfg.resume}: {what}{e}; start afresh in a new --run-dir (or with "
                "--resume never after removing the checkpoints)"
                if auto
                else f"--resume {cfg.resume}: {e}"
            ) from None
        except (CheckpointError, OSError) as e:
            raise ConfigError(
                f"--resume {cfg.resume}: not a complete checkpoint: {e}; pass auto, never, a "
                "checkpoint directory or a run directory"
            ) from None


def _mismatch_message(
    cfg: TrainConfig, e: CheckpointMismatchError, path: Path, *, auto: bool
) -> str:
    """One screen: which checkpoint, the first differing names, what the run used, the fix."""
    differences = e.differences(4)
    if not auto:
        return (
            f"--resume {cfg.resume}: the checkpoint does not fit the model this command builds: "
            f"{differences}. Pass the model flags it was trained with (--preset, --d-model, "
            "..., --hf-config)"
        )
    run_dir = Path(cfg.resolved_run_dir())
    was = _model_flags_of(run_dir / "config.toml", cfg)
    return (
        f"{run_dir} holds checkpoints of another model (newest: {path.name}; --resume auto "
        f"would load it): {differences}."
        + (f" That run used {was}." if was else "")
        + " Train this model in its own run directory (--name NAME or --run-dir DIR), or "
        "pass the model flags that run used"
    )


def _optimizer_message(cfg: TrainConfig, e: OptimizerMismatch, path: Path, *, auto: bool) -> str:
    """One screen: the checkpoint holds another optimizer's state."""
    was = f"an --optimizer {e.saved_by} run" if e.saved_by else "another optimizer"
    where = (
        f"{cfg.resolved_run_dir()} holds checkpoints of {was} (newest: {path.name}; --resume "
        "auto would load it)"
        if auto
        else f"--resume {cfg.resume}: the checkpoint was saved by {was}"
    )
    keep = f"--optimizer {e.saved_by}" if e.saved_by else "the optimizer it was saved with"
    return (
        f"{where}, but this command trains with --optimizer {cfg.optimizer}: its state does not "
        f"fit (saved param groups of {e.saved} parameters, {cfg.optimizer}'s {e.wanted}). "
        f"Resume that run with {keep}, or train this one in its own run directory (--name NAME "
        f"or --run-dir DIR; by default --optimizer {cfg.optimizer} runs in "
        f"runs/{replace(cfg, name='').resolved_name()})"
    )


def _model_flags_of(config_path: Path, cfg: TrainConfig) -> str:
    """How the model in a run's config.toml differs from ``cfg``'s, as flags ('' if unknown)."""
    from fullshard.train.config import flag, from_toml

    try:
        other = replace(cfg, **from_toml(str(config_path)))
    except (ConfigError, TypeError, ValueError):
        return ""
    if other.uses_hf != cfg.uses_hf:
        return f"--hf-config {other.hf_config[:80]}" if other.uses_hf else "the built-in GPT"
    ours, theirs = cfg.model_identity(), other.model_identity()
    changed = [k for k in theirs if ours.get(k) != theirs[k]]
    return ", ".join(f"{flag(k)} {str(getattr(other, k))[:80]}" for k in changed)


def _check_device(cfg: TrainConfig, world: int) -> None:
    if cfg.device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device cuda, but no CUDA GPU is visible; use --device cpu")
    if uses_cuda(cfg) and world > torch.cuda.device_count():
        raise ConfigError(
            f"--nproc {world} exceeds the {torch.cuda.device_count()} visible GPU(s); lower "
            "--nproc (one rank per GPU) or use --device cpu"
        )


def _check_model(cfg: TrainConfig, world: int, data_vocab: int) -> int:
    if cfg.uses_hf:
        try:
            vocab, context = hf.vocab_and_context(hf.parse_config(cfg.hf_config_source))
        except hf.HFError as e:
            raise ConfigError(str(e)) from None
        if context is not None and context < cfg.seq_len:
            raise ConfigError(
                f"--seq-len {cfg.seq_len} exceeds the --hf-config model's context of {context}; "
                f"lower --seq-len or raise max_position_embeddings"
            )
        if cfg.hf_weights and not Path(cfg.hf_weights).expanduser().exists():
            raise ConfigError(f"--hf-weights: {cfg.hf_weights!r} does not exist")
        if cfg.hf_model and not any(Path(cfg.hf_model).expanduser().glob("*.safetensors")):
            raise ConfigError(
                f"--hf-model {cfg.hf_model}: no *.safetensors weights there; save the model "
                "with save_pretrained(DIR) (safe_serialization), or use --hf-config for a "
                "randomly initialised one"
            )
    else:
        vocab = cfg.vocab_size
    if data_vocab > vocab:
        raise ConfigError(
            f"the data has token ids up to {data_vocab - 1} but the model's vocabulary is "
            f"{vocab}; raise --vocab-size (or the --hf-config vocab_size) or check --data-dtype"
        )
    n_params = count_parameters(cfg)
    if not uses_cuda(cfg):
        _check_host_memory(cfg, world, n_params, vocab)
    return n_params


def _check_data(cfg: TrainConfig) -> tuple[int, int, PendingCache | None]:
    """Token count, the largest token id + 1 (256 for text), and the tokenized stream for
    :func:`commit` to cache (``None`` unless ``--data`` is tokenized)."""
    pending = None
    try:
        if data_mod.tokenizes(cfg.data, cfg.tokenizer_source):
            cache_dir = Path(cfg.resolved_run_dir()) / "data_cache"
            tokens, mask, key = cached_stream(
                cfg.data, cfg.tokenizer_source, cache_dir, write=False
            )
            pending = PendingCache(cache_dir, key, tokens, mask)
        else:
            tokens = data_mod.load_tokens(
                cfg.data, data_dtype=cfg.data_dtype, vocab_size=vocab_size_of(cfg)
            )
        source = data_mod.describe_source(cfg.data)
        data_mod.check_size(
            len(tokens), seq_len=cfg.seq_len, eval_fraction=cfg.eval_fraction, source=source
        )
    except (data_mod.DataError, hf.HFError) as e:
        raise ConfigError(str(e)) from None
    except OSError as e:
        raise ConfigError(f"--data {cfg.data}: cannot read it ({e.strerror or e})") from None
    if tokens.dtype.itemsize == 1:
        return len(tokens), 256, pending
    top = 0
    for i in range(0, len(tokens), 1 << 26):  # chunked: a .bin can be larger than memory
        top = max(top, int(np.max(tokens[i : i + (1 << 26)])))
    return len(tokens), top + 1, pending


def validate(
    cfg: TrainConfig, *, world_size: int, fresh_launch: bool = True, node_size: int | None = None
) -> Checked:
    """Everything that can be known before spawning; raises :class:`ConfigError`. Writes
    nothing ([Note: checks write nothing]): :func:`commit` the result before launching.
    ``node_size``: ranks per machine when known (a launch on one machine: ``world_size``)."""
    if world_size < 1:
        raise ConfigError(f"--nproc must be at least 1 (0 means automatic), got {world_size}")
    _check_device(cfg, world_size)
    degrees = resolve(cfg, world_size, node_size=node_size)
    check_batch(cfg, degrees.dp, tp=degrees.tp)
    check_reshard(cfg, degrees)
    if degrees.tp > 1:
        _check_tp(cfg, degrees)
    if cfg.tensorboard:
        from fullshard.train.metrics import tensorboard_writer_class

        try:
            tensorboard_writer_class()
        except ImportError as e:
            raise ConfigError(str(e)) from None
    if cfg.ft_lighthouse and importlib.util.find_spec("torchft") is None:
        raise ConfigError("--ft-lighthouse needs torchft: pip install 'fullshard[ft]' (Linux)")
    if cfg.ft_serve_lighthouse:
        from fullshard.train.lighthouse import lighthouse_port

        lighthouse_port(cfg.ft_lighthouse)
    n_tokens, data_vocab, pending = _check_data(cfg)
    n_params = _check_model(cfg, world_size, data_vocab)
    if fresh_launch:
        _check_resume(cfg)
    _check_run_dir(cfg)
    return Checked(
        world_size=world_size,
        n_tokens=n_tokens,
        n_params=n_params,
        degrees=degrees,
        data_cache=pending,
    )


def _check_tp(cfg: TrainConfig, degrees: Degrees) -> None:
    """``--tp`` has a plan for the model and divides the heads, KV heads and MLP width."""
    if cfg.optimizer == "muon":  # WholeTensor refuses TP placements (one Shard dim only)
        raise ConfigError(
            f"--optimizer muon with --tp {degrees.tp}: Muon's whole-matrix step does not take "
            "tensor-parallel parameters yet; use --optimizer adamw, or --tp 1 (HSDP with "
            "--dp-replicate works with Muon)"
        )
    from fullshard.train.models import build_model, units_of
    from fullshard.train.tp import LLAMA_PLAN, supports_tp, tp_sizes

    try:
        model = build_model(cfg, meta=True)  # on meta: no weights read, nothing allocated
    except hf.HFError as e:
        raise ConfigError(str(e)) from None
    if not supports_tp(model, units_of(model).layers):
        raise ConfigError(
            f"--tp {degrees.tp}: no tensor-parallel plan for {type(model).__name__} (the GPT "
            f"and Llama-family models, with {', '.join(LLAMA_PLAN)} in every decoder layer, "
            "have one); use --tp 1"
        )
    check_tp_shapes(degrees, tp_sizes(model))
