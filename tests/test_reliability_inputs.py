"""Bad and untrusted input through the ``fullshard`` command, in-process (``fullshard.cli.main``
with the launcher replaced by a spy, so "before spawning" is checked, not assumed).

- ``fullshard train`` flags: each bad value is refused with exit 2 before any rank is spawned,
  by a message naming the flag, showing the value and saying how to fix it. (The same checks
  are unit-tested in ``test_train_config.py``; the real console entry, timed, in
  ``test_bad_flag_exits_before_spawning``.)
- A checkpoint of a different model passed to ``--resume``: missing/unexpected names and shape
  mismatches listed before launch.
- Crafted checkpoints (path traversal, a symlink out, absurd sizes, wrong dtypes, pickles)
  given to ``fullshard ckpt inspect``, ``fullshard ckpt export`` and ``fullshard train
  --resume``: refused, no code run, nothing written outside the run directory. (The library
  side, ``ckpt.load``, is covered case by case in ``test_checkpoint_safety.py``.)
"""

from __future__ import annotations

import json
import pickle
import shutil
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from fullshard import cli
from reliability_helpers import fullshard, record, save_train_checkpoint


def _run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    try:
        rc = cli.main(argv)
    except SystemExit as e:  # argparse usage errors
        rc = int(e.code or 0)
    captured = capsys.readouterr()
    return rc, captured.err + captured.out


def _error_line(text: str) -> str:
    lines = [ln for ln in text.splitlines() if "error:" in ln]
    return lines[-1].split("error: ", 1)[1] if lines else text.strip().splitlines()[-1]


# ---------------------------------------------------------------- train flags

# (case, extra flags, substrings the message must hold); {tmp} and {corpus} are filled in.
BAD_FLAGS: list[tuple[str, list[str], list[str]]] = [
    ("unknown flag", ["--max-stepz", "3"], ["--max-stepz", "did you mean --max-steps"]),
    ("missing value", ["--max-steps"], ["--max-steps", "expected one argument"]),
    ("not a number", ["--max-steps", "ten"], ["--max-steps", "invalid int", "ten"]),
    ("negative steps", ["--max-steps", "-5"], ["--max-steps", "positive", "-5"]),
    ("NaN learning rate", ["--lr", "nan"], ["--lr", "positive number", "nan"]),
    ("out-of-range fraction", ["--eval-fraction", "1.5"], ["--eval-fraction", "[0, 1)", "1.5"]),
    ("unknown choice", ["--mixed-precision", "fp8"], ["--mixed-precision", "fp8", "bf16"]),
    ("zero timeout", ["--collective-timeout", "0"], ["--collective-timeout", "positive"]),
    ("heads do not divide width", ["--d-model", "65"], ["--d-model (65)", "--n-head (4)"]),
    ("unknown preset", ["--preset", "huge"], ["--preset", "huge", "invalid choice"]),
    ("missing --config file", ["--config", "{tmp}/nope.toml"], ["--config", "nope.toml"]),
    ("data path does not exist", ["--data", "{tmp}/nope.txt"], ["--data", "does not exist"]),
    ("empty corpus (empty file)", ["--data", "{tmp}/empty.txt"], ["--data", "empty"]),
    ("empty corpus (no text files)", ["--data", "{tmp}/emptydir"], ["--data", "empty"]),
    ("corpus too short", ["--data", "{tmp}/short.txt"], ["--data", "too few"]),
    ("truncated .bin", ["--data", "{tmp}/odd.bin"], ["odd.bin", "not a multiple of uint16"]),
    ("vocabulary too small", ["--vocab-size", "100"], ["token ids up to 255", "--vocab-size"]),
    (
        "batch not divisible by ranks",
        ["--nproc", "3"],
        ["--global-batch 8", "3 x 2 = 6", "use --global-batch 12"],
    ),
    ("batch not divisible by micro", ["--micro-batch", "3"], ["2 x 3 = 6", "--global-batch 12"]),
    (
        "run dir under a file",
        ["--run-dir", "{tmp}/file/run"],
        ["--run-dir", "cannot be created in", "file (a file, not a directory)"],
    ),
    (
        "run dir on a read-only fs",
        ["--run-dir", "/proc/fullshard-run"],
        ["--run-dir", "cannot be created in /proc"],
    ),
    ("--resume not a checkpoint", ["--resume", "{tmp}"], ["--resume", "not a complete checkpoint"]),
    ("no GPU for --device cuda", ["--device", "cuda"], ["--device cuda", "--device cpu"]),
]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the --device cuda case needs no GPU")
def test_bad_train_flags_fail_before_spawning(
    tmp_path: Path, corpus: Path, no_launch: list[object], capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "emptydir").mkdir()
    (tmp_path / "short.txt").write_text("hi")
    (tmp_path / "odd.bin").write_bytes(b"abc")
    (tmp_path / "file").write_text("x")
    base = ["train", "--preset", "tiny", "--data", str(corpus), "--run-dir", str(tmp_path / "r")]
    for case, flags, needles in BAD_FLAGS:
        flags = [f.format(tmp=tmp_path, corpus=corpus) for f in flags]
        rc, err = _run(base + flags, capsys)
        missing = [n for n in needles if n not in err]
        ok = rc == 2 and not missing and no_launch == []
        record("inputs", case, " ".join(flags), _error_line(err), ok)
        assert ok, f"{case}: exit {rc}, launched {len(no_launch)}, missing {missing} in:\n{err}"


# ---------------------------------------------------------------- checkpoints


def test_resume_from_a_different_model_lists_the_mismatch(
    tmp_path: Path, corpus: Path, no_launch: list[object], capsys: pytest.CaptureFixture[str]
) -> None:
    base = ["train", "--preset", "tiny", "--data", str(corpus), "--run-dir", str(tmp_path / "r")]
    cases = {
        "wider model": (
            dict(d_model=32),
            ["shape mismatches", "embed.weight: checkpoint [256, 32] vs model [256, 64]"],
        ),
        "deeper model": (dict(n_layer=3), ["unexpected keys", "blocks.2.attn"]),
        "shallower model": (dict(n_layer=1), ["missing keys", "blocks.1.attn"]),
    }
    for case, (changes, needles) in cases.items():
        path = save_train_checkpoint(tmp_path / case.replace(" ", "_") / "step_00000001", **changes)
        rc, err = _run([*base, "--resume", str(path)], capsys)
        missing = [n for n in needles if n not in err]
        ok = rc == 2 and not missing and no_launch == [] and "--preset, --d-model" in err
        flags = " ".join(f"--{k.replace('_', '-')} {v}" for k, v in changes.items())
        record(
            "inputs",
            f"--resume a checkpoint of a {case}",
            f"checkpoint saved with {flags}, resumed as --preset tiny",
            _error_line(err)[:300] + ("..." if len(_error_line(err)) > 300 else ""),
            ok,
        )
        assert ok, f"{case}: exit {rc}, missing {missing} in:\n{err}"


class _Payload:
    """Unpickling this creates the marker file: proof that a pickle ran."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (Path.touch, (self.marker,))


RANK = "rank_00000.safetensors"


def _edit_manifest(edit: Callable[[dict[str, Any]], None]) -> Callable[[Path, Path], None]:
    def apply(path: Path, _: Path) -> None:
        doc = json.loads((path / "manifest.json").read_text())
        edit(doc)
        (path / "manifest.json").write_text(json.dumps(doc))

    return apply


def _rename_file(new: str) -> Callable[[Path, Path], None]:
    def edit(doc: dict[str, Any]) -> None:
        doc["files"][new] = doc["files"].pop(RANK)
        for rec in doc["model"].values():
            for s in rec["shards"]:
                s["file"] = new

    return _edit_manifest(edit)


def _set(field: str, value: Any) -> Callable[[Path, Path], None]:
    return _edit_manifest(lambda doc: doc["model"]["embed.weight"].__setitem__(field, value))


def _pickle_rank_file(path: Path, marker: Path) -> None:
    (path / RANK).write_bytes(pickle.dumps(_Payload(marker)))


def _pickle_manifest(path: Path, marker: Path) -> None:
    (path / "manifest.json").write_bytes(pickle.dumps(_Payload(marker)))


# The symlink's target: a file beside the checkpoint directory (not in it), inside the test's
# tmp_path so that the "nothing written" check watches it too, holding text the commands must
# not show.
OUTSIDE = "outside.txt"
SECRET = "secret-4f1d9b: a host file a checkpoint must not reach\n"


def _symlink_out(path: Path, marker: Path) -> None:
    target = marker.parent / OUTSIDE
    target.write_text(SECRET)
    (path / RANK).unlink()
    (path / RANK).symlink_to(target)


def _huge_header(path: Path, _: Path) -> None:
    with open(path / RANK, "r+b") as f:
        f.write(struct.pack("<Q", 2**62))  # safetensors header length: 4 EiB


def _truncate(path: Path, _: Path) -> None:
    data = (path / RANK).read_bytes()
    (path / RANK).write_bytes(data[: len(data) // 2])


def _flip_data_byte(path: Path, _: Path) -> None:
    from fullshard.checkpoint.safetensors_io import read_header

    entries, _, _ = read_header(path / RANK)
    data = bytearray((path / RANK).read_bytes())
    data[entries["model/embed.weight"].begin + 5] ^= 0x40
    (path / RANK).write_bytes(bytes(data))


# case -> (how it is crafted, what it claims)
CRAFTED: dict[str, tuple[Callable[[Path, Path], None], str]] = {
    "path traversal (../)": (
        _rename_file("../../evil.safetensors"),
        "manifest names file ../../evil.safetensors",
    ),
    "absolute path": (_rename_file("/etc/passwd"), "manifest names file /etc/passwd"),
    "symlink out of the checkpoint": (
        _symlink_out,
        "rank file is a symlink to a file outside the checkpoint",
    ),
    "absurd tensor shape": (_set("shape", [2**40, 2**20]), "embed.weight claims [2^40, 2^20]"),
    "absurd header length": (_huge_header, "safetensors header length 2^62"),
    "wrong dtype": (_set("dtype", "I32"), "manifest says I32, file holds F32"),
    "unknown dtype": (_set("dtype", "PICKLE"), "dtype 'PICKLE'"),
    "pickle as rank file": (
        _pickle_rank_file,
        "rank file replaced by a pickle that touches a file",
    ),
    "pickle as manifest": (_pickle_manifest, "manifest replaced by a pickle"),
    "truncated rank file": (_truncate, "rank file cut in half"),
    "flipped data byte": (
        _flip_data_byte,
        "one byte of embed.weight changed (same size, same header)",
    ),
}


BLOCK_LEVEL = {"flipped data byte"}


def _tree(root: Path) -> dict[str, float]:
    return {str(p.relative_to(root)): p.lstat().st_mtime for p in root.rglob("*")}


@pytest.fixture(scope="module")
def good_gpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_train_checkpoint(tmp_path_factory.mktemp("good") / "step_00000001")


@pytest.mark.parametrize("case", list(CRAFTED))
def test_crafted_checkpoint_through_the_cli(
    case: str,
    good_gpt: Path,
    corpus: Path,
    tmp_path: Path,
    no_launch: list[object],
    capsys: pytest.CaptureFixture[str],
) -> None:
    craft, what = CRAFTED[case]
    path = tmp_path / "in" / "step_00000001"
    shutil.copytree(good_gpt, path)
    marker = tmp_path / "PWNED"
    craft(path, marker)
    out = tmp_path / "out" / "model.safetensors"
    run_dir = tmp_path / "run"
    before = _tree(tmp_path)

    results: dict[str, tuple[int, str]] = {}
    results["inspect"] = _run(["ckpt", "inspect", str(path)], capsys)
    results["export"] = _run(["ckpt", "export", str(path), str(out)], capsys)
    train = ["train", "--preset", "tiny", "--data", str(corpus), "--run-dir", str(run_dir)]
    if case in BLOCK_LEVEL:
        # Only tensor bytes changed: the pre-launch check reads headers, not every block, so
        # the ranks launch and refuse the checkpoint at load (a real run, no restarts).
        proc, _ = fullshard(*train, "--resume", str(path), "--max-restarts", "0", cwd=tmp_path)
        results["train --resume"] = (proc.returncode, proc.stdout + proc.stderr)
        assert "checksum mismatch" in proc.stderr and RANK in proc.stderr, proc.stderr
    else:
        results["train --resume"] = _run([*train, "--resume", str(path)], capsys)
        assert no_launch == []

    after = _tree(tmp_path)
    written = sorted(
        k for k in after if (k not in before or after[k] != before[k]) and not k.startswith("run")
    )
    refused = {cmd: rc != 0 for cmd, (rc, _) in results.items()}
    ok = all(refused.values()) and not marker.exists() and written == []
    message = _error_line(results["train --resume"][1])
    if case in BLOCK_LEVEL:
        message = next(
            (ln for ln in results["train --resume"][1].splitlines() if "checksum mismatch" in ln),
            message,
        ).split("CheckpointError: ")[-1]
    launched = "launched; ranks refused it at load" if case in BLOCK_LEVEL else "not launched"
    record(
        "untrusted",
        case,
        what,
        f"inspect exit {results['inspect'][0]}, export exit {results['export'][0]}, train exit "
        f"{results['train --resume'][0]} ({launched}); no file written outside the run dir; "
        f"no code run. {message}",
        ok,
    )
    assert not marker.exists(), "a pickle payload ran"
    assert written == [], f"files written outside the run directory: {written}"
    assert all(refused.values()), {k: v for k, v in results.items()}
    if case == "symlink out of the checkpoint":
        # the file the symlink points to is left as it was (not removed, truncated or
        # rewritten) and none of its text reaches the user
        assert (tmp_path / OUTSIDE).read_text() == SECRET, "the symlink's target was changed"
        shown = [cmd for cmd, (_, text) in results.items() if SECRET.split(":")[0] in text]
        assert shown == [], f"the symlink's target was shown by {shown}"
