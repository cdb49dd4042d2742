"""Reliability hooks of the trainer: fault injection for tests, and resource sampling for soaks.

Both are off unless an environment variable turns them on, so they cost one ``if`` per step.
They are test hooks, not flags: nobody should kill their own ranks on purpose.

[Note: fault injection] ``FULLSHARD_FAULT`` holds faults separated by ``;``, each
``KIND@key=value,...``; keys are ``step`` (required), ``rank`` (default 0), ``attempt`` (the
restart of the group it fires in, ``failures.attempt_number()``; default 0, ``*`` for every
attempt) and, for ``nan_grad``, ``steps`` (``3|6|7``) instead of ``step``. Kinds:

- ``kill``: SIGKILL this rank in the middle of step ``step`` (after backward, before the
  optimizer step), as a crashed host or the OOM killer would;
- ``kill_in_save``: SIGKILL this rank while the checkpoint of step ``step`` is being written
  (after its shard file, before the manifest is published);
- ``enospc_in_save``: make this rank's write of the checkpoint of step ``step`` fail with
  ``OSError(ENOSPC)``, as a full disk would;
- ``stop``: SIGSTOP this rank at the start of step ``step`` (a hung rank: it never returns);
- ``nan_grad``: overwrite one element of this rank's first non-empty gradient shard with NaN
  after backward (after reduction), at each of ``steps``.

Before it fires, a fault appends ``{"kind", "rank", "step", "attempt", "time"}`` to
``RUN_DIR/faults.jsonl``, which tests read to know what happened and when.

``FULLSHARD_RESOURCE_EVERY=N`` makes every rank append ``{"step", "rss_mib", "fds", "time"}``
to ``RUN_DIR/resources_rank<R>.jsonl`` every N steps (current RSS and open file descriptors,
from ``/proc/self``): what the soak test measures leaks with.
"""

from __future__ import annotations

import contextlib
import errno
import json
import math
import os
import signal
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from fullshard.train.config import TrainConfig
    from fullshard.train.metrics import MetricsLog

import torch
import torch.distributed as dist
from torch import nn

from fullshard.train.failures import LAUNCHER_ENV

__all__ = [
    "FAULT_ENV",
    "LAUNCHER_ENV",
    "RESOURCE_ENV",
    "Fault",
    "FaultInjector",
    "ResourceProbe",
    "check_resume_checkpoint",
    "nonfinite_stop",
    "parse_faults",
]

FAULT_ENV = "FULLSHARD_FAULT"
RESOURCE_ENV = "FULLSHARD_RESOURCE_EVERY"
_KINDS = ("kill", "kill_in_save", "enospc_in_save", "stop", "nan_grad")


@dataclass(frozen=True)
class Fault:
    """One injected fault (see [Note: fault injection])."""

    kind: str
    steps: frozenset[int]
    rank: int = 0
    attempt: int | None = 0  # None: every attempt


def parse_faults(text: str) -> list[Fault]:
    """Parse ``FULLSHARD_FAULT``; raises ``ValueError`` naming the bad part."""
    faults = []
    for part in filter(None, (p.strip() for p in text.split(";"))):
        kind, _, rest = part.partition("@")
        if kind not in _KINDS:
            raise ValueError(f"{FAULT_ENV}: unknown fault {kind!r} in {part!r}; use {_KINDS}")
        opts = dict(kv.split("=", 1) for kv in rest.split(",") if kv)
        unknown = set(opts) - {"step", "steps", "rank", "attempt"}
        if unknown or not ({"step", "steps"} & set(opts)):
            raise ValueError(f"{FAULT_ENV}: {part!r} needs step=N (keys: step, rank, attempt)")
        steps = opts.get("steps", opts.get("step", ""))
        attempt = opts.get("attempt", "0")
        faults.append(
            Fault(
                kind=kind,
                steps=frozenset(int(s) for s in steps.split("|")),
                rank=int(opts.get("rank", "0")),
                attempt=None if attempt == "*" else int(attempt),
            )
        )
    return faults


class FaultInjector:
    """The faults of ``FULLSHARD_FAULT`` that concern this rank in this elastic attempt."""

    def __init__(self, faults: list[Fault], *, rank: int, attempt: int, run_dir: Path) -> None:
        self.faults = [f for f in faults if f.rank == rank and f.attempt in (None, attempt)]
        self.rank, self.attempt, self.run_dir = rank, attempt, run_dir

    @classmethod
    def from_env(cls, *, rank: int, attempt: int, run_dir: Path) -> FaultInjector:
        """An injector for this rank (inactive when ``FULLSHARD_FAULT`` is unset)."""
        return cls(
            parse_faults(os.environ.get(FAULT_ENV, "")), rank=rank, attempt=attempt, run_dir=run_dir
        )

    def _due(self, kind: str, step: int) -> bool:
        return any(f.kind == kind and step in f.steps for f in self.faults)

    def _record(self, kind: str, step: int) -> None:
        event = {"kind": kind, "rank": self.rank, "step": step, "attempt": self.attempt}
        with open(self.run_dir / "faults.jsonl", "a") as f:
            f.write(json.dumps(event | {"time": time.time()}) + "\n")
            f.flush()
            os.fsync(f.fileno())

    def step_begin(self, step: int) -> None:
        """Start of step ``step``: a ``stop`` fault freezes this rank here."""
        if self.faults and self._due("stop", step):
            self._record("stop", step)
            os.kill(os.getpid(), signal.SIGSTOP)

    def after_backward(self, step: int, model: nn.Module) -> None:
        """Gradients are reduced, the optimizer has not stepped: ``nan_grad`` and ``kill``."""
        if not self.faults:
            return
        if self._due("nan_grad", step):
            self._record("nan_grad", step)
            for p in model.parameters():
                g = p.grad
                if g is None:
                    continue
                local = g.to_local() if hasattr(g, "to_local") else g
                if local.numel():
                    with torch.no_grad():
                        local.view(-1)[0] = math.nan
                    break
        if self._due("kill", step):
            self._record("kill", step)
            os.kill(os.getpid(), signal.SIGKILL)

    @contextlib.contextmanager
    def saving(self, step: int) -> Iterator[None]:
        """Around the save of step ``step``: ``kill_in_save`` dies after writing its shard
        file, ``enospc_in_save`` fails to write it."""
        kill = self._due("kill_in_save", step) if self.faults else False
        if not (kill or (self.faults and self._due("enospc_in_save", step))):
            yield
            return
        from fullshard.checkpoint import saving as saving_mod

        original = saving_mod._write_rank

        def write_then_fail(tmp: Path, *args: object, **kwargs: object) -> None:
            if not kill:
                self._record("enospc_in_save", step)
                name = str(tmp / f"rank_{self.rank:05d}.safetensors")
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), name)
            original(tmp, *args, **kwargs)  # type: ignore[arg-type]
            self._record("kill_in_save", step)
            os.kill(os.getpid(), signal.SIGKILL)

        saving_mod._write_rank = write_then_fail  # type: ignore[assignment]
        try:
            yield
        finally:
            saving_mod._write_rank = original


class ResourceProbe:
    """Samples this rank's RSS and open file descriptors (see ``FULLSHARD_RESOURCE_EVERY``)."""

    def __init__(self, *, rank: int, run_dir: Path) -> None:
        self.every = int(os.environ.get(RESOURCE_ENV, "0") or 0)
        self.path = run_dir / f"resources_rank{rank}.jsonl"

    def after_step(self, step: int) -> None:
        """Append a sample when ``step`` is a multiple of the interval."""
        if self.every <= 0 or step % self.every:
            return
        pages = int(Path("/proc/self/statm").read_text().split()[1])
        sample = {
            "step": step,
            "rss_mib": round(pages * os.sysconf("SC_PAGE_SIZE") / 2**20, 2),
            "fds": len(os.listdir("/proc/self/fd")),
            "time": time.time(),
        }
        with open(self.path, "a") as f:
            f.write(json.dumps(sample) + "\n")


def nonfinite_stop(
    log: MetricsLog | None,
    step: int,
    in_a_row: int,
    max_skipped: int,
    last_saved: Path | None,
    skipped_total: int,
) -> int:
    """Every rank, after more than ``--max-skipped-steps`` consecutive non-finite steps.

    [Note: non-finite gradients] The global gradient norm (``fullshard.clip_grad_norm_``
    all-reduces it after the reduce-scatter) is the same on every rank, so every rank skips the
    same optimizer steps and stops after the same step: the weights stay those of the last
    finite step, and nothing is saved (the previous checkpoint is the one to resume from after
    fixing the cause). Restarting would only replay the same steps, so under ``fullshard
    train`` the ranks exit 0 (the elastic agent would restart a failed group) and the launcher
    turns the ``stop`` record's reason into exit status 1; under a bare torchrun they exit 1.
    """
    first = step - in_a_row + 1
    message = (
        f"stopped after step {step}: {in_a_row} consecutive steps had non-finite gradients "
        f"(steps {first}-{step}), more than --max-skipped-steps {max_skipped}; they were "
        f"skipped on every rank, so the weights are those of step {first - 1} "
        f"(last checkpoint: {last_saved or 'none'}). Lower --lr, use --mixed-precision bf16 or "
        "fp32, check the data, or raise --max-skipped-steps"
    )
    if log is not None:
        log.write(
            "stop",
            step=step,
            reason="nonfinite",
            checkpoint=None,
            skipped_steps=skipped_total,
            message=message,
        )
        log.close()
        print(f"fullshard train: error: {message}", file=sys.stderr, flush=True)
    sys.stdout.flush()
    dist.barrier()
    return 0 if os.environ.get(LAUNCHER_ENV) == "1" else 1


class _Fits(Exception):
    """Raised at the first tensor read: every name and shape was checked before it."""


def check_resume_checkpoint(cfg: TrainConfig, path: str) -> None:
    """Before launch: ``--resume PATH`` is a complete checkpoint whose files match its manifest
    (sizes, header checksums, dtypes, shapes: headers only, no tensor data is read) and whose
    tensors fit ``cfg``'s model (missing/unexpected names and shape mismatches are listed).

    Raises :class:`fullshard.checkpoint.CheckpointError` (or ``OSError``). Block checksums are
    verified while the ranks load, as always.
    """
    from fullshard.checkpoint import CheckpointError, CheckpointReader
    from fullshard.checkpoint.loading import apply_model_state
    from fullshard.train.models import build_model

    reader = CheckpointReader(path)
    m = reader.manifest
    missing = [k for k in ("step", "sampler") if k not in m.extra]
    if m.optimizer is None or missing:
        what = "no optimizer state" if m.optimizer is None else f"no {' or '.join(missing)}"
        raise CheckpointError(
            f"{reader.path} has {what}: it was not saved by fullshard train, which resumes "
            "model, optimizer and data order together"
        )
    for name in m.files:
        reader.check_file(name)  # a pickle, a truncated or a swapped file fails here
    model = build_model(cfg, meta=True)

    def source(fqn: str) -> object:
        if fqn not in m.model and fqn not in m.model_aliases:
            return None

        def read(box: object) -> torch.Tensor:
            raise _Fits

        return read

    shapes = {k: v.shape for k, v in m.model.items()}
    shapes.update({k: m.model[v].shape for k, v in m.model_aliases.items()})
    try:
        apply_model_state(model, source, shapes, str(reader.path), strict=True)  # type: ignore[arg-type]
    except _Fits:
        pass
    _check_optimizer_groups(cfg, model, [sorted(g["params"]) for g in m.optimizer.param_groups])


class OptimizerMismatch(Exception):
    """A checkpoint's optimizer param groups are not the ones ``cfg.optimizer`` builds."""

    def __init__(self, saved_by: str | None, saved: list[int], wanted: list[int]) -> None:
        self.saved_by = saved_by  # the --optimizer whose groups the checkpoint has, if any
        self.saved = saved  # parameters per saved group
        self.wanted = wanted  # parameters per group of this command's optimizer
        super().__init__(f"param groups of {saved} parameters, this optimizer's {wanted}")


def _check_optimizer_groups(
    cfg: TrainConfig, model: torch.nn.Module, saved: list[list[str]]
) -> None:
    """``saved`` (FQNs per param group) are the groups ``--optimizer`` builds for ``model``;
    else :class:`OptimizerMismatch`, naming the optimizer that built them when one did."""
    from fullshard.train.models import units_of
    from fullshard.train.optim import optimizer_groups

    fqn_of = {id(p): n for n, p in model.named_parameters()}
    layers = units_of(model).layers

    def groups(kind: str) -> list[list[str]] | None:
        try:
            return [sorted(fqn_of[id(p)] for p in g) for g in optimizer_groups(model, kind, layers)]
        except ValueError:  # muon on a model without block matrices
            return None

    wanted = groups(cfg.optimizer)
    if wanted == saved:
        return
    others = [k for k in ("adamw", "muon") if k != cfg.optimizer and groups(k) == saved]
    raise OptimizerMismatch(
        others[0] if others else None, [len(g) for g in saved], [len(g) for g in wanted or []]
    )
