"""How a rank's failure is reported, and whether restarting could help.

[Note: deterministic failures] Some failures repeat on every restart: a checkpoint that does
not fit the model or is corrupted (with no intact one to fall back to), a full disk, a
directory the job may not write. Restarting the group for those only repeats the failure and
buries its cause under every rank's traceback. So a rank that fails:

- appends its traceback to ``RUN_DIR/logs/rank_<R>.log`` (never to the terminal), and writes
  ``RUN_DIR/logs/failure_rank<R>.json`` with a one-line message: the root cause and the fix;
- exits with :data:`FATAL_EXIT` when the failure is deterministic, else 1.

The launcher (``fullshard train``, see launch.py) reads those records after the group has
stopped: a deterministic failure on any rank ends the job at once with one final
``fullshard train: error: ...`` line; anything else (a crash, a killed or hung rank) restarts
the group, up to ``--max-restarts``. Under a bare ``torchrun`` the ranks print that line
themselves (the failing rank, or for a deterministic failure the first rank to fail on
each machine: one line, as the launcher prints), since no launcher reads the records, and the
restarts that torchrun's agent makes anyway end at once: see [Note: no restart under a bare
torchrun].

[Note: no restart under a bare torchrun] torchrun's agent restarts the group after any
failure (``--max-restarts``); nothing a worker does changes that. So a rank that fails
deterministically under a bare torchrun also leaves a *stop marker* for the next attempt, and
each rank of a restarted attempt that finds one exits with :data:`FATAL_EXIT` before any work
(no model, data or checkpoint is touched; every remaining restart costs one interpreter
start-up), the one-line error printed again. The marker belongs to one torchrun invocation on
one machine: it is keyed by the agent (the workers' parent process: its pid and start time,
and ``TORCHELASTIC_RUN_ID``), so rerunning the same command after fixing the cause starts
afresh. It lives in the machine's temporary directory, not the run directory, so that a full
disk or a read-only run directory cannot keep it from being written. On several machines each
machine's ranks stop on their own machine's marker; the other machines' agents stop when the
rendezvous closes, as for any failed node.

[Note: one report per failure] torchrun's agent stops the whole group as soon as any rank
exits, so a rank that exits early can get another rank stopped before that rank has printed
its line or written its record (it did, on a loaded 2-core CI machine: the restarted ranks'
line went missing). Hence, per attempt and machine, two files beside the stop marker:

- ``.line``: a deterministic failure's line (a full disk, a checkpoint that does not fit, a
  refused restart) is one line for the whole machine, as the launcher prints one: the first
  rank to get there claims the file (``O_EXCL``) and prints it; the others wait until it is
  printed, then exit;
- ``.reported``: made once a rank that failed first (not secondary) has logged, recorded and
  printed; a secondary failure waits for it (5 s at most: the first failure may be on another
  machine) before its rank exits.

``fullshard train`` removes them once its group has stopped (:func:`remove_files`); under a
bare torchrun they stay with the marker in the temporary directory (a few bytes each).

A rank that fails only because another one did (a save that failed elsewhere, a checkpoint
another rank could not read) is *secondary*: it never decides the outcome.

This module imports no torch: the launcher and ``--help`` use it.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import signal
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "ATTEMPT_ENV",
    "FATAL_EXIT",
    "LAUNCHER_ENV",
    "Failure",
    "SecondaryFailure",
    "attempt_number",
    "await_report",
    "classify",
    "describe_exit",
    "exit_if_restart_refused",
    "log_dir",
    "rank_failed",
    "read_failures",
    "refuse_restarts",
    "remove_files",
    "report",
    "restart_refused",
]

FATAL_EXIT = 3  # a rank's exit status for a deterministic failure (2: a refused config)
ATTEMPT_ENV = "FULLSHARD_ATTEMPT"  # set by the launcher: how many times it restarted the group
LAUNCHER_ENV = "FULLSHARD_LOCAL_LAUNCH"  # set by `fullshard train` for the ranks it launches
_NO_SPACE = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG}
_NO_PERMISSION = {errno.EACCES, errno.EPERM, errno.EROFS}
# A collective that fails with one of these lost a peer that had died: a consequence.
_PEER_GONE = ("connection closed by peer", "connection reset by peer", "broken pipe")
_MAX_MESSAGE = 600  # characters: a message is one line on a terminal, give or take


class SecondaryFailure(RuntimeError):
    """This rank failed because another rank did (that rank's record names the cause)."""


@dataclass(frozen=True)
class Failure:
    """One rank's failure, as the launcher reports it."""

    message: str  # one line: what went wrong and how to fix it
    fatal: bool  # it would happen again after a restart
    secondary: bool = False  # a consequence of another rank's failure


def attempt_number() -> int:
    """Restarts of the group so far: the launcher's own count plus torchrun's (one of the two
    is 0: ``fullshard train`` relaunches the group itself, a bare torchrun restarts it)."""
    env = os.environ
    return int(env.get(ATTEMPT_ENV, "0") or 0) + int(env.get("TORCHELASTIC_RESTART_COUNT", "0"))


def log_dir(run_dir: Path) -> Path:
    """Where the ranks' tracebacks and failure records go."""
    return run_dir / "logs"


def _one_line(text: str) -> str:
    """``text`` on one line; a long one keeps its start (the cause) and end (often the fix)."""
    line = " ".join(text.split())
    if len(line) <= _MAX_MESSAGE:
        return line
    half = (_MAX_MESSAGE - 5) // 2
    return f"{line[:half]} ... {line[-half:]}"


def _os_error(e: OSError, fix: str) -> str:
    what = e.strerror or errno.errorcode.get(e.errno or 0, str(e))
    return f"{what}" + (f" ({e.filename})" if e.filename else "") + f"; {fix}"


def classify(exc: BaseException) -> Failure:
    """Whether ``exc`` would repeat on a restart, with a one-line message naming the fix."""
    from fullshard.checkpoint.manifest import (
        CheckpointCorruptedError,
        CheckpointError,
        CheckpointMismatchError,
    )

    if isinstance(exc, SecondaryFailure):
        return Failure(_one_line(str(exc)), fatal=False, secondary=True)
    if isinstance(exc, CheckpointMismatchError):
        return Failure(
            _one_line(
                f"{exc.what}: {exc.differences(4)}. Pass the model flags it was trained with "
                "(--preset, --d-model, ..., --hf-config), or train this model in its own run "
                "directory (--name NAME or --run-dir DIR)"
            ),
            fatal=True,
        )
    if isinstance(exc, CheckpointCorruptedError):
        return Failure(
            _one_line(
                f"{exc} (check a checkpoint with 'fullshard ckpt inspect DIR'; --resume PATH "
                "starts from a given one)"
            ),
            fatal=True,
        )
    if isinstance(exc, CheckpointError):
        return Failure(_one_line(str(exc)), fatal=True)
    if isinstance(exc, OSError) and exc.errno in _NO_SPACE:
        fix = (
            "free some space or use a --run-dir on a disk with room (lower --keep-last to keep "
            "fewer checkpoints), then run the same command again: it resumes from the newest "
            "checkpoint"
        )
        return Failure(_one_line(_os_error(exc, fix)), fatal=True)
    if isinstance(exc, OSError) and exc.errno in _NO_PERMISSION:
        fix = (
            "make the run directory writable for this user (or pick another --run-dir), then "
            "run the same command again"
        )
        return Failure(_one_line(_os_error(exc, fix)), fatal=True)
    if isinstance(exc, RuntimeError) and "failed on another rank" in str(exc):
        return Failure(_one_line(str(exc)), fatal=False, secondary=True)  # see saving._step
    message = _one_line(f"{type(exc).__name__}: {exc}")
    lost_peer = any(s in message.lower() for s in _PEER_GONE)
    return Failure(message, fatal=False, secondary=lost_peer)


def rank_failed(exc: BaseException, *, run_dir: Path, rank: int, launched: bool) -> int:
    """A rank's last act after ``exc`` (see [Note: deterministic failures]): log the
    traceback, record the failure, and return the exit status. ``launched``: under
    ``fullshard train`` (which reports), not a bare torchrun (where this rank reports)."""
    failure = classify(exc)
    attempt = attempt_number()
    text = "".join(traceback.format_exception(exc))
    logs = log_dir(run_dir)
    log = logs / f"rank_{rank}.log"
    record = asdict(failure) | {"rank": rank, "attempt": attempt, "time": time.time()}
    line = None  # what this rank prints: only under a bare torchrun (no launcher reports)
    try:
        logs.mkdir(parents=True, exist_ok=True)
        with open(log, "a") as f:
            f.write(f"=== attempt {attempt}, rank {rank}, {time.ctime()}\n{text}\n")
        (logs / f"failure_rank{rank}.json").write_text(json.dumps(record | {"log": str(log)}))
    except OSError as e:  # e.g. the disk is full: the terminal is all that is left
        print(
            f"fullshard train: rank {rank}: cannot write {log} ({e.strerror or e}); "
            f"traceback:\n{text}",
            file=sys.stderr,
            flush=True,
        )
        if launched and failure.fatal and not failure.secondary:
            print(f"fullshard train: error: {failure.message}", file=sys.stderr, flush=True)
    else:
        if not launched and not failure.secondary:
            kind = "error" if failure.fatal else f"rank {rank} failed"
            line = f"fullshard train: {kind}: {failure.message} (traceback: {log})"
    if failure.secondary:
        await_report()
        return 1
    if failure.fatal and not launched:
        refuse_restarts(failure.message, rank=rank)  # first: a restart must find it
    report(line, once=failure.fatal)
    return FATAL_EXIT if failure.fatal else 1


def _files(run_id: str | None = None, agent: int | None = None) -> Path | None:
    """The prefix of one torchrun invocation's coordination files on this machine (``None``
    outside torchrun): this rank's, or those of agent ``agent`` for run ``run_id``."""
    run_id = os.environ.get("TORCHELASTIC_RUN_ID") if run_id is None else run_id
    if run_id is None:
        return None
    agent = os.getppid() if agent is None else agent
    try:  # the agent's start time (clock ticks since boot): a reused pid is another agent
        started = Path(f"/proc/{agent}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        started = ""
    key = hashlib.sha256(f"{run_id}\0{agent}\0{started}".encode()).hexdigest()[:16]
    return Path(tempfile.gettempdir()) / f"fullshard-no-restart-{key}"


def _stop_marker() -> Path | None:
    """This torchrun invocation's stop marker on this machine (``None`` outside torchrun);
    see [Note: no restart under a bare torchrun]."""
    files = _files()
    return None if files is None else files.with_name(f"{files.name}.json")


def _attempt_file(what: str) -> Path | None:
    """This attempt's ``what`` file beside the stop marker (``None`` outside torchrun); see
    [Note: one report per failure]."""
    files = _files()
    return None if files is None else files.with_name(f"{files.name}.{attempt_number()}.{what}")


def remove_files(run_id: str) -> None:
    """Remove the coordination files of this process's workers in run ``run_id``: for a
    launcher that runs the agent itself, once the group has stopped."""
    files = _files(run_id, os.getpid())
    if files is not None:
        for path in files.parent.glob(f"{files.name}.*"):
            path.unlink(missing_ok=True)


def refuse_restarts(message: str, *, rank: int) -> None:
    """Under a bare torchrun: make every later attempt of this job end at once with
    ``message`` (a deterministic failure's one line). A no-op under ``fullshard train``,
    whose launcher decides on restarts itself."""
    marker = _stop_marker()
    if marker is None or os.environ.get(LAUNCHER_ENV) == "1":
        return
    record = {"message": message, "rank": rank, "attempt": attempt_number()}
    try:
        tmp = marker.with_name(f"{marker.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(record))
        os.replace(tmp, marker)
    except OSError:
        pass  # then the agent's restart runs, and fails the same way


def exit_if_restart_refused() -> int | None:
    """:data:`FATAL_EXIT` after printing the one-line error (once per machine) when
    :func:`restart_refused`; ``None`` otherwise. Imports no torch: a refused attempt ends
    in a fraction of a second."""
    refused = restart_refused()
    if refused is None:
        return None
    report(f"fullshard train: error: {refused}", once=True)
    return FATAL_EXIT


def report(line: str | None, *, once: bool = False) -> None:
    """Print a failed rank's ``line`` (``None``: nothing to print), then mark this attempt
    reported on this machine. ``once``: a deterministic failure's line, which every rank may
    hit: the first to get here prints it, the others wait until it is out. See [Note: one
    report per failure]."""
    if line is not None:
        claim = _attempt_file("line") if once else None
        if claim is not None and not _claim(claim):  # another rank prints it
            _wait_until(lambda: claim.stat().st_size > 0)
            return
        print(line, file=sys.stderr, flush=True)
        if claim is not None:
            _write_quietly(claim, "printed\n")
    reported = _attempt_file("reported")
    if reported is not None:
        _write_quietly(reported, "")


def await_report(wait: float = 5.0) -> None:
    """A secondary failure: wait (at most ``wait`` seconds) until a rank that failed first
    has reported, so that this rank's exit cannot get it stopped before its line and records
    are out. See [Note: one report per failure]."""
    reported = _attempt_file("reported")
    if reported is not None:
        _wait_until(reported.exists, wait)


def _claim(path: Path) -> bool:
    """Create ``path``, exclusively: ``False`` if it exists (another rank got there first);
    ``True`` if this rank made it, or if it cannot be made (then nobody coordinates)."""
    try:
        os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
    except FileExistsError:
        return False
    except OSError:
        pass
    return True


def _write_quietly(path: Path, text: str) -> None:
    try:
        path.write_text(text)
    except OSError:
        pass  # the waiting ranks give up after their timeout


def _wait_until(done: Callable[[], bool], wait: float = 10.0) -> None:
    """Poll ``done`` until it holds (or raises ``OSError``), for at most ``wait`` seconds."""
    deadline = time.monotonic() + wait
    while time.monotonic() < deadline:
        try:
            if done():
                return
        except OSError:
            return
        time.sleep(0.01)


def restart_refused() -> str | None:
    """In a restarted attempt of a bare torchrun job: the one-line error of the deterministic
    failure that ended an earlier attempt (see :func:`refuse_restarts`), else ``None``."""
    marker = _stop_marker()
    if marker is None or attempt_number() == 0 or os.environ.get(LAUNCHER_ENV) == "1":
        return None
    try:
        record = json.loads(marker.read_text())
        return (
            f"{record['message']} (rank {record['rank']}, attempt {record['attempt']}; not "
            "retried: it would fail the same way)"
        )
    except (OSError, ValueError, KeyError, TypeError):
        return None


def read_failures(run_dir: Path, since: float) -> list[dict[str, Any]]:
    """The ranks' failure records written after ``since`` (a ``time.time()``), oldest first."""
    records = []
    for path in log_dir(run_dir).glob("failure_rank*.json"):
        try:
            rec = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(rec, dict) and float(rec.get("time", 0)) >= since:
            records.append(rec)
    return sorted(records, key=lambda r: float(r["time"]))


def describe_exit(rank: int, exitcode: int) -> str:
    """``rank 1 was killed by SIGKILL`` / ``rank 1 exited with status 1``."""
    if exitcode < 0:
        try:
            name = signal.Signals(-exitcode).name
        except ValueError:
            name = f"signal {-exitcode}"
        why = " (the out-of-memory killer, or kill -9)" if name == "SIGKILL" else ""
        return f"rank {rank} was killed by {name}{why}"
    return f"rank {rank} exited with status {exitcode}"
