"""`fullshard bench`'s FSDP1 modes: ``fsdp1-fullshard`` (fullshard's ``FullyShardedDataParallel``)
beside ``fsdp1`` (torch's FSDP1, a peer), ``fullshard`` and ``fsdp2``.

The tiny config runs them on 2 gloo ranks with ``--modes`` (no config runs them by default):
every one trains like one process (the loss check), the FSDP1 wrapper issues the collectives
``fully_shard`` does on the same units (it is one fullshard unit per wrapper), torch's FSDP1's
are metered (on gloo it all-gathers into a list of tensors), and the tables compare the two
FSDP1s.

No timing assertions: the machine is shared.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from fullshard.bench.cli import main
from fullshard.bench.configs import CONFIGS, FSDP1_MODES
from fullshard.bench.report import markdown, table

MODES = ("fullshard", "fsdp1-fullshard", "fsdp1", "fsdp2", "single")


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("bench_fsdp1") / "bench.json"
    rc = main(
        [
            "--config",
            "tiny",
            "--nproc",
            "2",
            "--modes",
            ",".join(MODES),
            "--json",
            "--out",
            str(out),
        ]
    )
    data: dict[str, Any] = json.loads(out.read_text())
    data["_rc"] = rc
    return data


def test_fsdp1_modes_are_asked_for_by_name() -> None:
    assert all(set(FSDP1_MODES).isdisjoint(cfg.modes) for cfg in CONFIGS.values())


def test_every_fsdp1_mode_trains_like_one_process(report: dict[str, Any]) -> None:
    (run,) = report["runs"]
    assert tuple(run["modes"]) == MODES
    lc = run["loss_check"]
    assert lc["reference"] == "single" and set(lc["max_rel_err"]) == set(MODES) - {"single"}
    assert lc["passed"] is True and report["_rc"] == 0


def test_fsdp1_traffic(report: dict[str, Any]) -> None:
    (run,) = report["runs"]
    ours, fs = run["modes"]["fsdp1-fullshard"]["comm"], run["modes"]["fullshard"]["comm"]
    assert ours["source"] == "fullshard.count_collectives"
    assert ours["calls_per_step"] == fs["calls_per_step"]  # the same units, the same engine
    assert ours["bytes_per_step"] == fs["bytes_per_step"]
    theirs = run["modes"]["fsdp1"]["comm"]
    assert theirs["source"] == "torch.distributed wrappers"
    assert theirs["theory_bytes_per_step"] == 3 * run["param_bytes"]
    # 2 blocks and the root: each reduce-scattered once; the blocks gathered in forward and
    # backward, the root (which FSDP1 keeps gathered after forward) once
    assert theirs["calls_per_step"] == {"all_gather": 5, "reduce_scatter": 3, "all_reduce": 0}
    assert theirs["bytes_per_step"]["reduce_scatter"] >= run["param_bytes"]


def test_tables_compare_the_two_fsdp1s(report: dict[str, Any]) -> None:
    (run,) = report["runs"]
    assert run["modes"]["fsdp1"]["ratio_vs_fsdp1"] == 1.0
    assert run["modes"]["fsdp1-fullshard"]["ratio_vs_fsdp1"] > 0
    for text in (table(run), markdown(run)):
        assert "vs FSDP1" in text
        assert "fullshard's FSDP1 wrapper against torch's FSDP1: step time" in text
