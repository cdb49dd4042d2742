"""``fullshard train --ft-lighthouse``: two replica groups of the real trainer under torchft.

Two ``fullshard train`` launches (1 CPU rank each) join a lighthouse this test starts (or, with
2 ranks each, the one the first launch serves: ``--ft-serve-lighthouse``). One is
SIGKILLed mid-run (its launcher, agent and worker); the other trains on alone, never
restarted, skipping the dead group's rows (which its metrics name); the killed one is started
again and heals live from the survivor. Every committed step appears once in the survivor's
metrics (none lost, none repeated), the restarted group continues from the step it healed at,
the skipped windows are exactly the dead group's rows of the deterministic batches, and the
two groups' checkpoints of a step after the heal are bit-identical.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from fullshard.testing import free_port, process_tree
from fullshard.train import data as data_mod
from fullshard.train.launch import package_root
from fullshard.train.metrics import read_metrics

pytest.importorskip("torchft", reason="torchft is not installed (pip install -e '.[ft]')")

DEADLINE = 90.0  # seconds any one wait may take before the test fails (and tears down)
BATCH, SEQ, CKPT_EVERY = 8, 32, 10


class Job:
    """The lighthouse (in this process) and one ``fullshard train`` launch per replica group."""

    def __init__(self, root: Path, nproc: int = 1, served: bool = False) -> None:
        from torchft._torchft import LighthouseServer

        self.root, self.nproc, self.served = root, nproc, served
        self.data = root / "data.txt"
        rng = np.random.default_rng(0)
        words = ["def", "return", "self", "x", "=", "+", "(", ")", ":", "\n", "    ", "for"]
        self.data.write_text(" ".join(rng.choice(words, 40_000)))
        self.lighthouse: Any = None  # served by replica group 0's launch
        self.address = f"127.0.0.1:{free_port()}"
        if not served:
            self.lighthouse = LighthouseServer(
                bind="[::]:0", min_replicas=1, join_timeout_ms=200, heartbeat_timeout_ms=1000
            )
            self.address = self.lighthouse.address()
        self.procs: dict[int, subprocess.Popen[bytes]] = {}

    def run_dir(self, replica: int) -> Path:
        return self.root / f"replica_{replica}"

    def start(self, replica: int) -> None:
        args = [
            *("--preset", "tiny", "--device", "cpu", "--nproc", str(self.nproc)),
            *("--data", str(self.data)),
            *("--seq-len", str(SEQ), "--global-batch", str(BATCH), "--micro-batch", "2"),
            *("--max-steps", "100000", "--warmup-steps", "0", "--eval-every", "0"),
            *("--ckpt-every", str(CKPT_EVERY), "--keep-last", "0", "--sample-tokens", "0"),
            *("--progress", "plain", "--log-every", "1000", "--max-restarts", "0"),
            *("--collective-timeout", "30", "--run-dir", str(self.run_dir(replica))),
            *("--ft-lighthouse", self.address, "--ft-replicas", "2"),
            *("--ft-replica-id", str(replica)),
            *(["--ft-serve-lighthouse"] if self.served and replica == 0 else []),
        ]
        paths = [str(package_root()), *filter(None, os.environ.get("PYTHONPATH", "").split(":"))]
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(paths), OMP_NUM_THREADS="1")
        with open(self.root / f"out_{replica}", "ab") as out:
            self.procs[replica] = subprocess.Popen(
                [sys.executable, "-m", "fullshard.cli", "train", *args],
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        if self.served and replica == 0:  # the other group joins once it serves
            self.wait_for("the lighthouse", lambda: "serving the torchft" in self.output(0))

    def kill(self, replica: int) -> None:
        """SIGKILL the launch: its launcher, agent and worker."""
        proc = self.procs.pop(replica)
        for pid in process_tree(proc.pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        proc.wait()

    def stop(self) -> None:
        """Ctrl-C-like stop of every launch (each saves its step and exits 0)."""
        for proc in self.procs.values():
            proc.send_signal(signal.SIGTERM)
        end = time.monotonic() + DEADLINE
        for replica, proc in list(self.procs.items()):
            proc.wait(timeout=max(end - time.monotonic(), 1))
            assert proc.returncode == 0, self.output(replica)
            del self.procs[replica]

    def close(self) -> None:
        for replica in list(self.procs):
            self.kill(replica)
        if self.lighthouse is not None:
            self.lighthouse.shutdown()

    def output(self, replica: int) -> str:
        lines = (self.root / f"out_{replica}").read_text(errors="replace").splitlines()
        mine = [line for line in lines if "torchft::" not in line]
        return f"replica group {replica}:\n" + "\n".join(mine[-60:])

    def records(self, replica: int, kind: str) -> list[dict[str, Any]]:
        path = self.run_dir(replica) / "metrics.jsonl"
        return [r for r in read_metrics(path) if r["kind"] == kind] if path.exists() else []

    def wait_for(self, what: str, cond: Callable[[], bool]) -> None:
        end = time.monotonic() + DEADLINE
        while not cond():
            for replica, proc in self.procs.items():
                assert proc.poll() is None, f"{what}: exited\n{self.output(replica)}"
            assert time.monotonic() < end, f"timed out waiting for {what}\n" + "\n".join(
                self.output(r) for r in self.procs
            )
            time.sleep(0.1)


def _quorum_steps(job: Job, replica: int, quorum: int) -> list[int]:
    return [
        r["step"] for r in job.records(replica, "ft") if r["committed"] and r["quorum"] == quorum
    ]


@pytest.mark.parametrize(
    "nproc, served", [(1, False), (2, True)], ids=["1-rank-groups", "2-rank-groups-served"]
)
def test_kill_one_replica_group_survivor_trains_on_restarted_heals(
    tmp_path: Path, nproc: int, served: bool
) -> None:
    job = Job(tmp_path, nproc, served)
    try:
        job.start(0)
        job.start(1)
        job.wait_for(
            "both groups to commit 3 steps together", lambda: len(_quorum_steps(job, 1, 2)) >= 3
        )
        killed_after = max(r["step"] for r in job.records(1, "train"))
        job.kill(1)
        # group 0 also committed steps alone before group 1 first joined: count only the later
        job.wait_for(
            "the survivor to commit 3 steps alone",
            lambda: len([s for s in _quorum_steps(job, 0, 1) if s > killed_after]) >= 3,
        )
        restarted_at = time.time()
        job.start(1)

        def heals() -> list[dict[str, Any]]:
            return [r for r in job.records(1, "heal") if r["time"] > restarted_at]

        job.wait_for("the restarted group to heal", lambda: bool(heals()))
        healed_at = heals()[0]["step"]
        job.wait_for(
            "a checkpoint both groups saved after the heal",
            lambda: any(s > healed_at for s in _quorum_steps(job, 1, 2) if s % CKPT_EVERY == 0),
        )
        job.stop()
    finally:
        job.close()

    # the survivor was never restarted and committed every step once: none lost or repeated
    assert len(job.records(0, "start")) == 1, job.output(0)
    steps = [r["step"] for r in job.records(0, "train")]
    first = 1 + max((r["step"] for r in job.records(0, "heal")), default=0)  # came up second
    assert steps == list(range(first, steps[-1] + 1)), steps
    alone = _quorum_steps(job, 0, 1)
    assert len([s for s in alone if s > killed_after]) >= 3, alone
    # the restarted group healed at a step the survivor had committed and went on from there
    assert killed_after < healed_at < steps[-1]
    restarted = [r["step"] for r in job.records(1, "train") if r["time"] > restarted_at]
    assert restarted[0] == healed_at + 1, restarted[:5]
    assert restarted == list(range(healed_at + 1, restarted[-1] + 1))
    # the skipped samples are the dead group's rows of each batch it missed
    tokens, mask = data_mod.load_data(
        str(job.data), data_dtype="auto", vocab_size=256, tokenizer="", cache_dir=tmp_path / "cache"
    )
    train = data_mod.TokenData.split(tokens, 0.02, byte_level=True, mask=mask).train
    sampler = data_mod.Sampler(len(train), seq_len=SEQ, global_batch=BATCH, seed=0)
    batches = {s: sampler.next_batch() for s in range(1, steps[-1] + 1)}
    skipped = [r for r in job.records(0, "ft") if r["committed"] and r["quorum"] == 1]
    for rec in skipped:
        assert rec["replicas"] == [0] and rec["skipped_rows"] == [[BATCH // 2, BATCH]], rec
        assert rec["skipped_starts"] == batches[rec["step"]][BATCH // 2 :].tolist(), rec
    inherited = [r["skipped_samples"] for r in job.records(0, "heal")]  # if it came up second
    total = job.records(0, "ft")[-1]["skipped_samples"]
    assert total == BATCH // 2 * len(skipped) + sum(inherited[-1:])
    # the groups are one model: their checkpoints of a step after the heal are bit-identical
    common = [s for s in _quorum_steps(job, 1, 2) if s > healed_at and s % CKPT_EVERY == 0]
    name = f"checkpoints/step_{common[0]:08d}"
    for f in sorted((job.run_dir(0) / name).iterdir()):
        other = job.run_dir(1) / name / f.name
        assert f.read_bytes() == other.read_bytes(), f"{f.name} of {name} differs"
