"""Crash-safe publishing of checkpoint directories, ``latest`` resolution and rotation.

[Note: atomic publish]
A checkpoint ``<root>/<name>`` is written into ``<root>/<name>.partial``. Every rank writes and
fsyncs its own files there, then all ranks agree (an all-reduce on a dedicated gloo group) that
every write succeeded. Only then does rank 0 write ``manifest.json`` (fsynced), fsync the
directory, rename ``<name>.partial`` to ``<name>`` and fsync ``<root>``. A directory therefore
either has its final name and is complete, or ends in ``.partial`` and is ignored: a crash at any
point leaves every earlier checkpoint intact. Leftover ``.partial`` directories are removed by
the next successful save under the same root (:func:`clean_partial`). All ranks must see the same
file system (a local disk for one machine, a shared one for many).
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

import torch
import torch.distributed as dist

from .manifest import MANIFEST_NAME, CheckpointError

__all__ = [
    "PARTIAL_SUFFIX",
    "clean_partial",
    "latest_checkpoint",
    "list_checkpoints",
    "resolve_checkpoint",
    "rotate",
]

PARTIAL_SUFFIX = ".partial"
_STEP = re.compile(r"(\d+)$")


def fsync_dir(path: Path) -> None:
    """Make a directory's entries (creations, renames) durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_durable(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` and fsync it."""
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def partial_dir(final: Path) -> Path:
    return final.with_name(final.name + PARTIAL_SUFFIX)


def prepare_partial(final: Path, *, overwrite: bool) -> Path:
    """(rank 0) Create an empty ``<final>.partial`` directory, removing a stale one."""
    if final.name.endswith(PARTIAL_SUFFIX):
        raise CheckpointError(f"checkpoint name {final.name!r} must not end in {PARTIAL_SUFFIX}")
    if final.exists() and not overwrite:
        raise CheckpointError(
            f"checkpoint {final} already exists; pick a new name (e.g. the step number) or "
            "pass overwrite=True to replace it"
        )
    tmp = partial_dir(final)
    if tmp.exists():
        shutil.rmtree(tmp)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp.mkdir()
    return tmp


def publish(tmp: Path, final: Path, manifest: bytes) -> None:
    """(rank 0) Write the manifest into ``tmp`` and atomically rename it to ``final``."""
    write_durable(tmp / MANIFEST_NAME, manifest)
    fsync_dir(tmp)
    if final.exists():  # overwrite=True: move the old one aside, then swap in the new one
        old = final.with_name(final.name + ".old" + PARTIAL_SUFFIX)
        if old.exists():
            shutil.rmtree(old)
        os.rename(final, old)
        os.rename(tmp, final)
        fsync_dir(final.parent)
        shutil.rmtree(old)
    else:
        os.rename(tmp, final)
    fsync_dir(final.parent)


def _order_key(path: Path) -> tuple[int, int]:
    m = _STEP.search(path.name)
    step = int(m.group(1)) if m else -1
    return step, (path / MANIFEST_NAME).stat().st_mtime_ns


def list_checkpoints(root: str | os.PathLike[str]) -> list[Path]:
    """Complete checkpoints directly under ``root``, oldest first.

    Complete means: a directory with a ``manifest.json`` whose name does not end in ``.partial``.
    Order: the number at the end of the name (``step_00000010`` -> 10), then manifest mtime.
    """
    root = Path(root)
    if not root.is_dir():
        return []
    found = [
        p
        for p in root.iterdir()
        if p.is_dir() and not p.name.endswith(PARTIAL_SUFFIX) and (p / MANIFEST_NAME).is_file()
    ]
    return sorted(found, key=_order_key)


def latest_checkpoint(root: str | os.PathLike[str]) -> Path | None:
    """The newest complete checkpoint under ``root`` (see :func:`list_checkpoints`), or None."""
    found = list_checkpoints(root)
    return found[-1] if found else None


def clean_partial(root: str | os.PathLike[str], *, keep: Path | None = None) -> list[Path]:
    """Remove leftover ``*.partial`` directories under ``root`` (except ``keep``)."""
    root = Path(root)
    removed = []
    if root.is_dir():
        for p in root.iterdir():
            if p.is_dir() and p.name.endswith(PARTIAL_SUFFIX) and p != keep:
                shutil.rmtree(p, ignore_errors=True)
                removed.append(p)
    return removed


def rotate(root: str | os.PathLike[str], keep_last: int) -> list[Path]:
    """Delete all but the newest ``keep_last`` complete checkpoints under ``root``.

    Each one is first renamed to ``<name>.partial`` (so a crash mid-delete never leaves a
    half-deleted directory that looks complete), then removed. Returns what was removed.
    """
    if keep_last < 1:
        raise ValueError(f"keep_last must be >= 1, got {keep_last}")
    victims = list_checkpoints(root)[:-keep_last]
    for p in victims:
        doomed = partial_dir(p)
        os.rename(p, doomed)
        shutil.rmtree(doomed, ignore_errors=True)
    return victims


def resolve_checkpoint(path: str | os.PathLike[str]) -> Path:
    """Accept a checkpoint dir, a checkpoints root, or a run dir with ``checkpoints/`` in it."""
    p = Path(path)
    if (p / MANIFEST_NAME).is_file():
        return p
    for root in (p, p / "checkpoints"):
        latest = latest_checkpoint(root)
        if latest is not None:
            return latest
    raise CheckpointError(
        f"no complete checkpoint at {p}: expected a directory with {MANIFEST_NAME}, a "
        "checkpoints root holding such directories, or a run directory with checkpoints/ "
        "(directories ending in .partial are incomplete saves and are ignored)"
    )


# --- coordination: a dedicated gloo group so background saves never race training collectives

_GROUP: tuple[object, object] | None = None  # (the default group it was made for, the group)


def coordination_group() -> object | None:
    """A gloo process group over all ranks, created once (collectively) per default group."""
    global _GROUP
    if not (dist.is_available() and dist.is_initialized()):
        return None
    world = dist.group.WORLD
    if _GROUP is None or _GROUP[0] is not world:
        _GROUP = (world, dist.new_group(backend="gloo"))
    return _GROUP[1]


def all_ok(ok: bool, group: object | None) -> bool:
    """True on every rank iff ``ok`` is True on every rank (one all-reduce on ``group``)."""
    if group is None:
        return ok
    flag = torch.tensor([1 if ok else 0], dtype=torch.int32)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)  # type: ignore[arg-type]
    return bool(flag.item())
