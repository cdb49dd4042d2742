"""Multi-node ``fullshard train``, tested on one machine: two ``torchrun`` agents act as two
nodes (a c10d rendezvous on 127.0.0.1, 2 gloo ranks each) and train with HSDP, replicated
across the nodes and sharded within each (``--dp-replicate 2 --dp-shard 2``).

The oracle is one process on the same seed and data: every step's loss and the final weights
agree up to summation order. ``fullshard train --dp-replicate 2 --dp-shard 2`` on this
machine (4 local ranks, the same layout) is checked against it, uninterrupted. The two-node
run has a worker SIGKILLed on one node in step 6: both nodes' groups restart and resume, and
it still matches one process, and is bit-identical to the uninterrupted 4-rank run (so one
two-node launch covers both). Its step-4 checkpoint then resumes under other layouts (1 x 2,
4 x 1, and 1 x 2 x 2 with tensor parallelism), each step matching the two-node run. Each
launch is a few seconds of tiny GPT on 2 cores; most of the cost is interpreter and torch
start-up (about 2.5 minutes in all on a 2-core VM).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from fullshard.testing import free_port
from fullshard.train.metrics import read_metrics
from reliability_helpers import checkpoint_tensors, differing, env, fullshard, tiny_args

STEPS, EVERY = 8, 4  # a checkpoint at 4 (resumed from below) and at 8 (compared)


def _losses(run_dir: Path) -> dict[int, float]:
    records = [r for r in read_metrics(run_dir / "metrics.jsonl") if r["kind"] == "train"]
    steps = [r["step"] for r in records]
    assert len(steps) == len(set(steps)), f"duplicate steps in metrics.jsonl: {steps}"
    return {r["step"]: r["loss"] for r in records}


def _starts(run_dir: Path) -> list[dict[str, Any]]:
    return [r for r in read_metrics(run_dir / "metrics.jsonl") if r["kind"] == "start"]


def _final(run_dir: Path) -> dict[str, torch.Tensor]:
    return checkpoint_tensors(run_dir / "checkpoints" / f"step_{STEPS:08d}")


def _args(corpus: Path, run_dir: Path, *more: str) -> list[str]:
    return tiny_args(corpus, run_dir, STEPS, "--ckpt-every", str(EVERY), *more)


def _train(corpus: Path, run_dir: Path, *more: str) -> str:
    """``fullshard train`` on this machine (its own launcher); returns its output."""
    proc, _ = fullshard(*_args(corpus, run_dir, *more), cwd=run_dir.parent, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    return out


def _two_nodes(corpus: Path, run_dir: Path, *more: str, **extra_env: str) -> list[str]:
    """Two torchrun agents as two nodes of 2 ranks each, HSDP across them; their outputs."""
    port = free_port()
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2"]
    torchrun += ["--nproc-per-node", "2", "--rdzv-backend", "c10d", "--max-restarts", "1"]
    torchrun += ["--rdzv-id", f"fs-multinode-{port}", "--rdzv-endpoint", f"127.0.0.1:{port}"]
    torchrun += ["--monitor-interval", "0.2", "-m", "fullshard.train.worker"]
    flags = _args(corpus, run_dir, "--dp-replicate", "2", "--dp-shard", "2", *more)[1:]
    agents = [
        subprocess.Popen(
            [*torchrun, *flags],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env(**extra_env),
            cwd=run_dir.parent,
        )
        for _ in range(2)
    ]
    try:
        outputs = [a.communicate(timeout=300)[0] for a in agents]
    finally:
        for a in agents:
            if a.poll() is None:
                a.kill()
    assert [a.returncode for a in agents] == [0, 0], "\n\n".join(outputs)
    return outputs


def _resumable_copy(src: Path, dst: Path) -> Path:
    """``src`` as it was after step ``EVERY``: the later checkpoint removed."""
    shutil.copytree(src, dst)
    shutil.rmtree(dst / "checkpoints" / f"step_{STEPS:08d}")
    return dst


@pytest.fixture(scope="module")
def one_process(corpus: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    run_dir = tmp_path_factory.mktemp("one") / "run"
    _train(corpus, run_dir, "--nproc", "1")
    return run_dir


@pytest.fixture(scope="module")
def local_hsdp(corpus: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """``fullshard train --dp-replicate 2 --dp-shard 2``: 4 ranks (from the degrees)."""
    run_dir = tmp_path_factory.mktemp("local") / "run"
    return run_dir, _train(corpus, run_dir, "--dp-replicate", "2", "--dp-shard", "2")


@pytest.fixture(scope="module")
def two_nodes(corpus: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[str]]:
    """Two torchrun nodes, 2 x 2 HSDP; rank 3 (the second node's second rank) SIGKILLed at
    the start of step 6, in the first attempt."""
    run_dir = tmp_path_factory.mktemp("nodes") / "run"
    fault = "kill@step=6,rank=3,attempt=0"
    return run_dir, _two_nodes(corpus, run_dir, FULLSHARD_FAULT=fault)


def _assert_parity(run: Path, ref: Path, steps: range) -> None:
    losses, expected = _losses(run), _losses(ref)
    assert sorted(losses) == list(range(1, STEPS + 1))
    for step in steps:
        assert losses[step] == pytest.approx(expected[step], rel=1e-5), step
    got, want = _final(run), _final(ref)
    assert sorted(got) == sorted(want)
    for name in want:  # weights and AdamW moments: equal up to summation order
        assert torch.allclose(got[name].float(), want[name].float(), rtol=1e-4, atol=1e-5), name


def test_fullshard_train_hsdp_on_four_ranks_matches_one_process(
    one_process: Path, local_hsdp: tuple[Path, str]
) -> None:
    run_dir, out = local_hsdp
    assert "launching 4 rank(s), mesh 2 x 2 x 1 (dp_replicate x dp_shard x tp)" in out, out
    (start,) = _starts(run_dir)
    assert (start["world_size"], start["degrees"]) == (4, [2, 2, 1])
    manifest = json.loads((run_dir / "checkpoints" / "step_00000008" / "manifest.json").read_text())
    assert manifest["extra"]["degrees"] == [2, 2, 1]
    _assert_parity(run_dir, one_process, range(1, STEPS + 1))


def test_two_nodes_restart_both_groups_after_a_kill_and_match(
    one_process: Path, local_hsdp: tuple[Path, str], two_nodes: tuple[Path, list[str]]
) -> None:
    """The killed rank's agent restarts its group, the other node's ranks fail on the lost
    peer and restart too, and the 4 ranks meet again in attempt 1 (the same attempt on both
    nodes, whichever way each agent learnt of the failure), resume from step 4 and finish:
    parity with one process, bit-identical to the uninterrupted 4-rank run."""
    run_dir, outputs = two_nodes
    assert "4 rank(s) on cpu, mesh 2 x 2 x 1 (dp_replicate x dp_shard x tp)" in "".join(outputs)
    faults = [json.loads(line) for line in (run_dir / "faults.jsonl").read_text().splitlines()]
    assert [(f["kind"], f["rank"], f["step"]) for f in faults] == [("kill", 3, 6)]
    starts = _starts(run_dir)
    got = [(s["world_size"], s["degrees"], s["attempt"]) for s in starts]
    assert got == [(4, [2, 2, 1], 0), (4, [2, 2, 1], 1)], starts
    assert Path(starts[1]["resumed_from"]).name == "step_00000004"
    _assert_parity(run_dir, one_process, range(1, STEPS + 1))
    assert _losses(run_dir) == _losses(local_hsdp[0]), "\n\n".join(outputs)  # bit for bit
    diff = differing(_final(run_dir), _final(local_hsdp[0]))
    assert diff == [], f"tensors differ from the uninterrupted run: {diff}"


@pytest.mark.parametrize(
    ("layout", "flags", "degrees"),
    [
        ("1x2", ["--nproc", "2"], [1, 2, 1]),
        ("4x1", ["--dp-replicate", "4", "--dp-shard", "1"], [4, 1, 1]),
        ("1x2x2", ["--dp-shard", "2", "--tp", "2"], [1, 2, 2]),
    ],
)
def test_two_node_checkpoint_resumes_under_another_layout(
    layout: str,
    flags: list[str],
    degrees: list[int],
    two_nodes: tuple[Path, list[str]],
    corpus: Path,
    tmp_path: Path,
) -> None:
    """Step 4 of the two-node 2 x 2 run, resumed on one machine at ``layout``: steps 5-8 and
    the final weights match the two-node run."""
    run_dir = _resumable_copy(two_nodes[0], tmp_path / "run")
    out = _train(corpus, run_dir, *flags)
    assert f"resumed from {run_dir / 'checkpoints' / 'step_00000004'}" in out, out
    starts = _starts(run_dir)
    assert [s["degrees"] for s in starts] == [[2, 2, 1], [2, 2, 1], degrees]
    _assert_parity(run_dir, two_nodes[0], range(EVERY + 1, STEPS + 1))


def test_attempt_is_the_same_on_nodes_restarted_for_different_reasons(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """After one node's rank fails, its agent restarts its ranks (``TORCHELASTIC_RESTART_COUNT``
    1); the other node's agent may instead restart for the membership change, which torchrun
    does not count (still 0). Both must join the same attempt's keys of the shared store."""
    from datetime import timedelta

    import torch.distributed as dist

    from fullshard.train import loop

    port = free_port()
    host = dist.TCPStore("127.0.0.1", port, None, True, timedelta(seconds=30), False)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "fs-attempts")
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port))

    def attempts(restart_counts: list[int]) -> list[int]:
        out = []
        for rank, count in enumerate(restart_counts):
            monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", str(count))
            out.append(loop._rendezvous_store(rank, 4, 0)[1])
        return out

    assert attempts([0, 0, 0, 0]) == [0, 0, 0, 0]
    assert attempts([1, 1, 0, 0]) == [1, 1, 1, 1]  # node 1 restarted for the membership change
    assert attempts([1, 1, 1, 1]) == [2, 2, 2, 2]
    del host
