"""``fullshard plan``: predict per-rank peak memory before launch, and what to change to fit.

Examples::

    fullshard plan --preset speed --world-size 2
    fullshard plan --preset llama-8b --world-size 8 --budget 80GiB     # a `fullshard train` preset
    fullshard plan --config runs/tiny/config.toml                      # a train run's config
    fullshard plan --hf-config '{"model_type": "llama", "hidden_size": 512, ...}'
    fullshard plan --n-layer 24 --d-model 2048 --world-size 8 --dtype bf16 --batch 4 --seq 2048
    fullshard plan --preset gpt-1.3b --world-size 4 --budget 16GiB
    fullshard plan --hf-config path/to/config.json --world-size 8 --mesh 2x4 --ac
    fullshard plan --preset tiny --world-size 2 --measure     # predicted vs a real CPU run
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from fullshard.memory.cluster_cli import HF_SHAPES
from fullshard.memory.cluster_cli import add_arguments as add_cluster_arguments
from fullshard.memory.engines import ENGINES

if TYPE_CHECKING:
    import torch

    from fullshard.memory.planner import Plan, PlanSpec

# The planner (and torch) are imported once the arguments are parsed, so that --help and
# argument errors take a fraction of a second.

__all__ = ["PRESETS", "Option", "main", "parse_bytes", "recommend"]

_MIB = 2**20

#: Shapes of plan's own (beyond every ``fullshard train`` preset, which plan reads from
#: :data:`fullshard.train.presets.PRESETS`): name -> (GPTConfig fields, per-rank micro-batch,
#: sequence length). Byte-level vocabulary.
PRESETS: dict[str, tuple[dict[str, int], int, int]] = {
    "speed": ({"n_layer": 6, "d_model": 512, "n_head": 8, "seq_len": 256}, 4, 256),
    "comm": ({"n_layer": 6, "d_model": 512, "n_head": 8, "seq_len": 256}, 1, 256),
    "memory": ({"n_layer": 12, "d_model": 1024, "n_head": 16, "seq_len": 256}, 1, 256),
    "gpt-125m": ({"n_layer": 12, "d_model": 768, "n_head": 12, "seq_len": 1024}, 8, 1024),
    "gpt-350m": ({"n_layer": 24, "d_model": 1024, "n_head": 16, "seq_len": 1024}, 8, 1024),
    "gpt-1.3b": ({"n_layer": 24, "d_model": 2048, "n_head": 16, "seq_len": 2048}, 4, 2048),
    "gpt-7b": ({"n_layer": 32, "d_model": 4096, "n_head": 32, "seq_len": 4096}, 1, 4096),
}

_UNITS = {
    "k": 1e3,
    "m": 1e6,
    "g": 1e9,
    "t": 1e12,
    "ki": 2**10,
    "mi": 2**20,
    "gi": 2**30,
    "ti": 2**40,
}


def parse_bytes(text: str) -> int:
    """``"16GiB"`` -> 17179869184; accepts B, KB/KiB, MB/MiB, GB/GiB, TB/TiB (case-insensitive)."""
    m = re.fullmatch(r"\s*([0-9.]+)\s*([kmgt]i?)?b?\s*", text.lower())
    if not m:
        raise ValueError(f"cannot read {text!r} as a size (e.g. 16GiB, 500MB)")
    return int(float(m.group(1)) * (_UNITS[m.group(2)] if m.group(2) else 1))


#: What a CPU training rank holds beyond its tensors and the libraries this process has
#: loaded (gloo process group and threads, allocator caches, the data): a stated constant,
#: measured as peak RSS minus (tensor peak + this process's RSS) of ``fullshard train --preset
#: tiny`` ranks (torch 2.13, 2 gloo ranks, embedded corpus): 341 - (2 + 262) MiB, rounded.
RANK_RUNTIME_EXTRA = 80 * _MIB


def _fmt(n: float) -> str:
    """Bytes in the unit that keeps 1-4 significant digits (B, KiB, MiB, GiB)."""
    if n >= 2**30:
        return f"{n / 2**30:.2f} GiB"
    if n >= _MIB:
        return f"{n / _MIB:.1f} MiB"
    if n >= 2**10:
        return f"{n / 2**10:.1f} KiB"
    return f"{n:.0f} B"


def _process_rss() -> int:
    """This process's resident bytes now (Linux /proc; 0 elsewhere)."""
    import os
    from pathlib import Path

    try:
        return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="fullshard plan",
        description="Predict per-rank peak memory of fully sharded training: sharded params, "
        "grads, optimizer states, gathered units (with prefetch), activations (traced on fake "
        "tensors) and communication buffers; the timeline peak and where it occurs.",
    )
    m = p.add_argument_group("model (a preset, explicit shape, or a Hugging Face config)")
    m.add_argument(
        "--preset",
        choices=_preset_names(),
        help="a fullshard train preset (tiny, small, gpt2-124m, llama-1b, llama-8b) or a plan "
        "shape (speed, comm, memory, gpt-*)",
    )
    m.add_argument(
        "--config",
        metavar="FILE.toml",
        help="a fullshard train config (e.g. runs/NAME/config.toml): plan that run",
    )
    m.add_argument("--n-layer", type=int)
    m.add_argument("--d-model", type=int)
    m.add_argument("--n-head", type=int)
    m.add_argument("--vocab-size", type=int)
    m.add_argument("--tie-embeddings", action="store_true")
    m.add_argument(
        "--hf-config",
        metavar="PATH_OR_JSON",
        help="a Hugging Face causal LM: inline JSON with a model_type, a config.json, or its "
        "folder (read locally; nothing is downloaded)",
    )
    r = p.add_argument_group("run")
    r.add_argument("--world-size", type=int, default=2)
    r.add_argument("--mesh", help="RxS: R replicas of S-way sharding (HSDP); R*S = world size")
    r.add_argument(
        "--dtype",
        choices=["fp32", "bf16", "fp16"],
        help="param_dtype (default: fp32, or the config's)",
    )
    r.add_argument("--offload", action="store_true", help="CPU-offload sharded states")
    r.add_argument("--batch", type=int, help="micro-batch per rank (sequences)")
    r.add_argument("--seq", type=int, help="sequence length")
    r.add_argument("--optimizer", choices=["adamw", "adam", "sgd", "sgd-momentum"], default="adamw")
    r.add_argument(
        "--ac",
        nargs="?",
        const="full",
        choices=["none", "selective", "full"],
        help="activation checkpointing per block: full (bare --ac), selective (torchtitan's op "
        "policy) or none",
    )
    r.add_argument("--no-reshard-after-forward", action="store_true")
    r.add_argument("--units", choices=["block", "model"], default="block")
    r.add_argument(
        "--engine",
        choices=sorted(ENGINES),
        default="fullshard",
        help="whose buffers to model: fullshard on gloo/CPU (default), fullshard on NCCL, or "
        "torch FSDP2",
    )
    add_cluster_arguments(p)
    o = p.add_argument_group("output")
    o.add_argument("--budget", help="per-rank memory budget (e.g. 16GiB): recommend what fits")
    o.add_argument("--timeline", action="store_true", help="print every event of the step")
    o.add_argument("--json", action="store_true")
    o.add_argument(
        "--measure",
        action="store_true",
        help="also run 3 real steps on --world-size local gloo ranks and compare (GPT, CPU)",
    )
    return p


_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}  # --dtype -> torch's


def _dtype(name: str) -> torch.dtype:
    import torch

    return getattr(torch, _DTYPES[name])  # type: ignore[no-any-return]


def _preset_names() -> list[str]:
    from fullshard.train.presets import PRESETS as TRAIN_PRESETS

    return [*TRAIN_PRESETS, *sorted(set(PRESETS) - set(TRAIN_PRESETS)), *HF_SHAPES]


def _mesh(text: str | None) -> tuple[int, int] | None:
    if not text:
        return None
    mm = re.fullmatch(r"(\d+)x(\d+)", text)
    if not mm:
        raise ValueError(f"--mesh {text!r}: expected RxS, e.g. 2x4")
    return int(mm.group(1)), int(mm.group(2))


def _train_spec(args: argparse.Namespace) -> PlanSpec:
    """The plan of what ``fullshard train`` would run with these flags (one config path)."""
    from fullshard.memory.planner import PlanSpec
    from fullshard.train import hf
    from fullshard.train.cli import parse_config
    from fullshard.train.config import ConfigError
    from fullshard.train.models import gpt_config

    argv: list[str] = []
    for name in ("config", "preset", "hf_config", "n_layer", "d_model", "n_head", "vocab_size"):
        if getattr(args, name) is not None:
            argv += ["--" + name.replace("_", "-"), str(getattr(args, name))]
    if args.tie_embeddings:
        argv.append("--tie-embeddings")
    try:
        cfg = parse_config(argv)
        model = None if cfg.uses_hf else gpt_config(cfg)
        hf_cfg = hf.make_config(hf.parse_config(cfg.hf_config_source)) if cfg.uses_hf else None
    except (ConfigError, hf.HFError) as e:
        raise ValueError(str(e)) from None
    except SystemExit:  # argparse printed the error
        raise ValueError("see the message above") from None
    seq = args.seq or cfg.seq_len
    if model is not None and model.seq_len < seq:
        model = dataclasses.replace(model, seq_len=seq)
    return PlanSpec(
        model=model,
        hf_config=hf_cfg,
        world_size=args.world_size,
        mesh=_mesh(args.mesh),
        param_dtype=_dtype(args.dtype or cfg.mixed_precision),
        offload=args.offload or cfg.cpu_offload,
        batch=args.batch or cfg.micro_batch,
        seq=seq,
        optimizer=args.optimizer,
        ac=args.ac or cfg.activation_checkpointing,
        reshard_after_forward=not args.no_reshard_after_forward
        and cfg.reshard_after_forward != "false",
        units=args.units,
        engine=args.engine,
    )


def _spec(args: argparse.Namespace) -> PlanSpec:
    from fullshard.memory.planner import PlanSpec
    from fullshard.models import GPTConfig
    from fullshard.train.presets import PRESETS as TRAIN_PRESETS

    if args.preset in HF_SHAPES:
        args = argparse.Namespace(**vars(args))
        args.hf_config, args.preset = json.dumps(HF_SHAPES[args.preset]), None
    if args.config or args.hf_config is not None or args.preset in TRAIN_PRESETS:
        return _train_spec(args)
    fields: dict[str, Any] = {}
    batch, seq = 1, 256
    if args.preset:
        fields, batch, seq = dict(PRESETS[args.preset][0]), *PRESETS[args.preset][1:]
    for k in ("n_layer", "d_model", "n_head", "vocab_size"):
        if getattr(args, k) is not None:
            fields[k] = getattr(args, k)
    seq = args.seq or seq
    batch = args.batch or batch
    if not fields:
        raise ValueError("give --preset, --config, --n-layer/--d-model/..., or --hf-config")
    fields["seq_len"] = max(fields.get("seq_len", seq), seq)
    return PlanSpec(
        model=GPTConfig(tie_embeddings=args.tie_embeddings, **fields),
        world_size=args.world_size,
        mesh=_mesh(args.mesh),
        param_dtype=_dtype(args.dtype or "fp32"),
        offload=args.offload,
        batch=batch,
        seq=seq,
        optimizer=args.optimizer,
        ac=args.ac or False,
        reshard_after_forward=not args.no_reshard_after_forward,
        units=args.units,
        engine=args.engine,
    )


@dataclass
class Option:
    """One change to the run, its cost, and the peak it would give."""

    change: str
    cost: str
    peak: int
    spec: PlanSpec


def _candidates(spec: PlanSpec) -> list[tuple[str, str, PlanSpec]]:
    """The changes that lower a plan's peak, cheapest first: (change, its cost, new spec)."""
    import torch

    r = dataclasses.replace
    cands: list[tuple[str, str, PlanSpec]] = []
    if not spec.reshard_after_forward:
        cands.append(
            (
                "reshard_after_forward=True",
                "one more all-gather per unit in backward",
                r(spec, reshard_after_forward=True),
            )
        )
    if spec.units == "model":
        cands.append(("one unit per block", "more, smaller collectives", r(spec, units="block")))
    b = spec.batch // 2
    while b >= 1:
        k = spec.batch // b
        cands.append(
            (
                f"micro-batch {b} x {k} gradient-accumulation steps",
                "same math; smaller kernels, more steps",
                r(spec, batch=b),
            )
        )
        b //= 2
    if spec.ac_mode == "none":
        cands.append(
            (
                "activation checkpointing per block",
                "~1/3 more compute (forward recomputed)",
                r(spec, ac=True),
            )
        )
    if spec.param_dtype == torch.float32:
        cands.append(
            (
                "bf16 mixed precision (param_dtype=bfloat16)",
                "numerics change; faster on GPUs",
                r(spec, param_dtype=torch.bfloat16),
            )
        )
    if not spec.offload:
        cands.append(
            (
                "CPU offload of sharded states",
                "host<->device copies every unit",
                r(spec, offload=True),
            )
        )
    if spec.ac_mode == "none" and spec.batch > 1:
        cands.append(
            ("activation checkpointing + micro-batch 1", "both costs", r(spec, ac=True, batch=1))
        )
    if not spec.offload and spec.ac_mode == "none":
        cands.append(
            ("CPU offload + activation checkpointing", "both costs", r(spec, offload=True, ac=True))
        )
    return cands


def recommend(spec: PlanSpec, budget: int) -> list[Option]:
    """Single changes in order of cost (cheapest first), then combinations, with their peaks."""
    from fullshard.memory.planner import plan

    r = dataclasses.replace
    cands = _candidates(spec)
    out = []
    for change, cost, s in cands:
        out.append(Option(change, cost, plan(s).peak.total, s))
        if out[-1].peak <= budget:
            break
    else:
        w = spec.world_size
        for _ in range(8):
            w *= 2
            s = r(
                spec,
                world_size=w,
                mesh=None if spec.mesh is None else (spec.mesh[0], w // spec.mesh[0]),
            )
            p = plan(s).peak.total
            if p <= budget or w >= 4096:
                out.append(
                    Option(f"world size {w} (shard over {s.shard_size})", "more devices", p, s)
                )
                break
    return out


def _describe(spec: PlanSpec, p: Plan) -> str:
    if spec.model is not None:
        what = f"GPT {spec.model.n_layer}x{spec.model.d_model}"
    elif isinstance(spec.hf_config, str):
        what = f"HF {spec.hf_config}"
    else:
        c = spec.hf_config
        layers = getattr(c, "num_hidden_layers", None) or getattr(c, "n_layer", "?")
        width = getattr(c, "hidden_size", None) or getattr(c, "n_embd", "?")
        what = f"HF {c.model_type} {layers}x{width}"
    mesh = f" mesh {spec.mesh[0]}x{spec.mesh[1]}" if spec.mesh else ""
    flags = [
        n
        for n, on in (
            (f"AC {spec.ac_mode}", spec.ac_mode != "none"),
            ("offload", spec.offload),
            ("no reshard after fwd", not spec.reshard_after_forward),
        )
        if on
    ]
    return (
        f"{what} ({p.n_params / 1e6:.2f} M params, {len(p.units)} units), world size "
        f"{spec.world_size}{mesh} (shard {spec.shard_size}), {str(spec.param_dtype).split('.')[-1]}, "
        f"micro-batch {spec.batch} x {spec.seq}, {spec.optimizer}, engine model {spec.engine}"
        + (f", {', '.join(flags)}" if flags else "")
    )


def expected_rss(p: Plan, libraries_rss: int) -> tuple[int, int]:
    """(expected per-rank process RSS on CPU, the runtime baseline it adds to the tensor peak).

    The baseline is ``libraries_rss`` -- measured: this process's RSS once it has loaded what
    a rank loads (torch, and transformers for a Hugging Face model), before planning -- plus
    :data:`RANK_RUNTIME_EXTRA`, a stated constant for what a training rank adds.
    """
    baseline = libraries_rss + RANK_RUNTIME_EXTRA
    return p.peak.total + p.peak.host + baseline, baseline


def render(spec: PlanSpec, p: Plan, timeline: bool = False, libraries_rss: int = 0) -> str:
    lines = [f"fullshard plan: {_describe(spec, p)}", ""]
    rss, baseline = expected_rss(p, libraries_rss)
    lines.append(
        f"per-rank peak of live tensors: {_fmt(p.peak.total)}  at: {p.peak.label}  (what "
        "torch.cuda.max_memory_allocated reports on a GPU)"
    )
    lines.append(
        f"expected process RSS per CPU rank: {_fmt(rss)} = tensors + runtime baseline "
        f"{_fmt(baseline)} ({_fmt(baseline - RANK_RUNTIME_EXTRA)} measured: Python + libraries "
        f"in this process; + {_fmt(RANK_RUNTIME_EXTRA)} stated: process group, allocator "
        "caches, data); what fullshard train's rss_mib and bench report"
    )
    lines.append("peak breakdown:")
    for k, v in sorted(p.peak.bytes.items(), key=lambda kv: -kv[1]):
        if v and not k.startswith("host:"):
            lines.append(f"  {k:<24} {_fmt(v):>12}  {100 * v / p.peak.total:5.1f}%")
    if p.peak.host:
        lines.append(f"host memory (offloaded states): {_fmt(p.peak.host)}")
    lines.append("")
    events = p.events if timeline else sorted(p.events, key=lambda e: -e.total)[:5]
    lines.append("timeline:" if timeline else "highest moments of the step:")
    for e in events:
        lines.append(f"  {_fmt(e.total):>12}  {e.label}")
    return "\n".join(lines)


def _measure(spec: PlanSpec, p: Plan, text: list[str], result: dict[str, Any]) -> bool:
    """``--measure``: run the plan's GPT on local gloo ranks and add the measured peak and the
    prediction's error to ``text`` and ``result``; ``False`` (after saying why) if it cannot."""
    if spec.model is None:
        print("fullshard plan: --measure runs the GPT only", file=sys.stderr)
        return False
    if spec.engine.endswith("-nccl"):
        print(
            f"fullshard plan: --measure runs on local gloo ranks (CPU); --engine "
            f"{spec.engine} models NCCL. Measure with --engine fullshard, or drop --measure",
            file=sys.stderr,
        )
        return False
    from fullshard.memory.measure import measure_rank
    from fullshard.testing import run_distributed

    ranks = run_distributed(
        measure_rank,
        spec.world_size,
        dataclasses.asdict(spec.model),
        spec.batch,
        spec.seq,
        spec.engine,
        3,
        spec.reshard_after_forward,
    )
    measured = max(r["peak_bytes"] for r in ranks)
    err = p.peak.total / measured - 1
    text.append(
        f"\nmeasured ({spec.engine}, {spec.world_size} gloo ranks, 3 steps, live tensor bytes): "
        f"{_fmt(measured)} at {ranks[0]['peak_at']}; prediction {err:+.1%}"
    )
    result["measured_peak_bytes"] = measured
    result["relative_error"] = err
    return True


def main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    try:
        spec = _spec(args)
        budget = parse_bytes(args.budget) if args.budget else None
    except ValueError as e:
        print(f"fullshard plan: {e}", file=sys.stderr)
        return 2
    if args.gpus:
        from fullshard.memory.cluster_cli import run

        return run(args, spec, budget)
    from fullshard.memory.planner import plan

    libraries_rss = _process_rss()  # before planning allocates anything
    p = plan(spec)
    rss, baseline = expected_rss(p, libraries_rss)
    result: dict[str, Any] = {
        "plan": p.to_dict(),
        "expected_rss_bytes": rss,
        "runtime_baseline_bytes": baseline,
    }
    status = 0
    text = [render(spec, p, args.timeline, libraries_rss)]
    if budget is not None:
        if p.peak.total <= budget:
            text.append(
                f"\nfits the budget {_fmt(budget)} ({_fmt(budget - p.peak.total)} to spare)"
            )
            result["recommendation"] = None
        else:
            opts = recommend(spec, budget)
            fit = [o for o in opts if o.peak <= budget]
            more = "options, cheapest first:" if opts else "every saving is already on"
            text.append(
                f"\nover the budget {_fmt(budget)} by {_fmt(p.peak.total - budget)}; {more}"
            )
            text += [f"  {_fmt(o.peak):>12}  {o.change}  ({o.cost})" for o in opts]
            if fit:
                text.append(f"recommended: {fit[0].change}")
            else:
                status = 1
            result["recommendation"] = fit[0].change if fit else None
            result["options"] = [
                {"change": o.change, "cost": o.cost, "peak_bytes": o.peak} for o in opts
            ]
    if args.measure and not _measure(spec, p, text, result):
        return 2
    if args.json:
        json.dump(result, sys.stdout, indent=1)
        print()
    else:
        print("\n".join(text))
    if status:
        smallest = min((o.peak for o in opts), default=p.peak.total)
        print(
            f"fullshard plan: error: nothing tried fits the budget {_fmt(budget or 0)} per rank "
            f"(the smallest option needs {_fmt(smallest)}); raise --budget, "
            "use more ranks or a smaller model",
            file=sys.stderr,
        )
    return status
