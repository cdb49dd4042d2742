"""The GPU check's rows, its report files and the loop that runs the checks in a time budget.

The report is written as the run goes: after each check, ``gpu_check.json`` and
``gpu_check.md`` in the ``--out`` folder are rewritten whole (a temporary file, then a rename),
so a run killed at its time limit leaves the rows of every check it finished.
"""

from __future__ import annotations

import json
import os
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

#: Set to a check's key to make that check raise (how the tests see a failing check fail the run).
RAISE_ENV = "FULLSHARD_GPU_CHECK_RAISE"
#: Verdicts that make the run exit 1: a correctness failure, a check that raised, one not run.
FAILING = ("FAIL", "ERROR", "SKIPPED")


@dataclass
class Row:
    """One line of the table."""

    check: str
    fullshard: str
    reference: str  # torch FSDP2's figure, or the planner's prediction
    note: str
    verdict: str  # PASS / FAIL / ERROR / SKIPPED (correctness), met / missed / INFO (reported)


@dataclass
class Check:
    """One check: ``run()`` returns its rows; ``estimate_s`` is what it needs on one H200."""

    key: str
    title: str
    run: Callable[[], list[Row]]
    estimate_s: float


@dataclass
class Report:
    """Everything the run has found so far, and where it is written."""

    header: str
    out_dir: Path | None
    budget_s: float
    rows: list[Row] = field(default_factory=list)
    checks: list[dict[str, Any]] = field(default_factory=list)
    details: dict[str, Any] = field(default_factory=dict)  # trace summaries, plan, metrics
    done: bool = False

    def to_dict(self) -> dict[str, Any]:
        return {
            "header": self.header,
            "done": self.done,
            "budget_s": self.budget_s,
            "checks": self.checks,
            "rows": [asdict(r) for r in self.rows],
            "details": self.details,
        }

    def write(self) -> None:
        """Rewrite ``gpu_check.json`` and ``gpu_check.md`` (no-op without an out folder)."""
        if self.out_dir is None:
            return
        self.out_dir.mkdir(parents=True, exist_ok=True)
        _write(self.out_dir / "gpu_check.json", json.dumps(self.to_dict(), indent=1) + "\n")
        _write(self.out_dir / "gpu_check.md", markdown(self))

    def failed(self) -> bool:
        return any(r.verdict in FAILING for r in self.rows)


def _write(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    tmp.replace(path)


def _md_cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def markdown(report: Report) -> str:
    """The report as a markdown table, with each check's status and time below it."""
    lines = [f"**{report.header}**", ""]
    lines += ["| check | fullshard | FSDP2 / plan | verdict | note |", "|---|---|---|---|---|"]
    for r in report.rows:
        cells = (r.check, r.fullshard, r.reference, r.verdict, r.note)
        lines.append("| " + " | ".join(_md_cell(c) for c in cells) + " |")
    lines += ["", "| check | status | seconds |", "|---|---|---|"]
    for c in report.checks:
        lines.append(f"| {c['title']} | {c['status']} | {c['seconds']:.0f} |")
    state = "finished" if report.done else "in progress (or stopped before the end)"
    lines += ["", f"Run {state}; budget {report.budget_s:.0f} s."]
    return "\n".join(lines) + "\n"


def table(rows: list[Row], header: str) -> str:
    """The rows as aligned plain text (the console's table)."""
    cells = [["check", "fullshard", "FSDP2 / plan", "verdict", "note"]]
    cells += [[r.check, r.fullshard, r.reference, r.verdict, r.note] for r in rows]
    widths = [max(len(c[i]) for c in cells) for i in range(4)]
    lines = [header]
    for j, c in enumerate(cells):
        lines.append("  ".join(x.ljust(w) for x, w in zip(c[:4], widths)) + "  " + c[4])
        if j == 0:
            lines.append("  ".join("-" * w for w in widths) + "  " + "-" * 4)
    return "\n".join(lines)


def _run_one(check: Check) -> tuple[str, list[Row]]:
    try:
        if os.environ.get(RAISE_ENV) == check.key:
            raise RuntimeError(f"injected failure ({RAISE_ENV}={check.key})")
        return "ran", check.run()
    except Exception as e:  # report and go on: one broken check must not hide the rest
        traceback.print_exc()
        return "error", [Row(check.title, "-", "-", f"{type(e).__name__}: {e}"[:300], "ERROR")]


def run_checks(
    checks: list[Check], report: Report, clock: Callable[[], float] = time.monotonic
) -> None:
    """Run ``checks`` in order, writing the report after each; a check whose estimate no longer
    fits in what is left of the budget is reported SKIPPED ('time budget') instead."""
    t0 = clock()
    report.write()
    for check in checks:
        left = report.budget_s - (clock() - t0)
        start = clock()
        if left < check.estimate_s:
            status = "skipped"
            note = f"time budget: {left:.0f} s left, the check needs about {check.estimate_s:.0f} s"
            rows = [Row(check.title, "-", "-", note, "SKIPPED")]
        else:
            status, rows = _run_one(check)
        seconds = clock() - start
        report.rows += rows
        report.checks.append(
            {"key": check.key, "title": check.title, "status": status, "seconds": seconds}
        )
        report.write()
        print(f"gpu_check: {check.title}: {status} in {seconds:.0f} s", flush=True)
    report.done = True
    report.write()
