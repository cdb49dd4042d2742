"""``fullshard bench --config overhead``: the engine's CPU cost per unit per step.

The model is :class:`~fullshard.models.TinyUnits`: ``units`` blocks of ``LayerNorm(width)`` +
``Linear(width, width)`` (64 x 32 by default), each its own sharding unit, a batch of 4 per
rank and plain SGD, so compute is negligible and a sharded step's time is the engine's
bookkeeping: hooks, parameter swaps, DTensor wrapping, the optimizer's dispatch. The modes are

- ``fullshard`` / ``fsdp2``: every block, then the root, under the engine's ``fully_shard``
  (fullshard's SGD steps on the local shards, :func:`fullshard.optim.local_step`);
- ``bare``: the same model with no engine at all (at world size > 1, one unsynchronised replica
  per rank: the floor with no communication and no hooks),

alternating (A B C, C B A, ...) inside one set of rank processes per world size, so every mode
sees the same interpreter, the same warm caches and the same machine load. The overhead of a
mode is ``(median step - median bare step) / units``: medians over the timed steps (the slower
rank's time per step) of each repeat, then the median over repeats.

After the timed runs, rank 0 runs ``profile_steps`` more ``fullshard`` steps under
:mod:`cProfile` (the other ranks run the same steps unprofiled) and reports the top functions by
cumulative and by own time, per step. With ``labels`` (``--profile``) those steps run under
``torch.profiler`` instead, and the report sums fullshard's profiler labels ([Note: profiler
labels] in ``fullshard.engine.labels``): per label, calls and CPU ms per step, and the unit that
spent most in it.
"""

from __future__ import annotations

import cProfile
import dataclasses
import gc
import pstats
import shlex
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from fullshard.bench.configs import OVERHEAD_MODES
from fullshard.bench.runner import alternate, machine_info
from fullshard.models import TinyUnits
from fullshard.optim import local_step
from fullshard.peers import load_fully_shard
from fullshard.testing import run_distributed

__all__ = [
    "OVERHEAD_MODES",
    "OverheadConfig",
    "in_this_process",
    "markdown",
    "overhead_rank",
    "run",
    "table",
]

#: Modes of the overhead benchmark; ``bare`` is the no-engine floor the others are measured from.


@dataclass(kw_only=True, frozen=True)
class OverheadConfig:
    """The many-tiny-units benchmark: model shape, schedule, world sizes and modes."""

    units: int = 64
    """Blocks of LayerNorm + Linear, each one sharding unit."""
    width: int = 32
    batch: int = 4
    """Rows per rank per step."""
    steps: int = 30
    """Steps per run; the first ``warmup`` are not timed."""
    warmup: int = 5
    repeats: int = 3
    """Runs per mode, modes alternating."""
    nprocs: tuple[int, ...] = (1, 2)
    modes: tuple[str, ...] = OVERHEAD_MODES
    lr: float = 0.01
    seed: int = 0
    profile_steps: int = 5
    """fullshard steps rank 0 runs under cProfile after the timed runs (0: no profile)."""
    profile_rows: int = 15
    labels: bool = False
    """Profile under ``torch.profiler`` and summarise fullshard's labels (``--profile``)."""

    def __post_init__(self) -> None:
        bad = [m for m in self.modes if m not in OVERHEAD_MODES]
        if bad:
            raise ValueError(f"unknown overhead modes {bad}; choose from {list(OVERHEAD_MODES)}")
        if "bare" not in self.modes:
            raise ValueError(
                "the overhead is measured against the bare model: keep 'bare' in --modes"
            )
        if self.units < 1 or self.width < 1 or self.batch < 1:
            raise ValueError(
                f"units ({self.units}), width ({self.width}) and batch ({self.batch}) must be >= 1"
            )
        if not 0 <= self.warmup < self.steps:
            raise ValueError(f"need 0 <= warmup ({self.warmup}) < steps ({self.steps})")
        if self.repeats < 1 or self.profile_steps < 0:
            raise ValueError(
                f"need repeats >= 1 and profile steps >= 0, got {self.repeats}, {self.profile_steps}"
            )
        if not self.nprocs or min(self.nprocs) < 1:
            raise ValueError(f"world sizes must be >= 1, got {self.nprocs}")

    def replace(self, **changes: object) -> OverheadConfig:
        return dataclasses.replace(self, **changes)  # type: ignore[arg-type]

    def command(self) -> str:
        """The ``fullshard bench`` command line that reruns exactly this benchmark."""
        args = ["fullshard", "bench", "--config", "overhead"]
        args += ["--units", str(self.units), "--width", str(self.width)]
        args += ["--batch", str(self.batch), "--steps", str(self.steps)]
        args += ["--warmup", str(self.warmup), "--repeats", str(self.repeats)]
        args += ["--nproc", ",".join(map(str, self.nprocs)), "--modes", ",".join(self.modes)]
        args += ["--profile-steps", str(self.profile_steps)]
        if self.labels:
            args.append("--profile")
        return shlex.join(args)


# ----------------------------------------------------------------------------- on each rank


def _build(
    cfg: OverheadConfig, mode: str, device: str = "cpu"
) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(cfg.seed)
    model = TinyUnits(cfg.units, cfg.width).to(device)
    if mode != "bare":
        fully_shard = load_fully_shard(mode)
        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
    opt = torch.optim.SGD(model.parameters(), lr=cfg.lr)
    if mode == "fullshard":  # fullshard's optimizer path: the step on local shards
        local_step(opt)
    return model, opt


def _inputs(cfg: OverheadConfig, rank: int, steps: int, device: str = "cpu") -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(cfg.seed * 1000 + rank)
    return [torch.randn(cfg.batch, cfg.width, generator=gen).to(device) for _ in range(steps)]


def _step(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor) -> float:
    loss = model(x).square().mean()
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return float(loss.detach())


def _fsdp_module_of(model: nn.Module) -> str | None:
    """Where the ``FSDPModule`` class ``model`` was wrapped into lives (``None``: not wrapped)."""
    return next((c.__module__ for c in type(model).__mro__ if c.__name__ == "FSDPModule"), None)


def _timed_run(cfg: OverheadConfig, mode: str, rank: int, device: str) -> dict[str, Any]:
    model, opt = _build(cfg, mode, device)
    inputs = _inputs(cfg, rank, cfg.steps, device)
    gc.collect()
    dist.barrier()
    times, losses = [], []
    for x in inputs:
        t0 = time.perf_counter()
        losses.append(_step(model, opt, x))
        times.append(time.perf_counter() - t0)
    dist.barrier()
    return {"step_s": times[cfg.warmup :], "losses": losses, "fsdp_module": _fsdp_module_of(model)}


def _short(filename: str) -> str:
    """A profiler row's file, relative to the package that holds it."""
    for marker in ("site-packages/", "/src/"):
        if marker in filename:
            return filename.rsplit(marker, 1)[1]
    return filename


def _label_profile(
    cfg: OverheadConfig, model: Any, opt: Any, inputs: list[Any], rank: int
) -> dict[str, Any] | None:
    """The profiled steps under ``torch.profiler``: fullshard's labels summed (rank 0)."""
    from torch.profiler import ProfilerActivity, profile

    if rank != 0:
        for x in inputs:
            _step(model, opt, x)
        dist.barrier()
        return None
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for x in inputs:
            _step(model, opt, x)
    dist.barrier()
    n = cfg.profile_steps
    per: dict[str, dict[str, Any]] = {}
    for ev in prof.key_averages():
        if not ev.key.startswith("fullshard::"):
            continue
        what, _, unit = ev.key.removeprefix("fullshard::").partition(" (")
        row = per.setdefault(what, {"label": what, "calls": 0, "us": 0.0, "top": ("", -1.0)})
        row["calls"] += ev.count
        row["us"] += ev.cpu_time_total
        if ev.cpu_time_total > row["top"][1]:
            row["top"] = (unit.removesuffix(")"), ev.cpu_time_total)
    rows = [
        {
            "label": r["label"],
            "calls_per_step": r["calls"] / n,
            "cpu_ms_per_step": r["us"] / 1e3 / n,
            "top_unit": r["top"][0],
        }
        for r in per.values()
    ]
    return {
        "kind": "labels",
        "steps": n,
        "labels": sorted(rows, key=lambda r: -r["cpu_ms_per_step"]),
    }


def _profile(cfg: OverheadConfig, rank: int) -> dict[str, Any] | None:
    """``profile_steps`` fullshard steps after ``warmup`` unprofiled ones; rows on rank 0 only."""
    model, opt = _build(cfg, "fullshard")
    inputs = _inputs(cfg, rank, cfg.warmup + cfg.profile_steps)
    for x in inputs[: cfg.warmup]:
        _step(model, opt, x)
    gc.collect()
    dist.barrier()
    if cfg.labels:
        return _label_profile(cfg, model, opt, inputs[cfg.warmup :], rank)
    prof = cProfile.Profile() if rank == 0 else None
    for x in inputs[cfg.warmup :]:
        if prof is not None:
            prof.runcall(_step, model, opt, x)
        else:
            _step(model, opt, x)
    dist.barrier()
    if prof is None:
        return None
    stats = pstats.Stats(prof).stats  # type: ignore[attr-defined]
    n = cfg.profile_steps
    rows = [
        {
            "function": f"{_short(file)}:{line}({func})" if line else func,
            "calls_per_step": nc / n,
            "own_ms_per_step": tt * 1e3 / n,
            "cum_ms_per_step": ct * 1e3 / n,
        }
        for (file, line, func), (_cc, nc, tt, ct, _callers) in stats.items()
    ]
    total = max(
        (r["cum_ms_per_step"] for r in rows if r["function"].endswith("(_step)")), default=0
    )
    k = cfg.profile_rows
    return {
        "kind": "cprofile",
        "steps": n,
        "profiled_step_ms": total,
        "by_cumulative": sorted(rows, key=lambda r: -r["cum_ms_per_step"])[:k],
        "by_own": sorted(rows, key=lambda r: -r["own_ms_per_step"])[:k],
    }


def overhead_rank(cfg_dict: dict[str, Any], device: str = "cpu") -> dict[str, Any]:
    """Every repeat of every mode on this rank, modes alternating, then the profile (the
    timed runs on ``device``: ``"cuda"`` for the GPU check; the profile on the CPU)."""
    fields: dict[str, Any] = {
        k: tuple(v) if isinstance(v, list) else v for k, v in cfg_dict.items()
    }
    cfg = OverheadConfig(**fields)
    rank = dist.get_rank()
    runs: dict[str, list[dict[str, Any]]] = {m: [] for m in cfg.modes}
    for r in range(cfg.repeats):
        for mode in alternate(cfg.modes, r):
            runs[mode].append(_timed_run(cfg, mode, rank, device))
    profile = _profile(cfg, rank) if cfg.profile_steps and "fullshard" in cfg.modes else None
    return {"rank": rank, "runs": runs, "profile": profile}


# ----------------------------------------------------------------------------- in the parent


def _aggregate(cfg: OverheadConfig, world: int, ranks: list[dict[str, Any]]) -> dict[str, Any]:
    modes: dict[str, dict[str, Any]] = {}
    for mode in cfg.modes:
        repeat_medians = []
        for r in range(cfg.repeats):
            per_rank = [rk["runs"][mode][r]["step_s"] for rk in ranks]
            repeat_medians.append(statistics.median(max(s) for s in zip(*per_rank)))
        modes[mode] = {
            "step_ms": statistics.median(repeat_medians) * 1e3,
            "repeat_step_ms": [t * 1e3 for t in repeat_medians],
            "losses": ranks[0]["runs"][mode][0]["losses"],
            "fsdp_module": ranks[0]["runs"][mode][0]["fsdp_module"],
        }
    bare = modes["bare"]["step_ms"]
    for m in modes.values():
        m["overhead_us_per_unit"] = (m["step_ms"] - bare) * 1e3 / cfg.units
    fs, peer = modes.get("fullshard"), modes.get("fsdp2")
    ratio = loss_diff = None
    if fs is not None and peer is not None:
        if peer["overhead_us_per_unit"] > 0:
            ratio = fs["overhead_us_per_unit"] / peer["overhead_us_per_unit"]
        loss_diff = max(
            abs(a - b) / max(abs(b), 1e-12) for a, b in zip(fs["losses"], peer["losses"])
        )
    return {
        "world_size": world,
        "modes": modes,
        "fullshard_vs_fsdp2_overhead": ratio,
        "fullshard_vs_fsdp2_max_rel_loss_diff": loss_diff,
        "profile": ranks[0]["profile"],
    }


def run(cfg: OverheadConfig, *, timeout: float = 3600.0, quiet: bool = False) -> dict[str, Any]:
    """Run the benchmark at each world size; return ``{"machine", "command", "config", "worlds"}``."""
    machine = machine_info()  # the load average before the runs
    worlds = []
    for n in cfg.nprocs:
        t0 = time.perf_counter()
        ranks = run_distributed(overhead_rank, n, asdict(cfg), timeout=timeout)
        worlds.append(_aggregate(cfg, n, ranks))
        if not quiet:
            steps = ", ".join(f"{m} {v['step_ms']:.1f}" for m, v in worlds[-1]["modes"].items())
            print(
                f"[overhead n={n}] ms/step: {steps}  ({time.perf_counter() - t0:.0f} s wall)",
                file=sys.stderr,
                flush=True,
            )
    return {
        "machine": machine,
        "command": cfg.command(),
        "config": asdict(cfg),
        "worlds": worlds,
    }


def in_this_process(cfg: OverheadConfig, device: str = "cpu") -> dict[str, Any]:
    """One world's result (an entry of :func:`run`'s ``worlds``) measured in this process, on
    its initialised one-rank default group and ``device``: how ``scripts/gpu_check.sh`` runs
    the benchmark on CUDA/NCCL."""
    if dist.get_world_size() != 1:
        raise ValueError(f"in_this_process runs one rank; the group has {dist.get_world_size()}")
    return _aggregate(cfg, 1, [overhead_rank(asdict(cfg), device)])


# ----------------------------------------------------------------------------- rendering


def _title(res: dict[str, Any]) -> str:
    c = res["config"]
    return (
        f"overhead: {c['units']} units of LayerNorm({c['width']}) + Linear({c['width']}, "
        f"{c['width']}), batch {c['batch']} per rank, SGD; steps {c['warmup']}-{c['steps'] - 1} "
        f"of {c['steps']} timed, {c['repeats']} repeats, modes alternating"
    )


_HEADER = ["ranks", "mode", "ms/step (repeats)", "overhead µs/unit/step", "fullshard/fsdp2"]


def _rows(res: dict[str, Any]) -> list[list[str]]:
    rows = []
    for w in res["worlds"]:
        for mode, m in w["modes"].items():
            ratio = w["fullshard_vs_fsdp2_overhead"] if mode == "fullshard" else None
            rows.append(
                [
                    str(w["world_size"]),
                    mode,
                    f"{m['step_ms']:.1f} ("
                    + " / ".join(f"{t:.1f}" for t in m["repeat_step_ms"])
                    + ")",
                    "-" if mode == "bare" else f"{m['overhead_us_per_unit']:.0f}",
                    "-" if ratio is None else f"{ratio:.2f}x",
                ]
            )
    return rows


def _profile_lines(w: dict[str, Any], fmt: str) -> list[str]:
    p = w["profile"]
    if p is None:
        return []
    if p["kind"] == "labels":
        head = ["label", "calls/step", "cpu ms/step", "unit spending most"]
        rows = [
            [
                f"`{r['label']}`" if fmt == "md" else r["label"],
                f"{r['calls_per_step']:g}",
                f"{r['cpu_ms_per_step']:.2f}",
                r["top_unit"],
            ]
            for r in p["labels"]
        ]
        title = (
            f"fullshard's profiler labels on rank 0 of {w['world_size']} ({p['steps']} steps "
            f"under torch.profiler; a label's time includes the labels inside it):"
        )
        return [title, "", *_render([head, *rows], fmt)]
    out = [
        f"cProfile of fullshard on rank 0 of {w['world_size']} ({p['steps']} steps, "
        f"{p['profiled_step_ms']:.1f} ms/step under the profiler), top by cumulative and own time:"
    ]
    for key, label in (("by_cumulative", "cum"), ("by_own", "own")):
        rows = [
            [
                f"{r['cum_ms_per_step' if label == 'cum' else 'own_ms_per_step']:.2f}",
                f"{r['calls_per_step']:g}",
                f"`{r['function']}`" if fmt == "md" else r["function"],
            ]
            for r in p[key]
        ]
        head = [f"{label} ms/step", "calls/step", "function"]
        out += [""] + _render([head, *rows], fmt)
    return out


def _render(rows: list[list[str]], fmt: str) -> list[str]:
    if fmt == "md":
        return ["| " + " | ".join(rows[0]) + " |", "|" + "---|" * len(rows[0])] + [
            "| " + " | ".join(r) + " |" for r in rows[1:]
        ]
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(wd) for c, wd in zip(r, widths)).rstrip() for r in rows]
    return [lines[0], "  ".join("-" * wd for wd in widths), *lines[1:]]


def _loss_line(res: dict[str, Any]) -> str:
    diffs = [
        f"{w['fullshard_vs_fsdp2_max_rel_loss_diff']:.1e} at {w['world_size']} rank(s)"
        for w in res["worlds"]
        if w["fullshard_vs_fsdp2_max_rel_loss_diff"] is not None
    ]
    return "fullshard vs fsdp2 losses, max rel. difference: " + (", ".join(diffs) or "-")


def _report(res: dict[str, Any], fmt: str) -> str:
    title = f"**{_title(res)}**" if fmt == "md" else _title(res)
    lines = [title, "", *_render([_HEADER, *_rows(res)], fmt), "", _loss_line(res)]
    for w in res["worlds"]:
        prof = _profile_lines(w, fmt)
        if prof:
            lines += ["", *prof]
    m = res["machine"]
    lines += [
        "",
        f"machine: {m['cpu']}, {m['cores']} cores, torch {m['torch']}, load {m['load_avg_at_start']}"
        f" at start, {m['date']}",
        f"command: {res['command']}",
    ]
    return "\n".join(lines)


def table(res: dict[str, Any]) -> str:
    """The overhead table, the profiles and the command, for the terminal."""
    return _report(res, "text")


def markdown(res: dict[str, Any]) -> str:
    """The same as :func:`table`, as Markdown for BENCHMARKS.md."""
    return _report(res, "md")
