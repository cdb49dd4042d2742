"""scripts/gpu_check.sh: its dry run on the CPU (every check, tiny sizes), the report written
as it goes, the time budget, a raising check failing the run, and without a GPU one line
saying it skipped.

The CUDA paths themselves need a GPU (run ``bash scripts/gpu_check.sh --out DIR`` on one); the
trace analysis it reports from is tested in test_trace.py.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "gpu_check.sh"


def _gpu_check() -> ModuleType:
    """benchmarks/gpu_check.py (which puts its gpu_check_* modules on sys.path)."""
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "benchmarks" / "gpu_check.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_check"] = module
    spec.loader.exec_module(module)
    return module


def _script(tmp_path: Path, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", str(SCRIPT), *args],
        cwd=tmp_path,
        env=dict(os.environ, PYTHON=sys.executable, OMP_NUM_THREADS="1", **env),
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_skips_in_one_line_without_a_gpu(tmp_path: Path) -> None:
    proc = _script(tmp_path, CUDA_VISIBLE_DEVICES="")
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = proc.stdout.splitlines()
    assert len(lines) == 1 and lines[0].startswith("gpu_check: skipped: no CUDA GPU"), proc.stdout


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


def test_the_llama_is_llama_3_2_1b_shaped() -> None:
    gc = _gpu_check()
    from gpu_check_llama import llama_config

    args = gc._parse([])
    cfg = llama_config(SimpleNamespace(dry=False, args=args))  # type: ignore[arg-type]
    assert (cfg["hidden_size"], cfg["num_hidden_layers"], cfg["vocab_size"]) == (2048, 16, 128256)
    assert (args.train_steps, args.overhead_units) == (30, 64)
    dry = gc._parse(["--dry-run", "--train-steps", "2"])
    assert (dry.llama_layers, dry.train_steps, dry.overhead_units) == (2, 2, 8)
    assert (args.rl_layers, dry.rl_layers, dry.rl_repeats) == (8, 2, 2)


def test_the_estimates_fit_the_default_budget() -> None:
    gc = _gpu_check()
    assert sum(c[3] for c in gc.CHECKS) <= gc._parse([]).budget_s


def _report(out: Path) -> dict[str, Any]:
    return json.loads((out / "gpu_check.json").read_text())  # type: ignore[no-any-return]


def test_the_dry_run_runs_every_check_and_writes_the_report(tmp_path: Path) -> None:
    out = tmp_path / "out"
    proc = _script(tmp_path, "--dry-run", "--out", str(out))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = _report(out)
    gc = _gpu_check()
    assert report["done"] and [c["key"] for c in report["checks"]] == [c[0] for c in gc.CHECKS]
    assert {c["status"] for c in report["checks"]} == {"ran"}
    verdicts = {r["check"]: r["verdict"] for r in report["rows"]}
    assert not {"FAIL", "ERROR", "SKIPPED"} & set(verdicts.values()), verdicts
    for title in ("parity fp32", "comm buffers", "CPU offload parity", "per-unit CPU overhead"):
        assert any(title in check for check in verdicts), (title, verdicts)
    for title in ("Llama peak", "prefetch", "train --preset llama-1b: the run", "train: MFU"):
        assert any(title in check for check in verdicts), (title, verdicts)
    for title in ("RL weight sync", "RL publish ==", "RL ShardDeltas", "RL sleep/wake", "RL wake"):
        assert any(title in check for check in verdicts), (title, verdicts)
    for title in ("RL colocated: publish_colocated", "RL colocated: engine == publish()"):
        assert any(title in check for check in verdicts), (title, verdicts)
    for title in ("graph: engine tensors created", "captured steps == eager", "graph: step time"):
        assert verdicts[next(c for c in verdicts if title in c)] in ("PASS", "INFO"), title
    rl = {check: v for check, v in verdicts.items() if check.startswith("RL ")}
    assert len(rl) == 8 and set(rl.values()) <= {"PASS", "INFO"}, rl
    assert set(report["details"]) >= {
        "offload_copy_overlap", "llama_prefetch", "train", "rl", "colocated", "graph",
    }  # fmt: skip
    markdown = (out / "gpu_check.md").read_text()
    assert "| check | fullshard | FSDP2 / plan | verdict | note |" in markdown
    assert all(f"| {r['check']} |" in markdown for r in report["rows"])
    assert (out / "train_metrics.jsonl").exists() and (out / "plan_gpu.json").exists()
    assert "train: tokens/s per GPU" in proc.stdout  # the console's table


def test_the_rl_check_fails_when_publish_is_off_by_one_bit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """publish's weights must equal ``full_tensor().to(bf16)`` bit for bit: one flipped bit
    in one weight fails the check (and the run), the other RL rows still pass."""
    gc = _gpu_check()
    import gpu_check_rl
    import torch

    real = gpu_check_rl.publish

    def one_bit_off(model: Any, **kwargs: Any) -> Any:
        for i, (name, t) in enumerate(real(model, **kwargs)):
            if i == 1:
                t = t.clone()
                t.view(torch.int16).view(-1)[0] ^= 1
            yield name, t

    monkeypatch.setattr(gpu_check_rl, "publish", one_bit_off)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert gc.main(["--dry-run", "--only", "rl", "--out", str(tmp_path)]) == 1
    verdicts = {r["check"]: r["verdict"] for r in _report(tmp_path)["rows"]}
    assert verdicts.pop("RL publish == full_tensor().to(bf16), bit for bit") == "FAIL"
    assert set(verdicts.values()) <= {"PASS", "INFO"}, verdicts


def test_a_check_that_raises_fails_the_run(tmp_path: Path) -> None:
    out = tmp_path / "out"
    env = {"FULLSHARD_GPU_CHECK_RAISE": "offload"}
    proc = _script(tmp_path, "--dry-run", "--only", "buffers,offload", "--out", str(out), **env)
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = _report(out)
    assert [(c["key"], c["status"]) for c in report["checks"]] == [
        ("buffers", "ran"),
        ("offload", "error"),
    ]
    rows = report["rows"]
    assert rows[0]["verdict"] == "PASS" and rows[-1]["verdict"] == "ERROR"
    assert "injected failure" in rows[-1]["note"]


def test_the_report_is_written_as_it_goes_and_the_budget_skips(tmp_path: Path) -> None:
    """After each check the files hold every finished row (what a kill leaves); a check that
    no longer fits in the budget is SKIPPED ('time budget') and fails the run."""
    _gpu_check()
    from gpu_check_report import Check, Report, Row, run_checks

    now = [0.0]
    seen: dict[str, Any] = {}

    def first() -> list[Row]:
        now[0] += 10
        return [Row("first", "1", "2", "a note", "PASS")]

    def second() -> list[Row]:  # a kill here leaves what is on disk now
        seen["json"] = _report(tmp_path)
        seen["md"] = (tmp_path / "gpu_check.md").read_text()
        now[0] += 70
        return [Row("second", "3", "4", "note | with a bar", "INFO")]

    report = Report("header", tmp_path, budget_s=100)
    checks = [Check("a", "first", first, 5), Check("b", "second", second, 5)]
    checks.append(Check("c", "third", lambda: pytest.fail("over the budget, yet ran"), 30))
    run_checks(checks, report, clock=lambda: now[0])
    assert [r["check"] for r in seen["json"]["rows"]] == ["first"] and not seen["json"]["done"]
    assert "| first | 1 | 2 | PASS | a note |" in seen["md"]
    final = _report(tmp_path)
    assert final["done"] and [r["verdict"] for r in final["rows"]] == ["PASS", "INFO", "SKIPPED"]
    assert final["rows"][-1]["note"].startswith("time budget: 20 s left")
    assert "note \\| with a bar" in (tmp_path / "gpu_check.md").read_text()
    assert report.failed() and not list(tmp_path.glob("*.tmp"))


@pytest.mark.parametrize(
    ("code", "steps", "stop", "verdict"),
    [
        (0, 3, "done", "PASS"),
        (0, 2, "time_budget", "PASS"),  # stopped itself at its --time-budget
        (None, 3, None, "PASS"),  # killed in the final checkpoint save
        (None, 1, None, "SKIPPED"),  # killed at the check's time budget before its steps
        (1, 3, None, "FAIL"),
    ],
)
def test_the_training_runs_verdict(code: int | None, steps: int, stop: Any, verdict: str) -> None:
    _gpu_check()
    from gpu_check_runs import _run_row

    m = {"steps": steps, "losses": [5.0] * steps, "stop": stop}
    assert _run_row(argparse.Namespace(max_steps=3), code, m).verdict == verdict
    m["losses"] = [5.0, float("nan")]
    assert _run_row(argparse.Namespace(max_steps=3), 0, m).verdict == "FAIL"
