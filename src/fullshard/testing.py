"""Run a function on N gloo ranks on the CPU — the harness behind fullshard's distributed tests.

``run_distributed(fn, world_size, *args)`` spawns ``world_size`` fresh processes, initialises a
gloo process group in each (free port on loopback), calls ``fn(*args)`` and returns the list of
per-rank return values. A failure in any child is re-raised in the parent as
:class:`ChildFailed` carrying the child's full traceback, and a child that runs past ``timeout``
is killed and reported with the ranks that were still running. One spawn is expensive (each
child imports torch), so callers should run many sub-cases inside one ``fn``.

It lives in the package (not under ``tests/``) so that downstream users can test their own
fullshard code the same way.
"""

from __future__ import annotations

import datetime
import os
import pickle
import queue
import socket
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch.multiprocessing as mp

__all__ = ["ChildFailed", "free_port", "process_tree", "run_distributed"]


class ChildFailed(RuntimeError):
    """A rank of :func:`run_distributed` raised, crashed or timed out."""


def free_port() -> int:
    """Return a TCP port on loopback that is free right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _child(
    rank: int,
    world_size: int,
    port: int,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    env: dict[str, str],
    results: Any,
    pg_timeout: float | None,
) -> None:
    os.environ.update(env)
    os.environ.update(
        {
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "RANK": str(rank),
            "WORLD_SIZE": str(world_size),
            "LOCAL_RANK": str(rank),
            "LOCAL_WORLD_SIZE": str(world_size),
        }
    )
    import torch
    import torch.distributed as dist

    torch.set_num_threads(int(env.get("OMP_NUM_THREADS", "1")))
    try:
        timeout = None if pg_timeout is None else datetime.timedelta(seconds=pg_timeout)
        dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timeout)
        out = fn(*args)
        # Plain pickle: tensors travel as bytes, not as shared-memory handles that die with us.
        results.put((rank, "ok", pickle.dumps(out)))
    except BaseException:  # report everything, including KeyboardInterrupt in the child
        results.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _collect(
    fn: Callable[..., Any], procs: list[Any], results: Any, timeout: float
) -> tuple[dict[int, Any], dict[int, str]]:
    """Each rank's result or error, as they arrive; a rank that died without reporting is an
    error, and after the first error the others get 10 s more (they are usually stuck in a
    collective with it)."""
    world_size = len(procs)
    outputs: dict[int, Any] = {}
    errors: dict[int, str] = {}
    deadline = time.monotonic() + timeout
    while len(outputs) + len(errors) < world_size:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            pending = sorted(set(range(world_size)) - set(outputs) - set(errors))
            raise ChildFailed(
                f"{getattr(fn, '__name__', fn)} timed out after {timeout:.0f}s; "
                f"ranks still running: {pending}" + _format_errors(errors)
            )
        try:
            rank, status, payload = results.get(timeout=min(remaining, 1.0))
        except queue.Empty:
            dead = [
                r
                for r, p in enumerate(procs)
                if not p.is_alive()
                and p.exitcode not in (0, None)
                and r not in outputs
                and r not in errors
            ]
            for r in dead:
                errors[r] = f"rank {r} died with exit code {procs[r].exitcode}"
            continue
        if status == "ok":
            outputs[rank] = pickle.loads(payload)
        else:
            errors[rank] = payload
            # One rank failing usually leaves the others stuck in a collective: stop early.
            deadline = min(deadline, time.monotonic() + 10.0)
    return outputs, errors


def run_distributed(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 300.0,
    env: dict[str, str] | None = None,
    pg_timeout: float | None = None,
    start_method: str = "forkserver",
) -> list[Any]:
    """Run ``fn(*args)`` on ``world_size`` gloo ranks; return the per-rank results in rank order.

    ``fn`` must be importable by name (defined at module level) and its return value picklable.
    Inside ``fn``, ``torch.distributed`` is initialised and ``RANK``/``WORLD_SIZE`` are set.
    ``env`` adds environment variables to the children (``OMP_NUM_THREADS`` defaults to 1 so
    ranks do not oversubscribe the cores). ``pg_timeout`` sets the process group's collective
    timeout in seconds (torch's default when ``None``).

    ``start_method="forkserver"`` (the default) forks every rank from one server process
    that imported torch, ``torch.distributed`` and fullshard once (the first time, per parent
    process): a spawn then costs little beyond ``fn``. The ranks share the server's imported modules as they
    were when it started, so settings read at import time (e.g. ``TORCHINDUCTOR_*``
    variables in ``env``) take the parent's values then, not ``env``'s. ``"spawn"`` starts
    fresh interpreters, each importing torch (seconds of CPU per rank), for such settings.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if start_method not in ("spawn", "forkserver"):
        raise ValueError(f"start_method must be 'spawn' or 'forkserver', got {start_method!r}")
    child_env = {"OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"}
    child_env.update(env or {})
    if start_method == "forkserver":
        ctx: Any = mp.get_context("forkserver")
        # No effect once the server runs (it keeps what it imported at its start).
        ctx.set_forkserver_preload(["torch", "torch.distributed", "fullshard.api"])
    else:
        ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(
            target=_child,
            args=(rank, world_size, port, fn, args, child_env, results, pg_timeout),
            daemon=True,
        )
        for rank in range(world_size)
    ]
    for p in procs:
        p.start()
    try:
        outputs, errors = _collect(fn, procs, results, timeout)
        __tracebackhide__ = True  # pytest: show the child's traceback, not this loop
        if errors:
            raise ChildFailed(f"{getattr(fn, '__name__', fn)} failed" + _format_errors(errors))
        return [outputs[r] for r in range(world_size)]
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)


def _format_errors(errors: dict[int, str]) -> str:
    return "".join(f"\n--- rank {r} ---\n{tb}" for r, tb in sorted(errors.items()))


def process_tree(pid: int) -> list[int]:
    """``pid`` and every process below it, read from ``/proc`` (Linux): what a test kills to
    stop a whole launch (torchrun's agent puts its workers in a new session, so a
    process-group kill would miss them)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo += children.get(p, [])
    return out
