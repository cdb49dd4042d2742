"""`fullshard bench --config overhead` end to end, shrunk: 3 tiny units, 1 and 2 gloo ranks.

No timing assertions: what must hold is that each mode runs the engine it names, both engines
train identically, the report carries every number and a profile of fullshard's step, and the
printed command reruns exactly the same benchmark.
"""

from __future__ import annotations

import json
import shlex

import pytest

from fullshard.bench import cli, overhead

ARGS = ["--config", "overhead", "--units", "3", "--width", "8", "--batch", "2"]
ARGS += ["--steps", "3", "--warmup", "1", "--repeats", "2", "--nproc", "1,2"]
ARGS += ["--profile-steps", "1"]


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> dict:
    out = tmp_path_factory.mktemp("overhead") / "overhead.json"
    md = out.with_suffix(".md")
    assert cli.main([*ARGS, "--json", "--out", str(out), "--markdown", str(md)]) == 0
    data = json.loads(out.read_text())
    data["_markdown"] = md.read_text()
    return data


def test_every_world_and_mode_is_reported(report: dict) -> None:
    assert [w["world_size"] for w in report["worlds"]] == [1, 2]
    for w in report["worlds"]:
        assert list(w["modes"]) == list(overhead.OVERHEAD_MODES)
        for mode, m in w["modes"].items():
            assert len(m["repeat_step_ms"]) == 2, mode
            assert m["step_ms"] > 0 and len(m["losses"]) == 3
        assert w["modes"]["bare"]["overhead_us_per_unit"] == 0
        fs, peer = w["modes"]["fullshard"], w["modes"]["fsdp2"]
        assert fs["overhead_us_per_unit"] == pytest.approx(
            (fs["step_ms"] - w["modes"]["bare"]["step_ms"]) * 1e3 / 3
        )
        if peer["overhead_us_per_unit"] > 0:
            assert w["fullshard_vs_fsdp2_overhead"] == pytest.approx(
                fs["overhead_us_per_unit"] / peer["overhead_us_per_unit"]
            )


def test_each_mode_runs_its_engine_and_they_agree(report: dict) -> None:
    for w in report["worlds"]:
        modes = w["modes"]
        assert modes["fullshard"]["fsdp_module"].startswith("fullshard.")
        assert modes["fsdp2"]["fsdp_module"].startswith("torch.distributed.fsdp")
        assert modes["bare"]["fsdp_module"] is None
        assert w["fullshard_vs_fsdp2_max_rel_loss_diff"] < 1e-6
        assert modes["fullshard"]["losses"] == pytest.approx(modes["fsdp2"]["losses"], rel=1e-6)
    # One rank: sharding changes nothing, so the bare model trains the same.
    one = report["worlds"][0]["modes"]
    assert one["fullshard"]["losses"] == pytest.approx(one["bare"]["losses"], rel=1e-6)


def test_profile_is_of_fullshard_on_rank_0(report: dict) -> None:
    for w in report["worlds"]:
        p = w["profile"]
        assert p["steps"] == 1 and p["profiled_step_ms"] > 0
        for key in ("by_cumulative", "by_own"):
            assert 0 < len(p[key]) <= 15
        names = [r["function"] for r in p["by_cumulative"]]
        assert names[0].endswith("(_step)")  # the whole step comes first
        names += [r["function"] for r in p["by_own"]]
        assert not [n for n in names if "torch/distributed/fsdp/" in n], names  # not FSDP2's
        if w["world_size"] > 1:  # on one rank (local transport) the engine may rank below 15
            assert any(n.startswith("fullshard/") and "bench" not in n for n in names), names


def test_printed_command_reruns_the_same_benchmark(report: dict) -> None:
    cmd = report["command"]
    assert cmd in report["_markdown"] and cmd in overhead.table(report)
    argv = shlex.split(cmd)
    assert argv[:2] == ["fullshard", "bench"]
    again = cli._configure_overhead(cli._parser().parse_args(argv[2:]))
    assert again == cli._configure_overhead(cli._parser().parse_args(ARGS))
    assert report["config"]["units"] == 3 and report["config"]["nprocs"] == [1, 2]


def test_flags_that_do_not_apply_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["--config", "overhead", "--n-layer", "2"]) == 2
    assert "--n-layer" in capsys.readouterr().err
    assert cli.main(["--config", "tiny", "--units", "4"]) == 2
    assert "--units" in capsys.readouterr().err
    assert cli.main(["--config", "overhead", "--modes", "fullshard", "fsdp2"]) == 2
    assert "keep 'bare'" in capsys.readouterr().err
    with pytest.raises(ValueError, match="unknown overhead modes"):
        overhead.OverheadConfig(modes=("ddp", "bare"))


def test_profile_summarises_the_engine_labels(tmp_path) -> None:
    """``--profile``: the profiled steps run under torch.profiler and the report sums each of
    fullshard's labels ([Note: profiler labels]), with the command carrying the flag."""
    from fullshard.engine.labels import LABELS

    args = ["--config", "overhead", "--units", "3", "--width", "8", "--batch", "2"]
    args += ["--steps", "2", "--warmup", "1", "--repeats", "1", "--nproc", "2"]
    args += ["--modes", "fullshard,bare", "--profile-steps", "2", "--profile"]
    out = tmp_path / "labels.json"
    assert cli.main([*args, "--json", "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    (w,) = data["worlds"]
    p = w["profile"]
    assert p["kind"] == "labels" and p["steps"] == 2
    rows = {r["label"]: r for r in p["labels"]}
    expected = set(LABELS) - {"all_gather_copy_out"}  # these units' parameters are views
    assert expected <= set(rows), sorted(rows)
    for label in expected:
        assert rows[label]["calls_per_step"] >= 1 and rows[label]["cpu_ms_per_step"] > 0, label
    assert rows["pre_forward"]["calls_per_step"] == 4  # 3 blocks and the root, per step
    assert "--profile" in shlex.split(data["command"])
    assert "fullshard's profiler labels" in overhead.table(data)
