"""The commands the docs show (README's "Train a model" section and docs/train.md), for the
tests that run them (``test_docs.py``, ``test_train_cli.py``)."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def readme_train_section() -> str:
    text = (ROOT / "README.md").read_text()
    start = text.index("## Train a model")
    return text[start : text.index("\n## ", start + 1)]


def docs() -> dict[str, str]:
    return {
        "README.md": readme_train_section(),
        "docs/train.md": (ROOT / "docs/train.md").read_text(),
    }


def commands_in(text: str) -> list[tuple[str, list[str], str]]:
    """``(command, argv after 'fullshard train', documented output)`` for every command shown:
    in code blocks (continued over lines after a trailing backslash or until its quotes close;
    ``$`` marks one whose output follows) and inline in backticks."""
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
            while command.endswith("\\") and i < len(lines):  # a shell line continuation
                command = command[:-1].rstrip() + " " + lines[i]
                i += 1
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


def documented_commands() -> list[tuple[str, str, list[str], str]]:
    return [(doc, *c) for doc, text in docs().items() for c in commands_in(text)]


def hf_example() -> list[str]:
    """The argv of docs/train.md's Hugging Face example."""
    return next(argv for _, _, argv, _ in documented_commands() if "--hf-config" in argv)
