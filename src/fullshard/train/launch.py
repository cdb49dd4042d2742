"""Launch local ranks through torchrun's elastic agent (no hand-made process management).

``fullshard train`` on one machine is ``torchrun --standalone --nproc-per-node N
--max-restarts R -m fullshard.train.worker --config RUN_DIR/config.toml``, done in-process
through :class:`torch.distributed.launcher.api.LaunchConfig`: a c10d rendezvous on a free
localhost port, the agent restarting the whole group (which resumes from the newest
checkpoint) when a rank fails.

[Note: Ctrl-C under the agent] The agent catches SIGINT/SIGTERM, forwards the same signal to
every worker and gives them ``--stop-timeout`` seconds before SIGKILL. Workers finish the step,
save and exit 0 (see loop.py); the agent then re-raises the signal as ``SignalException``.
We exit 0 when the run recorded a ``stop`` after the signal, else 128 + the signal number.
"""

from __future__ import annotations

import os
import sys
import uuid
from pathlib import Path

from fullshard.train.guard import LAUNCHER_ENV
from fullshard.train.metrics import read_metrics

__all__ = ["launch", "package_root"]


def package_root() -> Path:
    """The directory that holds the ``fullshard`` package (put on the workers' PYTHONPATH)."""
    return Path(__file__).resolve().parents[2]


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
    """Run ``nproc`` workers on this machine under the elastic agent; return an exit code."""
    import time

    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    _worker_env(nproc, on_cuda)
    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=nproc,
        run_id=f"fullshard-{uuid.uuid4().hex[:12]}",
        rdzv_backend="c10d",
        rdzv_endpoint="localhost:0",  # the agent hosts the store on a free port
        max_restarts=max_restarts,
        monitor_interval=0.2,
        start_method="spawn",
        shutdown_timeout=stop_timeout,
    )
    args = ["-u", "-m", "fullshard.train.worker", "--config", str(config_path)]
    started = time.time()
    try:
        elastic_launch(config, sys.executable)(*args)
    except SignalException as e:
        if _stopped_cleanly(run_dir, started):
            return 0
        print(f"fullshard train: stopped by {e.sigval.name} before a checkpoint was saved")
        return 128 + int(e.sigval)
    except ChildFailedError as e:
        print(
            f"fullshard train: training failed (after up to {max_restarts} restart(s)):\n"
            f"{e.format_msg()}",
            file=sys.stderr,
        )
        return 1
    if _stop_reason(run_dir, started) == "nonfinite":  # the ranks printed why
        return 1
    return 0
