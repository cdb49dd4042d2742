"""``fullshard train`` as a new user meets it, in-process and fast (no rank is spawned).

- Fast start: ``--help`` and argument errors never import torch.
- ``--help`` shows the chosen preset's defaults and no reStructuredText markup; a bad TOML
  value names its key and the expected type; ``bench --steps -2`` names ``--steps``.
- Runs of different models or optimizers get different default run directories; auto-resume
  into a run directory of another model is refused before launch (one screen, the first
  differing names, the fix; nothing written), so is a resume of another optimizer's
  checkpoint; a damaged newest checkpoint is skipped for an intact one.
- Failure reports: which failures stop the job (deterministic) and which restart it.
"""

from __future__ import annotations

import errno
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

import fullshard.train.launch as launch_mod
from fullshard import cli
from fullshard.checkpoint import CheckpointCorruptedError, CheckpointMismatchError
from fullshard.train import failures
from fullshard.train.cli import parse_config
from fullshard.train.config import ConfigError, to_toml
from reliability_helpers import env, save_train_checkpoint

LLAMA = json.dumps(
    {
        "model_type": "llama",
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 256,
    }
)


def _main(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    try:
        rc = cli.main(argv)
    except SystemExit as e:
        rc = int(e.code or 0)
    out = capsys.readouterr()
    return rc, out.out, out.err


# ---------------------------------------------------------------- fast start


def test_help_and_argument_errors_do_not_import_torch(tmp_path: Path) -> None:
    """What makes ``--help`` take seconds is importing torch; none of these may (every
    subcommand's help, and argument errors of each)."""
    script = """
import contextlib, io, sys
from fullshard.cli import main
cases = [["--help"], ["train", "--help"], ["train", "--preset", "tiny", "--help"],
         ["train", "--max-steps", "-1"], ["train", "--max-stepz", "3"], ["bench", "--help"],
         ["bench", "--steps", "-2"], ["train", "--preset", "tiny", "--nproc", "3"],
         ["plan", "--help"], ["plan", "--world-size", "two"], ["plan", "--engine", "nope"],
         ["ckpt", "--help"], ["ckpt", "export", "--help"], ["ckpt", "inspect"],
         ["ckpt", "export", "run"], ["ckpt", "export", "run", "--max-shard-size", "5QB"]]
for argv in cases:
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        try:
            main(argv)
        except SystemExit:
            pass
    heavy = sorted(m for m in ("torch", "numpy", "transformers") if m in sys.modules)
    print(" ".join(argv), "->", heavy)
"""
    proc = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=env(), cwd=tmp_path
    )
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert len(lines) == 16 and all(line.endswith("-> []") for line in lines), proc.stdout


# ---------------------------------------------------------------- help, TOML, bench flags


def _flat(text: str) -> str:
    return " ".join(text.split())


def _default_of(flag: str, text: str) -> str:
    """The ``(default: X)`` in ``flag``'s help entry (up to the next flag)."""
    m = re.search(rf"{flag} ((?! --).)*?\(default: ([^)]*)\)", _flat(text))
    return m.group(2) if m else "<none>"


def test_train_help_shows_the_chosen_presets_defaults(capsys: pytest.CaptureFixture[str]) -> None:
    rc, small, _ = _main(["train", "--help"], capsys)
    assert rc == 0 and "--max-steps N Optimizer steps" in _flat(small)
    assert _default_of("--max-steps", small) == "300"
    rc, tiny, _ = _main(["train", "--preset", "tiny", "--help"], capsys)
    assert rc == 0 and "Defaults shown are those of --preset tiny" in _flat(tiny)
    assert _default_of("--max-steps", tiny) == "40" and _default_of("--d-model", tiny) == "64"
    rc, llama, _ = _main(["train", "--preset=llama-1b", "--help"], capsys)
    assert _default_of("--seq-len", llama) == "2048"
    assert _default_of("--preset", llama) == "'small'"  # the default preset is still small


@pytest.mark.parametrize("command", ["", "train", "bench", "ckpt", "ckpt export", "plan"])
def test_help_texts_have_no_rst_markup(command: str, capsys: pytest.CaptureFixture[str]) -> None:
    rc, text, _ = _main([*command.split(), "--help"], capsys)
    assert rc == 0 and text
    for markup in ("``", ":class:", ":mod:", ":func:", ":meth:", ".. "):
        assert markup not in text, f"{markup!r} in fullshard {command} --help"


@pytest.mark.parametrize(
    ("toml", "needles"),
    [
        ('max_steps = "ten"', ["max_steps", "an integer", "'ten'"]),
        ("lr = true", ["lr", "a number", "True"]),
        ("cpu-offload = 1", ["cpu-offload", "true or false"]),
        ('mixed_precision = "fp8"', ["mixed_precision", '"bf16"', "'fp8'"]),
        ("run_dir = 3", ["run_dir", "a quoted string"]),
    ],
)
def test_bad_toml_value_names_the_key_and_the_type(
    tmp_path: Path, toml: str, needles: list[str]
) -> None:
    path = tmp_path / "c.toml"
    path.write_text(toml + "\n")
    with pytest.raises(ConfigError) as info:
        parse_config(["--config", str(path)])
    for needle in needles:
        assert needle in str(info.value), str(info.value)


def test_bench_negative_steps_names_steps(capsys: pytest.CaptureFixture[str]) -> None:
    rc, _, err = _main(["bench", "--steps", "-2"], capsys)
    last = err.strip().splitlines()[-1]
    assert rc == 2 and last.endswith("error: argument --steps: must be a positive integer, got -2")
    rc, _, err = _main(["bench", "--steps", "3", "--warmup", "5"], capsys)
    assert rc == 2 and "--warmup (5) must be at least 0 and less than --steps (3)" in err


# ---------------------------------------------------------------- run names, auto-resume


def test_default_run_names_differ_by_model() -> None:
    def run_dir(*argv: str) -> str:
        return parse_config(list(argv)).resolved_run_dir()

    assert run_dir("--preset", "tiny") == run_dir("--preset", "tiny", "--lr", "0.1")
    assert run_dir("--preset", "tiny") == "runs/tiny" and run_dir() == "runs/small"
    llama = run_dir("--preset", "tiny", "--hf-config", LLAMA)
    assert re.fullmatch(r"runs/tiny-[0-9a-f]{8}", llama)
    respaced = json.dumps(json.loads(LLAMA), indent=2)  # the same model, written differently
    assert run_dir("--preset", "tiny", "--hf-config", respaced) == llama
    wider = run_dir("--preset", "tiny", "--d-model", "128")
    assert wider not in ("runs/tiny", llama) and wider.startswith("runs/tiny-")
    assert run_dir("--preset", "tiny", "--d-model", "128", "--name", "w") == "runs/w"
    assert run_dir("--preset", "llama-1b") == "runs/llama-1b"
    # Another optimizer's checkpoints cannot be resumed: the optimizer is in the name.
    assert run_dir("--optimizer", "muon") == "runs/small-muon"
    assert run_dir("--preset", "tiny", "--d-model", "128", "--optimizer", "muon") == wider + "-muon"
    assert run_dir("--optimizer", "muon", "--name", "w") == "runs/w"


def _gpt_run(run_dir: Path, *steps: int) -> None:
    """A run directory as a tiny GPT run leaves it: config.toml and checkpoints."""
    for step in steps:
        save_train_checkpoint(run_dir / "checkpoints" / f"step_{step:08d}", step=step)
    cfg = parse_config(["--preset", "tiny", "--run-dir", str(run_dir)])
    (run_dir / "config.toml").write_text(to_toml(cfg))


def test_auto_resume_of_another_model_is_refused_before_launch(
    tmp_path: Path, corpus: Path, no_launch: list[object], capsys: pytest.CaptureFixture[str]
) -> None:
    run_dir = tmp_path / "runs" / "tiny"
    _gpt_run(run_dir, 10)
    before = (run_dir / "config.toml").read_text()
    base = ["train", "--preset", "tiny", "--data", str(corpus), "--run-dir", str(run_dir)]
    # what each checkpoint/model pair differs in, listed by name (and shape) in the message
    llama_names = (
        "missing keys ['model.embed_tokens.weight', 'model.layers.0.self_attn.q_proj.weight'",
        "unexpected keys ['embed.weight', 'pos.weight', 'blocks.0.ln1.weight'",
    )
    wider_shapes = (
        "shape mismatches [embed.weight: checkpoint [256, 64] vs model [256, 128], "
        "pos.weight: checkpoint [64, 64] vs model [64, 128]",
    )
    for flags, was, listed, absent in (
        (["--hf-config", LLAMA], "That run used the built-in GPT", llama_names, "shape"),
        (["--d-model", "128"], "That run used --d-model 64", wider_shapes, " keys ["),
    ):
        rc, _, err = _main([*base, *flags], capsys)
        assert rc == 2 and no_launch == [], err
        assert err.startswith("fullshard train: error: ") and err.count("\n") == 1, err
        assert len(err) < 1200, f"more than a screen:\n{err}"
        assert f"{run_dir} holds checkpoints of another model (newest: step_00000010" in err
        assert was in err and "--name NAME or --run-dir DIR" in err
        assert all(text in err for text in listed) and absent not in err, err
        assert "strict=False" not in err
        assert (run_dir / "config.toml").read_text() == before  # nothing written
    assert sorted(p.name for p in run_dir.iterdir()) == ["checkpoints", "config.toml"]

    # --resume PATH of another model: the same kind of message, without strict=False.
    other = tmp_path / "other"
    rc, _, err = _main(
        [*base[:-1], str(other), "--hf-config", LLAMA, "--resume", str(run_dir)], capsys
    )
    assert rc == 2 and "does not fit the model this command builds" in err, err
    assert "'model.embed_tokens.weight'" in err and "and 17 more" in err
    assert "strict=False" not in err and not other.exists()


def test_resume_with_another_optimizer_is_refused_before_launch(
    tmp_path: Path, corpus: Path, no_launch: list[object], capsys: pytest.CaptureFixture[str]
) -> None:
    """An AdamW run's checkpoints and ``--optimizer muon`` (and the reverse): one screen
    naming both optimizers and the fix, before anything launches; the same optimizer resumes."""
    base = ["train", "--preset", "tiny", "--data", str(corpus)]
    for saved, asked in (("adamw", "muon"), ("muon", "adamw")):
        run_dir = tmp_path / saved
        save_train_checkpoint(run_dir / "checkpoints" / "step_00000010", step=10, optimizer=saved)
        rc, _, err = _main([*base, "--run-dir", str(run_dir), "--optimizer", asked], capsys)
        assert rc == 2 and no_launch == [], err
        assert err.startswith("fullshard train: error: ") and err.count("\n") == 1, err
        assert len(err) < 1200, f"more than a screen:\n{err}"
        assert f"{run_dir} holds checkpoints of an --optimizer {saved} run" in err, err
        assert f"this command trains with --optimizer {asked}" in err, err
        assert f"Resume that run with --optimizer {saved}" in err, err
        assert "--name NAME or --run-dir DIR" in err, err
        assert ("runs/tiny-muon" if asked == "muon" else "runs/tiny)") in err, err
        rc, _, err = _main([*base, "--run-dir", str(run_dir), "--optimizer", saved], capsys)
        assert rc == 0 and len(no_launch) == 1, err
        no_launch.clear()
    rc, _, err = _main([*base, "--run-dir", str(tmp_path / "x"), "--resume", str(run_dir)], capsys)
    assert rc == 2 and "--resume " in err and "saved by an --optimizer muon run" in err, err


def test_muon_ns_dtype_is_this_runs_after_a_resume(tmp_path: Path) -> None:
    """--muon-ns-dtype auto: float32 on CPU; a resumed run computes in its own dtype, not
    the one its checkpoint was saved with (the checkpoint's options win on load)."""
    import torch

    import fullshard.checkpoint as ckpt
    from fullshard.train.config import replace
    from fullshard.train.models import build_model, units_of
    from fullshard.train.optim import build_optimizer, muon_ns_dtype, set_ns_dtype
    from fullshard.train.presets import get_preset

    assert muon_ns_dtype("auto", torch.device("cpu")) == "float32"
    assert muon_ns_dtype("auto", torch.device("cuda")) == "bfloat16"
    assert muon_ns_dtype("bfloat16", torch.device("cpu")) == "bfloat16"
    path = save_train_checkpoint(tmp_path / "ckpt", optimizer="muon")  # saved with float32
    model = build_model(replace(get_preset("tiny"), optimizer="muon"))
    opt = build_optimizer(
        model, lr=1e-3, weight_decay=0.1, betas=(0.9, 0.95), kind="muon",
        layers=units_of(model).layers, ns_dtype="bfloat16",
    )  # fmt: skip
    ckpt.load(path, model=model, optimizer=opt)
    assert [g.get("ns_dtype") for g in opt.param_groups] == ["float32", None, None]
    set_ns_dtype(opt, "bfloat16")
    model(torch.zeros(2, 8, dtype=torch.long)).float().sum().backward()
    opt.step()
    inner = opt.optimizers[0].inner  # type: ignore[attr-defined]
    assert [g["ns_dtype"] for g in inner.param_groups] == ["bfloat16"]


def test_damaged_newest_checkpoint_is_skipped_before_launch(
    tmp_path: Path, corpus: Path, no_launch: list[object], capsys: pytest.CaptureFixture[str]
) -> None:
    run_dir = tmp_path / "run"
    _gpt_run(run_dir, 10, 20)
    (run_dir / "checkpoints" / "step_00000020" / "rank_00000.safetensors").write_bytes(b"x")
    args = ["train", "--preset", "tiny", "--data", str(corpus), "--run-dir", str(run_dir)]
    rc, _, err = _main(args, capsys)
    assert rc == 0 and len(no_launch) == 1, err  # the ranks resume from step 10, saying so
    (run_dir / "checkpoints" / "step_00000010" / "rank_00000.safetensors").write_bytes(b"x")
    rc, _, err = _main(args, capsys)
    assert rc == 2 and len(no_launch) == 1, err
    assert "every checkpoint of this run is damaged" in err and "truncated" in err
    assert "new --run-dir" in err


# ---------------------------------------------------------------- failure reports


def test_failures_are_classified_with_their_fix() -> None:
    full = failures.classify(OSError(errno.ENOSPC, "No space left on device", "ckpt/rank_0"))
    assert full.fatal and "No space left on device (ckpt/rank_0)" in full.message
    assert "--run-dir" in full.message and "resumes" in full.message
    for code in (errno.EACCES, errno.EROFS):
        denied = failures.classify(PermissionError(code, os.strerror(code), "/ro/ckpt"))
        assert denied.fatal and "/ro/ckpt" in denied.message and "writable" in denied.message
    mismatch = CheckpointMismatchError(
        "x does not fit the model", "fix", missing=[f"m{i}" for i in range(9)]
    )
    got = failures.classify(mismatch)
    assert got.fatal and "'m3'] and 5 more" in got.message and "--run-dir" in got.message
    assert "strict=False" not in got.message
    assert failures.classify(CheckpointCorruptedError("bad block")).fatal
    crash = failures.classify(RuntimeError("Timed out waiting 4000ms\n  for recv"))
    assert not crash.fatal and crash.message == "RuntimeError: Timed out waiting 4000ms for recv"
    peer = failures.classify(RuntimeError("[gloo] Connection closed by peer [127.0.0.1]:4"))
    assert peer.secondary and not peer.fatal  # the rank that died is the cause
    other = failures.classify(RuntimeError("saving x failed on another rank (see its error)"))
    assert other.secondary and not other.fatal
    long = failures.classify(RuntimeError("cause " + "x " * 1000 + "the fix"))
    assert len(long.message) <= 600 and long.message.endswith("the fix")


def test_a_rank_failure_is_logged_and_reported_once(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run_dir = tmp_path / "run"
    try:
        raise OSError(errno.ENOSPC, "No space left on device", str(run_dir / "f"))
    except OSError as e:
        code = failures.rank_failed(e, run_dir=run_dir, rank=1, launched=True)
    assert code == failures.FATAL_EXIT
    assert capsys.readouterr().err == ""  # the launcher reports, not the rank
    log = (run_dir / "logs" / "rank_1.log").read_text()
    assert "Traceback" in log and "OSError: [Errno 28]" in log
    try:
        raise RuntimeError("gloo: Connection reset by peer")
    except RuntimeError as e:  # secondary: the launcher reports the rank that died
        assert failures.rank_failed(e, run_dir=run_dir, rank=0, launched=False) == 1
    assert capsys.readouterr().err == ""

    def group_failed(**codes: int) -> object:
        procs = {int(r[1:]): SimpleNamespace(exitcode=c) for r, c in codes.items()}
        return SimpleNamespace(failures=procs, get_first_failure=lambda: next(iter(procs.items())))

    fatal, message = launch_mod._cause(group_failed(r0=1, r1=3), run_dir, since=0)
    assert fatal and message.startswith("No space left on device")
    (run_dir / "logs" / "failure_rank1.json").unlink()
    fatal, message = launch_mod._cause(group_failed(r0=1, r1=-9), run_dir, since=0)
    assert not fatal and message.startswith("rank 1 was killed by SIGKILL")
    try:  # a hang: rank 0 times out, the agent then kills the stopped rank 1
        raise RuntimeError("rank 0: all_gather of unit 'blocks.0' failed after 4.0s")
    except RuntimeError as e:
        failures.rank_failed(e, run_dir=run_dir, rank=0, launched=True)
    fatal, message = launch_mod._cause(group_failed(r0=1, r1=-9), run_dir, since=0)
    assert not fatal and message.startswith("rank 0 failed: RuntimeError: rank 0: all_gather")


def test_a_deterministic_failure_under_a_bare_torchrun_ends_its_restarts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """As a rank of a bare torchrun job: a refused config (or a deterministic failure) in
    attempt 0 makes every later attempt of the same agent end at once with the same line;
    another torchrun invocation is not affected (see [Note: no restart under a bare
    torchrun]). The torchrun run itself is in test_reliability_faults.py."""
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # where the stop marker goes
    monkeypatch.delenv(failures.LAUNCHER_ENV, raising=False)
    torchrun_env = {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "TORCHELASTIC_RUN_ID": "a"}
    for var, value in torchrun_env.items():
        monkeypatch.setenv(var, value)
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    argv = ["train", "--preset", "tiny", "--data", str(tmp_path / "nope.txt")]
    argv += ["--run-dir", str(tmp_path / "run")]
    rc, _, err = _main(argv, capsys)
    assert rc == 2 and "nope.txt' does not exist" in err, err
    cause = err.removeprefix("fullshard train: error: ").strip()

    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")  # the agent's restart
    rc, _, err = _main(argv, capsys)
    assert rc == failures.FATAL_EXIT, err
    assert (
        err == f"fullshard train: error: {cause} (rank 0, attempt 0; not retried: it would "
        "fail the same way)\n"
    )
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "b")  # another invocation: checked afresh
    rc, _, err = _main(argv, capsys)
    assert rc == 2 and "not retried" not in err and "does not exist" in err

    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "c")  # a failure during training does the same
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    try:
        raise PermissionError(errno.EACCES, "Permission denied", str(tmp_path / "ckpt"))
    except OSError as e:
        assert failures.rank_failed(e, run_dir=tmp_path, rank=1, launched=False) == 3
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    refused = failures.restart_refused()
    assert refused is not None and refused.startswith("Permission denied") and "rank 1" in refused
