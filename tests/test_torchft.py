"""Fault-tolerant training with torchft (the real one, on CPU/gloo) over fullshard's units.

Two replica groups (of 1 rank each, then of 2 ranks each) train under a lighthouse this test
starts; one group is SIGKILLed mid-run, the other keeps committing steps alone (no restart),
the killed group is started again and heals live from the survivor, and at the end every
parameter and optimizer-state tensor is identical across the replica groups and equal to
torch FSDP2's under the very same torchft run (tests/torchft_worker.py trains both).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

torchft = pytest.importorskip("torchft", reason="torchft is not installed (pip install -e '.[ft]')")

WORKER = Path(__file__).with_name("torchft_worker.py")
SRC = Path(__file__).resolve().parents[1] / "src"
DEADLINE = 120.0  # seconds any one wait may take before the test fails (and tears down)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class ReplicaGroups:
    """The lighthouse (in this process) and the replica groups' worker processes.

    Each replica group is one OS process group (its rank 0 leads it), so a kill takes the
    whole group and teardown leaves no orphan.
    """

    def __init__(self, folder: Path, group_size: int) -> None:
        from torchft._torchft import LighthouseServer

        self.folder, self.group_size = folder, group_size
        # each engine next to its torch reference; FSDP1 on one rank is torch's NO_SHARD
        self.engines = {"fullshard": "torch"}
        if group_size > 1:
            self.engines["fullshard_fsdp1"] = "torch_fsdp1"
        self.lighthouse = LighthouseServer(
            bind="[::]:0", min_replicas=1, join_timeout_ms=200, heartbeat_timeout_ms=1000
        )
        self.procs: dict[int, list[subprocess.Popen]] = {}

    def start(self, replica: int) -> None:
        port, procs = free_port(), []
        for rank in range(self.group_size):
            env = dict(
                os.environ,
                PYTHONPATH=f"{SRC}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
                OMP_NUM_THREADS="1",
                GLOO_SOCKET_IFNAME="lo",
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(port),
                RANK=str(rank),
                WORLD_SIZE=str(self.group_size),
                REPLICA_GROUP_ID=str(replica),
                TORCHFT_LIGHTHOUSE=self.lighthouse.address(),
                TORCHFT_TEST_ENGINES=",".join(f"{e},{r}" for e, r in self.engines.items()),
            )
            with open(self.folder / f"out_{replica}_{rank}", "a") as log:
                procs.append(
                    subprocess.Popen(
                        [sys.executable, str(WORKER), str(self.folder)],
                        env=env,
                        stdout=log,
                        stderr=subprocess.STDOUT,
                        process_group=procs[0].pid if procs else 0,
                    )
                )
        self.procs[replica] = procs

    def kill(self, replica: int) -> None:
        procs = self.procs.pop(replica)
        try:
            os.killpg(procs[0].pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        for p in procs:
            p.wait()

    def join(self) -> None:
        end = time.monotonic() + DEADLINE
        for replica, procs in self.procs.items():
            for rank, p in enumerate(procs):
                p.wait(timeout=max(end - time.monotonic(), 1))
                assert p.returncode == 0, self.output(replica, rank)

    def close(self) -> None:
        for replica in list(self.procs):
            self.kill(replica)
        self.lighthouse.shutdown()

    def output(self, replica: int, rank: int) -> str:
        text = (self.folder / f"out_{replica}_{rank}").read_text()
        return f"replica group {replica} rank {rank} failed:\n{text[-4000:]}"

    def steps(self, replica: int, rank: int = 0) -> list[tuple[int, int, int, int]]:
        """The (step, participants, committed, pid) lines the rank has logged."""
        path = self.folder / f"log_{replica}_{rank}"
        if not path.exists():
            return []
        lines = path.read_text().splitlines()
        return [tuple(int(v) for v in line.split()) for line in lines if len(line.split()) == 4]  # type: ignore[misc]

    def committed(self, replica: int) -> int:
        """The number of steps the replica group has committed (its rank 0's last count)."""
        done = [s for s, _, c, _ in self.steps(replica) if c]
        return done[-1] + 1 if done else 0

    def wait_for(self, what: str, cond: Callable[[], bool]) -> None:
        end = time.monotonic() + DEADLINE
        while not cond():
            for replica, procs in self.procs.items():
                for rank, p in enumerate(procs):
                    assert p.poll() is None, self.output(replica, rank)
            assert time.monotonic() < end, f"timed out waiting for {what}"
            time.sleep(0.05)

    def stop_at(self, step: int) -> None:
        tmp = self.folder / "stop.tmp"
        tmp.write_text(str(step))
        tmp.replace(self.folder / "stop")


def finals(folder: Path, replicas: int, group_size: int) -> dict[tuple[int, int], dict]:
    return {
        (r, k): torch.load(folder / f"final_{r}_{k}.pt", weights_only=True)
        for r in range(replicas)
        for k in range(group_size)
    }


@pytest.mark.parametrize("group_size", [1, 2])
def test_kill_survive_heal_matches_torch_fsdp2(tmp_path: Path, group_size: int) -> None:
    groups = ReplicaGroups(tmp_path, group_size)
    try:
        groups.start(0)
        groups.start(1)
        # whichever group comes up first may start alone; the other then heals from it
        groups.wait_for(
            "both groups to commit 3 steps together",
            lambda: sum(1 for _, n, c, _ in groups.steps(1) if c and n == 2) >= 3,
        )
        killed_at = groups.committed(1)
        survivor_pid = groups.steps(0)[-1][3]
        groups.kill(1)
        groups.wait_for(
            "the survivor to commit 3 steps alone",
            lambda: sum(1 for _, n, c, _ in groups.steps(0) if c and n == 1) >= 3,
        )
        groups.start(1)
        groups.wait_for(
            "the restarted group to heal and commit 2 steps",
            lambda: (
                len([s for s in groups.steps(1)[-10:] if s[2]]) >= 2
                and groups.steps(1)[-1][3] != groups.steps(1)[0][3]
            ),
        )
        groups.stop_at(max(groups.committed(0), groups.committed(1)) + 3)
        groups.join()
    finally:
        groups.close()
    log0, log1 = groups.steps(0), groups.steps(1)
    assert {pid for *_, pid in log0} == {survivor_pid}, "the survivor was restarted"
    alone = [s for s, n, c, _ in log0 if c and n == 1 and s >= killed_at]
    assert len(alone) >= 3, f"the survivor committed no steps alone: {log0}"
    restarted = [s for s, _, c, pid in log1 if c and pid != log1[0][3]]
    assert restarted[0] > killed_at + 2, f"the restarted group did not heal: {log1}"
    state = finals(tmp_path, 2, group_size)
    step = state[0, 0]["step"]
    for key, final in state.items():
        assert final["step"] == step, key
        for engine, reference in groups.engines.items():
            assert final[engine].keys() == final[reference].keys()
            for name, ref in state[0, key[1]][engine].items():
                where = f"{engine} {name} on replica group {key[0]} rank {key[1]}"
                torch.testing.assert_close(final[engine][name], ref, rtol=0, atol=0, msg=where)
                torch.testing.assert_close(
                    final[reference][name], ref, rtol=1e-6, atol=1e-7, msg=where
                )
