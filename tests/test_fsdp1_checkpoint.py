"""Checkpoints interoperate between torch's FSDP1, fullshard's ``FullyShardedDataParallel`` and
fullshard's ``fully_shard``, across world sizes.

Each engine trains the same model 2 steps on 2 ranks and saves model and optimizer state as
its users do: a FULL_STATE_DICT (rank 0's ``torch.save`` of ``state_dict()`` and
``FSDP.optim_state_dict``; for ``fully_shard``, DCP's ``get_state_dict(full_state_dict=True)``)
and a SHARDED_STATE_DICT written with torch DCP (``dcp.save`` of the sharded ``state_dict()``
and ``FSDP.optim_state_dict``: torch's FSDP1 writes ``ShardedTensor``, fullshard ``DTensor``).
Then, on 3 ranks, every engine loads every engine's checkpoints into a model built from
another seed (DCP's ``get_state_dict`` / ``dcp.load`` / ``set_state_dict``, which drive each
engine's own state-dict methods) and takes steps 2 and 3: their losses must be the ones the
saving run took next (step 3's depends on the optimizer state). fullshard runs under ``patch_torch_fsdp()`` (so DCP calls fullshard's FSDP1
methods); torch's FSDP1 without it, with ``use_orig_params=False`` (its optimizer state
values are wrong with ``True`` on CPU/gloo, see ``tests/test_fsdp1.py``). One step is
needed beyond the engines' own calls: torch's FSDP1 full optimizer state shares its tensors,
which must be cloned before DCP loads it into a ``fully_shard`` model (:func:`_unshared`; the
same holds for torch's FSDP2).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.fsdp import FullOptimStateDictConfig, FullStateDictConfig, StateDictType

import fullshard
from fsdp1_cases import ENGINES, VOCAB, make_net, wrap
from fullshard.testing import run_distributed

KINDS = ("torch", "fullshard", "fully_shard")  # torch's FSDP1, fullshard's FSDP1, fully_shard
ROWS, SEQ_LEN = 12, 5  # a global batch that splits over 2 and 3 ranks
TOL = 1e-5


@contextlib.contextmanager
def _engine(kind: str) -> Iterator[None]:
    patch = None if kind == "torch" else fullshard.patch_torch_fsdp()
    try:
        yield
    finally:
        if patch is not None:
            patch.undo()


def _build(kind: str, seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    if kind == "fully_shard":
        model: nn.Module = make_net(seed)
        for block in model.blocks:  # type: ignore[union-attr]
            fullshard.fully_shard(block)
        fullshard.fully_shard(model)
    else:
        model = wrap(kind, model=make_net(seed), use_orig_params=False)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def _step(model: nn.Module, opt: torch.optim.Optimizer, step: int) -> float:
    """One AdamW step on this rank's rows of step ``step``'s global batch; the global loss."""
    g = torch.Generator().manual_seed(500 + step)
    x, y = (torch.randint(0, VOCAB, (ROWS, SEQ_LEN), generator=g) for _ in range(2))
    per = ROWS // dist.get_world_size()
    rows = slice(dist.get_rank() * per, (dist.get_rank() + 1) * per)
    logits = model(x[rows]).float()
    loss = nn.functional.cross_entropy(logits.reshape(-1, VOCAB), y[rows].reshape(-1))
    loss.backward()
    opt.step()
    opt.zero_grad()
    total = loss.detach().clone()
    dist.all_reduce(total)
    return total.item() / dist.get_world_size()


def _save_fsdp1(kind: str, model: nn.Module, opt: torch.optim.Optimizer, folder: str) -> None:
    """What an FSDP1 user writes: a sharded DCP checkpoint and rank 0's full one."""
    cls = ENGINES[kind]
    with cls.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
        state = {"model": model.state_dict(), "optim": cls.optim_state_dict(model, opt)}
        dcp.save(state, checkpoint_id=os.path.join(folder, f"sharded-{kind}"))
    # offload_to_cpu stays off: torch's FSDP1 crashes with it on a CPU
    full = FullStateDictConfig(rank0_only=True)
    with cls.state_dict_type(
        model, StateDictType.FULL_STATE_DICT, full, FullOptimStateDictConfig(rank0_only=True)
    ):
        state = {"model": model.state_dict(), "optim": cls.optim_state_dict(model, opt)}
    if dist.get_rank() == 0:
        torch.save(state, os.path.join(folder, f"full-{kind}.pt"))


def _save_dcp(kind: str, model: nn.Module, opt: torch.optim.Optimizer, folder: str) -> None:
    """What a ``fully_shard`` user writes, through DCP's state-dict helpers."""
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=os.path.join(folder, f"sharded-{kind}"))
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    msd, osd = get_state_dict(model, opt, options=options)
    if dist.get_rank() == 0:
        torch.save({"model": msd, "optim": osd}, os.path.join(folder, f"full-{kind}.pt"))


def _save_all(folder: str) -> dict[str, list[float]]:
    """2 ranks: each engine trains 2 steps, saves both forms, then takes steps 2 and 3."""
    out = {}
    for kind in KINDS:
        with _engine(kind):
            model, opt = _build(kind, seed=0)
            losses = [_step(model, opt, s) for s in range(2)]
            save = _save_dcp if kind == "fully_shard" else _save_fsdp1
            save(kind, model, opt, folder)
            dist.barrier()
            out[kind] = losses + [_step(model, opt, s) for s in (2, 3)]
    return out


def _unshared(osd: dict[str, Any]) -> dict[str, Any]:
    """The optimizer state dict with every tensor its own. torch's FSDP1 writes a wrapper's
    full optimizer state as views of one buffer, and one ``step`` tensor for all of the
    wrapper's parameters; torch DCP's ``set_state_dict`` hands those tensors to a non-FSDP1
    model's optimizer as they are (torch's FSDP2 too), whose AdamW then increments the shared
    ``step`` once per parameter: Adam's bias correction goes wrong from the next step on."""
    state = {k: {n: v.clone() for n, v in entry.items()} for k, entry in osd["state"].items()}
    return {"state": state, "param_groups": osd["param_groups"]}


def _load(kind: str, source: str, form: str, folder: str) -> list[float]:
    """A fresh ``kind`` model and optimizer (another seed) loads ``source``'s checkpoint in
    ``form`` and takes steps 2 and 3 (step 3's loss depends on the optimizer state too)."""
    model, opt = _build(kind, seed=7)
    if form == "sharded":
        msd, osd = get_state_dict(model, opt)
        state = {"model": msd, "optim": osd}
        dcp.load(state, checkpoint_id=os.path.join(folder, f"sharded-{source}"))
        set_state_dict(model, opt, model_state_dict=msd, optim_state_dict=osd)
    else:
        full = torch.load(os.path.join(folder, f"full-{source}.pt"), weights_only=False)
        if kind == "fully_shard":
            full["optim"] = _unshared(full["optim"])
        options = StateDictOptions(full_state_dict=True)
        set_state_dict(
            model,
            opt,
            model_state_dict=full["model"],
            optim_state_dict=full["optim"],
            options=options,
        )
    return [_step(model, opt, s) for s in (2, 3)]


def _load_all(folder: str) -> dict[tuple[str, str, str], list[float]]:
    """3 ranks: every engine loads every engine's checkpoints, both forms."""
    out = {}
    for kind in KINDS:
        with _engine(kind):
            for source in KINDS:
                for form in ("full", "sharded"):
                    out[(kind, source, form)] = _load(kind, source, form, folder)
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Any]:
    folder = str(tmp_path_factory.mktemp("fsdp1_ckpt"))
    saved = run_distributed(_save_all, 2, folder, timeout=600)
    loaded = run_distributed(_load_all, 3, folder, timeout=600)
    return saved[0], loaded[0]


def test_the_three_engines_train_alike(runs: tuple[Any, Any]) -> None:
    saved, _ = runs
    for kind in KINDS:
        assert saved[kind] == pytest.approx(saved["torch"], rel=TOL), (kind, saved)


@pytest.mark.parametrize("form", ["full", "sharded"])
def test_checkpoints_saved_on_2_ranks_load_on_3_in_every_engine(
    runs: tuple[Any, Any], form: str
) -> None:
    """torch's FSDP1 checkpoints into fullshard's FSDP1 and ``fully_shard``, and back: the
    loading run's steps 2 and 3 are the saving run's (model and optimizer state restored)."""
    saved, loaded = runs
    for kind in KINDS:
        for source in KINDS:
            expected = saved[source][2:]
            got = loaded[(kind, source, form)]
            assert got == pytest.approx(expected, rel=TOL), (kind, source, form, got, expected)
