"""The GPU check: fullshard against torch FSDP2 on one CUDA GPU (NCCL at world size 1).

    bash scripts/gpu_check.sh [--out gpu_check.json] [--trace-dir traces/]

Prints one table (and, with ``--out``, the same as JSON):

- NCCL parity, fp32 and bf16 (``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``):
  losses of a small GPT trained 5 AdamW steps against the unsharded model (fp32) and against
  FSDP2 under the same policy (bf16), per step;
- CPU offload parity (``CPUOffloadPolicy(pin_memory=True)``: shards must live on the host) and
  how much of the host<->device copy time ran under kernels on other streams, from a
  ``torch.profiler`` trace;
- a Llama-shaped model (Llama 3.2 1B: 16 x 2048, GQA 32/8, 128256 vocab, tied embeddings;
  bf16 compute, fp32 master weights, AdamW), every decoder layer a unit: peak
  ``torch.cuda.max_memory_allocated`` and median step time, fullshard vs FSDP2 alternating;
- prefetch overlap from a profiler trace of one Llama step per engine: for each unit ``i``, the
  time GPU work on other streams (the all-gather of unit ``i + 1`` and its copies) ran inside
  unit ``i``'s compute span (:mod:`fullshard.bench.trace`). Reported as numbers, not assumed.

Without a CUDA GPU it prints one line saying it skipped and exits 0 (but exits 1 where the
driver sees GPUs and torch is a CPU build). It exits 1 when a parity
check fails or a check raises; speed and memory against FSDP2 are reported, never failed on.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from fullshard.bench.trace import copy_overlap, gpu_events, prefetch_overlap
from fullshard.models import GPT, GPTConfig
from fullshard.peers import load_fully_shard

ENGINES = ("fullshard", "fsdp2")
PARITY_STEPS = 5
FP32_RTOL = 1e-5  # per-step loss, sharded vs unsharded, fp32 (test_gpu.py's tolerance)
BF16_RTOL = 1e-3  # per-step loss, fullshard vs FSDP2 under the same bf16 policy
OFFLOAD_RTOL = 1e-4  # CPU AdamW vs CUDA AdamW: same math, another summation order
UNIT = "gpu_check::unit"  # record_function prefix around each unit's forward
PARITY_GPT = GPTConfig(vocab_size=256, seq_len=128, n_layer=4, d_model=256, n_head=4)
OFFLOAD_GPT = GPTConfig(vocab_size=256, seq_len=128, n_layer=4, d_model=1024, n_head=8)  # ~50M


@dataclass
class Row:
    """One line of the table."""

    check: str
    fullshard: str
    fsdp2: str
    note: str
    verdict: str  # PASS / FAIL / ERROR (correctness), met / missed / INFO (reported only)


def _policies(engine: str) -> tuple[Any, Any]:
    """(MixedPrecisionPolicy, CPUOffloadPolicy) classes of ``engine``."""
    if engine == "fullshard":
        from fullshard import CPUOffloadPolicy, MixedPrecisionPolicy
    else:
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy
    return MixedPrecisionPolicy, CPUOffloadPolicy


def _shard(model: nn.Module, units: list[nn.Module], engine: str, **kwargs: Any) -> nn.Module:
    fully_shard = load_fully_shard(engine)
    for unit in units:
        fully_shard(unit, **kwargs)
    fully_shard(model, **kwargs)
    return model


def _bf16(engine: str) -> Any:
    mp, _ = _policies(engine)
    return mp(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


def _rel(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a, b))


def _sync_time() -> float:
    torch.cuda.synchronize()
    return time.perf_counter()


# ----------------------------------------------------------------------------- small GPT parity


def _gpt(cfg: GPTConfig, device: str) -> GPT:
    torch.manual_seed(0)
    return GPT(cfg).to(device)


def _train_gpt(model: nn.Module, steps: int = PARITY_STEPS) -> list[float]:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(steps):
        rows = torch.randint(0, 256, (8, 129), generator=gen).cuda()
        logits = model(rows[:, :-1])
        loss = F.cross_entropy(logits.float().flatten(0, 1), rows[:, 1:].flatten())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss))
    return losses


def check_nccl_parity() -> list[Row]:
    ref = _train_gpt(_gpt(PARITY_GPT, "cuda"))
    fp32 = {}
    bf16 = {}
    for engine in ENGINES:
        model = _gpt(PARITY_GPT, "cuda")
        fp32[engine] = _rel(_train_gpt(_shard(model, list(model.blocks), engine)), ref)
        model = _gpt(PARITY_GPT, "cuda")
        bf16[engine] = _train_gpt(
            _shard(model, list(model.blocks), engine, mp_policy=_bf16(engine))
        )
    fs_vs_peer = _rel(bf16["fullshard"], bf16["fsdp2"])
    vs_ref = {e: _rel(bf16[e], ref) for e in ENGINES}
    return [
        Row(
            "NCCL parity fp32: max rel. loss err vs unsharded",
            f"{fp32['fullshard']:.1e}",
            f"{fp32['fsdp2']:.1e}",
            f"GPT {PARITY_GPT.n_layer}x{PARITY_GPT.d_model}, {PARITY_STEPS} AdamW steps, "
            f"tol {FP32_RTOL:g}",
            "PASS" if fp32["fullshard"] <= FP32_RTOL else "FAIL",
        ),
        Row(
            "NCCL parity bf16: fullshard vs FSDP2, same policy",
            f"{fs_vs_peer:.1e}",
            "(reference)",
            f"bf16 params, fp32 reduce; vs fp32 unsharded: {vs_ref['fullshard']:.1e} / "
            f"{vs_ref['fsdp2']:.1e}; tol {BF16_RTOL:g}",
            "PASS" if fs_vs_peer <= BF16_RTOL else "FAIL",
        ),
    ]


KNOBS = {  # FSDPModule knob -> how to turn it on for a unit
    "process-group allocator": lambda u: u.set_allocate_memory_from_process_group_for_comm(True),
    "symmetric memory": lambda u: u.set_symm_mem_for_comm(),
}


def check_comm_buffers() -> list[Row]:
    """The comm-buffer knobs on every unit: fp32 parity vs unsharded, under both engines."""
    ref = _train_gpt(_gpt(PARITY_GPT, "cuda"))
    rows = []
    for knob, turn_on in KNOBS.items():
        cells = {}
        for engine in ENGINES:
            try:
                model = _gpt(PARITY_GPT, "cuda")
                _shard(model, list(model.blocks), engine)
                for unit in [model, *model.blocks]:
                    turn_on(unit)
                cells[engine] = f"{_rel(_train_gpt(model), ref):.1e}"
            except Exception as e:  # FSDP2 may lack it on this machine: say so, keep ours
                if engine == "fullshard":
                    raise
                cells[engine] = f"{type(e).__name__}: {e}"[:60]
        ok = float(cells["fullshard"]) <= FP32_RTOL
        rows.append(
            Row(
                f"NCCL comm buffers from {knob}: max rel. loss err vs unsharded",
                cells["fullshard"],
                cells["fsdp2"],
                f"every unit, GPT {PARITY_GPT.n_layer}x{PARITY_GPT.d_model}, {PARITY_STEPS} "
                f"AdamW steps, tol {FP32_RTOL:g}",
                "PASS" if ok else "FAIL",
            )
        )
    return rows


# ----------------------------------------------------------------------------- CPU offload


def _offload_model(engine: str) -> nn.Module:
    _, offload = _policies(engine)
    # fullshard shards a host-built model straight into pinned host memory (as in
    # tests/test_gpu.py); FSDP2 expects the model on the device and moves the shards off it.
    model = _gpt(OFFLOAD_GPT, "cpu" if engine == "fullshard" else "cuda")
    return _shard(model, list(model.blocks), engine, offload_policy=offload(pin_memory=True))


def _shards_on_host(model: nn.Module) -> bool:
    locals_ = [p.to_local() if hasattr(p, "to_local") else p for p in model.parameters()]
    return all(t.device.type == "cpu" for t in locals_)


def _profile(step: Callable[[], object], path: Path) -> list[Any]:
    """Run ``step`` once under torch.profiler (CPU + CUDA); its GPU events, from the trace."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    prof.export_chrome_trace(str(path))
    return gpu_events(path)


def check_offload(trace_dir: Path) -> list[Row]:
    ref = _train_gpt(_gpt(OFFLOAD_GPT, "cuda"))
    errs, on_host, overlap, step_ms = {}, {}, {}, {}
    for engine in ENGINES:
        net = _offload_model(engine)
        on_host[engine] = _shards_on_host(net)
        t0 = _sync_time()
        errs[engine] = _rel(_train_gpt(net), ref)
        step_ms[engine] = (_sync_time() - t0) * 1e3 / PARITY_STEPS
        events = _profile(partial(_train_gpt, net, steps=1), trace_dir / f"offload_{engine}.json")
        overlap[engine] = copy_overlap(events)
    ok = on_host["fullshard"] and errs["fullshard"] <= OFFLOAD_RTOL

    def cell(e: str, d: str) -> str:
        c = overlap[e][d]
        return f"{c['overlapped_fraction'] * 100:.0f}% of {c['us'] / 1e3:.1f} ms ({c['copies']} copies)"

    return [
        Row(
            "CPU offload parity: max rel. loss err vs unsharded",
            f"{errs['fullshard']:.1e}" + ("" if on_host["fullshard"] else " (shards NOT on host)"),
            f"{errs['fsdp2']:.1e}" + ("" if on_host["fsdp2"] else " (shards NOT on host)"),
            f"GPT {OFFLOAD_GPT.n_layer}x{OFFLOAD_GPT.d_model}, pinned host shards, {PARITY_STEPS} steps; tol {OFFLOAD_RTOL:g}; "
            f"ms/step {step_ms['fullshard']:.0f} / {step_ms['fsdp2']:.0f}",
            "PASS" if ok else "FAIL",
        ),
        Row(
            "CPU offload H2D under compute",
            cell("fullshard", "HtoD"),
            cell("fsdp2", "HtoD"),
            "share of copy time overlapped by kernels on other streams (1 step)",
            "INFO",
        ),
        Row(
            "CPU offload D2H under compute",
            cell("fullshard", "DtoH"),
            cell("fsdp2", "DtoH"),
            "0% = copies serialised with compute",
            "INFO",
        ),
    ]


# ----------------------------------------------------------------------------- Llama ~1B


def _llama_config(layers: int) -> dict[str, Any]:
    from fullshard.train.presets import llama_1b

    cfg = json.loads(llama_1b().hf_config or "{}")
    cfg["num_hidden_layers"] = layers
    return cfg


def _build_llama(layers: int) -> tuple[nn.Module, list[nn.Module]]:
    from fullshard.train import hf

    torch.manual_seed(0)
    with torch.device("cuda"):
        model = hf.build(_llama_config(layers))
    return model, hf.decoder_layers(model)


def _annotate(units: list[nn.Module]) -> None:
    """Wrap each unit's forward (inside the engine's hooks) in a named profiler range."""
    from torch.profiler import record_function

    for i, unit in enumerate(units):
        inner = unit.forward

        def forward(*args: Any, _inner: Any = inner, _name: str = f"{UNIT}{i}", **kw: Any) -> Any:
            with record_function(_name):
                return _inner(*args, **kw)

        unit.forward = forward  # type: ignore[method-assign]


def _llama_run(engine: str, args: argparse.Namespace, trace: Path | None) -> dict[str, Any]:
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    model, units = _build_llama(args.llama_layers)
    _shard(model, units, engine, mp_policy=_bf16(engine))
    _annotate(units)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    vocab = int(_llama_config(args.llama_layers)["vocab_size"])
    gen = torch.Generator(device="cuda").manual_seed(2)
    data = torch.randint(
        0, vocab, (args.steps, args.batch, args.seq + 1), device="cuda", generator=gen
    )

    def step(rows: torch.Tensor) -> float:
        logits = model(input_ids=rows[:, :-1]).logits
        loss = F.cross_entropy(logits.float().flatten(0, 1), rows[:, 1:].flatten())
        del logits
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return float(loss)

    losses, times = [], []
    for rows in data:
        t0 = _sync_time()
        losses.append(step(rows))
        times.append(_sync_time() - t0)
    out: dict[str, Any] = {
        "peak_gib": (torch.cuda.max_memory_allocated() - base) / 2**30,
        "step_s": times[args.warmup :],
        "losses": losses,
        "n_params": sum(p.numel() for p in model.parameters()),
    }
    if trace is not None:
        events = _profile(lambda: step(data[0]), trace)
        try:
            out["prefetch"] = prefetch_overlap(events, [f"{UNIT}{i}" for i in range(len(units))])
        except ValueError as e:  # e.g. no kernel in the trace: report it, keep the other rows
            out["prefetch"] = {"error": str(e)}
    return out  # the model and optimizer go with this frame (gc.collect in the next run)


def check_llama(args: argparse.Namespace, trace_dir: Path) -> list[Row]:
    runs: dict[str, list[dict[str, Any]]] = {e: [] for e in ENGINES}
    for r in range(args.repeats):
        for engine in ENGINES if r % 2 == 0 else ENGINES[::-1]:
            trace = trace_dir / f"llama_{engine}.json" if r == args.repeats - 1 else None
            runs[engine].append(_llama_run(engine, args, trace))
    peak = {e: max(x["peak_gib"] for x in runs[e]) for e in ENGINES}
    step = {
        e: statistics.median(statistics.median(x["step_s"]) for x in runs[e]) * 1e3 for e in ENGINES
    }
    loss_err = _rel(runs["fullshard"][0]["losses"], runs["fsdp2"][0]["losses"])
    shape = (
        f"Llama {runs['fullshard'][0]['n_params'] / 1e9:.2f}B ({args.llama_layers} layers), "
        f"batch {args.batch} x {args.seq}, bf16 compute / fp32 AdamW"
    )
    rows = [
        Row(
            "Llama peak max_memory_allocated (GiB)",
            f"{peak['fullshard']:.2f}",
            f"{peak['fsdp2']:.2f}",
            f"{peak['fullshard'] / peak['fsdp2']:.3f}x FSDP2; {shape}",
            "met" if peak["fullshard"] <= peak["fsdp2"] else "missed",
        ),
        Row(
            "Llama step time (ms, median)",
            f"{step['fullshard']:.1f}",
            f"{step['fsdp2']:.1f}",
            f"{step['fullshard'] / step['fsdp2']:.3f}x FSDP2; steps {args.warmup}-{args.steps - 1} "
            f"timed, {args.repeats} repeats alternating",
            "met" if step["fullshard"] <= step["fsdp2"] else "missed",
        ),
        Row(
            "Llama loss: fullshard vs FSDP2 (max rel.)",
            f"{loss_err:.1e}",
            "(reference)",
            f"same init, data and bf16 policy; tol {BF16_RTOL * 10:g}",
            "PASS" if loss_err <= BF16_RTOL * 10 else "FAIL",
        ),
    ]
    pf = {e: runs[e][-1]["prefetch"] for e in ENGINES}

    def cell(e: str) -> str:
        p = pf[e]
        if "error" in p:
            return f"trace unreadable: {p['error'][:60]}"
        return f"{p['units_overlapped']}/{p['units']} units, {p['side_overlapped_fraction'] * 100:.0f}%"

    fs_pf = pf["fullshard"]
    rows.append(
        Row(
            "prefetch: unit i+1 gather inside unit i compute",
            cell("fullshard"),
            cell("fsdp2"),
            "units whose compute span had work on another stream; % of that side work under "
            f"compute. fullshard side work: {', '.join(fs_pf.get('side_top', [])) or 'none'}",
            "ERROR"
            if "error" in fs_pf
            else "met"
            if fs_pf["units_overlapped"] == fs_pf["units"]
            else "missed",
        )
    )
    return rows


# ----------------------------------------------------------------------------- main


def _table(rows: list[Row], header: str) -> str:
    cells = [["check", "fullshard", "torch FSDP2", "verdict", "note"]]
    cells += [[r.check, r.fullshard, r.fsdp2, r.verdict, r.note] for r in rows]
    widths = [max(len(c[i]) for c in cells) for i in range(4)]
    lines = [header]
    for j, c in enumerate(cells):
        lines.append("  ".join(x.ljust(w) for x, w in zip(c[:4], widths)) + "  " + c[4])
        if j == 0:
            lines.append("  ".join("-" * w for w in widths) + "  " + "-" * 4)
    return "\n".join(lines)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", help="also write the rows as JSON here")
    p.add_argument("--trace-dir", help="keep the profiler traces here (default: a temp folder)")
    p.add_argument("--llama-layers", type=int, default=16, help="decoder layers (16 = 1.2B)")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--steps", type=int, default=12, help="Llama steps per run (warmup included)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--repeats", type=int, default=2, help="Llama runs per engine, alternating")
    return p


def _gpus_the_driver_sees() -> int:
    """How many GPUs ``nvidia-smi -L`` lists (0 without the tool or a driver)."""
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return 0
    return sum(line.startswith("GPU ") for line in out.stdout.splitlines())


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if not torch.cuda.is_available():
        gpus = _gpus_the_driver_sees()
        if gpus and torch.version.cuda is None and os.environ.get("CUDA_VISIBLE_DEVICES") != "":
            # a CPU build of torch on a GPU machine (e.g. a CPU venv carried over): not a pass
            print(
                f"gpu_check: failed: the driver sees {gpus} GPU(s) but torch {torch.__version__} "
                "is a CPU build; install a CUDA build of torch (pip install torch from PyPI) "
                "and rerun",
                file=sys.stderr,
            )
            return 1
        print(f"gpu_check: skipped: no CUDA GPU visible to torch {torch.__version__}")
        return 0
    from fullshard.testing import free_port

    torch.cuda.set_device(0)
    dist.init_process_group(
        "nccl",
        init_method=f"tcp://127.0.0.1:{free_port()}",
        rank=0,
        world_size=1,
        device_id=torch.device("cuda", 0),
    )
    nccl = torch.cuda.nccl.version()
    nccl_s = ".".join(map(str, nccl)) if isinstance(nccl, tuple) else str(nccl)
    header = (
        f"gpu_check: {torch.cuda.get_device_name(0)}, torch {torch.__version__}, NCCL {nccl_s}, "
        "world size 1"
    )
    print(header, flush=True)
    rows: list[Row] = []
    with tempfile.TemporaryDirectory() as tmp:
        trace_dir = Path(args.trace_dir or tmp)
        trace_dir.mkdir(parents=True, exist_ok=True)
        checks: list[tuple[str, Callable[[], list[Row]]]] = [
            ("NCCL parity", check_nccl_parity),
            ("NCCL comm buffers", check_comm_buffers),
            ("CPU offload", lambda: check_offload(trace_dir)),
            ("Llama", lambda: check_llama(args, trace_dir)),
        ]
        for name, check in checks:
            t0 = time.perf_counter()
            try:
                rows += check()
            except Exception as e:  # report and go on: one broken check must not hide the rest
                traceback.print_exc()
                rows.append(Row(name, "-", "-", f"{type(e).__name__}: {e}"[:200], "ERROR"))
            print(f"gpu_check: {name} done in {time.perf_counter() - t0:.0f} s", flush=True)
    dist.destroy_process_group()
    print(_table(rows, header))
    if args.out:
        Path(args.out).write_text(
            json.dumps({"header": header, "rows": [asdict(r) for r in rows]}, indent=1)
        )
    return 1 if any(r.verdict in ("FAIL", "ERROR") for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
