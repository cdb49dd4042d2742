"""The docs are tested where they give commands: the README's "Train a model" section and
docs/train.md.

Every ``fullshard train`` command they show must parse and pass the pre-launch checks in a
scratch directory; a documented error must be the error the command prints; every flag they
name must exist; the TOML example must load. The README's ``--preset tiny --nproc 4`` is really
run (with fewer steps: ``--max-steps`` and friends appended), then docs/train.md's Hugging Face
example is checked in the same scratch directory, as a new user would type them: it must get
a run directory of its own, not resume the first run's GPT checkpoint into its Llama. (The
Hugging Face example itself trains in ``test_train_cli.py``.)
"""

from __future__ import annotations

import functools
import re
from pathlib import Path

import pytest

from doc_commands import ROOT, docs, documented_commands
from fullshard.train import cli
from fullshard.train import data as data_mod
from fullshard.train.config import from_toml
from fullshard.train.metrics import read_metrics
from hf_local import make_hf_model_dir, write_chat_jsonl
from reliability_helpers import fullshard, write_corpus

FEWER_STEPS = ["--max-steps", "3", "--eval-every", "0", "--sample-tokens", "0"]
FEWER_STEPS += ["--progress", "plain"]
TORCHRUN_FLAGS = {"--nnodes", "--nproc-per-node", "--rdzv-backend", "--rdzv-endpoint"}
TORCHRUN_FLAGS |= {"--rdzv-id", "--standalone"}
OTHER_TOOLS_FLAGS = TORCHRUN_FLAGS | {"--local-dir"}  # torchrun, huggingface-cli download


def test_the_docs_show_the_commands_this_test_runs() -> None:
    shown = {" ".join(argv) for _, _, argv, _ in documented_commands()}
    assert {"", "--help", "--preset tiny --nproc 4", "--preset tiny --nproc 3"} <= shown, shown
    assert any("--hf-config" in s for s in shown), shown


def test_every_documented_command_passes_its_checks_or_fails_as_documented(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    no_launch: list[object],
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    # The files the fine-tuning examples name, made locally (see hf_local): a model directory
    # and a chat corpus.
    make_hf_model_dir(tmp_path / "my-llama", max_positions=512)
    write_chat_jsonl(tmp_path / "chat.jsonl", 2000)
    # The default corpus (the standard library's source) is read once, not once per command.
    monkeypatch.setattr(data_mod, "load_tokens", functools.cache(data_mod.load_tokens))
    unique = {
        (tuple(argv), output): (doc, command)
        for doc, command, argv, output in documented_commands()
    }
    for (args, output), (doc, command) in unique.items():
        argv = list(args)
        try:
            rc = cli.main(argv)
        except SystemExit as e:
            rc = int(e.code or 0)
        captured = capsys.readouterr()
        if output:  # a documented failure: the same words, however the lines wrap
            assert rc == 2 and " ".join(captured.err.split()) == output, (doc, command, captured)
        else:
            assert rc == 0, f"{doc}: `{command}` failed:\n{captured.err}"
    launched = [Path(args[0]).parent.name for args in no_launch]
    assert "tiny" in launched and "small" in launched, launched


def _ckpt_export_help() -> str:
    """``fullshard ckpt export --help`` (the docs name its flags beside train's)."""
    import contextlib
    import io

    from fullshard.checkpoint import cli as ckpt_cli

    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.suppress(SystemExit):
        ckpt_cli.main(["export", "--help"])
    return out.getvalue()


def test_every_documented_flag_exists() -> None:
    from fullshard.memory import cli as plan_cli

    helps = cli.build_parser().format_help() + _ckpt_export_help()
    helps += plan_cli._parser().format_help()  # docs/train.md shows `fullshard plan` too
    known = set(re.findall(r"--[a-z][a-z0-9-]*", helps))
    for doc, text in docs().items():
        for name in set(re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*[a-z0-9](?![\w-])", text)):
            assert name in known or name in OTHER_TOOLS_FLAGS, f"{doc} names unknown flag {name}"


def test_the_toml_example_loads(tmp_path: Path) -> None:
    text = (ROOT / "docs/train.md").read_text()
    example = re.search(r"```toml\n(.*?)```", text, flags=re.S)
    assert example, "docs/train.md lost its TOML example"
    path = tmp_path / "c.toml"
    path.write_text(example.group(1))
    cfg = cli.parse_config(["--config", str(path)])
    assert from_toml(str(path)) and cfg.preset in text


def test_readme_tiny_run_then_the_hf_example_in_the_same_directory(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    no_launch: list[object],
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The README's tiny run for real (fewer steps, a small corpus), then, in the same scratch
    directory, docs/train.md's Hugging Face example: it must pass its checks in a run directory
    of its own and leave the first run's untouched (it used to auto-resume the GPT checkpoint
    into the Llama). That example trains for real in test_train_cli.test_hf_llama_trains."""
    commands = {" ".join(argv): argv for _, _, argv, _ in documented_commands()}
    corpus = ["--data", str(write_corpus(tmp_path / "corpus.txt"))]
    proc, _ = fullshard(
        "train", *commands["--preset tiny --nproc 4"], *FEWER_STEPS, *corpus, cwd=tmp_path
    )
    assert proc.returncode == 0, f"{proc.stdout}\n{proc.stderr}"
    first = tmp_path / "runs" / "tiny"
    assert (first / "checkpoints" / "step_00000003").is_dir()
    config = (first / "config.toml").read_text()

    monkeypatch.chdir(tmp_path)
    hf = next(argv for key, argv in commands.items() if "--hf-config" in key)
    assert cli.main([*hf, *corpus]) == 0, capsys.readouterr().err
    (run_dir,) = [Path(args[0]).parent for args in no_launch]
    assert re.fullmatch(r"tiny-[0-9a-f]{8}", run_dir.name) and run_dir.parent.name == "runs"
    assert (first / "config.toml").read_text() == config
    records = read_metrics(first / "metrics.jsonl")
    assert [r["kind"] for r in records].count("start") == 1
    assert records[-1]["kind"] == "stop" and records[-1]["reason"] == "done"
