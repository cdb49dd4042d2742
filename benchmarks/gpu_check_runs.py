"""The GPU check's whole-tool rows: ``fullshard train --preset llama-1b`` beside ``fullshard
plan``'s prediction for the same run, and ``fullshard bench --config overhead``'s per-unit CPU
cost against FSDP2 (64 tiny units), measured on the device.

The training run and its plan read one config file, written here from the same flags
(``fullshard train --config``, ``fullshard plan --config``), so they describe the same run.
Both tools run as the user runs them: ``python -m fullshard ...`` in a child process.
"""

from __future__ import annotations

import gc
import json
import math
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
from gpu_check_common import TINY_LLAMA, Ctx
from gpu_check_report import Row

PRESET = "llama-1b"
ROOT = Path(__file__).resolve().parent.parent
#: Seconds kept back from the training run for its final checkpoint save (1.2B parameters with
#: AdamW states: ~20 GB) and the rest of the check; the run is killed if it overruns anyway.
SAVE_RESERVE_S = 60.0


def _env() -> dict[str, str]:
    """This environment with fullshard's sources (and the peers package) importable."""
    paths = [str(ROOT / "src"), str(ROOT / "benchmarks")]
    old = os.environ.get("PYTHONPATH")
    return dict(os.environ, PYTHONPATH=os.pathsep.join(paths + ([old] if old else [])))


def _fullshard(
    argv: list[str], log: Path, timeout: float, errors: Path | None = None
) -> int | None:
    """``python -m fullshard ARGV`` with its output in ``log`` (its stderr in ``errors``, when
    given); the exit code, or ``None`` when it ran past ``timeout`` seconds and was killed
    (with every process it started)."""
    with log.open("w") as out, open(errors or os.devnull, "w") as err:
        proc = subprocess.Popen(
            [sys.executable, "-m", "fullshard", *argv],
            stdout=out,
            stderr=err if errors else subprocess.STDOUT,
            env=_env(),
            start_new_session=True,  # its own process group: the ranks go with it
        )
        try:
            return proc.wait(timeout=max(timeout, 1.0))
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            return None


def _plan(ctx: Ctx, config: Path, flags: list[str], name: str) -> dict[str, Any]:
    """``fullshard plan --config CONFIG FLAGS --json``, parsed (its output kept in the out dir)."""
    out, err = ctx.work / f"plan_{name}.json", ctx.work / f"plan_{name}.log"
    argv = ["plan", "--config", str(config), *flags, "--json"]
    code = _fullshard(argv, out, ctx.time_left(), errors=err)
    if code != 0:
        raise RuntimeError(f"fullshard plan {' '.join(flags)} exited {code}: {err.read_text()}")
    return json.loads(out.read_text())  # type: ignore[no-any-return]


def _train_flags(ctx: Ctx) -> list[str]:
    a = ctx.args
    flags = ["--preset", PRESET, "--max-steps", str(a.train_steps)]
    flags += ["--global-batch", str(a.train_global_batch), "--nproc", "1", "--device", ctx.device]
    flags += ["--eval-every", "0", "--ckpt-every", "0", "--sample-tokens", "0"]
    flags += ["--progress", "plain", "--log-every", "1", "--resume", "never"]
    flags += ["--time-budget", f"{max(ctx.time_left() - SAVE_RESERVE_S - 30, 10):.0f}"]
    if ctx.dry:  # the preset's run at a size the CPU trains in seconds
        flags += ["--hf-config", json.dumps(TINY_LLAMA), "--seq-len", "64", "--micro-batch", "2"]
    return flags


def _write_config(ctx: Ctx) -> tuple[Path, Any]:
    from fullshard.train.cli import parse_config
    from fullshard.train.config import to_toml

    cfg = parse_config(_train_flags(ctx))
    path = ctx.work / "train_config.toml"
    path.write_text(to_toml(cfg))
    return path, cfg


def _measured(records: list[dict[str, Any]], warmup: int) -> dict[str, Any]:
    train = [r for r in records if r.get("kind") == "train"]
    if not train:
        raise ValueError("the run logged no step")
    timed = train[min(warmup, len(train) - 1) :]
    stop = [r for r in records if r.get("kind") == "stop"]
    return {
        "steps": len(train),
        "timed_from": timed[0]["step"],
        "losses": [r["loss"] for r in train],
        "tokens_per_s": statistics.median(r["tokens_per_s"] for r in timed),
        "step_time_s": statistics.median(r["step_time_s"] for r in timed),
        "peak_mem_gib": max(max(r["peak_mem_mib"]) for r in train) / 1024,
        "stop": stop[-1]["reason"] if stop else None,
    }


def _train(ctx: Ctx, config: Path) -> tuple[int | None, dict[str, Any]]:
    from fullshard.train.metrics import read_metrics

    gc.collect()
    if ctx.cuda:  # the device memory this process caches, for the run's own
        torch.cuda.empty_cache()
    run_dir = Path(tempfile.mkdtemp(prefix="gpu_check_train_"))
    log = ctx.work / "train.log"
    try:
        argv = ["train", "--config", str(config), "--run-dir", str(run_dir)]
        code = _fullshard(argv, log, ctx.time_left() - 20)
        metrics = run_dir / "metrics.jsonl"
        if metrics.exists():
            shutil.copy(metrics, ctx.work / "train_metrics.jsonl")
        try:
            return code, _measured(read_metrics(metrics), ctx.args.train_warmup)
        except ValueError as e:
            tail = " | ".join(log.read_text().splitlines()[-3:])
            raise RuntimeError(
                f"fullshard train exited {code} ({e}); its log ends: {tail}"
            ) from None
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)  # the checkpoint: ~20 GB at 1.2B


def _run_row(cfg: Any, code: int | None, m: dict[str, Any]) -> Row:
    """PASS: every step (or its own --time-budget stop) with finite losses; SKIPPED: killed at
    the check's time budget before that; FAIL otherwise."""
    finite = all(math.isfinite(x) for x in m["losses"])
    complete = m["steps"] == cfg.max_steps or m["stop"] == "time_budget"
    how = "exit 0" if code == 0 else "killed at the time budget" if code is None else f"exit {code}"
    if not finite or code not in (0, None):
        verdict = "FAIL"
    else:
        verdict = "PASS" if complete else "SKIPPED"
    note = f"{how}, stop reason {m['stop']}; train.log, train_config.toml and "
    note += "train_metrics.jsonl in the out folder"
    losses = (
        f"{m['steps']}/{cfg.max_steps} steps, loss {m['losses'][0]:.2f} -> {m['losses'][-1]:.2f}"
    )
    return Row(f"train --preset {PRESET}: the run", losses, "-", note, verdict)


def _rows(ctx: Ctx, cfg: Any, m: dict[str, Any], plan: dict[str, Any], mem: float) -> list[Row]:
    from fullshard.memory.hardware import GPUS

    gpu = ctx.args.plan_gpu
    tps, ptps = m["tokens_per_s"], plan["tokens_per_s_per_gpu"]
    mfu = tps * plan["model_flops_per_token"] / GPUS[gpu].bf16_flops
    where = f"plan: 1 x {gpu}" + ("" if ctx.cuda else " (this ran on the CPU: not comparable)")
    shape = f"micro-batch {cfg.micro_batch} x {cfg.seq_len}, global batch {cfg.global_batch}"
    steps = f"median of steps {m['timed_from']}-{m['steps']}"
    mem_what = "max_memory_allocated vs plan" if ctx.cuda else "peak RSS vs plan's expected RSS"
    return [
        Row(
            "train: tokens/s per GPU",
            f"{tps:,.0f}",
            f"{ptps:,.0f}",
            f"{tps / ptps:.3g}x the plan; {steps}; {shape}; {where}",
            "INFO",
        ),
        Row(
            "train: MFU",
            f"{mfu * 100:.1f}%" if ctx.cuda else "n/a (CPU)",
            f"{plan['mfu'] * 100:.1f}%",
            f"6N + 12 L H Q T FLOPs per token over {gpu}'s bf16 peak; {where}",
            "INFO",
        ),
        Row(
            "train: step time (s, median)",
            f"{m['step_time_s']:.3g}",
            f"{plan['step_time_s']:.3g}",
            f"{m['step_time_s'] / plan['step_time_s']:.3g}x the plan; {where}",
            "INFO",
        ),
        Row(
            "train: peak memory (GiB)",
            f"{m['peak_mem_gib']:.3g}",
            f"{mem:.3g}",
            f"{m['peak_mem_gib'] / mem:.3g}x the plan; {mem_what}",
            "INFO",
        ),
    ]


def check_train(ctx: Ctx) -> list[Row]:
    """``fullshard train --preset llama-1b`` for a few dozen steps beside its plan."""
    config, cfg = _write_config(ctx)
    gpus = ["--gpus", "1", "--gpu", ctx.args.plan_gpu, "--local-batch", str(cfg.global_batch)]
    plan = _plan(ctx, config, gpus, "gpu")
    if ctx.cuda:
        mem = plan["peak_memory_gib"]
    else:  # the planner's CPU prediction: a rank's resident memory
        mem = _plan(ctx, config, ["--world-size", "1"], "cpu")["expected_rss_bytes"] / 2**30
    code, m = _train(ctx, config)
    ctx.details["train"] = {"measured": m, "exit_code": code}
    return [_run_row(cfg, code, m), *_rows(ctx, cfg, m, plan, mem)]


def check_overhead(ctx: Ctx) -> list[Row]:
    """``fullshard bench --config overhead`` (many tiny units) on the device, in this process."""
    from fullshard.bench.overhead import OverheadConfig, in_this_process

    cfg = OverheadConfig(units=ctx.args.overhead_units, profile_steps=0)
    if ctx.dry:
        cfg = cfg.replace(steps=6, warmup=2, repeats=1)
    w = in_this_process(cfg, ctx.device)
    ctx.details["overhead"] = w
    modes, ratio = w["modes"], w["fullshard_vs_fsdp2_overhead"]
    loss_diff = w["fullshard_vs_fsdp2_max_rel_loss_diff"]
    step = " / ".join(f"{modes[m]['step_ms']:.2f}" for m in ("fullshard", "fsdp2", "bare"))
    model = f"{cfg.units} units of LayerNorm + Linear({cfg.width}), batch {cfg.batch}, SGD"
    return [
        Row(
            f"per-unit CPU overhead on {ctx.device} (us per unit per step)",
            f"{modes['fullshard']['overhead_us_per_unit']:.1f}",
            f"{modes['fsdp2']['overhead_us_per_unit']:.1f}",
            f"{'n/a' if ratio is None else f'{ratio:.2f}x'} FSDP2; ms/step fullshard / FSDP2 / "
            f"bare {step}; {model}; {cfg.repeats} repeats alternating",
            "met" if ratio is not None and ratio <= 1 else "missed",
        ),
        Row(
            "overhead model loss: fullshard vs FSDP2 (max rel.)",
            f"{loss_diff:.1e}",
            "(reference)",
            f"{cfg.steps} SGD steps, same init and data; tol 1e-5",
            "PASS" if loss_diff <= 1e-5 else "FAIL",
        ),
    ]
