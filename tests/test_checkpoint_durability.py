"""Durability: a save killed mid-write leaves the previous checkpoint as ``latest``; partial
directories are ignored and cleaned; keep-last-K rotation; overwrite rules; RNG state as JSON.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

import fullshard.checkpoint as ckpt
from test_checkpoint_models import TinyNet, assert_same, make_model, make_optimizer

TESTS = Path(__file__).parent
SRC = TESTS.parent / "src"

_CRASH_SCRIPT = textwrap.dedent(
    """
    import os, sys
    sys.path.insert(0, {tests!r})
    import torch.distributed as dist
    from safetensors.torch import save_file
    from test_checkpoint_models import make_model, make_optimizer, train_step
    import fullshard.checkpoint as ckpt
    from fullshard.testing import run_distributed

    def rank_fn(root):
        model = make_model(seed=0)
        opt = make_optimizer(model)
        manager = ckpt.CheckpointManager(root, keep_last=2)
        train_step(model, opt, 0)
        manager.save(1, model=model, optimizer=opt)
        full = ckpt.get_full_state_dict(model)
        if dist.get_rank() == 0:
            save_file({{k: v.clone() for k, v in full.items()}}, os.path.join(root, "expected.st"))
        train_step(model, opt, 1)
        os.environ["FULLSHARD_CKPT_TEST_WRITE_DELAY_S"] = "120"  # stall mid-file: get killed
        manager.save(2, model=model, optimizer=opt)
        return b""

    if __name__ == "__main__":
        run_distributed(rank_fn, 2, sys.argv[1], timeout=300)
    """
)


def test_sigkill_during_save_keeps_previous_checkpoint(tmp_path: Path) -> None:
    root = tmp_path / "checkpoints"
    script = tmp_path / "crash.py"
    script.write_text(_CRASH_SCRIPT.format(tests=str(TESTS)))
    env = {**os.environ, "PYTHONPATH": f"{SRC}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    proc = subprocess.Popen(
        [sys.executable, str(script), str(root)], env=env, start_new_session=True
    )
    partial = root / "step_00000002.partial"
    try:
        deadline = time.monotonic() + 120
        while not all((partial / f"rank_0000{r}.safetensors").exists() for r in (0, 1)):
            assert proc.poll() is None, f"crash script exited early with {proc.returncode}"
            assert time.monotonic() < deadline, "save of step 2 never started"
            time.sleep(0.2)
        time.sleep(0.3)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # the launcher and both ranks, mid-write
        proc.wait()
    assert partial.is_dir() and not (partial / "manifest.json").exists()
    assert ckpt.latest_checkpoint(root) == root / "step_00000001"
    assert ckpt.CheckpointManager(root).checkpoints() == [root / "step_00000001"]

    model = TinyNet()  # fresh process, 1 rank, unsharded: loads the 2-rank checkpoint
    extra = ckpt.load(root, model=model, optimizer=make_optimizer(model))
    assert extra["step"] == 1
    expected = load_file(root / "expected.st")
    assert_same({k: v for k, v in model.state_dict().items()}, expected, "after crash")

    # The next save under the root removes the leftover partial directory.
    ckpt.CheckpointManager(root, keep_last=2).save(3, model=model)
    assert not partial.exists()
    assert [p.name for p in ckpt.list_checkpoints(root)] == ["step_00000001", "step_00000003"]


def test_latest_rotation_and_partial_dirs(tmp_path: Path) -> None:
    model = make_model(seed=0)
    manager = ckpt.CheckpointManager(tmp_path, keep_last=2)
    assert manager.latest() is None and manager.load_latest(model=model) is None
    (tmp_path / "step_00000099.partial").mkdir()  # a crashed save
    (tmp_path / "step_00000050").mkdir()  # no manifest: not a checkpoint
    (tmp_path / "notes.txt").write_text("hi")
    for step in (10, 20, 30):
        manager.save(step, model=model, extra={"data_pos": step * 7})
    assert [p.name for p in manager.checkpoints()] == ["step_00000020", "step_00000030"]
    assert manager.latest() == tmp_path / "step_00000030"
    assert not (tmp_path / "step_00000099.partial").exists()
    assert manager.load_latest(model=TinyNet()) == {"data_pos": 210, "step": 30}
    # A run dir holding checkpoints/ resolves to its newest checkpoint.
    run = tmp_path / "run"
    ckpt.save(run / "checkpoints" / "step_00000005", model=model)
    assert ckpt.load(run, model=TinyNet()) == {}
    with pytest.raises(ckpt.CheckpointError, match="no complete checkpoint"):
        ckpt.load(tmp_path / "nowhere", model=model)


def test_overwrite_and_bad_extra(tmp_path: Path) -> None:
    model = make_model(seed=0)
    path = tmp_path / "step_00000001"
    ckpt.save(path, model=model, extra={"v": 1})
    with pytest.raises(ckpt.CheckpointError, match="already exists"):
        ckpt.save(path, model=model)
    ckpt.save(path, model=model, extra={"v": 2}, overwrite=True)
    assert ckpt.load(path, model=TinyNet()) == {"v": 2}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_00000001"]
    with pytest.raises(TypeError, match="JSON-serialisable"):
        ckpt.save(tmp_path / "x", model=model, extra={"rng": torch.get_rng_state()})


def test_async_save_single_process_and_wait(tmp_path: Path) -> None:
    model = make_model(seed=0)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    handle = ckpt.save(tmp_path / "a", model=model, async_save=True)
    with torch.no_grad():
        model.fc1.weight.add_(1.0)  # training continues: the snapshot is unaffected
    ckpt.save(tmp_path / "b", model=model)  # waits for the pending save first
    assert handle.done() and handle.wait() == tmp_path / "a"
    loaded = TinyNet()
    ckpt.load(tmp_path / "a", model=loaded)
    assert_same(dict(loaded.state_dict()), before, "async snapshot")


def test_rng_state_round_trips_through_json() -> None:
    torch.manual_seed(3)
    random.seed(4)
    np.random.seed(5)
    state = json.loads(json.dumps(ckpt.rng_state_to_json()))
    expected = (torch.rand(3), random.random(), np.random.rand())
    torch.manual_seed(0)
    random.seed(0)
    np.random.seed(0)
    ckpt.rng_state_from_json(state)
    got = (torch.rand(3), random.random(), np.random.rand())
    assert torch.equal(got[0], expected[0]) and got[1:] == expected[1:]
