"""The trainer's typed configuration: one kw-only dataclass, every field a CLI flag.

Each field's docstring (the string literal under it) is its ``--help`` text, read from this
file's source, so code and help cannot drift apart. Precedence, lowest first: the dataclass
defaults, the preset (a plain function in :mod:`fullshard.train.presets`), ``--config
FILE.toml``, then command-line flags. ``__post_init__`` checks what a config can check on its
own and raises :class:`ConfigError` naming the flag and the fix; checks that need the world
size or the filesystem live in :mod:`fullshard.train.checks`.
"""

from __future__ import annotations

import ast
import dataclasses
import hashlib
import inspect
import itertools
import json
import math
import sys
import typing
from dataclasses import dataclass, fields
from typing import Any, Literal

__all__ = [
    "GPT_MODEL_FIELDS",
    "ConfigError",
    "TrainConfig",
    "check_batch",
    "field_help",
    "flag",
    "from_toml",
    "to_toml",
]

# The fields that shape the built-in GPT's tensors (see TrainConfig.model_identity).
GPT_MODEL_FIELDS = (
    "vocab_size",
    "seq_len",
    "n_layer",
    "d_model",
    "n_head",
    "mlp_ratio",
    "tie_embeddings",
)


class ConfigError(ValueError):
    """A configuration value is invalid; the message names the flag and says how to fix it."""


def flag(name: str) -> str:
    """The command-line flag of config field ``name`` (``max_steps`` -> ``--max-steps``)."""
    return "--" + name.replace("_", "-")


@dataclass(kw_only=True, slots=True)
class TrainConfig:
    """Everything ``fullshard train`` needs to know; see ``fullshard train --help``."""

    # ---- run
    preset: str = "small"
    """Preset to start from: tiny, small, gpt2-124m, llama-1b, llama-8b (flags override it)."""
    name: str = ""
    """Run name; the default run directory is runs/<name>. Empty: the preset's name, plus a
    short hash of the model settings when they are not the preset's (e.g. tiny-1a2b3c4d)."""
    run_dir: str = ""
    """Run directory (config.toml, metrics.jsonl, loss.png, checkpoints/). Default: runs/<name>."""
    seed: int = 0
    """Seed for initialisation, data order and sampling (the same seed gives the same run)."""
    max_steps: int = 300
    """Optimizer steps to train for (the learning-rate schedule ends here)."""
    time_budget: float = 0.0
    """Stop (saving a checkpoint) after this many seconds of training; 0 means no limit."""
    nproc: int = 0
    """Local ranks to launch: 0 means --dp-replicate x --dp-shard x --tp when --dp-shard is
    given, else every GPU, or 2 CPU ranks without one."""
    max_restarts: int = 1
    """Times the elastic agent restarts the whole group after a rank fails (resuming)."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Device to train on: auto picks cuda (NCCL) when available, else cpu (gloo)."""
    stop_timeout: int = 300
    """Seconds a rank gets to finish its step and save after Ctrl-C/SIGTERM before SIGKILL."""
    collective_timeout: int = 600
    """Seconds a collective waits for the other ranks before failing (a hung or stopped rank):
    the job then fails, or the agent restarts it, instead of hanging."""

    # ---- model
    vocab_size: int = 256
    """GPT vocabulary size (256 covers byte-level text; .bin data may need more)."""
    seq_len: int = 128
    """Tokens per training sequence (the model's context length)."""
    n_layer: int = 4
    """GPT transformer blocks (each one a fully_shard unit)."""
    d_model: int = 256
    """GPT hidden width."""
    n_head: int = 4
    """GPT attention heads (must divide --d-model)."""
    mlp_ratio: float = 4.0
    """GPT MLP hidden width as a multiple of --d-model."""
    tie_embeddings: bool = True
    """Share the GPT input embedding with the output head."""
    hf_config: str = ""
    """Train a Hugging Face causal LM instead of the GPT: a config.json path, a directory
    holding one, or inline JSON with a model_type (e.g. '{"model_type": "llama", ...}')."""
    hf_weights: str = ""
    """Local pretrained weights for --hf-config: a .safetensors file or a directory of them."""
    hf_model: str = ""
    """Fine-tune a local Hugging Face model directory (config.json, *.safetensors and, if
    there, its tokenizer), as written by save_pretrained; nothing is downloaded. Sets the
    model, its weights and --tokenizer at once."""
    init: Literal["auto", "cpu", "meta"] = "auto"
    """Where parameters are initialised: cpu (each rank builds the full model, then shards it:
    identical at every world size), meta (shard first, initialise shards: for models too big
    for one host), auto (meta above 1B parameters)."""

    # ---- data
    data: str = ""
    """Training data: a text file, a folder of text files, or a pre-tokenized .bin of uint16/
    uint32 tokens, .jsonl or .parquet records (with a tokenizer). Empty: the Python standard
    library's own source (no download)."""
    tokenizer: str = ""
    """A local Hugging Face tokenizer directory: --data text (.txt, .jsonl with a text field or
    chat messages, .parquet) is tokenized with it once, cached in the run directory. Default:
    --hf-model's own tokenizer, else bytes as tokens."""
    data_dtype: Literal["auto", "uint16", "uint32"] = "auto"
    """Token dtype of a .bin file; auto is uint16 when the vocabulary fits, else uint32."""
    eval_fraction: float = 0.02
    """Fraction of the data (its tail) held out for the eval loss."""
    global_batch: int = 16
    """Sequences per optimizer step over all ranks; fixed, so results do not depend on ranks."""
    micro_batch: int = 4
    """Sequences per rank per forward/backward; the remainder is gradient accumulation."""

    # ---- optimizer
    lr: float = 1e-3
    """Peak learning rate (AdamW)."""
    min_lr_ratio: float = 0.1
    """Final learning rate of the cosine decay, as a fraction of --lr."""
    warmup_steps: int = 20
    """Steps of linear warm-up from 0 to --lr."""
    weight_decay: float = 0.1
    """AdamW weight decay, applied to weight matrices only (not to biases or norm scales)."""
    beta1: float = 0.9
    """AdamW beta1."""
    beta2: float = 0.95
    """AdamW beta2."""
    optimizer: Literal["adamw", "muon"] = "adamw"
    """adamw, or muon: Muon (torch.optim.Muon's update) on the 2-D weights of the blocks,
    stepped on whole matrices (fullshard.optim.WholeTensor; same --lr and --weight-decay,
    RMS-matched to AdamW), AdamW on embeddings, head and 1-D parameters. The default run name
    gets a -muon suffix, so the two never share a run directory."""
    muon_ns_dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    """Dtype of Muon's Newton-Schulz orthogonalisation: bfloat16 (torch.optim.Muon's choice,
    fast on GPUs) or float32 (~30x faster on CPUs without native bf16 matmuls); auto picks
    float32 on CPU, bfloat16 on GPU."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this value; 0 disables clipping."""
    max_skipped_steps: int = 10
    """Consecutive steps with non-finite gradients to skip (no optimizer step on any rank,
    counted in metrics.jsonl) before stopping with an error; 0 stops at the first one."""

    # ---- parallelism and memory
    mixed_precision: Literal["fp32", "bf16", "fp16"] = "fp32"
    """Compute dtype of the gathered parameters; sharded master weights and gradient
    reduction stay fp32 (fp16 adds dynamic loss scaling)."""
    dp_replicate: int = 1
    """Data-parallel replicas (HSDP): the model is sharded within each group of --dp-shard x
    --tp ranks and replicated across groups, gradients all-reduced between them; on several
    machines, one group per node and --dp-replicate the number of nodes."""
    dp_shard: int = 0
    """Ranks that shard each replica (ZeRO-3); 0: the rest, world size / (--dp-replicate x
    --tp), so by default every rank shards."""
    tp: int = 1
    """Tensor-parallel degree: attention heads and MLP width split over this many neighbouring
    ranks (DTensor TP, within a node), then fully_shard over the data-parallel ranks. For the
    GPT and Llama-family Hugging Face models; must divide the heads and KV heads."""
    reshard_after_forward: str = "auto"
    """Free gathered parameters after each unit's forward (true: least memory), keep them for
    backward (false: less traffic), FSDP2's default (auto: all but the root), or an integer K
    dividing --dp-shard: keep a copy sharded over groups of K ranks, so backward gathers
    within K ranks (e.g. one node's)."""
    cpu_offload: bool = False
    """Keep sharded parameters, gradients and optimizer states in host memory."""
    activation_checkpointing: bool = False
    """Recompute each block's activations in backward instead of storing them."""
    compile: bool = False
    """torch.compile each block (needs a working compiler toolchain)."""

    # ---- fault tolerance (torchft)
    ft_lighthouse: str = ""
    """HOST:PORT of a torchft lighthouse: this launch becomes one replica group of a
    fault-tolerant job (pip install 'fullshard[ft]'); the groups average gradients through
    torchft, a failed group drops out while the others train on, a restarted one heals live.
    Empty: off (checkpoint-and-restart only)."""
    ft_serve_lighthouse: bool = False
    """Serve the lighthouse at --ft-lighthouse's port from this launch (its launcher process,
    for as long as it runs; the other groups join HOST:PORT). Convenient for small jobs: if this
    launch's machine dies the job stops, so large jobs run torchft_lighthouse on a host of its
    own. Off: join a lighthouse that runs already."""
    ft_replica_id: int = 0
    """This replica group's number, from 0 to --ft-replicas - 1 (with --ft-lighthouse); it picks
    the group's rows of each global batch."""
    ft_replicas: int = 2
    """Replica groups the job has (with --ft-lighthouse): each global batch splits into
    --ft-replicas x data-parallel parts; a missing group's rows of a step are skipped."""

    # ---- eval, checkpoints, output
    eval_every: int = 50
    """Evaluate the held-out loss every this many steps (and at the end); 0 disables it."""
    eval_batches: int = 4
    """Global batches of held-out data per evaluation."""
    ckpt_every: int = 100
    """Save a checkpoint every this many steps (and always at the end or on Ctrl-C); 0: only those."""
    keep_last: int = 3
    """Checkpoints kept in run_dir/checkpoints (older ones are deleted); 0 keeps all."""
    resume: str = "auto"
    """auto: continue from the newest complete checkpoint of this run (if any); never: start
    fresh (refused when the run directory already has checkpoints); or a checkpoint PATH."""
    tensorboard: bool = False
    """Also write TensorBoard event files into the run directory (needs the tensorboard
    package: pip install 'fullshard[tensorboard]'); view with tensorboard --logdir runs."""
    log_every: int = 10
    """Print a log line every this many steps when output is not a terminal."""
    progress: Literal["auto", "bar", "plain"] = "auto"
    """Rank 0 output: a live progress bar (bar), log lines (plain), or bar only on a terminal."""
    sample_tokens: int = 300
    """Bytes to generate from the trained model at the end; 0 skips the sample."""
    sample_prompt: str = "def "
    """Prompt for the final sample."""
    temperature: float = 0.8
    """Sampling temperature of the final sample."""

    def __post_init__(self) -> None:
        positive = "max_steps seq_len n_layer d_model n_head vocab_size global_batch"
        positive += " micro_batch eval_batches stop_timeout collective_timeout dp_replicate tp"
        for name in positive.split():
            _require(self, name, getattr(self, name) >= 1, "a positive integer")
        nonneg = "max_restarts nproc warmup_steps eval_every ckpt_every keep_last log_every"
        nonneg += " sample_tokens max_skipped_steps dp_shard"
        for name in nonneg.split():
            _require(self, name, getattr(self, name) >= 0, "zero or a positive integer")
        for name in ("lr", "mlp_ratio", "temperature"):
            value = getattr(self, name)
            _require(self, name, math.isfinite(value) and value > 0, "a positive number")
        for name in ("time_budget", "grad_clip", "weight_decay"):
            value = getattr(self, name)
            _require(self, name, math.isfinite(value) and value >= 0, "zero or a positive number")
        for name in ("min_lr_ratio", "beta1", "beta2"):
            _require(self, name, 0.0 <= getattr(self, name) <= 1.0, "between 0 and 1")
        _require(self, "eval_fraction", 0.0 <= self.eval_fraction < 1.0, "in [0, 1)")
        if not self.uses_hf and self.d_model % self.n_head != 0:
            raise ConfigError(
                f"--d-model ({self.d_model}) must be divisible by --n-head ({self.n_head}); "
                f"pick e.g. --n-head {math.gcd(self.d_model, self.n_head)}"
            )
        if self.hf_weights and not self.hf_config:
            raise ConfigError("--hf-weights needs --hf-config (the model the weights belong to)")
        if self.hf_model and self.hf_config:
            raise ConfigError(
                "--hf-model already names the model (its config.json); drop --hf-config"
            )
        if self.reshard_after_forward not in ("auto", "true", "false"):
            k = self.reshard_group
            if k is None or k < 1:
                raise ConfigError(
                    "--reshard-after-forward must be auto, true, false or a positive integer K "
                    f"(a copy sharded over K ranks), got {self.reshard_after_forward!r}"
                )
        if self.resume == "":
            raise ConfigError("--resume must be auto, never or a checkpoint path, got ''")
        self._check_ft()
        for name, value in _choices_of_literals().items():
            if getattr(self, name) not in value:
                raise ConfigError(
                    f"{flag(name)} must be one of {', '.join(value)}, got {getattr(self, name)!r}"
                )

    def _check_ft(self) -> None:
        _require(self, "ft_replicas", self.ft_replicas >= 1, "a positive integer")
        _require(self, "ft_replica_id", self.ft_replica_id >= 0, "zero or a positive integer")
        if not self.ft_lighthouse:
            if self.ft_serve_lighthouse:
                raise ConfigError(
                    "--ft-serve-lighthouse needs --ft-lighthouse HOST:PORT (the address the "
                    "other replica groups join; this launch serves its port)"
                )
            return
        if self.ft_replica_id >= self.ft_replicas:
            raise ConfigError(
                f"--ft-replica-id {self.ft_replica_id} is not below --ft-replicas "
                f"{self.ft_replicas}; number the replica groups from 0 to {self.ft_replicas - 1}"
            )
        if self.dp_replicate != 1 or self.tp != 1:
            raise ConfigError(
                "--ft-lighthouse: each replica group is one --dp-shard group; drop "
                "--dp-replicate/--tp (torchft's replica groups are the replication)"
            )

    @property
    def reshard_group(self) -> int | None:
        """``--reshard-after-forward K`` as the int ``K``; ``None`` for auto/true/false."""
        text = self.reshard_after_forward.strip()
        try:
            return int(text)
        except ValueError:
            return None

    @property
    def uses_hf(self) -> bool:
        """Whether the model is a Hugging Face causal LM (``--hf-config`` or ``--hf-model``)."""
        return bool(self.hf_config or self.hf_model)

    @property
    def hf_config_source(self) -> str:
        """Where the Hugging Face config comes from: ``--hf-config``, else ``--hf-model``."""
        return self.hf_config or self.hf_model

    @property
    def hf_weights_source(self) -> str:
        """Local pretrained weights: ``--hf-weights``, else ``--hf-model``'s (or none)."""
        return self.hf_weights or self.hf_model

    @property
    def tokenizer_source(self) -> str:
        """The tokenizer directory: ``--tokenizer``, else ``--hf-model`` when it has one."""
        if self.tokenizer or not self.hf_model:
            return self.tokenizer
        from pathlib import Path

        names = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
        return self.hf_model if any((Path(self.hf_model) / n).exists() for n in names) else ""

    def model_identity(self) -> dict[str, Any]:
        """The settings that decide the model's tensors (names and shapes): the canonical
        ``--hf-config`` for a Hugging Face model, else the GPT's shape flags."""
        if not self.uses_hf:
            return {name: getattr(self, name) for name in GPT_MODEL_FIELDS}
        if self.hf_model and not self.hf_config:
            from pathlib import Path

            return {"hf_model": str(Path(self.hf_model).resolve())}
        text = self.hf_config.strip()
        if text.startswith("{"):
            try:
                text = json.dumps(json.loads(text), sort_keys=True, separators=(",", ":"))
            except json.JSONDecodeError:
                pass  # refused later, with a message, by the checks
        return {"hf_config": text}

    def resolved_name(self) -> str:
        """The run name: ``--name``; else the preset's name when the model is the preset's,
        or the preset's name and a short hash of :meth:`model_identity` when it is not
        (``tiny-1a2b3c4d``), so runs of different models never share a run directory; then
        ``-muon`` for ``--optimizer muon`` (``small-muon``), whose checkpoints AdamW's cannot
        resume (nor the reverse)."""
        if self.name:
            return self.name
        from fullshard.train.presets import PRESETS  # presets import this module

        model = self.model_identity()
        make = PRESETS.get(self.preset)
        if make is not None and make().model_identity() == model:
            name = self.preset
        else:
            digest = hashlib.sha1(json.dumps(model, sort_keys=True).encode()).hexdigest()[:8]
            name = f"{self.preset}-{digest}"
        # Another optimizer's checkpoints cannot be resumed: its own directory (AdamW, the
        # default, keeps the plain name, so runs started without --optimizer resume).
        return name if self.optimizer == "adamw" else f"{name}-{self.optimizer}"

    def resolved_run_dir(self) -> str:
        """The run directory: ``--run-dir``, else ``runs/<name>``."""
        return self.run_dir or f"runs/{self.resolved_name()}"

    def to_dict(self) -> dict[str, Any]:
        """Field name -> value, in declaration order."""
        return {f.name: getattr(self, f.name) for f in fields(self)}


def check_batch(cfg: TrainConfig, world: int, *, tp: int = 1) -> None:
    """The global batch splits into ``world`` data-parallel ranks x ``--micro-batch`` (needs
    no torch, so ``fullshard train`` checks it before importing anything heavy when --nproc
    is given). ``tp``: ranks of one TP group, which read the same rows."""
    if cfg.ft_lighthouse:  # each replica group reads its share (see fullshard.train.ft)
        world *= cfg.ft_replicas
    unit = world * cfg.micro_batch
    if cfg.global_batch % unit:
        up = (cfg.global_batch // unit + 1) * unit
        ranks = "ranks" if tp == 1 else f"data-parallel ranks ({world * tp} ranks / --tp {tp})"
        if cfg.ft_lighthouse:
            ranks = f"--ft-replicas x {ranks} of a replica group"
        raise ConfigError(
            f"--global-batch {cfg.global_batch} is not divisible by {ranks} x --micro-batch = "
            f"{world} x {cfg.micro_batch} = {unit}; use --global-batch {up}, or a --micro-batch "
            f"or --nproc that divides {cfg.global_batch}"
        )


def _require(cfg: TrainConfig, name: str, ok: bool, what: str) -> None:
    if not ok:
        raise ConfigError(f"{flag(name)} must be {what}, got {getattr(cfg, name)!r}")


def _choices_of_literals() -> dict[str, tuple[str, ...]]:
    hints = typing.get_type_hints(TrainConfig)
    return {
        name: typing.get_args(hint)
        for name, hint in hints.items()
        if typing.get_origin(hint) is Literal
    }


def field_types() -> dict[str, Any]:
    """Field name -> resolved annotation (``int``, ``Literal[...]``, ...)."""
    return typing.get_type_hints(TrainConfig)


def field_help() -> dict[str, str]:
    """Field name -> its docstring (the string literal right under it in the class body)."""
    tree = ast.parse(inspect.getsource(TrainConfig))
    cls = tree.body[0]
    assert isinstance(cls, ast.ClassDef)
    out: dict[str, str] = {}
    body = cls.body
    for node, nxt in itertools.pairwise(body):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(nxt, ast.Expr)
            and isinstance(nxt.value, ast.Constant)
            and isinstance(nxt.value.value, str)
        ):
            out[node.target.id] = " ".join(nxt.value.value.split())
    return out


def replace(cfg: TrainConfig, **changes: Any) -> TrainConfig:
    """``dataclasses.replace`` that names unknown keys as flags (re-validates the result)."""
    names = {f.name for f in fields(TrainConfig)}
    unknown = sorted(set(changes) - names)
    if unknown:
        raise ConfigError(f"unknown config key(s): {', '.join(unknown)}")
    return dataclasses.replace(cfg, **changes)


# ---- TOML (read with tomllib; written by hand: a flat table of scalars is all we need)


def to_toml(cfg: TrainConfig) -> str:
    """The config as a flat TOML table, one commented ``key = value`` per field."""
    helps = field_help()
    lines = ["# fullshard train: the resolved configuration of this run", ""]
    for name, value in cfg.to_dict().items():
        lines.append(f"# {helps.get(name, '')}")
        lines.append(f"{name} = {_toml_value(value)}")
    return "\n".join(lines) + "\n"


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)  # JSON string escapes are valid TOML basic-string escapes
    raise TypeError(f"cannot write {type(value).__name__} to TOML")


def from_toml(path: str) -> dict[str, Any]:
    """Read ``--config FILE.toml``: a flat table of config keys (dashes or underscores)."""
    if sys.version_info >= (3, 11):
        import tomllib
    else:  # Python 3.10: the same parser, from PyPI
        import tomli as tomllib

    try:
        with open(path, "rb") as f:
            raw = tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError(f"--config: no such file {path!r}") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"--config {path}: not valid TOML: {e}") from None
    out: dict[str, Any] = {}
    types = field_types()
    for key, value in raw.items():
        name = key.replace("-", "_")
        if name not in types:
            raise ConfigError(f"--config {path}: unknown key {key!r}; see fullshard train --help")
        if isinstance(value, dict):
            raise ConfigError(f"--config {path}: {key!r} must be a value, not a table")
        if types[name] is float and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if name == "reshard_after_forward" and isinstance(value, (bool, int)):
            value = str(value).lower()  # reshard_after_forward = 2 / true: as the flag takes it
        problem = _toml_type_problem(types[name], value)
        if problem:
            raise ConfigError(f"--config {path}: {key} must be {problem}, got {value!r}")
        out[name] = value
    return out


_TOML_KINDS = {bool: "true or false", int: "an integer", float: "a number", str: "a quoted string"}


def _toml_type_problem(hint: Any, value: Any) -> str:
    """What ``value`` should have been for a field annotated ``hint``; '' when it fits."""
    if typing.get_origin(hint) is Literal:
        choices = typing.get_args(hint)
        return "" if value in choices else f"one of {', '.join(map(json.dumps, choices))}"
    kind = type(value)
    if kind is hint or (hint is float and kind is int):
        return ""
    return _TOML_KINDS.get(hint, str(hint))
