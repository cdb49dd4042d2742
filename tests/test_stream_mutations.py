"""Every stream call of the engine is needed, and checked on the CPU ([Note: the stream
interface] in fullshard.engine.streams): each ``wait_stream`` / ``wait_event`` /
``record_event`` / ``synchronize`` line in ``src/`` (found by parsing, so a new one is
covered), deleted or turned around on a copy of ``src/``, makes a case of ``stream_cases``
report an unordered access on some rank, with no case on any rank crashing (a crash is not the
checker noticing). Also: no engine module but ``streams.py`` names CUDA's
stream API."""

from __future__ import annotations

import ast
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src" / "fullshard"
STREAM_CALLS = {"wait_stream", "wait_event", "record_event", "synchronize"}
# the logical streams themselves (what the calls run on, on the CPU), not calls the engine makes
IMPLEMENTATION = {"engine/streamcheck.py"}
# host waits outside the engine's streams, which no CPU case can model: the colocated sync's
# wait before it hands another process a CUDA IPC handle (tests/test_gpu.py's
# test_colocated_buckets_over_cuda_ipc needs it on a GPU)
HOST_WAITS = {("rl/colocated.py", "synchronize")}
# edits that are decisions about stream work rather than stream calls
EXTRA = [
    (
        "engine/reduce.py",
        "if sp.reads_grad_on_arrival():",
        "if False:",
        "a gradient added into at once waits for its copy",
    ),
    (
        "engine/reduce.py",
        "self.handle.wait()  # the hook stream waits for the reduce-scatter",
        "pass",
        "the all-reduce hook's stream waits for the reduce-scatter",
    ),
]


def _stream_lines() -> list[tuple[str, int, str]]:
    """(file, line, call) of every statement in src/ that calls a stream method."""
    found = []
    for path in sorted(SRC.rglob("*.py")):
        rel = path.relative_to(SRC).as_posix()
        if rel in IMPLEMENTATION:
            continue
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if not isinstance(node, ast.stmt) or isinstance(
                node, (ast.FunctionDef, ast.ClassDef, ast.With, ast.If, ast.For)
            ):
                continue
            calls = [
                c.func.attr
                for c in ast.walk(node)
                if isinstance(c, ast.Call)
                and isinstance(c.func, ast.Attribute)
                and c.func.attr in STREAM_CALLS
            ]
            if calls and (rel, calls[0]) not in HOST_WAITS:
                found.append((rel, node.lineno, calls[0]))
    return found


def _deleted(line: str) -> str:
    """``line`` without its stream call: ``pass``, or for an assignment (an event kept for
    later) the target assigned ``None``, what the code holds where no event was recorded."""
    indent, stmt = line[: len(line) - len(line.lstrip())], line.strip()
    node = ast.parse(stmt).body[0]
    if isinstance(node, ast.Assign | ast.AnnAssign) and node.value is not None:
        return indent + stmt[: node.value.col_offset] + "None"
    return indent + "pass"


def _mutations() -> list[tuple[str, str, str, str]]:
    """(file, old text, new text, description): each stream line deleted, each
    ``a.wait_stream(b)`` also turned into ``b.wait_stream(a)``, and the EXTRA edits."""
    out = []
    for rel, lineno, call in _stream_lines():
        line = (SRC / rel).read_text().splitlines()[lineno - 1]
        indent = line[: len(line) - len(line.lstrip())]
        out.append((rel, line, _deleted(line), f"{rel}:{lineno} {call} deleted"))
        stmt = line.strip().split("#")[0].strip()
        if call == "wait_stream" and stmt.endswith(")") and ".wait_stream(" in stmt:
            waiter, waited = stmt[:-1].split(".wait_stream(", 1)
            turned = f"{indent}({waited}).wait_stream({waiter})"
            out.append((rel, line, turned, f"{rel}:{lineno} wait_stream turned around"))
    out += [(rel, old, new, what) for rel, old, new, what in EXTRA]
    return out


def _run(src: Path) -> list[dict[str, dict[str, Any]]]:
    """Every rank's report of ``python -m stream_cases`` against ``src``: per case, the
    ``violations`` and the ``error``; a process that failed is one rank with a ``process``
    case that errored."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env["PYTHONPATH"] = os.pathsep.join([str(src), str(ROOT / "tests"), str(ROOT / "benchmarks")])
    proc = subprocess.run(
        [sys.executable, "-m", "stream_cases"],
        env=env,
        cwd=ROOT / "tests",
        capture_output=True,
        text=True,
        timeout=300,
    )
    if proc.returncode != 0:
        error = f"exit {proc.returncode}: {proc.stderr[-300:]}"
        return [{"process": {"violations": [], "error": error}}]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _crashes(ranks: list[dict[str, dict[str, Any]]]) -> list[str]:
    return [
        f"rank {r} {case}: {out['error']}"
        for r, cases in enumerate(ranks)
        for case, out in cases.items()
        if out["error"] is not None
    ]


def _noticed(ranks: list[dict[str, dict[str, Any]]]) -> list[str]:
    return [
        f"rank {r} {case}: {v}"
        for r, cases in enumerate(ranks)
        for case, out in cases.items()
        for v in out["violations"]
    ]


def test_the_stream_lines_are_found() -> None:
    lines = _stream_lines()
    calls = {call for _, _, call in lines}
    assert calls == STREAM_CALLS, lines
    assert {rel for rel, _, _ in lines} >= {"engine/streams.py", "engine/handle.py"}, lines


def test_unmutated_cases_are_clean() -> None:
    ranks = _run(ROOT / "src")
    assert len(ranks) == 2, ranks
    assert not _crashes(ranks) and not _noticed(ranks), ranks


def test_a_crash_is_not_a_notice_and_every_rank_counts() -> None:
    """How a mutated run is judged: a violation on any rank is noticed; an error on any rank
    is a crash, never a notice."""
    clean = {"packed": {"violations": [], "error": None}}
    seen = {"packed": {"violations": ["unordered read"], "error": None}}
    crashed = {"packed": {"violations": [], "error": "AttributeError: _event"}}
    assert _noticed([clean, seen]) == ["rank 1 packed: unordered read"]
    assert not _crashes([clean, seen]) and not _noticed([clean, clean])
    assert _crashes([clean, crashed]) == ["rank 1 packed: AttributeError: _event"]
    assert not _noticed([crashed, crashed])


@pytest.mark.parametrize("mutation", _mutations(), ids=lambda m: m[3])
def test_each_stream_line_is_needed(mutation: tuple[str, str, str, str], tmp_path: Path) -> None:
    rel, old, new, what = mutation
    copy = tmp_path / "src" / "fullshard"
    shutil.copytree(SRC, copy, ignore=shutil.ignore_patterns("__pycache__"))
    text = (copy / rel).read_text()
    assert text.count(old) == 1, f"{what}: {old!r} is not one line of {rel}"
    (copy / rel).write_text(text.replace(old, new))
    ranks = _run(tmp_path / "src")
    crashes = _crashes(ranks)
    assert not crashes, f"{what} crashed instead of being reported: {crashes}"
    assert _noticed(ranks), f"{what} went unnoticed on every rank: {ranks}"


def test_only_streams_py_names_cuda_streams() -> None:
    """No engine module but ``streams.py`` uses ``torch.cuda``'s streams and events in code."""
    names = {"Stream", "Event", "current_stream", "stream"}
    offenders = []
    for path in sorted((SRC / "engine").glob("*.py")):
        if path.name == "streams.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.Attribute)
                and node.attr in names
                and isinstance(node.value, ast.Attribute)
                and node.value.attr == "cuda"
            ):
                offenders.append(f"{path.name}:{node.lineno} torch.cuda.{node.attr}")
    assert offenders == [], offenders
