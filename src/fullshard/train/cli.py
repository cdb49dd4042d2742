"""``fullshard train``: parse and check everything, then launch ranks (or be one).

Run by a person, it validates the config (see :mod:`fullshard.train.checks`), writes
``RUN_DIR/config.toml`` and launches local ranks under torchrun's elastic agent. Run by
torchrun (``TORCHELASTIC_RUN_ID`` or ``RANK`` + ``WORLD_SIZE`` in the environment, e.g.
``torchrun --nnodes 2 ... -m fullshard.train.worker --preset small``), it is one of the ranks.
"""

from __future__ import annotations

import argparse
import difflib
import os
import sys
import textwrap
import typing
from dataclasses import fields
from pathlib import Path
from typing import Any, Literal

from fullshard.train.config import (
    ConfigError,
    TrainConfig,
    check_batch,
    field_help,
    field_types,
    flag,
    from_toml,
    replace,
    to_toml,
)
from fullshard.train.presets import PRESETS, get_preset

__all__ = ["build_parser", "in_torchrun", "main", "parse_config"]

_GROUPS = {
    "preset": "run",
    "vocab_size": "model",
    "data": "data",
    "lr": "optimizer",
    "mixed_precision": "parallelism and memory",
    "ft_lighthouse": "fault tolerance (torchft)",
    "eval_every": "evaluation, checkpoints and output",
}

_METAVARS = {
    "name": "NAME",
    "run_dir": "DIR",
    "data": "PATH",
    "hf_config": "PATH_OR_JSON",
    "hf_weights": "PATH",
    "hf_model": "DIR",
    "tokenizer": "DIR",
    "resume": "{auto,never,PATH}",
    "reshard_after_forward": "{auto,true,false,K}",
    "sample_prompt": "TEXT",
    "ft_lighthouse": "HOST:PORT",
}

_EPILOG = """\
run directory: config.toml (the resolved config), metrics.jsonl (one JSON line per step and
eval), loss.png, checkpoints/step_XXXXXXXX/. Rerunning the same command resumes.

examples:
  fullshard train                                  # small GPT on the stdlib source, 2 CPU ranks
  fullshard train --preset tiny --nproc 4
  fullshard train --hf-config '{"model_type": "llama", "hidden_size": 64, "intermediate_size":
      128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
      "vocab_size": 256}' --max-steps 50
  fullshard train --hf-model ./my-llama --data chat.jsonl --lr 2e-5 --tensorboard
  fullshard train --nproc 1 --ft-lighthouse HOST:29510 --ft-replica-id 0 --run-dir runs/ft0
      # one torchft replica group of 2 (--ft-replicas); replica 1 likewise, with its own run dir
      # (--ft-serve-lighthouse on one of them serves HOST:29510 from that launch)
  torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint HOST:29500 \\
      --rdzv-id myrun -m fullshard.train.worker --preset gpt2-124m --run-dir /shared/runs/g
"""


def in_torchrun() -> bool:
    """Whether this process is a rank that torchrun (or similar) started."""
    env = os.environ
    return "TORCHELASTIC_RUN_ID" in env or ("RANK" in env and "WORLD_SIZE" in env)


def _preset_in(argv: list[str]) -> str:
    """The preset ``argv`` asks for (``--preset X``, ``--preset=X``, else ``--config``'s), so
    ``--help`` can show that preset's defaults; ``small`` when none (or an unknown one)."""
    preset, config = "", ""
    for i, arg in enumerate(argv):
        for name in ("--preset", "--config"):
            if arg == name and i + 1 < len(argv):
                value = argv[i + 1]
            elif arg.startswith(name + "="):
                value = arg.split("=", 1)[1]
            else:
                continue
            preset, config = (value, config) if name == "--preset" else (preset, value)
    if not preset and config:
        try:
            preset = str(from_toml(config).get("preset", ""))
        except ConfigError:
            preset = ""
    return preset if preset in PRESETS else "small"


def build_parser(preset: str = "small") -> argparse.ArgumentParser:
    """Every :class:`TrainConfig` field as a flag; the defaults shown are ``preset``'s."""
    parser = argparse.ArgumentParser(
        prog="fullshard train",
        description=textwrap.fill(
            "Train a model fully sharded (ZeRO-3) on local ranks, or as a torchrun rank. "
            f"Defaults shown are those of --preset {preset}; each preset has its own (run "
            "'fullshard train --preset NAME --help' to see them).",
            width=92,
        ),
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        argument_default=argparse.SUPPRESS,  # so we know which flags were given
        allow_abbrev=False,
    )
    parser.add_argument(
        "--config", metavar="FILE.toml", help="read settings from a TOML file (flags override it)"
    )
    helps, types, defaults = field_help(), field_types(), PRESETS[preset]()
    group: Any = parser
    for f in fields(TrainConfig):
        if f.name in _GROUPS:
            group = parser.add_argument_group(_GROUPS[f.name])
        hint, default = types[f.name], getattr(defaults, f.name)
        text = helps.get(f.name, "")
        kwargs: dict[str, Any] = {"dest": f.name}
        if f.name == "preset":
            kwargs["choices"] = list(PRESETS)
            kwargs["metavar"] = "{" + ",".join(PRESETS) + "}"
        if f.name == "preset":
            pass
        elif hint is bool:
            kwargs["action"] = argparse.BooleanOptionalAction
        elif typing.get_origin(hint) is Literal:
            kwargs["choices"] = list(typing.get_args(hint))
        else:
            kwargs["type"] = hint
            kwargs["metavar"] = _METAVARS.get(f.name) or {int: "N", float: "X"}.get(hint, "STR")
        if f.name == "preset":
            default = "small"  # the default preset, whichever one's defaults are shown
        if default != "" and f.name != "hf_config":
            text += (
                f" (default: {default!r})" if isinstance(default, str) else f" (default: {default})"
            )
        group.add_argument(flag(f.name), help=text.replace("%", "%%"), **kwargs)
    return parser


def _unknown_flags_error(parser: argparse.ArgumentParser, unknown: list[str]) -> ConfigError:
    known = [s for a in parser._actions for s in a.option_strings]
    parts = []
    for arg in unknown:
        name = arg.split("=", 1)[0]
        close = difflib.get_close_matches(name, known, n=1) if name.startswith("-") else []
        parts.append(f"{arg!r}" + (f" (did you mean {close[0]}?)" if close else ""))
    return ConfigError(f"unrecognized argument(s): {', '.join(parts)}; see fullshard train --help")


def parse_config(argv: list[str]) -> TrainConfig:
    """Defaults < preset < --config FILE.toml < flags. Raises ConfigError (argparse: SystemExit)."""
    parser = build_parser(_preset_in(argv))
    ns, unknown = parser.parse_known_args(argv)
    if unknown:
        raise _unknown_flags_error(parser, unknown)
    given = vars(ns)
    from_file = from_toml(given.pop("config")) if "config" in given else {}
    preset = given.get("preset", from_file.get("preset", "small"))
    try:
        cfg = get_preset(preset)
        return replace(cfg, **(from_file | given))
    except TypeError as e:  # a TOML value of the wrong type
        raise ConfigError(f"--config: {e}") from None


def _run_as_worker(cfg: TrainConfig) -> int:
    from fullshard.train import checks, failures
    from fullshard.train.loop import init_distributed, train

    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    refused = failures.exit_if_restart_refused()  # [Note: no restart under a bare torchrun]
    if refused is not None:
        return refused
    fresh = failures.attempt_number() == 0
    node = int(os.environ["LOCAL_WORLD_SIZE"]) if "LOCAL_WORLD_SIZE" in os.environ else None
    try:
        checked = checks.validate(
            cfg, world_size=world, fresh_launch=fresh and rank == 0, node_size=node
        )
        checks.commit(cfg, checked)
    except ConfigError as e:
        failures.refuse_restarts(" ".join(str(e).split()), rank=rank)
        failures.report(f"fullshard train: error: {e}", once=True)  # one line, whichever rank
        return 2
    env = init_distributed(cfg)
    import torch.distributed as dist

    try:
        code = train(cfg, env)
    except Exception as e:  # see [Note: deterministic failures] in failures.py
        launched = os.environ.get(failures.LAUNCHER_ENV) == "1"
        run_dir = Path(cfg.resolved_run_dir())
        code = failures.rank_failed(e, run_dir=run_dir, rank=env.rank, launched=launched)
        _exit_now(code)
    if dist.is_initialized():
        dist.destroy_process_group()
    return code


def _exit_now(code: int) -> typing.NoReturn:
    """End a failed rank without the interpreter's teardown.

    [Note: a failed rank exits at once] After a failed step, Python's own finalization of a
    rank took 6-7 s on both ranks (measured on 2 gloo ranks, an ENOSPC in a save; no Python
    thread left: C++ destructors), during which the agent neither restarts nor reports. Once
    the failure is logged (:func:`failures.rank_failed`) nothing is left to do but what the
    exit hooks would: finish a pending asynchronous checkpoint save and flush the output.
    """
    from fullshard.checkpoint import wait_for_pending_save

    try:  # not destroy_process_group(): with a hung peer it can block (the OS closes sockets)
        wait_for_pending_save()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def main(argv: list[str] | None = None) -> int:
    """``fullshard train [flags]``: returns the exit code."""
    args = sys.argv[1:] if argv is None else argv
    try:
        cfg = parse_config(args)
    except SystemExit as e:  # --help, or argparse's own usage errors (already printed)
        return int(e.code or 0)
    except ConfigError as e:
        print(f"fullshard train: error: {e}", file=sys.stderr)
        return 2
    if in_torchrun():
        return _run_as_worker(cfg)
    ranks = cfg.nproc or (cfg.dp_replicate * cfg.dp_shard * cfg.tp)  # see default_nproc
    if ranks:  # before the checks that import torch: a second saved on a typo
        from fullshard.train.degrees import resolve

        try:
            degrees = resolve(cfg, ranks)
            check_batch(cfg, degrees.dp, tp=degrees.tp)
        except ConfigError as e:
            print(f"fullshard train: error: {e}", file=sys.stderr)
            return 2

    from fullshard.train import checks
    from fullshard.train.launch import hold_run_dir, launch
    from fullshard.train.lighthouse import served_lighthouse

    nproc = cfg.nproc or checks.default_nproc(cfg)
    try:
        if nproc < 1:
            raise ConfigError("no GPU visible for --device cuda; use --device cpu")
        checked = checks.commit(cfg, checks.validate(cfg, world_size=nproc, node_size=nproc))
    except ConfigError as e:
        print(f"fullshard train: error: {e}", file=sys.stderr)
        return 2
    cfg = replace(cfg, name=cfg.resolved_name(), run_dir=cfg.resolved_run_dir())
    run_dir = Path(cfg.run_dir)
    config_path = run_dir / "config.toml"
    try:
        with hold_run_dir(run_dir), served_lighthouse(cfg):
            config_path.write_text(to_toml(cfg))
            print(
                f"fullshard train: launching {nproc} rank(s), mesh {checked.degrees.describe()} "
                f"({checked.n_params / 1e6:.2f}M parameters, {checked.n_tokens:,} tokens of "
                f"data); config in {config_path}",
                flush=True,
            )
            return launch(
                config_path,
                run_dir=run_dir,
                nproc=nproc,
                max_restarts=cfg.max_restarts,
                stop_timeout=cfg.stop_timeout,
                on_cuda=checks.uses_cuda(cfg),
            )
    except ConfigError as e:
        print(f"fullshard train: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
