"""`fullshard bench`'s ``deepspeed`` mode: DeepSpeed ZeRO-3 as a peer (the ``peers`` extra).

Where DeepSpeed is importable, the tiny config runs ``deepspeed`` beside ``fsdp2`` and ``single``
on 2 gloo ranks: the loss check must pass (same model, init, batches, AdamW, fp32: DeepSpeed's
default gradient clipping would fail it), its traffic must be metered (its torch backend binds
its all-gather and reduce-scatter at start-up, so wrapping ``torch.distributed`` alone sees
none) and its config printed. Where it is not, those tests are reported as skipped, never as
passed. The "not installed" path always runs, with DeepSpeed hidden from the import system.

No timing assertions: the machine is shared.
"""

from __future__ import annotations

import importlib.util
import json
from typing import Any

import pytest

from fullshard.bench.cli import main
from fullshard.bench.configs import ALL_MODES, PEER_MODES, get_config
from fullshard.bench.report import markdown, table
from fullshard.peers import load_peer, peer_missing

HAVE_DEEPSPEED = importlib.util.find_spec("deepspeed") is not None
needs_deepspeed = pytest.mark.skipif(
    not HAVE_DEEPSPEED, reason="DeepSpeed is not installed (pip install -e '.[peers]')"
)


@pytest.fixture
def no_deepspeed(monkeypatch: pytest.MonkeyPatch) -> None:
    """DeepSpeed not found on the import path, whether or not this machine has it."""
    real = importlib.util.find_spec

    def find_spec(name: str, *args: Any, **kwargs: Any) -> Any:
        return None if name == "deepspeed" else real(name, *args, **kwargs)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)


def test_deepspeed_is_a_peer_mode_that_tiny_leaves_out() -> None:
    assert "deepspeed" in ALL_MODES and PEER_MODES == ("deepspeed",)
    for name in ("speed", "comm", "memory"):
        assert "deepspeed" in get_config(name).modes, name
    assert "deepspeed" not in get_config("tiny").modes  # DeepSpeed's start-up is not "seconds"


def test_without_deepspeed_asking_for_it_prints_the_install_line(
    no_deepspeed: None, capsys: pytest.CaptureFixture[str]
) -> None:
    rc = main(["--config", "tiny", "--modes", "deepspeed", "single", "--json"])
    assert rc == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        "fullshard bench: mode deepspeed: DeepSpeed is not installed; install it with: "
        "pip install 'fullshard[peers]'  (from a checkout: pip install -e '.[peers]')"
    ]
    assert peer_missing("deepspeed") is not None


def test_without_deepspeed_default_runs_skip_it_and_say_why(no_deepspeed: None) -> None:
    from fullshard.bench.cli import missing_peers

    skipped = missing_peers([get_config("speed"), get_config("tiny")])
    assert set(skipped) == {"deepspeed"}
    assert "pip install 'fullshard[peers]'" in skipped["deepspeed"]
    assert missing_peers([get_config("tiny")]) == {}  # not asked for: nothing to say


def test_the_config_is_zero3_defaults_fp32_and_no_clipping() -> None:
    cfg = load_peer("deepspeed").config(micro_batch=4)
    assert cfg == {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 0.0,
        "zero_optimization": {"stage": 3},
    }


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    if not HAVE_DEEPSPEED:
        pytest.skip("DeepSpeed is not installed (pip install -e '.[peers]')")
    out = tmp_path_factory.mktemp("bench_ds") / "bench.json"
    argv = ["--config", "tiny", "--nproc", "2", "--modes", "fsdp2", "deepspeed", "single"]
    rc = main([*argv, "--json", "--out", str(out)])
    data: dict[str, Any] = json.loads(out.read_text())
    data["_rc"] = rc
    return data


@needs_deepspeed
def test_deepspeed_trains_like_one_process(report: dict[str, Any]) -> None:
    (run,) = report["runs"]
    assert set(run["modes"]) == {"fsdp2", "deepspeed", "single"}
    lc = run["loss_check"]
    assert lc["reference"] == "single" and set(lc["max_rel_err"]) == {"fsdp2", "deepspeed"}
    assert lc["max_rel_err"]["deepspeed"] < lc["rtol"], lc
    assert lc["passed"] is True and report["_rc"] == 0
    assert run["modes"]["deepspeed"]["losses"] == pytest.approx(
        run["modes"]["fsdp2"]["losses"], rel=1e-6
    )


@needs_deepspeed
def test_deepspeed_traffic_is_metered(report: dict[str, Any]) -> None:
    (run,) = report["runs"]
    ds = run["modes"]["deepspeed"]
    c = ds["comm"]
    assert c["source"] == "torch.distributed wrappers and the engine's bound collectives"
    assert c["theory_bytes_per_step"] == 3 * run["param_bytes"]
    # every parameter gathered at least once per step and every gradient reduce-scattered
    assert c["bytes_per_step"]["all_gather"] >= run["param_bytes"]
    assert c["bytes_per_step"]["reduce_scatter"] >= run["param_bytes"]
    assert c["calls_per_step"]["reduce_scatter"] >= 1
    assert ds["ratio_vs_deepspeed"] == 1.0
    assert run["modes"]["fsdp2"]["ratio_vs_deepspeed"] is not None


@needs_deepspeed
def test_deepspeed_config_is_printed(report: dict[str, Any]) -> None:
    (run,) = report["runs"]
    e = run["modes"]["deepspeed"]["engine"]
    assert e["engine"].startswith("DeepSpeed 0.")
    assert e["config"]["zero_optimization"] == {"stage": 3}
    assert e["zero_resolved"]["stage"] == 3
    assert "param_persistence_threshold" in e["shown"]
    for text in (table(run), markdown(run)):
        assert '"zero_optimization": {"stage": 3}' in text
        assert "| deepspeed |" in text or "deepspeed  " in text
        assert "ZeRO defaults as resolved: overlap_comm" in text
