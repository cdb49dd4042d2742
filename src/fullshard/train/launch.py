"""Launch local ranks through torchrun's elastic agent (no hand-made process management).

``fullshard train`` on one machine is torchrun --standalone --nproc-per-node N
-m fullshard.train.worker --config RUN_DIR/config.toml, done in-process through
torch.distributed.launcher.api.LaunchConfig: a c10d rendezvous on a free localhost port.
When a rank fails the group is relaunched (up to --max-restarts times; it resumes from the
newest checkpoint), unless the failure is deterministic (see failures.py).

[Note: Ctrl-C under the agent] The agent catches SIGINT/SIGTERM, forwards the same signal to
every worker and gives them ``--stop-timeout`` seconds before SIGKILL. Workers finish the step,
save and exit 0 (see session.py); the agent then re-raises the signal as ``SignalException``.
We exit 0 when the run recorded a ``stop`` after the signal, else 128 + the signal number.

[Note: one launch per run directory] Two launches writing one run directory would interleave
their metrics and overwrite each other's config and checkpoints (two torchft replica groups
given the same ``--run-dir`` are the easy way there). The launcher holds an exclusive
``flock`` on ``RUN_DIR/.launch.lock`` from before it writes ``config.toml`` until it exits,
then removes the file (the OS drops the lock if the launcher dies, even by SIGKILL, and the
next launch takes the file left behind); a second launch is refused in one line naming the
holder. ``flock`` is per machine on most network filesystems: launches on two
machines sharing a directory are not caught.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import socket
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

from fullshard.engine import LAUNCH_SHUTDOWN_TIMEOUT
from fullshard.train import failures
from fullshard.train.failures import LAUNCHER_ENV
from fullshard.train.metrics import read_metrics

__all__ = ["hold_run_dir", "launch", "package_root"]


def package_root() -> Path:
    """The directory that holds the ``fullshard`` package (put on the workers' PYTHONPATH)."""
    return Path(__file__).resolve().parents[2]


@contextlib.contextmanager
def hold_run_dir(run_dir: Path) -> Iterator[None]:
    """Hold ``run_dir`` for this launch (see [Note: one launch per run directory]); a
    :class:`ConfigError` naming the launch that holds it already."""
    path = run_dir / ".launch.lock"
    f = _lock(path)
    try:
        f.seek(0)
        f.truncate()
        started = time.strftime("%Y-%m-%d %H:%M:%S")
        f.write(f"fullshard train pid {os.getpid()} on {socket.gethostname()} since {started}\n")
        f.flush()
        yield
    finally:
        path.unlink(missing_ok=True)  # before the unlock: a waiter then retries on a new file
        f.close()


def _lock(path: Path) -> IO[str]:
    """``path`` opened and exclusively locked: the lock on the file the path names now (a
    holder removes it on release, so a lock won on a removed file is tried again)."""
    from fullshard.train.config import ConfigError

    while True:
        f = open(path, "a+")
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.seek(0)
            holder = f.read().strip() or "another launch"
            f.close()
            raise ConfigError(
                f"--run-dir {path.parent} is in use by {holder}; give each launch its own "
                "--run-dir (with torchft, one per replica group) or stop that one first"
            ) from None
        try:
            if os.stat(path).st_ino == os.fstat(f.fileno()).st_ino:
                return f
        except FileNotFoundError:
            pass
        f.close()


def _worker_env(nproc: int, on_cuda: bool) -> None:
    # Workers inherit the agent's environment.
    if not on_cuda and "OMP_NUM_THREADS" not in os.environ:
        os.environ["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // nproc))
    os.environ[LAUNCHER_ENV] = "1"  # see [Note: non-finite gradients] in guard.py
    root = str(package_root())
    paths = os.environ.get("PYTHONPATH", "").split(os.pathsep)
    if root not in paths:
        os.environ["PYTHONPATH"] = os.pathsep.join([root, *filter(None, paths)])


def _stopped_cleanly(run_dir: Path, since: float) -> bool:
    records = read_metrics(run_dir / "metrics.jsonl")
    return any(r.get("kind") == "stop" and r.get("time", 0) >= since for r in records)


def _stop_reason(run_dir: Path, since: float) -> str | None:
    stops = [r for r in read_metrics(run_dir / "metrics.jsonl") if r.get("kind") == "stop"]
    return stops[-1].get("reason") if stops and stops[-1].get("time", 0) >= since else None


def launch(
    config_path: Path,
    *,
    run_dir: Path,
    nproc: int,
    max_restarts: int,
    stop_timeout: int,
    on_cuda: bool,
) -> int:
    """Run ``nproc`` workers on this machine under the elastic agent; return an exit code.

    The group is restarted here, not by the agent, so that a deterministic failure (see
    [Note: deterministic failures] in failures.py) ends the job instead of repeating.
    """
    _worker_env(nproc, on_cuda)
    for attempt in range(max_restarts + 1):
        os.environ[failures.ATTEMPT_ENV] = str(attempt)
        outcome = _run_group(config_path, run_dir=run_dir, nproc=nproc, stop_timeout=stop_timeout)
        if isinstance(outcome, int):
            return outcome
        fatal, message = outcome
        logs = failures.log_dir(run_dir)
        if fatal:
            print(f"fullshard train: tracebacks in {logs}/", file=sys.stderr)
            print(f"fullshard train: error: {message}", file=sys.stderr, flush=True)
            return 1
        if attempt < max_restarts:
            print(
                f"fullshard train: {message}; restarting the group ({attempt + 1} of "
                f"--max-restarts {max_restarts}), resuming from the newest checkpoint "
                f"(tracebacks in {logs}/)",
                file=sys.stderr,
                flush=True,
            )
    print(
        f"fullshard train: error: {message}; gave up after {max_restarts} restart(s) "
        f"(--max-restarts). Tracebacks in {logs}/",
        file=sys.stderr,
        flush=True,
    )
    return 1


def _run_group(
    config_path: Path, *, run_dir: Path, nproc: int, stop_timeout: int
) -> int | tuple[bool, str]:
    """One attempt: an exit code when the job is over, else ``(fatal, one-line cause)``."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=nproc,
        run_id=f"fullshard-{uuid.uuid4().hex[:12]}",
        rdzv_backend="c10d",
        rdzv_endpoint="localhost:0",  # the agent hosts the store on a free port
        max_restarts=0,  # restarts are launch()'s decision
        monitor_interval=0.2,
        start_method="spawn",
    )
    if LAUNCH_SHUTDOWN_TIMEOUT.available:  # torch 2.11 and older: the agent's fixed 30 s
        config.shutdown_timeout = stop_timeout
    args = ["-u", "-m", "fullshard.train.worker", "--config", str(config_path)]
    started = time.time()
    try:
        with _quiet_agent():
            elastic_launch(config, sys.executable)(*args)
    except SignalException as e:
        if _stopped_cleanly(run_dir, started):
            return 0
        print(f"fullshard train: stopped by {e.sigval.name} before a checkpoint was saved")
        return 128 + int(e.sigval)
    except ChildFailedError as e:
        return _cause(e, run_dir, since=started - 1)
    finally:
        failures.remove_files(config.run_id)  # see [Note: one report per failure]
    if _stop_reason(run_dir, started) == "nonfinite":  # the ranks printed why
        return 1
    return 0


def _cause(e: Any, run_dir: Path, since: float) -> tuple[bool, str]:
    """Why the group failed: a deterministic failure on any rank wins; else the first rank's
    own error (not one caused by a lost peer), else a rank that was killed (the others then
    fail on its closed connections), else whatever was recorded."""
    records = failures.read_failures(run_dir, since)
    primary = [r for r in records if not r.get("secondary")]
    for rec in primary:
        if rec.get("fatal"):
            return True, str(rec["message"])
    codes: dict[int, int] = {rank: f.exitcode for rank, f in e.failures.items()}
    if any(code in (2, failures.FATAL_EXIT) for code in codes.values()):  # 2: a refused config
        return True, "a rank refused to continue (its message is above)"
    for rec in primary:
        return False, f"rank {rec['rank']} failed: {rec['message']}"
    killed = sorted(rank for rank, code in codes.items() if code < 0)
    if killed:
        return False, failures.describe_exit(killed[0], codes[killed[0]])
    for rec in records:
        return False, f"rank {rec['rank']} failed: {rec['message']}"
    rank, first = e.get_first_failure()
    return False, failures.describe_exit(rank, first.exitcode)


@contextlib.contextmanager
def _quiet_agent() -> Iterator[None]:
    """The agent logs every worker failure at ERROR level with a traceback block; our own
    summary replaces that (the ranks' tracebacks are in RUN_DIR/logs)."""
    loggers = [
        logging.getLogger(name)
        for name in (
            "torch.distributed.elastic.multiprocessing.api",
            "torch.distributed.elastic.agent.server.api",
            "torch.distributed.elastic.multiprocessing.errors",
            "torch.distributed.launcher.api",
        )
    ]
    levels = [log.level for log in loggers]
    for log in loggers:
        log.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        for log, level in zip(loggers, levels):
            log.setLevel(level)
