"""Run the reliability tests and render ``docs/reliability.md`` from what they recorded.

    python scripts/reliability_report.py            # CI-sized soak (60 steps)
    python scripts/reliability_report.py --slow     # plus the 500-step soak
    python scripts/reliability_report.py --rows DIR/rows.jsonl   # render saved rows only

The ``tests/test_reliability_*.py`` tests append one JSON row per case to
``$FULLSHARD_RELIABILITY_RESULTS/rows.jsonl``; the tests that already covered a part of the
issue elsewhere (engine faults and bad input, checkpoint safety and durability) are run too and
listed with their pass/fail from pytest's JUnit XML. Exit status: pytest's.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
OURS = [
    "tests/test_reliability_faults.py",
    "tests/test_reliability_inputs.py",
    "tests/test_reliability_soak.py",
]
# Tests elsewhere that cover the rest of the issue: (node id, what it shows).
ELSEWHERE = [
    (
        "tests/test_faults_engine.py::test_stuck_rank_fails_fast_with_a_named_collective",
        "a rank stuck in user code: the other fails within the process-group timeout with a "
        "CollectiveError naming collective, unit and rank",
    ),
    (
        "tests/test_faults_engine.py::test_divergent_path_errors_instead_of_hanging",
        "divergent paths (a rank skips a unit): an error (CollectiveError after the timeout, or "
        "gloo's size mismatch), never a hang",
    ),
    (
        "tests/test_engine.py::test_api_and_errors",
        "fully_shard twice, units applied top-down, mixed dtypes in a unit, mesh not matching "
        "the process group, meta parameters at forward, a non-module argument",
    ),
    (
        "tests/test_engine_knobs.py::test_knobs_and_bad_input",
        "set_* knobs given bad values",
    ),
    (
        "tests/test_checkpoint_safety.py",
        "library side of crafted checkpoints (13 manifest edits), pickles never run, flipped/"
        "truncated bytes named by file and tensor, missing/unexpected keys and shape mismatches",
    ),
    (
        "tests/test_checkpoint_durability.py::test_sigkill_during_save_keeps_previous_checkpoint",
        "SIGKILL of both ranks mid-save (library): the previous checkpoint stays latest",
    ),
    (
        "tests/test_gc.py::test_a_dropped_model_is_collected",
        "a model dropped after a forward, a backward, a step, a state dict, summon_full_params "
        "or no_sync (FSDP1 wrapper and fully_shard) is garbage-collected with every storage it "
        "held",
    ),
    (
        "tests/test_train_config.py::test_bad_values_fail_fast",
        "trainer flag validation (unit level)",
    ),
    (
        "tests/test_train_config.py::test_bad_flag_exits_before_spawning",
        "a bad flag through the real console script: exit 2 within seconds, nothing created",
    ),
]


def run_tests(results: Path, slow: bool) -> tuple[int, dict[str, tuple[str, float]]]:
    """Run the tests; return pytest's exit status and {node id prefix: (outcome, seconds)}."""
    env = {**os.environ, "FULLSHARD_RELIABILITY_RESULTS": str(results)}
    env.setdefault("OMP_NUM_THREADS", "1")
    if slow:
        env["FULLSHARD_RUN_SLOW"] = "1"
    src = str(ROOT / "src")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [src, env.get("PYTHONPATH", "")]))
    junit = results / "junit.xml"
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={junit}"]
    cmd += OURS + [node for node, _ in ELSEWHERE]
    print("+", " ".join(cmd), flush=True)
    rc = subprocess.call(cmd, cwd=ROOT, env=env)
    outcomes: dict[str, tuple[str, float]] = {}
    if junit.exists():
        for case in ET.parse(junit).getroot().iter("testcase"):
            path = case.get("classname", "").replace(".", "/") + ".py"
            node = f"{path}::{case.get('name')}"
            state = "passed"
            for child in case:
                if child.tag in ("failure", "error"):
                    state = "FAILED"
                elif child.tag == "skipped" and state == "passed":
                    state = "skipped"
            outcomes[node] = (state, float(case.get("time", 0)))
    return rc, outcomes


def _cell(text: Any) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def _table(rows: list[dict[str, Any]], headers: list[str], keys: list[str]) -> list[str]:
    out = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    for r in rows:
        out.append("| " + " | ".join(_cell(r.get(k, "")) for k in keys) + " |")
    return out


def render(rows: list[dict[str, Any]], outcomes: dict[str, tuple[str, float]], cmd: str) -> str:
    """The Markdown of docs/reliability.md."""
    import torch

    for r in rows:
        r["result"] = "ok" if r["ok"] else "**FAILED**"
        r["time"] = f"{r['seconds']:.0f} s" if "seconds" in r else ""
    by = {
        t: [r for r in rows if r["table"] == t] for t in ("faults", "inputs", "untrusted", "soak")
    }
    n_ok = sum(r["ok"] for r in rows)
    lines = [
        "# Reliability: faults, hangs, bad input and leaks",
        "",
        f"Generated by `{cmd}` on {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} "
        f"(torch {torch.__version__}, {platform.machine()}, {os.cpu_count()} CPU cores, gloo, "
        f"2 ranks). Every row below is one case of a test in `tests/test_reliability_*.py`; "
        f"{n_ok} of {len(rows)} cases held. Do not edit by hand: rerun the script.",
        "",
        "Faults are injected through the trainer's test hook `FULLSHARD_FAULT` "
        "(`src/fullshard/train/guard.py`, [Note: fault injection]) into real `fullshard train` "
        "runs: 2 CPU ranks under torchrun's elastic agent, the tiny preset.",
        "",
        f"## Faults injected ({sum(r['ok'] for r in by['faults'])} of {len(by['faults'])} "
        "survived as specified)",
        "",
        *_table(
            by["faults"],
            ["Fault", "Injected", "Outcome", "Result", "Run"],
            ["case", "injected", "outcome", "result", "time"],
        ),
        "",
        "What the trainer does, and the knobs:",
        "",
        "- A rank that dies (any signal, any exit status) fails the group; torchrun's agent "
        "restarts it up to `--max-restarts` times (default 1), and every restart resumes from "
        "the newest *complete* checkpoint (`--resume auto`). A save cut short leaves only a "
        "`.partial` directory, which is ignored and later removed.",
        "- A rank that hangs makes the others fail after `--collective-timeout` seconds "
        "(default 600) with a `CollectiveError` naming the collective, the unit and the rank. "
        "When the hung rank is *stopped* (SIGSTOP) rather than dead, the agent needs up to 30 s "
        "more (its hard-coded SIGTERM-to-SIGKILL grace when tearing down a failed group) before "
        "it restarts or exits.",
        "- A rank whose forward skips a unit the others run (a data-dependent branch) gets an "
        "error, never a deadlock: a `CollectiveError` after the timeout, or gloo's own size "
        "mismatch error (`tests/test_faults_engine.py`). Such models are not supported; run the "
        "same units on every rank.",
        "- Non-finite gradients: the global gradient norm (`fullshard.clip_grad_norm_`, "
        "all-reduced) is the same on every rank, so every rank skips the same optimizer steps. "
        "`metrics.jsonl` marks each step `skipped` and counts `skipped_steps`; more than "
        "`--max-skipped-steps` (default 10) in a row stops the run with exit 1 and no elastic "
        "restart (it would replay the same steps).",
        "- `--resume PATH` is checked before launch: a complete checkpoint, file headers that "
        "match its manifest, optimizer and data-order state present, tensors that fit the "
        "model (names and shapes). Block checksums are verified as the ranks load. "
        "`--resume auto` checks the newest checkpoint the same way (one of another model is "
        "refused, a damaged one is skipped for the newest intact one).",
        "- The checks write nothing: a refused command leaves the run directory as it was; "
        "the directory, `config.toml` and the tokenized-data cache are written once every "
        "check has passed.",
        "- A failure a restart would only repeat (a checkpoint that does not fit, or is damaged "
        "with no intact one left; no space left on the device; permission denied) stops the "
        "job at once with exit 1 and one `fullshard train: error: ...` line naming the cause "
        "and the fix; the ranks' tracebacks go to `RUN_DIR/logs/`. Under a bare `torchrun`, "
        "whose agent restarts after any failure, the failing rank leaves a stop marker for its "
        "torchrun invocation and the restarted ranks exit at once with the same line "
        "([Note: no restart under a bare torchrun] in `src/fullshard/train/failures.py`).",
        "",
        f"## Bad input ({sum(r['ok'] for r in by['inputs'])} of {len(by['inputs'])} refused "
        "with a clear error, before any process was spawned)",
        "",
        *_table(
            by["inputs"],
            ["Input", "Flags", "Error printed (exit 2)", "Result"],
            ["case", "injected", "outcome", "result"],
        ),
        "",
        f"## Untrusted checkpoints ({sum(r['ok'] for r in by['untrusted'])} of "
        f"{len(by['untrusted'])} rejected without side effects)",
        "",
        "Each crafted checkpoint is given to `fullshard ckpt inspect`, `fullshard ckpt export` "
        "and `fullshard train --resume`. Rejected means: every command exits non-zero, no "
        "pickle payload runs (it would create a marker file), and no file appears or changes "
        "outside the run directory (export's output included).",
        "",
        *_table(
            by["untrusted"],
            ["Crafted", "How", "Outcome", "Result"],
            ["case", "injected", "outcome", "result"],
        ),
        "",
        "## Soak",
        "",
        *_table(
            by["soak"],
            ["Run", "Setup", "Outcome", "Result", "Run time"],
            ["case", "injected", "outcome", "result", "time"],
        ),
        "",
    ]
    for r in by["soak"]:
        lines += [f"{r['case']}, median step {r['median_step_s'] * 1000:.1f} ms:", ""]
        lines += [
            "| Rank | RSS at warm-up (MiB) | Peak after (MiB) | At end (MiB) | Growth | Open fds |",
            "|---|---|---|---|---|---|",
        ]
        for rank, f in r["ranks"].items():
            lines.append(
                f"| {rank[-1]} | {f['rss_at_warmup_mib']} | {f['rss_peak_after_mib']} | "
                f"{f['rss_end_mib']} | {f['rss_growth_pct']}% | {f['fds']} |"
            )
        lines += ["", f"Checkpoints left: {', '.join(r['checkpoints_left'])}.", ""]
    lines += [
        "## Covered by other tests (run by this script too)",
        "",
        "| Test | What it shows | Result |",
        "|---|---|---|",
    ]
    for node, what in ELSEWHERE:
        hits = [(n, o) for n, o in outcomes.items() if n == node or n.startswith(node + "::")]
        if not hits:
            result = "not run"
        else:
            states = [o[0] for _, o in hits]
            failed = states.count("FAILED")
            result = f"{len(hits) - failed} of {len(hits)} passed" if len(hits) > 1 else states[0]
        lines.append(f"| `{node}` | {_cell(what)} | {result} |")
    lines += [
        "",
        "Parameters of one unit on different devices raise in `fully_shard`; that case "
        "needs two devices and is not exercised on CPU-only machines.",
        "",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--slow", action="store_true", help="include the 500-step soak")
    parser.add_argument("--rows", type=Path, help="render these saved rows; run no tests")
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "reliability.md")
    args = parser.parse_args(argv)
    cmd = "python scripts/reliability_report.py" + (" --slow" if args.slow else "")
    if args.rows:
        rows = [json.loads(line) for line in args.rows.read_text().splitlines()]
        rc, outcomes = 0, dict[str, tuple[str, float]]()
    else:
        with tempfile.TemporaryDirectory() as tmp:
            rc, outcomes = run_tests(Path(tmp), args.slow)
            path = Path(tmp) / "rows.jsonl"
            text = path.read_text() if path.exists() else ""
            rows = [json.loads(line) for line in text.splitlines()]
    args.out.write_text(render(rows, outcomes, cmd))
    print(f"wrote {args.out} ({len(rows)} rows); pytest exit status {rc}")
    return rc


if __name__ == "__main__":
    sys.exit(main())
