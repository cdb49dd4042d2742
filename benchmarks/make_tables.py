"""Regenerate BENCHMARKS.md: run `fullshard bench --all` and the planner checks, write tables.

    python benchmarks/make_tables.py                      # everything (~25 min on 2 cores)
    python benchmarks/make_tables.py --configs memory --merge  # rerun one, keep the others
    python benchmarks/make_tables.py --from-json benchmarks/results/latest.json  # re-render

Raw results go to benchmarks/results/latest.json. The analysis in benchmarks/NOTES.md is copied
in verbatim below the tables (edit it there, not in BENCHMARKS.md); other ``## `` sections
written into BENCHMARKS.md by hand are kept, after the generated ones.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))

from fullshard.bench.cli import run  # noqa: E402
from fullshard.bench.configs import get_config  # noqa: E402
from fullshard.bench.report import markdown, scaling_markdown  # noqa: E402

COMMAND = "python benchmarks/make_tables.py"
PLAN_CASES = [("speed", 2), ("comm", 2), ("tiny", 2)]


def _plan_shape(name: str) -> tuple[dict[str, int], int, int]:
    """(GPTConfig fields, per-rank micro-batch, sequence length) of a plan or train preset."""
    from fullshard.memory.cli import PRESETS

    if name in PRESETS:
        return PRESETS[name]
    from fullshard.train.presets import get_preset

    t = get_preset(name)
    fields = {"n_layer": t.n_layer, "d_model": t.d_model, "n_head": t.n_head, "seq_len": t.seq_len}
    return fields, t.micro_batch, t.seq_len


def plan_accuracy(engine: str) -> list[dict[str, Any]]:
    """Predicted vs measured (live tensor bytes, real gloo ranks) for the shipped presets."""
    from fullshard.memory.measure import measure_rank
    from fullshard.memory.planner import PlanSpec, plan
    from fullshard.models import GPTConfig
    from fullshard.testing import run_distributed

    rows = []
    for name, world in PLAN_CASES:
        fields, batch, seq = _plan_shape(name)
        cfg = GPTConfig(tie_embeddings=False, **fields)
        p = plan(PlanSpec(model=cfg, world_size=world, batch=batch, seq=seq, engine=engine))
        ranks = run_distributed(
            measure_rank, world, dataclasses.asdict(cfg), batch, seq, engine, 3, timeout=900
        )
        measured = max(r["peak_bytes"] for r in ranks)
        rows.append(
            {
                "preset": name,
                "world_size": world,
                "batch": batch,
                "seq": seq,
                "engine": engine,
                "predicted_bytes": p.peak.total,
                "predicted_at": p.peak.label,
                "measured_bytes": measured,
                "measured_at": ranks[0]["peak_at"],
                "error": p.peak.total / measured - 1,
            }
        )
        print(f"plan {name}: {rows[-1]['error']:+.2%}", file=sys.stderr)
    return rows


def _commit() -> str:
    """The checkout's commit, ``+dirty`` when tracked files other than this script's own
    outputs (BENCHMARKS.md, benchmarks/results/, which a --merge chain rewrites) differ."""

    def git(*a: str) -> str:
        return subprocess.run(["git", *a], cwd=ROOT, capture_output=True, text=True).stdout.strip()

    outputs = [":(exclude)BENCHMARKS.md", ":(exclude)benchmarks/results"]
    dirty = git("status", "--porcelain", "--untracked-files=no", "--", ".", *outputs)
    return (git("rev-parse", "--short", "HEAD") or "unknown") + ("+dirty" if dirty else "")


def _provenance(r: dict[str, Any]) -> list[str]:
    """How one config's run was made: its command, commit, start and the load then."""
    if "command" not in r:
        return []
    return [
        f"Command: `{r['command']}` at commit {r['commit']}, {r['started']} to "
        f"{r['ended'][-9:]} (load average at start {r['load_avg_at_start']}); "
        f"{r['config']['repeats']} repeat(s) of every mode, modes alternating (A B C, C B A).",
        "",
        *_load_warning([r]),
    ]


def _load_warning(runs: list[dict[str, Any]]) -> list[str]:
    """A warning when other work loaded the machine while these runs ran (load > cores)."""
    loads = [
        x
        for r in runs
        for m in r["modes"].values()
        for x in m.get("load_avg_before_runs", [])
        if x is not None and x >= 0
    ]
    cores = os.cpu_count() or 1
    if not loads or max(loads) <= cores:
        return []
    return [
        f"Not a quiet machine: the load average before each mode's runs was "
        f"{min(loads):.1f}-{max(loads):.1f} on {cores} cores (other jobs), so step times are "
        "inflated and vary widely within a run (see the min-max ranges); compare the ratios "
        "within one run, and with caution.",
        "",
    ]


def _peer_section(results: dict[str, Any]) -> list[str]:
    """DeepSpeed ZeRO-3 against fullshard, per config and repeat, from the runs themselves."""
    runs = [r for r in results["runs"] if "deepspeed" in r["modes"] and "fullshard" in r["modes"]]
    if not runs:
        return []
    out = [
        "## DeepSpeed ZeRO-3 as a peer",
        "",
        "The `deepspeed` mode (`pip install 'fullshard[peers]'`; `fullshard bench --modes "
        "fullshard deepspeed single` for just it) hands the same GPT, built from the same seed, "
        "and the same `torch.optim.AdamW` to `deepspeed.initialize` with ZeRO stage 3 and all "
        "its defaults, fp32, on the ranks' gloo group (`DS_ACCELERATOR=cpu`); only "
        "`gradient_clipping` is set, to 0, because DeepSpeed's default of 1.0 clips every "
        "gradient to norm 1 and no other mode clips. Its units are its own (every submodule "
        "fetches its parameters; parameters under `param_persistence_threshold` elements stay "
        "gathered), so its calls and bytes differ from the fully_shard engines'. Step = its "
        "forward, `engine.backward`, `engine.step` (which zeroes the gradients).",
        "",
        "| config | ranks | fullshard s/step | DeepSpeed s/step | fullshard / DeepSpeed | per "
        "repeat | peak RSS per rank fullshard / DeepSpeed MiB | DeepSpeed bytes vs theory | "
        "DeepSpeed loss rel. err. |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in runs:
        fs, ds = r["modes"]["fullshard"], r["modes"]["deepspeed"]
        per = " / ".join(
            f"{a / b:.2f}x" for a, b in zip(fs["repeat_medians_s"], ds["repeat_medians_s"])
        )
        c = ds["comm"] or {}
        vs = c.get("bytes_vs_theory")
        err = r["loss_check"]["max_rel_err"].get("deepspeed")
        out.append(
            f"| `{r['config']['name']}` | {r['nproc']} | {fs['step_s_median']:.3f} | "
            f"{ds['step_s_median']:.3f} | **{fs['ratio_vs_deepspeed']:.2f}x** | {per} | "
            f"{fs['peak_rss_mib_max']:.0f} / {ds['peak_rss_mib_max']:.0f} | "
            + ("-" if vs is None else f"{vs:.2f}x")
            + " | "
            + ("-" if err is None else f"{err:.1e}")
            + " |"
        )
    e = runs[0]["modes"]["deepspeed"].get("engine")
    if e:
        out += [
            "",
            f"{e['engine']}, config (`{runs[0]['config']['name']}`; "
            "`train_micro_batch_size_per_gpu` is each config's per-rank batch) "
            f"`{json.dumps(e['config'], sort_keys=True)}`; ZeRO "
            "defaults as resolved: "
            + ", ".join(f"`{k}` {v}" for k, v in e["shown"].items())
            + " (every resolved knob is in `benchmarks/results/latest.json`).",
        ]
    return out + [""]


def render(results: dict[str, Any]) -> str:
    m = results["machine"]
    out = [
        "# Benchmarks",
        "",
        f"Generated by `{results.get('command', COMMAND)}` on {m['date']}"
        + (
            f" (runs kept from {results['machine_previous']['date']})"
            if results.get("machine_previous")
            else ""
        )
        + " — do not edit by hand (analysis lives in "
        "`benchmarks/NOTES.md` and is copied below). Raw numbers: `benchmarks/results/latest.json`.",
        "",
        f"Machine: {m['cores']} cores ({m['cpu']}), {m['memory_gib']} GiB, torch {m['torch']}, "
        f"Python {m['python']}, {m['backend']}; load average at start {m['load_avg_at_start']}.",
        "",
        "Per config, the same command alone: "
        + ", ".join(f"`fullshard bench --config {c}`" for c in results["configs"])
        + " (add `--json` for machines).",
        "",
        "## Method",
        "",
        "- Same GPT (untied embeddings), data (bytes of torch's `nn/modules/*.py`, a fixed random "
        "global batch per step, each rank its contiguous slice), seed 0, AdamW (lr 1e-3, betas "
        "0.9/0.95, wd 0.1), fp32, for every mode. Units: each block, then the root.",
        "- Modes: `fullshard` and `fsdp2` (`fully_shard` on blocks then root, "
        "reshard_after_forward=True), `deepspeed` (DeepSpeed ZeRO stage 3 with its defaults: "
        "[below](#deepspeed-zero-3-as-a-peer)), `ddp`, `single` (one process, threads = "
        "ranks), `nocomm` (each rank trains its own replica on its slice: the same compute, no "
        "communication).",
        "- Each (repeat, mode) is a fresh spawn of gloo ranks on loopback, one thread per rank; "
        "modes alternate A B C, C B A over repeats. Step = forward + loss + backward + "
        "optimizer step + zero_grad. Step time: slower rank per step, median over the timed "
        "steps of all repeats, (min-max) over those steps.",
        "- Peak RSS per rank: children are born with `MALLOC_MMAP_THRESHOLD_=65536` so freed "
        "buffers leave RSS; after setup (model, wrap, optimizer, data) the high-water mark is "
        "reset by writing 5 to `/proc/self/clear_refs`, and `VmHWM` is read after the last "
        'step. "Above runtime" subtracts the rank\'s RSS before the model was built.',
        "- Traffic: all-gather output / reduce-scatter input / all-reduce tensor bytes per step "
        "(fullshard: its own `count_collectives`; FSDP2: wrappers on the `torch.distributed` "
        "functions it calls; DeepSpeed: the same wrappers, also on the all-gather and "
        "reduce-scatter functions its torch backend binds at start-up; DDP: its reducer's "
        "buckets). Theory: 3 x parameter bytes for "
        "ZeRO-3, 1 x for DDP.",
        "- Exposed comm = step time - `nocomm` step time (communication and sharding overhead "
        "not hidden behind compute). Blocked in comm = wall time inside collective calls and "
        "`wait()` per step, where observable.",
        "- Loss check: the mean of the ranks' losses at every step against `single`, relative "
        "tolerance 1e-5.",
        "",
    ]
    for r in results["runs"]:
        if r["config"]["name"] != "memory":
            out += [f"## `{r['config']['name']}`", "", *_provenance(r), markdown(r), ""]
    mem = [r for r in results["runs"] if r["config"]["name"] == "memory"]
    if mem:
        out += ["## `memory`: per-rank memory against world size", "", *_provenance(mem[0])]
        out += [scaling_markdown(mem), ""]
        out += [markdown(r) + "\n" for r in mem]
    out += _peer_section(results)
    if results.get("plan"):
        out += [
            "## `fullshard plan` against measured runs",
            "",
            "Measured: peak live tensor bytes over 3 real training steps on 2 gloo ranks "
            "(`fullshard plan --preset P --world-size 2 --engine E --measure`), counted by a "
            "TorchDispatchMode over tensor storages (`fullshard.memory.tracker.LiveTensorBytes`): "
            "the quantity the plan predicts and `torch.cuda.max_memory_allocated` reports on a "
            "GPU. RSS is not used here because it adds ~300 MiB of interpreter, libraries and "
            "allocator caching that do not scale with the model. Activations in the plan come "
            "from one fake-tensor forward + backward, not from a formula.",
            "",
            "| preset | ranks | micro-batch | engine | predicted MiB (at) | measured MiB (at) | error |",
            "|---|---|---|---|---|---|---|",
        ]
        for p in results["plan"]:
            out.append(
                f"| {p['preset']} | {p['world_size']} | {p['batch']} x {p['seq']} | {p['engine']} | "
                f"{p['predicted_bytes'] / 2**20:.1f} ({p['predicted_at']}) | "
                f"{p['measured_bytes'] / 2**20:.1f} ({p['measured_at']}) | {p['error']:+.1%} |"
            )
        out.append("")
    if results.get("skipped"):
        out += ["Skipped: " + "; ".join(f"{k}: {v}" for k, v in results["skipped"].items()), ""]
    notes = ROOT / "benchmarks" / "NOTES.md"
    if notes.exists():
        out += [
            "*The analysis below is `benchmarks/NOTES.md`, written by hand for the runs it "
            "names; the tables above carry their own commands and dates, which may be newer.*",
            "",
            notes.read_text().strip(),
            "",
        ]
    return "\n".join(out)


def _sections(text: str) -> dict[str, str]:
    """``## `` heading -> that section's text (up to the next ``## ``)."""
    parts = re.split(r"^(?=## )", text, flags=re.M)
    return {p.splitlines()[0]: p.rstrip() for p in parts if p.startswith("## ")}


def keep_hand_written(new: str, old: str) -> str:
    """``new`` plus the sections of ``old`` that ``new`` lacks: sections written into
    BENCHMARKS.md by hand (e.g. ``## Planner vs published results``) outlive a regeneration."""
    have = _sections(new)
    kept = [text for head, text in _sections(old).items() if head not in have]
    return "\n\n".join([new.rstrip(), *kept]) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--configs", default="speed,comm,memory")
    ap.add_argument("--from-json", help="re-render from saved results instead of running")
    ap.add_argument("--out", default=str(ROOT / "BENCHMARKS.md"))
    ap.add_argument(
        "--merge", action="store_true", help="keep other configs' runs from results/latest.json"
    )
    ap.add_argument("--steps", type=int, help="steps per run for speed/comm (default 30)")
    ap.add_argument("--warmup", type=int, default=5, help="untimed steps with --steps")
    ap.add_argument("--no-plan", action="store_true", help="skip the plan-vs-measured runs")
    args = ap.parse_args()
    if args.from_json:
        results = json.loads(Path(args.from_json).read_text())
    else:
        names = [n for n in args.configs.split(",") if n]
        cfgs = [get_config(n) for n in names]
        if args.steps:  # shorter runs for speed/comm (memory keeps its own 2 steps)
            cfgs = [
                c.replace(steps=args.steps, warmup=args.warmup) if c.name != "memory" else c
                for c in cfgs
            ]
        started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
        load = round(os.getloadavg()[0], 2)
        results = run(cfgs, timeout=3600)
        results["command"] = " ".join(["python benchmarks/make_tables.py", *sys.argv[1:]])
        for r in results["runs"]:  # each config's own provenance survives later --merge runs
            r.update(
                command=results["command"],
                commit=_commit(),
                started=started,
                ended=results["machine"]["date"],  # machine_info() is taken after the runs
                load_avg_at_start=load,
            )
        dest = ROOT / "benchmarks" / "results" / "latest.json"
        # The runs are kept before the plan checks start: a failure there loses nothing.
        partial = dest.with_name("runs-" + time.strftime("%Y%m%d-%H%M%S") + ".json")
        partial.parent.mkdir(parents=True, exist_ok=True)
        partial.write_text(json.dumps(results, indent=1))
        print(f"runs saved to {partial}", file=sys.stderr)
        engine = "fsdp2" if "fullshard" in results["skipped"] else "fullshard"
        results["plan"] = plan_accuracy(engine) if not args.no_plan else []
        if args.merge and dest.exists():  # keep the other configs' runs from the last time
            old = json.loads(dest.read_text())
            results["runs"] = [
                r for r in old["runs"] if r["config"]["name"] not in names
            ] + results["runs"]
            names = list(dict.fromkeys(old.get("configs", []) + names))
            results["plan"] = results["plan"] or old.get("plan", [])
            results["machine_previous"] = old["machine"]
        order = {"speed": 0, "comm": 1, "memory": 2}
        results["runs"].sort(key=lambda r: (order.get(r["config"]["name"], 9), r["nproc"]))
        results["configs"] = sorted(names, key=lambda n: order.get(n, 9))
        dest.write_text(json.dumps(results, indent=1))
        partial.unlink()
    out = Path(args.out)
    out.write_text(keep_hand_written(render(results), out.read_text() if out.exists() else ""))
    print(f"wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
