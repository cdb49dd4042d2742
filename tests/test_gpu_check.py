"""scripts/gpu_check.sh without a GPU: one line saying it skipped, exit 0; its Python imports.

The check itself needs a CUDA GPU (run ``bash scripts/gpu_check.sh`` on one); the trace
analysis it reports from is tested in test_trace.py.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _gpu_check() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "benchmarks" / "gpu_check.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_check"] = module
    spec.loader.exec_module(module)
    return module


def test_skips_in_one_line_without_a_gpu(tmp_path: Path) -> None:
    env = dict(os.environ, PYTHON=sys.executable, CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run(
        ["bash", str(ROOT / "scripts" / "gpu_check.sh")],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = proc.stdout.splitlines()
    assert len(lines) == 1 and lines[0].startswith("gpu_check: skipped: no CUDA GPU"), proc.stdout


def test_llama_shape_and_table() -> None:
    gc = _gpu_check()
    cfg = gc._llama_config(16)
    assert (cfg["hidden_size"], cfg["num_hidden_layers"], cfg["vocab_size"]) == (2048, 16, 128256)
    rows = [gc.Row("a check", "1.0", "2.0", "a note", "PASS")]
    text = gc._table(rows, "header")
    assert text.splitlines()[0] == "header" and "a check" in text and text.endswith("a note")


def test_a_cpu_torch_on_a_gpu_machine_fails(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A CPU build of torch where the driver sees GPUs (a CPU venv carried to a GPU machine)
    is a failure, not a skip: the check would otherwise report green without running."""
    gc = _gpu_check()
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setattr(gc.torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(gc.torch.version, "cuda", None)
    monkeypatch.setattr(gc, "_gpus_the_driver_sees", lambda: 2)
    assert gc.main([]) == 1
    assert "the driver sees 2 GPU(s)" in capsys.readouterr().err
    monkeypatch.setattr(gc, "_gpus_the_driver_sees", lambda: 0)
    assert gc.main([]) == 0
    assert capsys.readouterr().out.startswith("gpu_check: skipped: no CUDA GPU")
