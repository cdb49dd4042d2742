"""The GPU check's Llama rows: a Llama-3.2-1B-shaped model (16 x 2048, GQA 32/8, 128256 vocab,
tied embeddings; bf16 compute, fp32 master weights, AdamW), every decoder layer a unit, under
fullshard and FSDP2 alternating: peak memory, median step time, losses, and the prefetch
overlap read off a profiler trace of one step per engine (:mod:`fullshard.bench.trace`)."""

from __future__ import annotations

import json
import statistics
from typing import Any

import torch
import torch.nn.functional as F
from gpu_check_common import ENGINES, TINY_LLAMA, Ctx, PeakBytes, bf16_policy, profile, rel, shard
from gpu_check_engines import BF16_RTOL
from gpu_check_report import Row
from torch import nn

from fullshard.bench.trace import prefetch_overlap

UNIT = "gpu_check::unit"  # record_function prefix around each unit's forward


def llama_config(ctx: Ctx) -> dict[str, Any]:
    """The llama-1b preset's shape (``--dry-run``: :data:`TINY_LLAMA`), ``--llama-layers`` deep."""
    from fullshard.train.presets import llama_1b

    cfg = dict(TINY_LLAMA) if ctx.dry else json.loads(llama_1b().hf_config or "{}")
    cfg["num_hidden_layers"] = ctx.args.llama_layers
    return cfg


def _annotate(units: list[nn.Module]) -> None:
    """Wrap each unit's forward (inside the engine's hooks) in a named profiler range."""
    from torch.profiler import record_function

    for i, unit in enumerate(units):
        inner = unit.forward

        def forward(*args: Any, _inner: Any = inner, _name: str = f"{UNIT}{i}", **kw: Any) -> Any:
            with record_function(_name):
                return _inner(*args, **kw)

        unit.forward = forward  # type: ignore[method-assign]


def _sharded_llama(ctx: Ctx, engine: str) -> tuple[nn.Module, int]:
    from fullshard.train import hf

    torch.manual_seed(0)
    with torch.device(ctx.device):
        model = hf.build(llama_config(ctx))
    units = hf.decoder_layers(model)
    shard(ctx, model, units, engine, mp_policy=bf16_policy(engine))
    _annotate(units)
    return model, len(units)


def _step(model: nn.Module, opt: torch.optim.Optimizer, rows: torch.Tensor) -> float:
    logits = model(input_ids=rows[:, :-1]).logits
    loss = F.cross_entropy(logits.float().flatten(0, 1), rows[:, 1:].flatten())
    del logits
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return float(loss)


def _prefetch(ctx: Ctx, step: Any, engine: str, units: int) -> dict[str, Any]:
    events = profile(ctx, step, ctx.trace_dir / f"llama_{engine}.json")
    try:
        return prefetch_overlap(events, [f"{UNIT}{i}" for i in range(units)])
    except ValueError as e:  # e.g. no kernel in the trace (the CPU): report it, keep the rest
        return {"error": str(e)}


def _llama_run(ctx: Ctx, engine: str, traced: bool) -> dict[str, Any]:
    a = ctx.args
    gen = torch.Generator().manual_seed(2)
    vocab = int(llama_config(ctx)["vocab_size"])
    data = torch.randint(0, vocab, (a.steps, a.batch, a.seq + 1), generator=gen).to(ctx.device)
    losses, times = [], []
    with PeakBytes(ctx) as peak:
        model, units = _sharded_llama(ctx, engine)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        for rows in data:
            t0 = ctx.sync()
            losses.append(_step(model, opt, rows))
            times.append(ctx.sync() - t0)
    out: dict[str, Any] = {
        "peak_gib": peak.bytes / 2**30,
        "step_s": times[a.warmup :],
        "losses": losses,
        "n_params": sum(p.numel() for p in model.parameters()),
    }
    if traced:
        out["prefetch"] = _prefetch(ctx, lambda: _step(model, opt, data[0]), engine, units)
    return out  # the model and optimizer go with this frame (gc.collect in the next run)


def _prefetch_row(ctx: Ctx, pf: dict[str, dict[str, Any]]) -> Row:
    def cell(p: dict[str, Any]) -> str:
        if "error" in p:
            return "n/a" if ctx.cuda else "n/a (CPU)"
        return f"{p['units_overlapped']}/{p['units']} units, {p['side_overlapped_fraction'] * 100:.0f}%"

    fs = pf["fullshard"]
    if not ctx.cuda:
        verdict, why = "INFO", "CPU run: no GPU streams to overlap (trace written and read)"
    elif "error" in fs:
        verdict, why = "ERROR", f"no overlap read off the trace: {fs['error']}"
    else:
        verdict = "met" if fs["units_overlapped"] == fs["units"] else "missed"
        why = f"fullshard side work: {', '.join(fs.get('side_top', [])) or 'none'}"
    return Row(
        "prefetch: unit i+1 gather inside unit i compute",
        cell(fs),
        cell(pf["fsdp2"]),
        "units whose compute span had work on another stream; % of that side work under "
        f"compute. {why}",
        verdict,
    )


def check_llama(ctx: Ctx) -> list[Row]:
    a = ctx.args
    runs: dict[str, list[dict[str, Any]]] = {e: [] for e in ENGINES}
    for r in range(a.repeats):
        for engine in ENGINES if r % 2 == 0 else ENGINES[::-1]:
            runs[engine].append(_llama_run(ctx, engine, traced=r == a.repeats - 1))
    peak = {e: max(x["peak_gib"] for x in runs[e]) for e in ENGINES}
    step = {e: statistics.median(statistics.median(x["step_s"]) for x in runs[e]) for e in ENGINES}
    loss_err = rel(runs["fullshard"][0]["losses"], runs["fsdp2"][0]["losses"])
    pf = {e: runs[e][-1]["prefetch"] for e in ENGINES}
    ctx.details["llama_prefetch"] = pf
    what = "max_memory_allocated" if ctx.cuda else "live tensor bytes"
    shape = (
        f"Llama {runs['fullshard'][0]['n_params'] / 1e9:.3g}B ({a.llama_layers} layers), "
        f"batch {a.batch} x {a.seq}, bf16 compute / fp32 AdamW"
    )
    return [
        Row(
            f"Llama peak {what} (GiB)",
            f"{peak['fullshard']:.3g}",
            f"{peak['fsdp2']:.3g}",
            f"{peak['fullshard'] / peak['fsdp2']:.3f}x FSDP2; {shape}",
            "met" if peak["fullshard"] <= peak["fsdp2"] else "missed",
        ),
        Row(
            "Llama step time (ms, median)",
            f"{step['fullshard'] * 1e3:.1f}",
            f"{step['fsdp2'] * 1e3:.1f}",
            f"{step['fullshard'] / step['fsdp2']:.3f}x FSDP2; steps {a.warmup}-{a.steps - 1} "
            f"timed, {a.repeats} repeats alternating",
            "met" if step["fullshard"] <= step["fsdp2"] else "missed",
        ),
        Row(
            "Llama loss: fullshard vs FSDP2 (max rel.)",
            f"{loss_err:.1e}",
            "(reference)",
            f"same init, data and bf16 policy; tol {BF16_RTOL * 10:g}",
            "PASS" if loss_err <= BF16_RTOL * 10 else "FAIL",
        ),
        _prefetch_row(ctx, pf),
    ]
