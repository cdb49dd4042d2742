"""``examples/grpo.py`` runs as documented (a subprocess, 2 training ranks + 1 inference rank)
and learns: the reward rises well above chance, which needs both the training step and the
delta sync (a receiver left with its first weights samples at chance forever), and the
receiver ends bit for bit equal to the trainers' ``full_tensor()`` in bf16."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
CHANCE = 1 / 16  # the example's vocabulary


def _run(tmp_path: Path, *args: str) -> dict[str, Any]:
    """``examples/grpo.py --steps 60 ...`` as a subprocess; its result, checked bit for bit."""
    out = tmp_path / "result.json"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), env.get("PYTHONPATH", "")])
    argv = ["--steps", "60", "--max-stride", "1", "--seed", "0", "--out", str(out), *args]
    proc = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "grpo.py"), *argv],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "in bfloat16: bit for bit" in proc.stdout, proc.stdout[-2000:]
    result: dict[str, Any] = json.loads(out.read_text())
    assert result["weights_equal"] and not result["differ"]
    return result


def test_grpo_example_learns_and_the_receiver_matches_the_trainers(tmp_path: Path) -> None:
    result = _run(tmp_path)
    history = result["history"]
    assert [r["step"] for r in history] == list(range(1, 61))
    first = sum(r["reward"] for r in history[:10]) / 10
    last = sum(r["reward"] for r in history[-10:]) / 10
    # seed 0 gives about 0.07 -> 0.43; a policy that never changes stays near chance
    assert first < 2 * CHANCE, first
    assert last > 4 * CHANCE and last > first + 0.2, (first, last)
    # every step sent a delta, smaller than the full weights sent once at the start
    assert all(0 < r["sync_bytes"] < result["full_bytes"] for r in history)
    assert result["path"] == "wire"


def test_grpo_example_with_colocated_buckets(tmp_path: Path) -> None:
    """``--sync colocated``: every step hands the inference process the full weights through
    shared-memory buckets; the same learning, the receiver bit for bit at the end."""
    result = _run(tmp_path, "--sync", "colocated")
    history = result["history"]
    first = sum(r["reward"] for r in history[:10]) / 10
    last = sum(r["reward"] for r in history[-10:]) / 10
    assert last > 4 * CHANCE and last > first + 0.2, (first, last)
    assert result["path"] == "colocated"
    assert all(r["sync_bytes"] == result["full_bytes"] > 0 for r in history)
