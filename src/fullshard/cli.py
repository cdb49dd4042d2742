"""The ``fullshard`` command: a thin dispatcher to each tool's own ``main(argv)``.

Each subcommand lives beside the code it drives and owns its flags:

- ``fullshard train``  -> :mod:`fullshard.train.cli`
- ``fullshard ckpt``   -> :mod:`fullshard.checkpoint.cli` (``export``, ``inspect``)
- ``fullshard bench``  -> :mod:`fullshard.bench.cli`
- ``fullshard plan``   -> :mod:`fullshard.memory.cli`
"""

from __future__ import annotations

import importlib
import sys

_COMMANDS: dict[str, tuple[str, str]] = {
    "train": ("fullshard.train.cli", "train a model fully sharded on local ranks (the main job)"),
    "ckpt": ("fullshard.checkpoint.cli", "inspect or export a fullshard checkpoint"),
    "bench": ("fullshard.bench.cli", "side-by-side speed/memory benchmark vs torch FSDP2 and DDP"),
    "plan": ("fullshard.memory.cli", "predict per-rank peak memory before launch"),
}


def _usage() -> str:
    lines = ["usage: fullshard <command> [options]", "", "commands:"]
    lines += [f"  {name:<7} {help_}" for name, (_, help_) in _COMMANDS.items()]
    lines += ["", "Run 'fullshard <command> --help' for a command's options."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``fullshard`` console script."""
    args = sys.argv[1:] if argv is None else argv
    if not args or args[0] in ("-h", "--help"):
        print(_usage())
        return 0
    name, rest = args[0], args[1:]
    if name not in _COMMANDS:
        print(f"fullshard: unknown command {name!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    module = importlib.import_module(_COMMANDS[name][0])
    return int(module.main(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
