"""The docs are tested where they give commands: the README's "Train a model" section and
docs/train.md.

Every ``fullshard train`` command they show must parse and pass the pre-launch checks in a
scratch directory; a documented error must be the error the command prints; every flag they
name must exist; the TOML example must load. The cheap commands are really run, one after the
other in one scratch directory as a new user would, with fewer steps (``--max-steps`` and
friends appended): the README's ``--preset tiny --nproc 4``, then docs/train.md's Hugging Face
example, which must train its own model in its own run directory, not resume the first.
"""

from __future__ import annotations

import functools
import re
import shlex
from pathlib import Path

import pytest

import fullshard.train.launch as launch_mod
from fullshard.train import cli
from fullshard.train import data as data_mod
from fullshard.train.config import from_toml
from fullshard.train.metrics import read_metrics
from test_reliability_common import fullshard

ROOT = Path(__file__).resolve().parents[1]
FEWER_STEPS = ["--max-steps", "3", "--eval-every", "0", "--sample-tokens", "0"]
FEWER_STEPS += ["--progress", "plain"]
TORCHRUN_FLAGS = {"--nnodes", "--nproc-per-node", "--rdzv-backend", "--rdzv-endpoint"}
TORCHRUN_FLAGS |= {"--rdzv-id", "--standalone"}


def _readme_train_section() -> str:
    text = (ROOT / "README.md").read_text()
    start = text.index("## Train a model")
    return text[start : text.index("\n## ", start + 1)]


def _docs() -> dict[str, str]:
    return {
        "README.md": _readme_train_section(),
        "docs/train.md": (ROOT / "docs/train.md").read_text(),
    }


def _commands(text: str) -> list[tuple[str, list[str], str]]:
    """``(command, argv after 'fullshard train', documented output)`` for every command shown:
    in code blocks (continued over lines until its quotes close; ``$`` marks one whose output
    follows) and inline in backticks."""
    found: list[tuple[str, list[str], str]] = []
    blocks = re.findall(r"```[a-z]*\n(.*?)```", text, flags=re.S)
    for block in blocks:
        lines = [line.strip() for line in block.splitlines()]
        i = 0
        while i < len(lines):
            line = lines[i]
            m = re.match(r"(\$ )?(?:\S*/)?(fullshard train(?:\s.*)?)$", line)
            i += 1
            if not m:
                continue
            command = m.group(2)
            while True:
                try:
                    words = shlex.split(command, comments=True)
                    break
                except ValueError:  # an open quote: the command goes on on the next line
                    command += " " + lines[i]
                    i += 1
            output = ""
            if m.group(1):  # "$ command": the lines after it, up to the next blank, are output
                rest = lines[i:]
                output = " ".join(rest[: rest.index("")] if "" in rest else rest)
            found.append((command, words[2:], output))
    prose = re.sub(r"```.*?```", "", text, flags=re.S)
    for command in re.findall(r"`(fullshard train(?:\s[^`]*)?)`", prose):
        if "..." not in command:
            words = shlex.split(" ".join(command.split()))
            found.append((command, words[2:], ""))
    return found


def _all_commands() -> list[tuple[str, str, list[str], str]]:
    return [(doc, *c) for doc, text in _docs().items() for c in _commands(text)]


def test_the_docs_show_the_commands_this_test_runs() -> None:
    shown = {" ".join(argv) for _, _, argv, _ in _all_commands()}
    assert {"", "--help", "--preset tiny --nproc 4", "--preset tiny --nproc 3"} <= shown, shown
    assert any("--hf-config" in s for s in shown), shown


@pytest.fixture
def no_launch(monkeypatch: pytest.MonkeyPatch) -> list[object]:
    calls: list[object] = []
    monkeypatch.setattr(launch_mod, "launch", lambda *a, **k: calls.append(a) or 0)
    for var in ("TORCHELASTIC_RUN_ID", "RANK", "WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    return calls


def test_every_documented_command_passes_its_checks_or_fails_as_documented(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    no_launch: list[object],
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.chdir(tmp_path)
    # The default corpus (the standard library's source) is read once, not once per command.
    monkeypatch.setattr(data_mod, "load_tokens", functools.cache(data_mod.load_tokens))
    unique = {
        (tuple(argv), output): (doc, command) for doc, command, argv, output in _all_commands()
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


def test_every_documented_flag_exists() -> None:
    known = set(re.findall(r"--[a-z][a-z0-9-]*", cli.build_parser().format_help()))
    for doc, text in _docs().items():
        for name in set(re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*[a-z0-9](?![\w-])", text)):
            assert name in known or name in TORCHRUN_FLAGS, f"{doc} names unknown flag {name}"


def test_the_toml_example_loads(tmp_path: Path) -> None:
    text = (ROOT / "docs/train.md").read_text()
    example = re.search(r"```toml\n(.*?)```", text, flags=re.S)
    assert example, "docs/train.md lost its TOML example"
    path = tmp_path / "c.toml"
    path.write_text(example.group(1))
    cfg = cli.parse_config(["--config", str(path)])
    assert from_toml(str(path)) and cfg.preset in text


def test_readme_then_hf_example_run_in_their_own_directories(tmp_path: Path) -> None:
    """The README's tiny run then docs/train.md's Hugging Face run, as a new user types them
    (fewer steps): the second must not resume the first's GPT checkpoint into its Llama."""
    commands = {" ".join(argv): argv for _, _, argv, _ in _all_commands()}
    tiny = commands["--preset tiny --nproc 4"]
    hf = next(argv for key, argv in commands.items() if "--hf-config" in key)
    runs = []
    for argv in (tiny, hf):
        proc, _ = fullshard("train", *argv, *FEWER_STEPS, cwd=tmp_path)
        assert proc.returncode == 0, f"{argv}\n{proc.stdout}\n{proc.stderr}"
        assert "resumed from" not in proc.stdout
        runs.append(proc)
    assert "LlamaForCausalLM" in runs[1].stdout
    dirs = sorted(p.name for p in (tmp_path / "runs").iterdir())
    assert len(dirs) == 2 and dirs[0] == "tiny" and re.fullmatch(r"tiny-[0-9a-f]{8}", dirs[1])
    for name in dirs:
        records = read_metrics(tmp_path / "runs" / name / "metrics.jsonl")
        assert [r["kind"] for r in records].count("start") == 1
        assert records[-1]["kind"] == "stop" and records[-1]["reason"] == "done"
