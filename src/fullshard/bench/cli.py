"""``fullshard bench``: fullshard vs torch FSDP2 vs DeepSpeed vs DDP vs one process, side by side.

Examples::

    fullshard bench                       # the `speed` config on 2 ranks
    fullshard bench --config comm --json  # communication-bound config, machine-readable
    fullshard bench --config memory       # ~150M params on 1, 2 and 4 ranks
    fullshard bench --config overhead     # engine CPU cost per unit per step, 1 and 2 ranks
    fullshard bench --all --markdown out.md
    fullshard bench --config optim --nproc 4  # WholeTensor(Muon) vs AdamW vs naive, per step
    fullshard bench --config weight-sync      # trainer -> inference weight sync, 4 ways
    fullshard bench --config comm --modes fullshard deepspeed single  # vs DeepSpeed ZeRO-3
    fullshard bench --modes fullshard,fsdp1-fullshard,fsdp1,fsdp2  # FSDP1's wrapper, both

``fsdp1-fullshard`` is fullshard's ``FullyShardedDataParallel`` (FSDP1's API on fullshard's
engine), ``fsdp1`` torch's FSDP1; no config runs them unless ``--modes`` names them.

The ``deepspeed`` mode needs the ``peers`` extra (``pip install 'fullshard[peers]'``): without
it, runs that include it by default skip it and say how to install it; asking for it with
``--modes`` exits with status 2 and that line.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import TYPE_CHECKING, Any

from fullshard.bench.configs import (
    ALL_MODES,
    CONFIGS,
    OVERHEAD_MODES,
    PEER_MODES,
    BenchConfig,
    get_config,
)
from fullshard.bench.report import markdown, table

if TYPE_CHECKING:
    from fullshard.bench.overhead import OverheadConfig

__all__ = ["fullshard_available", "main", "missing_peers", "run"]


def fullshard_available() -> str | None:
    """``None`` if ``fullshard.fully_shard`` imports, else why not."""
    try:
        from fullshard import fully_shard  # type: ignore[attr-defined]  # noqa: F401
    except ImportError as e:
        return f"fullshard.fully_shard is not importable ({e})"
    return None


def missing_peers(cfgs: list[BenchConfig]) -> dict[str, str]:
    """Peer modes the configs run that cannot run here -> why, with the one-line install."""
    from fullshard.peers import peer_missing

    wanted = dict.fromkeys(m for cfg in cfgs for m in cfg.modes if m in PEER_MODES)
    return {m: why for m in wanted if (why := peer_missing(m)) is not None}


def _integer(text: str, low: int, what: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be {what}, got {text!r}") from None
    if value < low:
        raise argparse.ArgumentTypeError(f"must be {what}, got {value}")
    return value


def _positive(text: str) -> int:
    return _integer(text, 1, "a positive integer")


def _non_negative(text: str) -> int:
    return _integer(text, 0, "zero or a positive integer")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="fullshard bench",
        description="Train the same GPT, data and seed under fullshard, torch FSDP2, DeepSpeed "
        "ZeRO-3 (the peers extra), DDP, one process and a no-communication floor (and, asked "
        "for, FSDP1's wrapper: fullshard's and torch's), alternating modes over repeats on local gloo "
        "ranks; report step time, tokens/s, ratios, peak RSS per rank, collective traffic vs "
        "ZeRO-3 theory, exposed communication, and a loss check.",
    )
    p.add_argument(
        "--config",
        choices=sorted([*CONFIGS, "overhead", "optim", "weight-sync"]),
        default="speed",
        help="overhead: many tiny units, engine cost per unit per step vs the bare model; "
        "optim: the optimizer step of Muon on whole matrices vs AdamW vs all-gather-all; "
        "weight-sync: training ranks' weights to an inference rank (full_tensor per weight, "
        "fullshard.rl's publisher, shard rows, XOR deltas)",
    )
    p.add_argument("--all", action="store_true", help="run speed, comm and memory")
    p.add_argument("--nproc", help="ranks, or a comma list of world sizes (e.g. 1,2,4)")
    p.add_argument("--steps", type=_positive, help="steps per run (config default otherwise)")
    p.add_argument("--warmup", type=_non_negative, help="untimed first steps")
    p.add_argument("--repeats", type=_positive, help="runs per mode (modes alternate)")
    p.add_argument("--batch", type=_positive, help="global batch (per rank for memory, overhead)")
    p.add_argument("--n-layer", type=_positive)
    p.add_argument("--d-model", type=_positive)
    p.add_argument(
        "--modes",
        nargs="+",
        help=f"subset of {list(ALL_MODES)}, or of {list(OVERHEAD_MODES)} for overhead "
        "(comma or space separated)",
    )
    p.add_argument("--units", type=int, help="overhead: tiny blocks (sharding units)")
    p.add_argument("--width", type=int, help="overhead: LayerNorm/Linear width")
    p.add_argument(
        "--profile-steps", type=int, help="overhead: fullshard steps profiled on rank 0 (0: none)"
    )
    p.add_argument(
        "--profile",
        action="store_true",
        help="overhead: profile the --profile-steps under torch.profiler and summarise "
        "fullshard's labels (fullshard::<what> (<unit>)) instead of cProfile's functions",
    )
    p.add_argument(
        "--no-reshard-after-forward", action="store_true", help="keep units gathered after fwd"
    )
    p.add_argument("--json", action="store_true", help="print the results as JSON on stdout")
    p.add_argument("--out", help="also write the JSON results to this file")
    p.add_argument("--markdown", help="write the tables as Markdown to this file")
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds per run")
    return p


def _changes(
    args: argparse.Namespace, default_warmup: int, fields: tuple[str, ...]
) -> dict[str, Any]:
    """The config fields the flags set: ``fields`` as given, plus warmup, nprocs and modes."""
    changes: dict[str, Any] = {f: getattr(args, f) for f in fields if getattr(args, f) is not None}
    if args.steps is not None and args.warmup is None:
        changes["warmup"] = min(default_warmup, args.steps - 1)
    if args.nproc:
        changes["nprocs"] = tuple(int(x) for x in args.nproc.split(","))
    if args.modes:
        changes["modes"] = tuple(m for item in args.modes for m in item.split(",") if m)
    return changes


def _configure(args: argparse.Namespace, name: str) -> BenchConfig:
    cfg = get_config(name)
    fields = ("steps", "warmup", "repeats", "batch", "n_layer", "d_model")
    changes = _changes(args, cfg.warmup, fields)
    if args.no_reshard_after_forward:
        changes["reshard_after_forward"] = False
    return cfg.replace(**changes)


_GPT_ONLY = ("n_layer", "d_model", "no_reshard_after_forward")
_OVERHEAD_ONLY = ("units", "width", "profile_steps", "profile")


def _given(args: argparse.Namespace, fields: tuple[str, ...]) -> list[str]:
    return [f"--{f.replace('_', '-')}" for f in fields if getattr(args, f) not in (None, False)]


def _configure_overhead(args: argparse.Namespace) -> OverheadConfig:
    from fullshard.bench import overhead  # imports torch

    wrong = _given(args, _GPT_ONLY)
    if wrong or args.all:
        raise ValueError(f"{wrong or ['--all']} do not apply to --config overhead")
    cfg = overhead.OverheadConfig()
    fields = ("steps", "warmup", "repeats", "batch", "units", "width", "profile_steps")
    changes = _changes(args, cfg.warmup, fields)
    if args.profile:
        changes["labels"] = True
    return cfg.replace(**changes)


def _main_overhead(args: argparse.Namespace) -> int:
    from fullshard.bench import overhead  # imports torch

    try:
        cfg = _configure_overhead(args)
    except ValueError as e:
        print(f"fullshard bench: {e}", file=sys.stderr)
        return 2
    results = overhead.run(cfg, timeout=args.timeout, quiet=args.json)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(overhead.markdown(results) + "\n")
    if args.json:
        json.dump(results, sys.stdout, indent=1)
        print()
    else:
        print(overhead.table(results))
    return 0


def run(cfgs: list[BenchConfig], *, timeout: float, quiet: bool = False) -> dict[str, Any]:
    """Run each config at each of its world sizes; return ``{"machine":..., "runs": [...]}``."""

    def log(msg: str) -> None:
        if not quiet:
            print(msg, file=sys.stderr, flush=True)

    from fullshard.bench.runner import machine_info, run_config  # imports torch

    skipped: dict[str, str] = missing_peers(cfgs)
    why = fullshard_available()
    if why is not None:
        skipped["fullshard"] = why
    runs = []
    for cfg in cfgs:
        if any(m in skipped for m in cfg.modes):
            cfg = cfg.replace(modes=tuple(m for m in cfg.modes if m not in skipped))
        for n in cfg.nprocs:
            runs.append(run_config(cfg, n, timeout=timeout, log=log))
    return {"machine": machine_info(), "argv": sys.argv[1:], "skipped": skipped, "runs": runs}


def main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    if args.config == "overhead":
        return _main_overhead(args)
    if args.config == "optim":
        from fullshard.bench import optim

        return optim.main(args)
    if args.config == "weight-sync":
        from fullshard.bench import weight_sync

        return weight_sync.main(args)
    wrong = _given(args, _OVERHEAD_ONLY)
    if wrong:
        print(f"fullshard bench: {wrong} apply to --config overhead only", file=sys.stderr)
        return 2
    names = ["speed", "comm", "memory"] if args.all else [args.config]
    try:
        cfgs = [_configure(args, n) for n in names]
    except ValueError as e:
        print(f"fullshard bench: {e}", file=sys.stderr)
        return 2
    asked = missing_peers(cfgs) if args.modes else {}
    if asked:  # asked for by name: say how to get it instead of running without it
        for mode, why in asked.items():
            print(f"fullshard bench: mode {mode}: {why}", file=sys.stderr)
        return 2
    results = run(cfgs, timeout=args.timeout, quiet=args.json)
    for mode, why in results["skipped"].items():
        print(f"fullshard bench: skipped mode {mode}: {why}", file=sys.stderr)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write("\n\n".join(markdown(r) for r in results["runs"]) + "\n")
    if args.json:
        json.dump(results, sys.stdout, indent=1)
        print()
    else:
        print("\n\n".join(table(r) for r in results["runs"]))
    failed = [r["config"]["name"] for r in results["runs"] if r["loss_check"]["passed"] is False]
    if failed:
        print(f"fullshard bench: loss check FAILED for {failed}", file=sys.stderr)
        return 1
    return 0
