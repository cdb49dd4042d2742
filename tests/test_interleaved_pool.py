"""``benchmarks/interleaved.py --pool``: saved runs reported together over the modes they share."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from types import ModuleType

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "interleaved.py"


def _script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("interleaved_script", SCRIPT)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _save(path: Path, per_step: dict[str, list[float]]) -> Path:
    path.write_text(json.dumps({"command": f"run {path.name}", "per_step_s": per_step}))
    return path


def test_pool_reports_the_modes_every_file_has(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    mod = _script()
    a = _save(tmp_path / "a.json", {"fullshard": [1.0, 2.0, 3.0], "ddp": [2.0, 2.0, 2.0]})
    # a three-mode run: its fs-rs2 steps are left out, its fullshard / ddp steps pooled
    b = _save(
        tmp_path / "b.json",
        {"fullshard": [4.0, 4.0], "fs-rs2": [9.0, 9.0], "ddp": [2.0, 2.0]},
    )
    assert mod.pool([a, b]) == 0
    out = capsys.readouterr().out
    assert "run a.json" in out and "run b.json" in out
    assert "pooling the modes every file has: fullshard, ddp" in out
    assert "fs-rs2" not in out.split("pooling")[1]
    # per-step ratios 0.5, 1.0, 1.5, 2.0, 2.0: median 1.5 over 5 steps
    line = next(ln for ln in out.splitlines() if ln.startswith("fullshard"))
    assert "median per-step ratio 1.500" in line and "5 steps" in line


def test_pool_refuses_files_sharing_fewer_than_two_modes(tmp_path: Path) -> None:
    mod = _script()
    a = _save(tmp_path / "a.json", {"fullshard": [1.0, 2.0], "ddp": [2.0, 2.0]})
    b = _save(tmp_path / "b.json", {"fullshard": [1.0, 2.0], "fsdp2": [2.0, 2.0]})
    with pytest.raises(SystemExit, match="fewer than two modes"):
        mod.pool([a, b])
