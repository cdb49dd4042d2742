"""fullshard train end to end through the real CLI: 2 gloo ranks under torchrun's agent.

One uninterrupted ``tiny`` run is the reference; an interrupted-and-resumed run, a resume on a
different number of ranks and a two-agent "multi-node" run are compared with it step by step.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from doc_commands import hf_example
from fullshard.testing import free_port
from fullshard.train.config import from_toml
from fullshard.train.launch import package_root
from fullshard.train.metrics import read_metrics

STEPS = 60
TINY = ["--preset", "tiny", "--max-steps", str(STEPS), "--ckpt-every", "20", "--log-every", "20"]


def _env() -> dict[str, str]:
    paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    root = str(package_root())
    pythonpath = os.pathsep.join(paths if root in paths else [*paths, root])
    return {**os.environ, "PYTHONPATH": pythonpath, "OMP_NUM_THREADS": "1"}


def _cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "fullshard.cli", "train", *args]


def _run(*args: str, cwd: Path, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(
        _cmd(*args), capture_output=True, text=True, env=_env(), cwd=cwd, timeout=timeout
    )
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    return proc


def _train_losses(run_dir: Path) -> dict[int, float]:
    records = [r for r in read_metrics(run_dir / "metrics.jsonl") if r["kind"] == "train"]
    steps = [r["step"] for r in records]
    assert len(steps) == len(set(steps)), f"duplicate steps in metrics.jsonl: {steps}"
    return {r["step"]: r["loss"] for r in records}


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    root = tmp_path_factory.mktemp("ref")
    proc = _run(*TINY, "--run-dir", str(root / "run"), cwd=root)
    return root / "run", proc.stdout


def test_tiny_trains_end_to_end(reference: tuple[Path, str]) -> None:
    run_dir, stdout = reference
    records = read_metrics(run_dir / "metrics.jsonl")
    train = [r for r in records if r["kind"] == "train"]
    assert [r["step"] for r in train] == list(range(1, STEPS + 1))
    for r in train:
        assert set(r) >= {"loss", "lr", "grad_norm", "tokens", "tokens_per_s", "peak_mem_mib"}
        assert (
            len(r["peak_mem_mib"]) == len(r["rss_mib"]) == 2 and r["tokens"] == r["step"] * 8 * 64
        )
    first, last = train[0]["loss"], sum(r["loss"] for r in train[-5:]) / 5
    assert last < first - 1.5, f"loss did not fall: {first} -> {last}"
    evals = [r for r in records if r["kind"] == "eval"]
    assert [r["step"] for r in evals] == [20, 40, 60] and evals[-1]["loss"] < evals[0]["loss"]
    assert [r["kind"] for r in records].count("start") == 1  # no elastic restart happened
    assert records[0]["kind"] == "start"
    assert (records[-1]["kind"], records[-1]["reason"]) == ("stop", "done")
    png = (run_dir / "loss.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 5000
    config = from_toml(str(run_dir / "config.toml"))
    assert config["preset"] == "tiny" and config["max_steps"] == STEPS
    ckpts = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    assert ckpts == ["step_00000020", "step_00000040", "step_00000060"]
    assert "--- sample" in stdout and f"step {STEPS}/{STEPS}" in stdout


def _interrupt(run_dir: Path, cwd: Path, after: int) -> int:
    """Start a run, SIGINT its process group (like Ctrl-C) after ``after`` steps; return its stop step."""
    proc = subprocess.Popen(
        _cmd(*TINY, "--run-dir", str(run_dir)),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=_env(),
        cwd=cwd,
        start_new_session=True,
    )
    deadline = time.monotonic() + 180
    while len(_train_losses(run_dir) if (run_dir / "metrics.jsonl").exists() else {}) < after:
        assert proc.poll() is None, proc.communicate()[0]
        assert time.monotonic() < deadline, "the run never got going"
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGINT)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, out
    stop = read_metrics(run_dir / "metrics.jsonl")[-1]
    assert stop["kind"] == "stop" and stop["reason"] == "signal", out
    assert stop["step"] < STEPS, "the run finished before the interrupt arrived"
    assert Path(stop["checkpoint"]).name == f"step_{stop['step']:08d}"
    assert "run the same command again to resume" in out
    return int(stop["step"])


def test_interrupt_then_resume_matches_uninterrupted(
    reference: tuple[Path, str], tmp_path: Path
) -> None:
    run_dir = tmp_path / "run"
    stopped = _interrupt(run_dir, tmp_path, after=8)
    shutil.copytree(run_dir, tmp_path / "copy")  # for the other world size, below
    proc = _run(*TINY, "--run-dir", str(run_dir), cwd=tmp_path)
    assert f"resumed from {run_dir / 'checkpoints' / f'step_{stopped:08d}'}" in proc.stdout
    expected = _train_losses(reference[0])
    assert _train_losses(run_dir) == expected  # every step, bit for bit

    # The same checkpoint resumed on 1 rank: same data, same first loss up to summation order.
    other = tmp_path / "copy"
    proc = _run(*TINY, "--run-dir", str(other), "--nproc", "1", cwd=tmp_path)
    starts = [r for r in read_metrics(other / "metrics.jsonl") if r["kind"] == "start"]
    assert [s["world_size"] for s in starts] == [2, 1]
    losses = _train_losses(other)
    assert sorted(losses) == list(range(1, STEPS + 1))
    assert losses[stopped + 1] == pytest.approx(expected[stopped + 1], rel=1e-5)
    assert losses[STEPS] == pytest.approx(expected[STEPS], rel=2e-2)


def test_hf_llama_trains(tmp_path: Path) -> None:
    """docs/train.md's Hugging Face example, as written there (fewer steps)."""
    run_dir = tmp_path / "run"
    args = [*hf_example(), "--max-steps", "30", "--sample-tokens", "20"]
    proc = _run(*args, "--run-dir", str(run_dir), cwd=tmp_path)
    assert "LlamaForCausalLM" in proc.stdout
    losses = _train_losses(run_dir)
    assert len(losses) == 30 and losses[30] < losses[1] - 1.0
    kinds = [r["kind"] for r in read_metrics(run_dir / "metrics.jsonl")]
    assert kinds.count("start") == 1 and kinds[-1] == "stop"


def test_two_agents_multi_node(reference: tuple[Path, str], tmp_path: Path) -> None:
    """Two torchrun agents (``--nnodes 2``, one rank each) meet in a c10d rendezvous on localhost."""
    port = free_port()
    run_dir = tmp_path / "run"
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2"]
    torchrun += ["--nproc-per-node", "1", "--rdzv-backend", "c10d", "--rdzv-id", "fs-test"]
    torchrun += ["--rdzv-endpoint", f"127.0.0.1:{port}", "-m", "fullshard.train.worker"]
    agents: list[subprocess.Popen[Any]] = [
        subprocess.Popen(
            [*torchrun, *TINY, "--run-dir", str(run_dir)],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=_env(),
            cwd=tmp_path,
        )
        for _ in range(2)
    ]
    outputs = [a.communicate(timeout=240)[0] for a in agents]
    assert [a.returncode for a in agents] == [0, 0], "\n".join(outputs)
    start = read_metrics(run_dir / "metrics.jsonl")[0]
    assert start["world_size"] == 2
    assert _train_losses(run_dir) == _train_losses(reference[0])


def test_precision_checkpointing_offload_and_time_budget(tmp_path: Path) -> None:
    """bf16 + activation checkpointing + CPU offload + Muon train (loss falls, stays finite),
    and --time-budget stops the run early with a resumable checkpoint at the step it reached."""
    run_dir = tmp_path / "run"
    flags = [
        "--preset", "tiny", "--max-steps", "100000", "--time-budget", "12",
        "--mixed-precision", "bf16", "--activation-checkpointing", "--cpu-offload",
        "--optimizer", "muon",
        "--eval-every", "0", "--sample-tokens", "0", "--log-every", "10",
    ]  # fmt: skip
    proc = _run(*flags, "--run-dir", str(run_dir), cwd=tmp_path)
    config = from_toml(str(run_dir / "config.toml"))
    assert config["mixed_precision"] == "bf16"
    assert config["activation_checkpointing"] is True and config["cpu_offload"] is True
    assert config["optimizer"] == "muon" and config["muon_ns_dtype"] == "auto"
    stop = read_metrics(run_dir / "metrics.jsonl")[-1]
    assert (stop["kind"], stop["reason"]) == ("stop", "time_budget"), proc.stdout
    losses = _train_losses(run_dir)
    assert 5 <= stop["step"] < 100000 and len(losses) == stop["step"]
    assert all(v == v and abs(v) < 100 for v in losses.values())  # finite
    first, last = losses[1], sum(list(losses.values())[-3:]) / 3
    assert last < first - 0.3, f"loss did not fall under bf16 + AC + offload: {first} -> {last}"
    assert Path(stop["checkpoint"]).name == f"step_{stop['step']:08d}"
    assert Path(stop["checkpoint"]).is_dir()
    groups = json.loads((Path(stop["checkpoint"]) / "manifest.json").read_text())
    assert groups["optimizer"]["param_groups"][0]["options"]["ns_dtype"] == "float32"  # auto, CPU
    assert "time budget reached" in proc.stdout + proc.stderr


def test_gpt_export_loads_with_the_documented_loader(
    reference: tuple[Path, str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``ckpt export --hf`` of the built-in GPT: config.json beside the weights, and
    ``load_exported`` gives the trained model (its held-out loss is the run's last eval)."""
    import torch
    import torch.nn.functional as F

    from fullshard.checkpoint.cli import main as ckpt_main
    from fullshard.train import data as data_mod
    from fullshard.train.models import load_exported

    run_dir, _ = reference
    out = tmp_path / "gpt"
    assert ckpt_main(["export", str(run_dir), "--hf", str(out)]) == 0
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "fullshard_gpt" and config["n_layer"] == 2
    model = load_exported(out)
    tokens = data_mod.load_tokens("")
    held_out = data_mod.TokenData.split(tokens, 0.02, byte_level=True).eval
    starts = data_mod.eval_starts(len(held_out), seq_len=64, count=2 * 8)
    inputs, targets = data_mod.gather_batch(held_out, None, starts, 64)
    with torch.no_grad():
        loss = float(F.cross_entropy(model(inputs).flatten(0, 1), targets.flatten()))
    last_eval = [r for r in read_metrics(run_dir / "metrics.jsonl") if r["kind"] == "eval"][-1]
    assert loss == pytest.approx(last_eval["loss"], rel=1e-5)
    # an existing output file or directory is never silently overwritten
    capsys.readouterr()
    assert ckpt_main(["export", str(run_dir), str(tmp_path / "w.safetensors")]) == 0
    assert ckpt_main(["export", str(run_dir), str(tmp_path / "w.safetensors")]) == 2
    assert "pass --force" in capsys.readouterr().err
    assert ckpt_main(["export", str(run_dir), str(tmp_path / "w.safetensors"), "--force"]) == 0
