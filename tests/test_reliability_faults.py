"""Faults injected into real ``fullshard train`` runs (2 gloo ranks under torchrun's agent).

Each fault comes from the trainer's test hook ``FULLSHARD_FAULT`` (see
``fullshard/train/guard.py``): a rank SIGKILLed mid-step or mid-save, a rank frozen with
SIGSTOP, a NaN written into one rank's gradient shard. The oracle is an uninterrupted run with
the same seed and steps: after recovery, every model and optimizer tensor is bit-identical.
Engine-level faults (a stuck rank, a divergent code path) are in ``test_faults_engine.py``.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import pytest

from fullshard.train.metrics import read_metrics
from reliability_helpers import (
    checkpoint_tensors,
    differing,
    fullshard,
    record,
    tiny_args,
)

STEPS = 20


@pytest.fixture(scope="module")
def reference(corpus: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An uninterrupted run: 20 steps, a checkpoint every 5."""
    root = tmp_path_factory.mktemp("ref")
    proc, _ = fullshard(*tiny_args(corpus, root / "run", STEPS, "--ckpt-every", "5"), cwd=root)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return root / "run"


def _faults(run_dir: Path) -> list[dict[str, object]]:
    path = run_dir / "faults.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _losses(run_dir: Path) -> dict[int, float]:
    return {
        r["step"]: r["loss"]
        for r in read_metrics(run_dir / "metrics.jsonl")
        if r["kind"] == "train"
    }


def _final(run_dir: Path) -> Path:
    return run_dir / "checkpoints" / f"step_{STEPS:08d}"


def test_sigkill_mid_step_then_mid_save_restarts_bit_identical(
    corpus: Path, reference: Path, tmp_path: Path
) -> None:
    """Attempt 0: rank 1 is SIGKILLed in step 13 (after backward, before the optimizer step).
    The agent restarts the group, which resumes from step 10 (the newest checkpoint). Attempt 1:
    rank 1 is SIGKILLed while writing the checkpoint of step 15; that save never completes, so
    attempt 2 resumes from step 10 again and finishes. The result equals the reference."""
    run_dir = tmp_path / "run"
    fault = "kill@step=13,rank=1,attempt=0;kill_in_save@step=15,rank=1,attempt=1"
    args = tiny_args(corpus, run_dir, STEPS, "--ckpt-every", "5", "--max-restarts", "2")
    proc, seconds = fullshard(*args, cwd=tmp_path, FULLSHARD_FAULT=fault)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out

    fired = [(f["kind"], f["step"], f["attempt"]) for f in _faults(run_dir)]
    assert fired == [("kill", 13, 0), ("kill_in_save", 15, 1)], fired
    starts = [r for r in read_metrics(run_dir / "metrics.jsonl") if r["kind"] == "start"]
    resumed = [Path(s["resumed_from"]).name if s["resumed_from"] else None for s in starts]
    assert resumed == [None, "step_00000010", "step_00000010"], resumed
    assert out.count(f"resumed from {run_dir / 'checkpoints' / 'step_00000010'}") == 2, out

    ckpts = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    assert ckpts == ["step_00000010", "step_00000015", "step_00000020"], ckpts  # no .partial
    assert _losses(run_dir) == _losses(reference)  # every step, bit for bit
    diff = differing(checkpoint_tensors(_final(run_dir)), checkpoint_tensors(_final(reference)))
    assert diff == [], f"tensors differ from the uninterrupted run: {diff}"

    record(
        "faults",
        "SIGKILL one rank mid-step",
        "rank 1 of 2 killed in step 13 (after backward, before optimizer.step)",
        "agent restarted the group; resumed from step 10; final weights and optimizer state "
        "bit-identical to an uninterrupted run",
        True,
        seconds=round(seconds, 1),
    )
    record(
        "faults",
        "SIGKILL one rank during a checkpoint save",
        "rank 1 of 2 killed after writing its shard of step 15, before the manifest",
        "save of step 15 never published; restart resumed from step 10 (the previous "
        "checkpoint); final state bit-identical",
        True,
        seconds=round(seconds, 1),
    )


def test_sigstop_rank_fails_the_group_within_the_timeout(corpus: Path, tmp_path: Path) -> None:
    """A rank frozen with SIGSTOP never answers its collectives: the other rank fails after
    --collective-timeout seconds with a CollectiveError naming the collective, the unit and the
    rank, and the job exits non-zero (no restarts allowed here) instead of hanging."""
    run_dir = tmp_path / "run"
    timeout = 4
    args = tiny_args(corpus, run_dir, STEPS, "--ckpt-every", "5", "--max-restarts", "0")
    args += ["--collective-timeout", str(timeout), "--stop-timeout", "3"]
    proc, seconds = fullshard(
        *args, cwd=tmp_path, timeout=240, FULLSHARD_FAULT="stop@step=8,rank=1"
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out
    assert [(f["kind"], f["step"]) for f in _faults(run_dir)] == [("stop", 8)]
    m = re.search(
        r"CollectiveError: (rank \d+: (\w+) of unit '([^']+)'.*failed after ([\d.]+)s)", out
    )
    assert m, out
    message, collective, unit, waited = m.group(1), m.group(2), m.group(3), float(m.group(4))
    assert collective in ("all_gather", "reduce_scatter") and unit, message
    assert timeout <= waited < timeout + 3, f"failed after {waited}s with a {timeout}s timeout"
    assert "--collective-timeout" in out  # the message says which knob sets the timeout
    record(
        "faults",
        "Hung rank (SIGSTOP)",
        f"rank 1 of 2 stopped at step 8; --collective-timeout {timeout}",
        f"rank 0 raised CollectiveError after {waited:.1f}s: {message.split(' (group')[0]}; "
        "job exited 1 (with --max-restarts > 0 the agent restarts it after the agent's 30 s "
        "SIGTERM grace)",
        True,
        seconds=round(seconds, 1),
    )


@pytest.mark.slow
@pytest.mark.skipif(
    os.environ.get("FULLSHARD_RUN_SLOW") != "1", reason="slow (~1 min): set FULLSHARD_RUN_SLOW=1"
)
def test_sigstop_rank_then_elastic_restart_bit_identical(
    corpus: Path, reference: Path, tmp_path: Path
) -> None:
    """The same hang with a restart allowed: the group fails after the timeout, the agent kills
    the stopped rank (after its 30 s grace), restarts, and the run resumes from step 5 and
    finishes bit-identical to the uninterrupted one."""
    run_dir = tmp_path / "run"
    args = tiny_args(corpus, run_dir, STEPS, "--ckpt-every", "5", "--max-restarts", "1")
    args += ["--collective-timeout", "4"]
    proc, seconds = fullshard(
        *args, cwd=tmp_path, timeout=300, FULLSHARD_FAULT="stop@step=8,rank=1"
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    stopped_at = float(_faults(run_dir)[0]["time"])  # type: ignore[arg-type]
    starts = [r for r in read_metrics(run_dir / "metrics.jsonl") if r["kind"] == "start"]
    assert [s["step"] for s in starts] == [0, 5], starts
    restart_after = starts[1]["time"] - stopped_at
    assert _losses(run_dir) == _losses(reference)
    diff = differing(checkpoint_tensors(_final(run_dir)), checkpoint_tensors(_final(reference)))
    assert diff == [], diff
    record(
        "faults",
        "Hung rank (SIGSTOP), restart allowed",
        "rank 1 of 2 stopped at step 8; --collective-timeout 4, --max-restarts 1",
        f"group failed after the timeout; restarted {restart_after:.0f} s after the stop "
        "(timeout + the agent's 30 s grace + start-up); resumed from step 5; final state "
        "bit-identical",
        True,
        seconds=round(seconds, 1),
    )


def test_nonfinite_gradients_are_skipped_on_every_rank_then_stop(
    corpus: Path, tmp_path: Path
) -> None:
    """NaN written into rank 1's gradient shard (after the reduce-scatter) at step 3, then at
    steps 6, 7, 8. The global grad norm is NaN on every rank, so every rank skips the same
    optimizer steps: the checkpoint of step 3 equals that of step 2 bit for bit (had one rank
    stepped, its shards would differ). With --max-skipped-steps 2 the third consecutive skip
    stops the run with exit 1 and a message naming the steps, without an elastic restart."""
    run_dir = tmp_path / "run"
    args = tiny_args(corpus, run_dir, STEPS, "--ckpt-every", "1", "--keep-last", "0")
    args += ["--max-skipped-steps", "2", "--max-restarts", "1"]  # a restart is allowed
    proc, seconds = fullshard(*args, cwd=tmp_path, FULLSHARD_FAULT="nan_grad@steps=3|6|7|8,rank=1")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out
    assert "stopped after step 8: 3 consecutive steps had non-finite gradients (steps 6-8)" in out
    assert "--max-skipped-steps 2" in out and "Lower --lr" in out
    # no elastic restart although one is allowed: the launcher did not restart the group and
    # no second attempt resumed from a checkpoint
    assert "restarting the group" not in out and "resumed from" not in out, out
    records = read_metrics(run_dir / "metrics.jsonl")
    assert [r["kind"] for r in records].count("start") == 1
    train = {r["step"]: r for r in records if r["kind"] == "train"}
    assert [s for s, r in train.items() if r["skipped"]] == [3, 6, 7, 8]
    assert train[8]["skipped_steps"] == 4 and train[2]["grad_norm"] is not None
    stop = records[-1]
    assert (stop["kind"], stop["reason"], stop["skipped_steps"]) == ("stop", "nonfinite", 4)

    ckpt = run_dir / "checkpoints"
    step = {i: checkpoint_tensors(ckpt / f"step_{i:08d}") for i in (2, 3, 4)}
    assert differing(step[2], step[3]) == [], "a rank stepped its optimizer on a NaN step"
    assert len(differing(step[3], step[4])) == len(step[3]), "step 4 should update everything"
    assert not (ckpt / "step_00000008").exists()  # nothing saved from the failing steps
    record(
        "faults",
        "Non-finite gradients",
        "NaN in one element of rank 1's gradient shard at steps 3, 6, 7, 8; --max-skipped-steps 2",
        "step 3 skipped on both ranks (state bit-identical to step 2); steps 6-8 skipped, then "
        "a clear stop (exit 1, no restart); metrics.jsonl counts 4 skips",
        True,
        seconds=round(seconds, 1),
    )


def test_damaged_newest_checkpoint_falls_back_then_disk_full_stops_at_once(
    corpus: Path, reference: Path, tmp_path: Path
) -> None:
    """The reference run's newest checkpoint (step 20) gets one flipped byte in rank 1's file;
    the rerun falls back to step 15 (saying so) and retrains steps 16-20 bit-identically. Its
    save of step 20 then fails on rank 1 with ENOSPC: the job stops at once (exit 1, no
    restart although --max-restarts is 1) with one final error line naming the cause and
    the fix; the tracebacks are in RUN_DIR/logs, not on the terminal."""
    from fullshard.checkpoint.safetensors_io import read_header

    run_dir = tmp_path / "run"
    shutil.copytree(reference, run_dir)
    damaged = _final(run_dir) / "rank_00001.safetensors"
    entries, _, _ = read_header(damaged)
    data = bytearray(damaged.read_bytes())
    data[min(e.begin for e in entries.values()) + 5] ^= 0x40
    damaged.write_bytes(bytes(data))

    args = tiny_args(corpus, run_dir, STEPS, "--ckpt-every", "5", "--max-restarts", "1")
    fault = f"enospc_in_save@step={STEPS},rank=1"
    tmp = tmp_path / "tmp"  # the ranks' coordination files: removed once the group stopped
    tmp.mkdir()
    proc, seconds = fullshard(*args, cwd=tmp_path, FULLSHARD_FAULT=fault, TMPDIR=str(tmp))
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out
    assert list(tmp.glob("fullshard-*")) == []
    ckpts = run_dir / "checkpoints"
    assert f"checkpoint {_final(run_dir)} is damaged (checksum mismatch in {damaged}" in out
    assert f"resumed from {ckpts / 'step_00000015'} at step 15" in proc.stdout
    assert _losses(run_dir) == _losses(reference)  # steps 16-20 redone exactly

    last = proc.stderr.strip().splitlines()[-1]
    partial = ckpts / f"step_{STEPS:08d}.partial" / "rank_00001.safetensors"
    assert last.startswith(f"fullshard train: error: No space left on device ({partial})"), out
    assert "--run-dir" in last and "run the same command again" in last
    assert "Traceback" not in out and len(proc.stderr.splitlines()) <= 3, proc.stderr
    assert [(f["kind"], f["attempt"]) for f in _faults(run_dir)] == [("enospc_in_save", 0)]
    starts = [r for r in read_metrics(run_dir / "metrics.jsonl") if r["kind"] == "start"]
    assert len(starts) == 2, starts  # the reference's and this run's: no restart
    assert "OSError: [Errno 28]" in (run_dir / "logs" / "rank_1.log").read_text()
    record(
        "faults",
        "Damaged newest checkpoint",
        "one byte flipped in rank 1's file of the newest checkpoint (step 20)",
        "the ranks found the bad block at load and fell back to step 15 together, saying so; "
        "steps 16-20 retrained bit-identically",
        True,
        seconds=round(seconds, 1),
    )
    record(
        "faults",
        "Disk full during a save",
        "rank 1's write of the step 20 checkpoint fails with ENOSPC; --max-restarts 1",
        f"job stopped at once (exit 1, no restart), nothing published; last line: {last}",
        True,
        seconds=round(seconds, 1),
    )


def test_bare_torchrun_does_not_retry_a_full_disk(corpus: Path, tmp_path: Path) -> None:
    """Under torchrun itself (no ``fullshard train`` launcher), ``--max-restarts 1``: the save
    of step 1 fails with ENOSPC on rank 1 in every attempt. The agent restarts the group as it
    always does, but the restarted ranks find the stop marker of attempt 0 and exit at once
    with the same one-line error: no second training start, no second save attempt. See
    [Note: no restart under a bare torchrun] in fullshard/train/failures.py."""
    import subprocess
    import sys
    import time

    from reliability_helpers import env

    run_dir = tmp_path / "run"
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    torchrun += ["--nproc-per-node", "2", "--max-restarts", "1", "-m", "fullshard.train.worker"]
    args = tiny_args(corpus, run_dir, 1, "--ckpt-every", "1")[1:]  # the worker takes train's flags
    t0 = time.monotonic()
    proc = subprocess.run(
        [*torchrun, *args],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=300,
        env=env(FULLSHARD_FAULT="enospc_in_save@step=1,rank=1,attempt=*"),
    )
    seconds = time.monotonic() - t0
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out
    errors = [line for line in proc.stderr.splitlines() if "fullshard train: error: " in line]
    assert len(errors) == 2, out  # attempt 0: rank 1's; attempt 1: the first rank to start
    first, again = errors
    assert first.startswith("fullshard train: error: No space left on device"), out
    assert again.endswith("(rank 1, attempt 0; not retried: it would fail the same way)"), out
    assert first.split("error: ")[1].split(" (traceback")[0] in again, out
    assert [(f["kind"], f["attempt"]) for f in _faults(run_dir)] == [("enospc_in_save", 0)]
    starts = [r for r in read_metrics(run_dir / "metrics.jsonl") if r["kind"] == "start"]
    assert len(starts) == 1, starts  # attempt 1 never started training
    record(
        "faults",
        "Disk full under a bare torchrun",
        "torchrun --max-restarts 1 -m fullshard.train.worker; rank 1's save fails with ENOSPC "
        "in every attempt",
        "attempt 0 stops with one error line; the agent's restart exits at once (stop marker "
        f"of attempt 0), before any work; its line: {again.strip()}",
        True,
        seconds=round(seconds, 1),
    )


_RANK = """
import errno, sys
from pathlib import Path
from fullshard.train import failures as f
role, rank, run_dir = sys.argv[1], int(sys.argv[2]), Path(sys.argv[3])
if role == "refused":
    sys.exit(f.exit_if_restart_refused())
exc = (
    OSError(errno.ENOSPC, "No space left on device", "x")
    if role == "fatal"
    else f.SecondaryFailure("saving x failed on another rank")
)
sys.exit(f.rank_failed(exc, run_dir=run_dir, rank=rank, launched=False))
"""


def test_a_failure_is_reported_once_and_no_rank_exits_before_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Under a bare torchrun, one rank per machine prints a deterministic failure's line, in the
    attempt that fails and in each restart the stop marker refuses, and no rank exits before
    that line is out: torchrun's agent stops the group at the first exit, so a rank exiting
    early could get the printer killed first (a CI failure of the test above). The ranks are
    this test's subprocesses; this process plays the agent (the marker is keyed by it). See
    [Note: one report per failure] in fullshard/train/failures.py."""
    import subprocess
    import sys
    import tempfile
    import time

    from fullshard.train import failures

    monkeypatch.setattr(os, "getppid", os.getpid)
    monkeypatch.setenv("TMPDIR", str(tmp_path))  # where the ranks' marker files go
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # and this process's
    monkeypatch.delenv(failures.LAUNCHER_ENV, raising=False)
    monkeypatch.delenv(failures.ATTEMPT_ENV, raising=False)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "a")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    marker = failures._stop_marker()
    assert marker is not None

    def rank(role: str, r: int) -> subprocess.Popen[str]:
        argv = [sys.executable, "-c", _RANK, role, str(r), str(tmp_path / "run")]
        return subprocess.Popen(argv, stderr=subprocess.PIPE, text=True, cwd=tmp_path)

    def finish(*ranks: subprocess.Popen[str]) -> tuple[list[int | None], list[str]]:
        errs = [p.communicate(timeout=60)[1] for p in ranks]
        lines = [x for e in errs for x in e.splitlines() if x.startswith("fullshard train:")]
        return [p.returncode for p in ranks], lines

    # Attempt 0: rank 0 fails only because the others did; it waits for their report.
    secondary = rank("secondary", 0)
    recorded = tmp_path / "run" / "logs" / "failure_rank0.json"  # written, then it waits
    deadline = time.monotonic() + 60
    while not recorded.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(1.0)
    assert secondary.poll() is None, "a secondary failure exited before any report"
    codes, lines = finish(rank("fatal", 1), rank("fatal", 2), secondary)
    assert codes == [failures.FATAL_EXIT, failures.FATAL_EXIT, 1], lines
    assert len(lines) == 1, lines  # one line for both ranks that hit the full disk
    assert lines[0].startswith("fullshard train: error: No space left on device (x); free")
    record = json.loads(marker.read_text())
    assert record["message"].startswith("No space left on device (x)"), record
    # Attempt 1, refused: another rank has claimed the line and not printed it yet.
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    claim = marker.with_name(f"{marker.stem}.1.line")
    claim.touch()
    waiting = rank("refused", 0)
    time.sleep(1.0)
    assert waiting.poll() is None, "a rank exited before the line was printed"
    claim.write_text("printed\n")
    assert finish(waiting) == ([failures.FATAL_EXIT], [])  # the claimant printed it
    # Two ranks of a refused attempt start together: one line in all.
    claim.unlink()
    codes, lines = finish(rank("refused", 0), rank("refused", 1))
    assert codes == [failures.FATAL_EXIT] * 2
    assert len(lines) == 1, lines
    assert lines[0].endswith(
        f"(rank {record['rank']}, attempt 0; not retried: it would fail the same way)"
    ), lines


def test_fault_spec_parsing() -> None:
    """The test hook's grammar (a typo must fail loudly, not inject nothing)."""
    from fullshard.train.guard import Fault, parse_faults

    assert parse_faults("") == []
    assert parse_faults("kill@step=13,rank=1;nan_grad@steps=3|6,attempt=*") == [
        Fault("kill", frozenset({13}), rank=1, attempt=0),
        Fault("nan_grad", frozenset({3, 6}), rank=0, attempt=None),
    ]
    for bad in ("explode@step=1", "kill@rank=1", "kill@step=1,when=now"):
        with pytest.raises(ValueError, match="FULLSHARD_FAULT"):
            parse_faults(bad)
