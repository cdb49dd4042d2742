"""Frameworks that drive torch FSDP2 get fullshard through ``fullshard.patch_torch_fsdp()``.

Each client script (``clients.py``) runs under torch FSDP2 and under fullshard in the same
spawn; fp32 losses must agree within 1e-5. Three spawns in all: 2 ranks for every client but
pipelining, 3 ranks to load the DCP checkpoints saved on 2, 4 ranks for pipelining.

- Accelerate's FSDP2 plugin: Accelerate only selects FSDP on accelerators, so on CPU the
  Accelerator's distributed type is set to FSDP by hand; prepare / save_state / load_state
  are Accelerate's own FSDP2 code.
- Lightning Fabric's ModelParallelStrategy runs as is (it adopts the spawned process group).
- torch pipelining: 2 stages x 2 data-parallel ranks (4 ranks, Schedule1F1B), each stage's
  module sharded over its data-parallel sub-mesh; also checked against a single-process run.
- torchtitan (``titan.py``, a spawn of its own, skipped where torchtitan is not installed):
  its llama3 model, FSDP application and chunked loss; no chunk gathers anything.
- FSDP1 (``fsdp1_clients.py``, a 2-rank spawn of its own): Accelerate's plugin with
  ``fsdp_version=1``, transformers' Trainer with an FSDP1 ``fsdp_config`` and Lightning's
  ``FSDPStrategy`` (Fabric's and the Trainer's), under torch's FSDP1 and under fullshard's
  ``FullyShardedDataParallel`` (Accelerate's CPU fallback overridden the same way, and its
  device set to ``cpu``, which torch's FSDP1 needs; Lightning's GPU-only check passed by a
  subclass, which hands torch's FSDP1 the CPU as ``device_id``).
"""

from __future__ import annotations

import math
from typing import Any

import pytest

from fullshard.engine.compat import TORCH_VERSION
from fullshard.testing import run_distributed

pytest.importorskip("transformers")
pytest.importorskip("accelerate")
pytest.importorskip("lightning")

# tests/clients is on sys.path (pytest prepends a test file's folder)
import fsdp1_clients

import clients

TOL = 1e-5
ENV = {"TORCHELASTIC_RUN_ID": "fullshard-clients"}  # Fabric: adopt the process group
# torch 2.9's pipelining opens a stage's links with a float received for an int64 sent, which
# gloo aborts on (torch's own FSDP2 too; fixed in 2.10): nothing to compare there.
PIPELINING_ON_GLOO = TORCH_VERSION >= (2, 10)


def close(a: list[float], b: list[float]) -> bool:
    return len(a) == len(b) > 0 and all(
        math.isclose(x, y, rel_tol=0, abs_tol=TOL) for x, y in zip(a, b)
    )


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    folder = str(tmp_path_factory.mktemp("clients"))
    two = run_distributed(clients.two_ranks, 2, folder, timeout=600, env=ENV)
    three = run_distributed(clients.three_ranks, 3, folder, timeout=600, env=ENV)
    four = (
        run_distributed(clients.four_ranks, 4, timeout=600, env=ENV) if PIPELINING_ON_GLOO else []
    )
    return {"two": two, "three": three, "four": four}


def _both(runs: dict[str, Any], client: str) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    return [(r["torch"][client], r["fullshard"][client]) for r in runs["two"]]


def test_transformers_llama(runs: dict[str, Any]) -> None:
    for torch_run, ours in _both(runs, "transformers"):
        assert close(ours["losses"], torch_run["losses"]), (ours["losses"], torch_run["losses"])
        assert ours["generated"] == torch_run["generated"]
        assert ours["reload_diff"] == 0.0  # from_pretrained reproduces the sharded model's logits
    rank0, rank1 = (r["fullshard"]["transformers"]["generated"] for r in runs["two"])
    assert len(rank0) < len(rank1)  # rank 0 stopped at its EOS; rank 1 went on (no hang)


def test_dcp_saved_on_2_loaded_on_3(runs: dict[str, Any]) -> None:
    for torch_run, ours in _both(runs, "dcp"):
        assert close(ours["losses"] + ours["after"], torch_run["losses"] + torch_run["after"])
    expected = runs["two"][0]["fullshard"]["dcp"]["after"]  # what the 2-rank run did next
    for r in runs["three"]:
        for engine in ("torch", "fullshard", "fullshard_from_torch"):
            for kind in ("sharded", "full"):
                assert close(r[engine][kind], expected), (engine, kind, r[engine][kind], expected)


@pytest.mark.skipif(not PIPELINING_ON_GLOO, reason="torch 2.9's pipelining aborts on gloo")
def test_pipelining_two_stages_two_replicas(runs: dict[str, Any]) -> None:
    import torch

    for r in runs["four"]:
        torch_run, ours, ref = r["torch"], r["fullshard"], r["reference"]
        stage = ours["stage"]
        assert torch_run["stage"] == stage
        if stage == 1:  # the last stage reports the losses
            assert close(ours["losses"], torch_run["losses"]), (ours["losses"], torch_run)
            assert close(ours["losses"], ref["losses"]), (ours["losses"], ref["losses"])
        else:
            assert ours["losses"] == torch_run["losses"] == []
        for a, b, c in zip(
            ours["weights"], torch_run["weights"], ref["weights"][stage], strict=True
        ):
            torch.testing.assert_close(a, b, rtol=0, atol=TOL)
            torch.testing.assert_close(a, c, rtol=0, atol=TOL)
        # 4 micro-batches, 2 units per stage: gradients reduced once per unit per step
        assert ours["reductions"] == [2, 2, 2]


def test_fabric_model_parallel(runs: dict[str, Any]) -> None:
    for torch_run, ours in _both(runs, "fabric"):
        assert close(ours["losses"] + ours["after"], torch_run["losses"] + torch_run["after"])
        # no_backward_sync: no reduce-scatter in the skipped micro-step, one per unit after
        assert ours["reduce_scatters"] == [[0, 3], [0, 3]]
        assert close(ours["again"], ours["after"])  # fabric.load restored model and optimizer


def test_accelerate_fsdp2_plugin(runs: dict[str, Any]) -> None:
    for torch_run, ours in _both(runs, "accelerate"):
        assert close(ours["losses"] + ours["after"], torch_run["losses"] + torch_run["after"])
        assert close(ours["again"], ours["after"])  # load_state restored model and optimizer


@pytest.fixture(scope="module")
def titan_runs() -> list[dict[Any, Any]]:
    # torchtitan 0.3 is built for torch 2.13 and newer: on 2.9 its loss module does not import,
    # on 2.10-2.11 its FSDP helpers (DataParallelMeshDims) do not, on 2.12 its ranks crash
    if TORCH_VERSION < (2, 13):
        pytest.skip("torchtitan 0.3 needs torch 2.13 or newer")
    pytest.importorskip("torchtitan", reason="torchtitan (the clients extra) is not installed")
    import titan

    return run_distributed(titan.two_ranks, 2, timeout=600)


def test_torchtitan_llama3_chunked_loss(titan_runs: list[dict[Any, Any]]) -> None:
    """torchtitan keeps its [norm, output] unit gathered over the loss chunks: no chunk of any
    step gathers anything (issue 42: from the second step on, each chunk's backward gathered
    the last block again); no unit is gathered more often than under FSDP2; same losses."""
    import titan

    for r in titan_runs:
        for ckpt in (False, True):
            ours, ref = r[("fullshard", ckpt)], r[("torch", ckpt)]
            assert close([s["loss"] for s in ours], [s["loss"] for s in ref]), (ours, ref)
            for step, (a, b) in enumerate(zip(ours, ref, strict=True)):
                assert a["chunks"] == [[]] * titan.CHUNKS, (ckpt, step, a["chunks"])
                for unit in set(b["forward"] + b["backward"]):
                    n = a["forward"].count(unit) + a["backward"].count(unit)
                    assert n <= b["forward"].count(unit) + b["backward"].count(unit), (ckpt, a, b)
                assert "head" in a["forward"] and "head" in a["backward"], a


@pytest.fixture(scope="module")
def fsdp1_runs(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    folder = str(tmp_path_factory.mktemp("fsdp1_clients"))
    return run_distributed(fsdp1_clients.two_ranks, 2, folder, timeout=600, env=ENV)


def test_accelerate_fsdp1_plugin(fsdp1_runs: list[dict[str, Any]]) -> None:
    """Accelerate's FSDP1 plugin (transformer auto-wrap, the optimizer prepared with the
    model): fp32 and bf16 losses as torch's FSDP1's; save_state / load_state restore model and
    optimizer, sharded (DCP) and full (fullshard only: Accelerate's full save offloads to the
    CPU, which crashes torch's FSDP1 there)."""
    for r in fsdp1_runs:
        torch_run, ours = r["torch"]["accelerate"], r["fullshard"]["accelerate"]
        assert close(ours["losses"] + ours["after"], torch_run["losses"] + torch_run["after"])
        assert close(ours["bf16"], torch_run["bf16"]), (ours["bf16"], torch_run["bf16"])
        assert set(ours["again"]) == {"SHARDED_STATE_DICT", "FULL_STATE_DICT"}
        for kind, again in ours["again"].items():
            assert close(again, ours["after"]), (kind, again, ours["after"])
        assert close(torch_run["again"]["SHARDED_STATE_DICT"], torch_run["after"])


def test_trainer_fsdp1(fsdp1_runs: list[dict[str, Any]]) -> None:
    """transformers' Trainer, ``fsdp="full_shard auto_wrap"`` with an FSDP1 ``fsdp_config``: the
    logged losses and clipped gradient norms are torch's FSDP1's, and so is a run resumed from
    its step-2 checkpoint. (Its step 3 is the uninterrupted run's; step 4 is not, under either
    engine: the fresh optimizer's state is not restored, since Accelerate loads FSDP1's sharded
    optimizer state into a template made from the optimizer, which has no state before its
    first step.)"""
    for r in fsdp1_runs:
        torch_run, ours = r["torch"]["trainer"], r["fullshard"]["trainer"]
        assert len(ours["losses"]) == 4
        assert close(ours["losses"], torch_run["losses"]), (ours, torch_run)
        assert all(
            math.isclose(a, b, rel_tol=TOL)
            for a, b in zip(ours["grad_norms"], torch_run["grad_norms"])
        ), (ours, torch_run)
        assert close(ours["resumed"], torch_run["resumed"]), (ours, torch_run)
        assert ours["resumed"][0] == ours["losses"][2]


def test_lightning_fabric_fsdp1(fsdp1_runs: list[dict[str, Any]]) -> None:
    """Lightning Fabric's FSDPStrategy (FSDP1), ``use_orig_params`` True (Lightning's default)
    and False (Lightning then checks that the optimizer holds FSDP1's ``_fsdp_flattened``
    parameters): losses (clipped by ``fabric.clip_gradients``) and the full weights as torch's
    FSDP1's; ``fabric.load`` of a sharded checkpoint (fullshard's own, and torch's) and of a
    full one (fullshard only: Lightning's full save offloads to the CPU, which crashes torch's
    FSDP1 there) restores model and optimizer."""
    import torch

    for r in fsdp1_runs:
        theirs, ours = r["torch"]["fabric"], r["fullshard"]["fabric"]
        assert set(ours) == {f"{o}-{k}" for o in (True, False) for k in ("sharded", "full")}
        for key, run in ours.items():
            ref = theirs[key.replace("full", "sharded")]  # the steps before a save are the same
            assert close(run["losses"] + run["after"], ref["losses"] + ref["after"]), (key, run)
            assert close(run["again"], run["after"]), (key, run)
            assert run["weights"].keys() == ref["weights"].keys()
            for name, w in run["weights"].items():
                torch.testing.assert_close(w, ref["weights"][name], rtol=0, atol=TOL)
        for key, ref in theirs.items():
            assert close(ref["again"], ref["after"]), (key, ref)
            assert close(ours[key]["from_torch"], ref["after"]), (key, ours[key])


def test_lightning_trainer_fsdp1(fsdp1_runs: list[dict[str, Any]]) -> None:
    """Lightning's Trainer with FSDPStrategy (FSDP1, ``use_orig_params=False``): 4 steps as
    torch's FSDP1's; resumed from the step-2 checkpoint (full, the Trainer's default, under
    fullshard; sharded under torch, whose full save crashes on a CPU), steps 3 and 4 again."""
    for r in fsdp1_runs:
        theirs, ours = r["torch"]["lightning"], r["fullshard"]["lightning"]
        assert ours["full"] and not theirs["full"]  # a file; torch's a folder of shards
        assert len(ours["losses"]) == 4
        assert close(ours["losses"], theirs["losses"]), (ours, theirs)
        assert close(ours["resumed"], ours["losses"][2:]), ours
        assert close(theirs["resumed"], theirs["losses"][2:]), theirs
