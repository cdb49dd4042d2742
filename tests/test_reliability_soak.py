"""Soak: many steps of the tiny preset with a checkpoint every 10 steps, through the CLI.

Every rank samples its resident memory and open file descriptors every 10 steps (the trainer's
``FULLSHARD_RESOURCE_EVERY`` hook, ``fullshard/train/guard.py``). After warm-up, RSS may not
grow by 5% or more, the descriptor count may not change, and only ``--keep-last`` checkpoints
remain. CI runs the short form (60 steps); the long form (500 steps) is marked ``slow`` and runs
when ``FULLSHARD_RUN_SLOW=1`` (``scripts/reliability_report.py --slow`` sets it).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from fullshard.train.metrics import read_metrics
from reliability_helpers import fullshard, record, tiny_args, write_corpus

EVERY = 10  # checkpoint and sampling interval, steps
KEEP = 3


def _samples(run_dir: Path, rank: int) -> list[dict[str, float]]:
    text = (run_dir / f"resources_rank{rank}.jsonl").read_text()
    return [json.loads(line) for line in text.splitlines()]


def _soak(tmp_path: Path, steps: int, warmup: int, form: str) -> None:
    corpus = write_corpus(tmp_path / "corpus.txt")
    run_dir = tmp_path / "run"
    args = tiny_args(corpus, run_dir, steps, "--ckpt-every", str(EVERY))
    args += ["--keep-last", str(KEEP), "--eval-every", "50", "--log-every", "100"]
    proc, seconds = fullshard(
        *args, cwd=tmp_path, timeout=1800, FULLSHARD_RESOURCE_EVERY=str(EVERY)
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr

    figures: dict[str, object] = {}
    problems = []
    for rank in (0, 1):
        samples = _samples(run_dir, rank)
        assert [s["step"] for s in samples] == list(range(EVERY, steps + 1, EVERY))
        base = next(s for s in samples if s["step"] == warmup)
        after = [s for s in samples if s["step"] >= warmup]
        peak = max(s["rss_mib"] for s in after)
        growth = (peak - base["rss_mib"]) / base["rss_mib"]
        fds = sorted({int(s["fds"]) for s in after})
        figures[f"rank{rank}"] = {
            "rss_at_warmup_mib": base["rss_mib"],
            "rss_peak_after_mib": peak,
            "rss_end_mib": after[-1]["rss_mib"],
            "rss_growth_pct": round(100 * growth, 2),
            "fds": fds,
        }
        if growth >= 0.05:
            problems.append(f"rank {rank}: RSS {base['rss_mib']} -> {peak} MiB (+{growth:.1%})")
        if len(fds) != 1:
            problems.append(f"rank {rank}: open file descriptors changed: {fds}")

    ckpts = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    expected = [f"step_{s:08d}" for s in range(steps - EVERY * (KEEP - 1), steps + 1, EVERY)]
    if ckpts != expected:
        problems.append(f"checkpoints left: {ckpts}, expected {expected}")
    train = [r for r in read_metrics(run_dir / "metrics.jsonl") if r["kind"] == "train"]
    assert len(train) == steps
    step_s = sorted(r["step_time_s"] for r in train[warmup:])
    r0, r1 = figures["rank0"], figures["rank1"]
    assert isinstance(r0, dict) and isinstance(r1, dict)
    record(
        "soak",
        f"{form}: {steps} steps, checkpoint every {EVERY}",
        f"tiny preset, 2 ranks, --keep-last {KEEP}, samples every {EVERY} steps, warm-up "
        f"{warmup} steps",
        f"RSS growth after warm-up {r0['rss_growth_pct']}% / {r1['rss_growth_pct']}% "
        f"(rank 0 / 1; limit 5%), open fds {r0['fds']} / {r1['fds']}, checkpoints left "
        f"{len(ckpts)} of {steps // EVERY} saved",
        not problems,
        seconds=round(seconds, 1),
        steps=steps,
        warmup=warmup,
        median_step_s=round(step_s[len(step_s) // 2], 4),
        ranks=figures,
        checkpoints_left=ckpts,
    )
    assert not problems, problems


def test_soak_short(tmp_path: Path) -> None:
    _soak(tmp_path, steps=60, warmup=20, form="short (CI)")


@pytest.mark.slow
@pytest.mark.skipif(
    os.environ.get("FULLSHARD_RUN_SLOW") != "1", reason="long soak: set FULLSHARD_RUN_SLOW=1"
)
def test_soak_long(tmp_path: Path) -> None:
    _soak(tmp_path, steps=500, warmup=100, form="long")
