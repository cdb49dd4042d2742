"""`fullshard bench` end to end in its short mode: 2 gloo ranks, tiny GPT, every mode, JSON.

No timing assertions: the machine is shared. What must hold is the shape of the report and the
loss check (every synchronised mode trains exactly like one process).
"""

from __future__ import annotations

import json

import pytest

from fullshard.bench.cli import fullshard_available, main
from fullshard.bench.comm import KINDS
from fullshard.bench.configs import BenchConfig, get_config
from fullshard.bench.report import markdown, table

MODE_FIELDS = {
    "world_size",
    "threads_per_rank",
    "step_s_median",
    "step_s_min",
    "step_s_max",
    "repeat_medians_s",
    "tokens_per_s",
    "ratio_vs_fsdp2",
    "ratio_vs_fsdp1",
    "ratio_vs_ddp",
    "peak_rss_mib_per_rank",
    "peak_rss_mib_max",
    "rss_after_setup_mib_per_rank",
    "rss_runtime_mib_per_rank",
    "peak_above_runtime_mib_max",
    "comm",
    "exposed_comm_s",
    "losses",
}
COMM_FIELDS = {
    "calls_per_step",
    "bytes_per_step",
    "total_bytes_per_step",
    "theory_bytes_per_step",
    "bytes_vs_theory",
    "blocked_s_per_step",
    "source",
}


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> dict:
    out = tmp_path_factory.mktemp("bench") / "bench.json"
    md = out.with_suffix(".md")
    rc = main(
        ["--config", "tiny", "--nproc", "2", "--json", "--out", str(out), "--markdown", str(md)]
    )
    assert rc == 0
    data = json.loads(out.read_text())
    data["_markdown"] = md.read_text()
    return data


def test_json_has_every_field(report: dict) -> None:
    assert {"machine", "runs", "skipped", "argv"} <= set(report)
    (run,) = report["runs"]
    assert run["nproc"] == 2 and run["global_batch"] == 4
    expected = set(get_config("tiny").modes) - set(report["skipped"])
    assert set(run["modes"]) == expected
    for mode, m in run["modes"].items():
        assert MODE_FIELDS <= set(m), mode
        assert m["step_s_min"] <= m["step_s_median"] <= m["step_s_max"]
        assert len(m["peak_rss_mib_per_rank"]) == m["world_size"]
        assert all(x > 0 for x in m["peak_rss_mib_per_rank"])
        assert m["ratio_vs_fsdp2"] is not None and m["ratio_vs_ddp"] is not None
    for mode in ("fsdp2", "ddp", "fullshard"):
        if mode in run["modes"]:
            c = run["modes"][mode]["comm"]
            assert COMM_FIELDS <= set(c)
            assert set(c["calls_per_step"]) == set(KINDS)
            assert c["theory_bytes_per_step"] > 0
            assert run["modes"][mode]["exposed_comm_s"] is not None


def test_traffic_matches_zero3_theory(report: dict) -> None:
    (run,) = report["runs"]
    fsdp2 = run["modes"]["fsdp2"]["comm"]
    # torch FSDP2: forward + backward all-gathers and one reduce-scatter per unit, 3 x params.
    assert fsdp2["bytes_vs_theory"] == pytest.approx(1.0, rel=0.02)
    assert fsdp2["calls_per_step"]["reduce_scatter"] == 3  # 2 blocks + root
    ddp = run["modes"]["ddp"]["comm"]
    assert ddp["bytes_vs_theory"] == pytest.approx(1.0, rel=0.02)
    if "fullshard" in run["modes"]:
        fs = run["modes"]["fullshard"]["comm"]
        # The root and the last block take back their pooled memory for backward instead of
        # regathering it ([Note: taking back a unit's own gathered memory]): two all-gathers
        # fewer than FSDP2's per step, the same reduce-scatters, less than the theory's bytes
        assert fs["calls_per_step"]["all_gather"] == fsdp2["calls_per_step"]["all_gather"] - 2
        assert fs["calls_per_step"]["reduce_scatter"] == fsdp2["calls_per_step"]["reduce_scatter"]
        assert 0.5 < fs["bytes_vs_theory"] < 0.98


def test_loss_check_passes(report: dict) -> None:
    (run,) = report["runs"]
    lc = run["loss_check"]
    assert lc["reference"] == "single"
    assert lc["passed"] is True
    assert set(lc["max_rel_err"]) == set(run["modes"]) - {"single", "nocomm"}


def test_rss_high_water_mark_was_reset(report: dict) -> None:
    (run,) = report["runs"]
    for m in run["modes"].values():
        # The HWM is reset after setup, so the peak is near the post-setup RSS, never below.
        for peak, setup in zip(m["peak_rss_mib_per_rank"], m["rss_after_setup_mib_per_rank"]):
            assert peak >= setup * 0.95


def test_tables_render(report: dict) -> None:
    (run,) = report["runs"]
    assert "loss check vs single" in table(run)
    assert report["_markdown"].count("| fsdp2 |") == 1
    assert markdown(run).startswith("**tiny")


def test_fullshard_mode_is_reported_or_explained(report: dict) -> None:
    why = fullshard_available()
    (run,) = report["runs"]
    assert ("fullshard" in run["modes"]) == (why is None)
    if why is not None:
        assert report["skipped"]["fullshard"] == why


def test_config_validation() -> None:
    with pytest.raises(ValueError, match="unknown modes"):
        get_config("tiny").replace(modes=("zero9",))
    with pytest.raises(ValueError, match="split evenly"):
        BenchConfig(name="x", n_layer=1, d_model=8, n_head=1, batch=3, steps=2, warmup=1, repeats=1)
    assert get_config("memory").global_batch(4) == 4
    assert get_config("speed").global_batch(2) == 8
