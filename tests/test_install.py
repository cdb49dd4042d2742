"""``fullshard bench`` runs from a built wheel, away from the checkout, FSDP2 comparison included.

The wheel is built from a copy of ``src/`` and ``pyproject.toml`` (the checkout stays clean) and
unpacked into a temporary folder, which is how pip installs a pure-Python wheel. The bench runs
with ``python -S`` (no site hooks, so the checkout's editable install is invisible), the working
directory outside the checkout, and ``PYTHONPATH`` = the unpacked wheel + the folder torch is
installed in (what a virtual environment with ``--system-site-packages`` would see).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


def _build_wheel(tmp: Path) -> Path:
    src = tmp / "src"
    shutil.copytree(
        ROOT / "src", src / "src", ignore=shutil.ignore_patterns("__pycache__", "*.egg-info")
    )
    # The FSDP2 peer engine is the benchmarks' own package, shipped in the wheel beside fullshard.
    shutil.copytree(ROOT / "benchmarks" / "fullshard_peers", src / "benchmarks" / "fullshard_peers")
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", ".", "--no-deps", "--no-build-isolation", "-q"]
        + ["-w", str(tmp / "dist")],
        cwd=src,
        check=True,
        capture_output=True,
    )
    (wheel,) = (tmp / "dist").glob("fullshard-*.whl")
    return wheel


def test_bench_runs_from_an_installed_wheel(tmp_path: Path) -> None:
    site = tmp_path / "site"
    with zipfile.ZipFile(_build_wheel(tmp_path)) as zf:
        zf.extractall(site)
    deps = Path(torch.__file__).resolve().parents[1]  # torch, numpy, safetensors live here
    assert not deps.is_relative_to(ROOT / "src")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(site), str(deps)]), OMP_NUM_THREADS="1")
    run = tmp_path / "run"
    run.mkdir()
    python = [sys.executable, "-S"]

    where = subprocess.run(
        python + ["-c", "import importlib.util as u; print(u.find_spec('fullshard').origin)"],
        cwd=run,
        env=env,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    assert Path(where).is_relative_to(site), f"fullshard resolved to {where}, not the wheel"
    assert (site / "fullshard_peers" / "__init__.py").is_file(), "the wheel lacks the FSDP2 peer"

    out = run / "bench.json"
    # The overhead config runs every mode in one spawned process: the cheapest FSDP2 comparison.
    args = ["--config", "overhead", "--units", "2", "--width", "8", "--steps", "2", "--warmup", "1"]
    args += ["--repeats", "1", "--nproc", "1", "--profile-steps", "0"]
    proc = subprocess.run(
        python + ["-m", "fullshard", "bench", *args, "--json", "--out", str(out)],
        cwd=run,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    (world,) = json.loads(out.read_text())["worlds"]
    modes = world["modes"]
    assert modes["fsdp2"]["fsdp_module"].startswith("torch.distributed.fsdp")
    assert modes["fullshard"]["fsdp_module"].startswith("fullshard.")
    # One rank, same seed and data: both engines train exactly like each other.
    assert modes["fullshard"]["losses"] == pytest.approx(modes["fsdp2"]["losses"], rel=1e-6)
