"""Run every mode of a benchmark config, alternating over repeats, and aggregate per mode.

Each (repeat, mode) is a fresh set of ranks spawned by :func:`fullshard.testing.run_distributed`
(gloo on loopback, one thread per rank; ``single`` is one process with as many threads as the
distributed modes have ranks, so every mode gets the same cores). Children start with
``MALLOC_MMAP_THRESHOLD_=65536`` in their environment from birth (glibc reads it once, at
start-up), so freed buffers leave RSS and the high-water mark means what it says.
"""

from __future__ import annotations

import os
import platform
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict
from typing import Any

from fullshard.bench.comm import KINDS
from fullshard.bench.configs import SHARDED_MODES, BenchConfig
from fullshard.bench.worker import run_rank
from fullshard.memory.tracker import MALLOC_ENV
from fullshard.testing import run_distributed

__all__ = ["LOSS_RTOL", "RATIO_PEERS", "aggregate", "alternate", "machine_info", "run_config"]

#: Relative loss tolerance against the reference (single process) at every step, fp32.
LOSS_RTOL = 1e-5
#: Every mode's step time is also given as a ratio to each of these (``ratio_vs_<peer>``).
RATIO_PEERS: tuple[str, ...] = ("fsdp2", "fsdp1", "deepspeed", "ddp")

_MIB = 2**20


@contextmanager
def _environ(env: dict[str, str]) -> Iterator[None]:
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def machine_info() -> dict[str, Any]:
    import torch

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    mem = 0
    try:
        with open("/proc/meminfo") as f:
            mem = int(f.readline().split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "memory_gib": round(mem / 2**30, 1),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "backend": "gloo (loopback)",
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "load_avg_at_start": round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None,
    }


def _spawn(cfg: BenchConfig, mode: str, nproc: int, timeout: float) -> list[dict[str, Any]]:
    world = 1 if mode == "single" else nproc
    env = dict(MALLOC_ENV, OMP_NUM_THREADS=str(nproc if mode == "single" else 1))
    with _environ(MALLOC_ENV):  # in the parent's environ so children are born with it
        return run_distributed(run_rank, world, asdict(cfg), mode, nproc, timeout=timeout, env=env)


def alternate(modes: tuple[str, ...], repeat: int) -> tuple[str, ...]:
    """The order modes run in on ``repeat``: A B C, then C B A, ... (drift hits each alike)."""
    return modes if repeat % 2 == 0 else tuple(reversed(modes))


def run_config(
    cfg: BenchConfig,
    nproc: int,
    *,
    timeout: float = 1800.0,
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Run all of ``cfg.modes`` ``cfg.repeats`` times on ``nproc`` ranks; return aggregated results."""
    raw: dict[str, list[list[dict[str, Any]]]] = {m: [] for m in cfg.modes}
    for r in range(cfg.repeats):
        for mode in alternate(cfg.modes, r):
            t0 = time.perf_counter()
            load = os.getloadavg()[0] if hasattr(os, "getloadavg") else -1.0
            ranks = _spawn(cfg, mode, nproc, timeout)
            for rk in ranks:
                rk["load_avg_before"] = load
            raw[mode].append(ranks)
            med = statistics.median(
                max(rk["step_s"][i] for rk in ranks) for i in range(len(ranks[0]["step_s"]))
            )
            log(
                f"[{cfg.name} n={nproc}] repeat {r + 1}/{cfg.repeats} {mode:<9} "
                f"{med:.3f} s/step  ({time.perf_counter() - t0:.0f} s wall)"
            )
    return aggregate(cfg, nproc, raw)


def _loss_curve(ranks: list[dict[str, Any]]) -> list[float]:
    """The global-batch loss per step: the mean of the ranks' losses (equal local batches)."""
    return [
        statistics.fmean(rk["losses"][i] for rk in ranks) for i in range(len(ranks[0]["losses"]))
    ]


def aggregate(
    cfg: BenchConfig, nproc: int, raw: dict[str, list[list[dict[str, Any]]]]
) -> dict[str, Any]:
    """Per mode: step-time stats (slower rank), tokens/s, ratios, memory, traffic, loss check."""
    tokens = cfg.global_batch(nproc) * cfg.seq_len
    first = next(iter(raw.values()))[0][0]
    param_bytes = first["param_bytes"]
    modes: dict[str, dict[str, Any]] = {}
    for mode, repeats in raw.items():
        per_step: list[float] = []  # slower rank's time, every timed step of every repeat
        repeat_medians: list[float] = []
        for ranks in repeats:
            steps = [max(rk["step_s"][i] for rk in ranks) for i in range(len(ranks[0]["step_s"]))]
            per_step += steps
            repeat_medians.append(statistics.median(steps))
        world = repeats[0][0]["world_size"]
        peak = [max(rs[r]["peak_rss_bytes"] for rs in repeats) / _MIB for r in range(world)]
        setup = [max(rs[r]["rss_after_setup_bytes"] for rs in repeats) / _MIB for r in range(world)]
        runtime = [min(rs[r]["rss_runtime_bytes"] for rs in repeats) / _MIB for r in range(world)]
        comm = repeats[-1][0]["comm"]
        sharded = mode in SHARDED_MODES
        theory = (3 if sharded else 1 if mode == "ddp" else 0) * param_bytes if world > 1 else 0
        comm_out: dict[str, Any] | None = None
        if comm is not None:
            total = sum(comm["bytes"][k] for k in KINDS)
            blocked = [rs[r]["comm"]["blocked_s"] for rs in repeats for r in range(world)]
            comm_out = {
                "calls_per_step": comm["calls"],
                "bytes_per_step": comm["bytes"],
                "total_bytes_per_step": total,
                "theory_bytes_per_step": theory,
                "bytes_vs_theory": total / theory if theory else None,
                "blocked_s_per_step": (statistics.median(blocked) if None not in blocked else None),
                "source": comm.get("source"),
            }
        modes[mode] = {
            "world_size": world,
            "threads_per_rank": repeats[0][0]["threads"],
            "step_s_median": statistics.median(per_step),
            "step_s_min": min(per_step),
            "step_s_max": max(per_step),
            "repeat_medians_s": repeat_medians,
            "load_avg_before_runs": [rs[0].get("load_avg_before") for rs in repeats],
            "tokens_per_s": tokens / statistics.median(per_step),
            "peak_rss_mib_per_rank": peak,
            "peak_rss_mib_max": max(peak),
            "rss_after_setup_mib_per_rank": setup,
            "rss_runtime_mib_per_rank": runtime,
            "peak_above_runtime_mib_max": max(p - b for p, b in zip(peak, runtime)),
            "comm": comm_out,
            "losses": _loss_curve(repeats[0]),
            "engine": repeats[0][0].get("engine"),  # a peer engine's version and config
        }
    for mode, m in modes.items():
        for peer in RATIO_PEERS:
            m[f"ratio_vs_{peer}"] = (
                m["step_s_median"] / modes[peer]["step_s_median"] if peer in modes else None
            )
        base = modes.get("nocomm")
        m["exposed_comm_s"] = (
            max(0.0, m["step_s_median"] - base["step_s_median"])
            if base is not None and mode not in ("nocomm", "single")
            else None
        )
    return {
        "config": asdict(cfg),
        "nproc": nproc,
        "global_batch": cfg.global_batch(nproc),
        "tokens_per_step": tokens,
        "n_params": first["n_params"],
        "param_bytes": param_bytes,
        "modes": modes,
        "loss_check": _loss_check(modes),
    }


def _loss_check(modes: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Every synchronised mode must follow the reference's losses within :data:`LOSS_RTOL`."""
    ref_name = "single" if "single" in modes else "ddp" if "ddp" in modes else None
    checked = [m for m in modes if m not in ("nocomm", ref_name)]
    if ref_name is None:
        return {"reference": None, "passed": None, "max_rel_err": {}, "rtol": LOSS_RTOL}
    ref = modes[ref_name]["losses"]
    errs = {m: max(abs(a - b) / abs(b) for a, b in zip(modes[m]["losses"], ref)) for m in checked}
    return {
        "reference": ref_name,
        "rtol": LOSS_RTOL,
        "max_rel_err": errs,
        "passed": all(e < LOSS_RTOL for e in errs.values()),
    }
