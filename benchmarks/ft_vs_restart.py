"""torchft healing against checkpoint-and-restart, one rank's process killed every N steps.

Both runs train the same ``tiny`` GPT to the same step on 2 CPU ranks with the same global
batch: ``restart`` is one ``fullshard train --nproc 2`` (a SIGKILLed worker makes the agent
restart the group from the newest checkpoint); ``torchft`` is two ``fullshard train --nproc 1
--ft-lighthouse`` replica groups under a lighthouse started here (replica group 1 is
SIGKILLed, launcher, agent and worker, and started again at once; it heals live). Printed per
run: wall time to the last step, committed steps lost (trained, then trained again after a
restart), samples skipped (torchft: the dead group's rows of the steps it missed), and
seconds idle of the killed rank (restart: from each kill to the first step after it; torchft:
from each kill to the heal, or to the last step) and of the other rank (restart: the same; torchft: the survivor's
steps longer than 3x its median step, i.e. its stalls at each failure and heal).

    python benchmarks/ft_vs_restart.py --steps 300 --kill-every 100 --ckpt-every 50
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from fullshard.testing import process_tree
from fullshard.train.launch import package_root
from fullshard.train.metrics import read_metrics


def kill_tree(pid: int, *, leaf_only: bool = False) -> None:
    """SIGKILL ``pid``'s tree (or only one worker: its deepest process)."""
    pids = process_tree(pid)
    for p in pids[-1:] if leaf_only else pids:
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass


def records(run_dir: Path, kind: str) -> list[dict[str, Any]]:
    path = run_dir / "metrics.jsonl"
    return [r for r in read_metrics(path) if r["kind"] == kind] if path.exists() else []


def last_step(run_dir: Path) -> int:
    return max((r["step"] for r in records(run_dir, "train")), default=0)


def launch(root: Path, name: str, *args: str) -> subprocess.Popen[bytes]:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(package_root()), env.get("PYTHONPATH")]))
    with open(root / f"{name}.out", "ab") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "fullshard.cli", "train", *args, "--run-dir", str(root / name)],
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


def common(args: argparse.Namespace, data: Path) -> list[str]:
    return [
        *("--preset", "tiny", "--device", "cpu", "--data", str(data), "--seq-len", "64"),
        *("--global-batch", "8", "--micro-batch", "2", "--max-steps", str(args.steps)),
        *("--warmup-steps", "0", "--eval-every", "0", "--sample-tokens", "0"),
        *("--ckpt-every", str(args.ckpt_every), "--progress", "plain", "--log-every", "1000"),
        *("--collective-timeout", "30"),
    ]


def run_restart(args: argparse.Namespace, root: Path, data: Path) -> dict[str, float]:
    kills = args.steps // args.kill_every - (args.steps % args.kill_every == 0)
    t0 = time.monotonic()
    proc = launch(
        root, "restart", *common(args, data), "--nproc", "2", "--max-restarts", str(kills)
    )
    killed_at: list[float] = []
    reached: list[int] = []  # the last step trained before each kill
    while proc.poll() is None:
        step = last_step(root / "restart")
        if len(killed_at) < kills and step >= (len(killed_at) + 1) * args.kill_every:
            killed_at.append(time.time())
            kill_tree(proc.pid, leaf_only=True)
            time.sleep(0.2)  # the other rank may finish the step in flight
            reached.append(last_step(root / "restart"))
        time.sleep(0.05)
    wall = time.monotonic() - t0
    assert proc.returncode == 0, (root / "restart.out").read_text()[-3000:]
    train = records(root / "restart", "train")  # cut back to each resumed step
    starts = records(root / "restart", "start")
    idle, lost = 0.0, 0
    for t, step in zip(killed_at, reached):
        idle += min(r["time"] for r in train if r["time"] > t) - t  # each rank, killed or not
        lost += step - min(r["step"] for r in starts if r["time"] > t)
    return {
        "wall_s": wall,
        "kills": len(killed_at),
        "lost_steps": lost,
        "skipped": 0,
        "idle_killed": idle,
        "idle_others": idle,
    }


def run_ft(args: argparse.Namespace, root: Path, data: Path) -> dict[str, float]:
    from torchft._torchft import LighthouseServer

    kills = args.steps // args.kill_every - (args.steps % args.kill_every == 0)
    lighthouse = LighthouseServer(
        bind="[::]:0", min_replicas=1, join_timeout_ms=200, heartbeat_timeout_ms=1000
    )
    ft = [*common(args, data), "--nproc", "1", "--max-restarts", "0"]
    ft += ["--ft-lighthouse", lighthouse.address(), "--ft-replicas", "2"]
    t0 = time.monotonic()
    procs = [launch(root, f"ft{r}", *ft, "--ft-replica-id", str(r)) for r in range(2)]
    killed_at: list[float] = []
    try:
        while procs[0].poll() is None:
            due = (len(killed_at) + 1) * args.kill_every
            if len(killed_at) < kills and last_step(root / "ft0") >= due:
                killed_at.append(time.time())
                kill_tree(procs[1].pid)
                procs[1].wait()
                procs[1] = launch(root, "ft1", *ft, "--ft-replica-id", "1")
            time.sleep(0.05)
        wall = time.monotonic() - t0
        procs[1].wait(timeout=120)
    finally:
        for p in procs:
            if p.poll() is None:
                kill_tree(p.pid)
        lighthouse.shutdown()
    assert procs[0].returncode == 0, (root / "ft0.out").read_text()[-3000:]
    train = records(root / "ft0", "train")
    heals = [r["time"] for r in records(root / "ft1", "heal")]
    end = train[-1]["time"]  # a group not back by the last step idles until then
    idle = sum(min([h for h in heals if h > t] + [end]) - t for t in killed_at)
    median = statistics.median(r["step_time_s"] for r in train)
    stalls = sum(r["step_time_s"] for r in train if r["step_time_s"] > 3 * median)
    ft_recs = records(root / "ft0", "ft")
    return {
        "wall_s": wall,
        "kills": len(killed_at),
        "lost_steps": len(train) - len({r["step"] for r in train}),
        "skipped": ft_recs[-1]["skipped_samples"] if ft_recs else 0,
        "idle_killed": idle,
        "idle_others": stalls,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--kill-every", type=int, default=100)
    parser.add_argument("--ckpt-every", type=int, default=50)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        data = root / "data.txt"
        words = ["def", "return", "self", "x", "=", "+", "(", ")", ":", "\n", "    ", "for"]
        data.write_text(" ".join(np.random.default_rng(0).choice(words, 200_000)))
        rows = {"restart": run_restart(args, root, data), "torchft": run_ft(args, root, data)}
    print(f"command: python benchmarks/ft_vs_restart.py {' '.join(sys.argv[1:])}")
    print(
        f"tiny GPT, 2 CPU ranks (restart: one group of 2; torchft: 2 groups of 1), global "
        f"batch 8 x 64, {args.steps} steps, a rank killed every {args.kill_every} steps, "
        f"checkpoint every {args.ckpt_every}\n"
    )
    print(
        "| run | kills | wall s to the last step | committed steps lost | samples skipped |", end=""
    )
    print(" s idle: killed rank | s idle: the other rank |")
    print("|---|---|---|---|---|---|---|")
    for name, r in rows.items():
        print(
            f"| {name} | {r['kills']} | {r['wall_s']:.1f} | {r['lost_steps']} | "
            f"{r['skipped']} | {r['idle_killed']:.1f} | {r['idle_others']:.1f} |"
        )


if __name__ == "__main__":
    main()
