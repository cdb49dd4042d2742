"""pytest configuration: GPU-only tests skip cleanly (and visibly) without CUDA; fixtures shared
by the ``fullshard train`` tests."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import fullshard.train.launch as launch_mod
from reliability_helpers import write_corpus


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (none on this machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def no_launch(monkeypatch: pytest.MonkeyPatch) -> list[object]:
    """``fullshard train`` in-process up to the launch: the launch is recorded (its arguments),
    not run, and no torchrun environment makes the command think it is a rank."""
    calls: list[object] = []
    monkeypatch.setattr(launch_mod, "launch", lambda *a, **k: calls.append(a) or 0)
    for var in ("TORCHELASTIC_RUN_ID", "RANK", "WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    return calls


@pytest.fixture(scope="session")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """~140 KB of text for the tiny preset (see reliability_helpers.write_corpus)."""
    return write_corpus(tmp_path_factory.mktemp("data") / "corpus.txt")
