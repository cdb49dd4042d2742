"""Shared by the reliability tests (no tests here): running ``fullshard`` as a user would, a
small corpus, checkpoint comparison, and the rows behind ``docs/reliability.md``.

With ``FULLSHARD_RELIABILITY_RESULTS=DIR`` set, :func:`record` appends one JSON row per case to
``DIR/rows.jsonl``; ``scripts/reliability_report.py`` sets it, runs the tests and renders them.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

from fullshard.checkpoint import CheckpointReader
from fullshard.train.launch import package_root

RESULTS_ENV = "FULLSHARD_RELIABILITY_RESULTS"


def record(table: str, case: str, injected: str, outcome: str, ok: bool, **details: Any) -> None:
    """One row of the report: ``table`` is faults, inputs, untrusted or soak."""
    out = os.environ.get(RESULTS_ENV)
    if not out:
        return

    def tidy(text: str) -> str:  # pytest's temporary paths say nothing in a report
        return re.sub(r"/tmp/pytest-of-[^/]+/pytest-\d+/[^/\s'\":,]+", "$TMP", text)

    row = {
        "table": table,
        "case": case,
        "injected": tidy(injected),
        "outcome": tidy(outcome),
        "ok": ok,
    }
    Path(out).mkdir(parents=True, exist_ok=True)
    with open(Path(out) / "rows.jsonl", "a") as f:
        f.write(json.dumps(row | details) + "\n")


def env(**extra: str) -> dict[str, str]:
    """The environment a user's shell would give ``fullshard`` (this checkout importable)."""
    paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    root = str(package_root())
    pythonpath = os.pathsep.join(paths if root in paths else [*paths, root])
    base = {k: v for k, v in os.environ.items() if not k.startswith("FULLSHARD_FAULT")}
    return {**base, "PYTHONPATH": pythonpath, "OMP_NUM_THREADS": "1", **extra}


def fullshard(
    *args: str, cwd: Path, timeout: float = 300, **extra_env: str
) -> tuple[subprocess.CompletedProcess[str], float]:
    """Run the ``fullshard`` command; returns the finished process and its wall time."""
    t0 = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "fullshard.cli", *args],
        capture_output=True,
        text=True,
        env=env(**extra_env),
        cwd=cwd,
        timeout=timeout,
    )
    return proc, time.monotonic() - t0


def write_corpus(path: Path) -> Path:
    """~140 KB of text (two standard-library modules): loads in milliseconds, unlike the
    trainer's default 12M-token corpus, and is plenty for the tiny preset."""
    import argparse

    text = Path(argparse.__file__).read_text() + Path(os.__file__).read_text()
    path.write_text(text)
    return path


def tiny_args(corpus: Path, run_dir: Path, steps: int, *more: str) -> list[str]:
    """``fullshard train`` flags of a quick tiny run (no eval, no sample, plain output)."""
    return [
        "train",
        "--preset",
        "tiny",
        "--max-steps",
        str(steps),
        "--data",
        str(corpus),
        "--run-dir",
        str(run_dir),
        "--eval-every",
        "0",
        "--sample-tokens",
        "0",
        "--progress",
        "plain",
        *more,
    ]


def checkpoint_tensors(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint (model and optimizer state), assembled in full."""
    reader = CheckpointReader(path)
    return {name: reader.read_full(rec, name) for name, rec in reader.manifest.all_tensors()}


def differing(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[str]:
    """Names whose tensors are not bit-identical (or present on one side only)."""
    names = sorted(set(a) | set(b))
    return [n for n in names if n not in a or n not in b or not torch.equal(a[n], b[n])]


def save_train_checkpoint(path: Path, step: int = 1, **changes: Any) -> Path:
    """A checkpoint like ``fullshard train`` writes (tiny GPT with ``changes`` to its shape or
    ``optimizer``, its optimizer's state, sampler), written in-process on one rank."""
    import fullshard.checkpoint as ckpt
    from fullshard.train.config import replace
    from fullshard.train.data import Sampler
    from fullshard.train.models import build_model, units_of
    from fullshard.train.optim import build_optimizer
    from fullshard.train.presets import get_preset

    cfg = replace(get_preset("tiny"), **changes)
    torch.manual_seed(0)
    model = build_model(cfg)
    opt = build_optimizer(
        model,
        lr=cfg.lr,
        weight_decay=cfg.weight_decay,
        betas=(0.9, 0.95),
        kind=cfg.optimizer,
        layers=units_of(model).layers,
        ns_dtype="float32",
    )
    model(torch.zeros(2, 8, dtype=torch.long)).float().sum().backward()
    opt.step()
    sampler = Sampler(10_000, seq_len=cfg.seq_len, global_batch=cfg.global_batch, seed=0)
    extra = {"step": step, "tokens": 0, "sampler": sampler.state_dict(), "scaler": {}}
    ckpt.save(path, model=model, optimizer=opt, extra=extra)
    return path
