"""The GPU check's parity checks: a small GPT trained under fullshard and torch FSDP2 at world
size 1 (NCCL, or gloo under ``--dry-run``) against the unsharded model, in fp32 and bf16, with
the comm-buffer knobs on, and with CPU offload (pinned host shards on CUDA)."""

from __future__ import annotations

from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from gpu_check_common import ENGINES, Ctx, bf16_policy, policies, profile, rel, shard
from gpu_check_report import Row
from torch import nn

from fullshard.bench.trace import copy_overlap
from fullshard.engine.compat import FSDP_MODULE_METHODS_SINCE, TorchFeature
from fullshard.models import GPT, GPTConfig

PARITY_STEPS = 5
FP32_RTOL = 1e-5  # per-step loss, sharded vs unsharded, fp32 (test_gpu.py's tolerance)
BF16_RTOL = 1e-3  # per-step loss, fullshard vs FSDP2 under the same bf16 policy
OFFLOAD_RTOL = 1e-4  # CPU AdamW vs CUDA AdamW: same math, another summation order
TINY_GPT = GPTConfig(vocab_size=256, seq_len=32, n_layer=2, d_model=32, n_head=2)
#: (full, --dry-run) shapes
PARITY_GPT = (GPTConfig(vocab_size=256, seq_len=128, n_layer=4, d_model=256, n_head=4), TINY_GPT)
OFFLOAD_GPT = (  # ~50M parameters
    GPTConfig(vocab_size=256, seq_len=128, n_layer=4, d_model=1024, n_head=8),
    TINY_GPT,
)


def _gpt(cfg: GPTConfig, device: str) -> GPT:
    torch.manual_seed(0)
    return GPT(cfg).to(device)


def _shard_blocks(ctx: Ctx, model: GPT, engine: str, **kwargs: Any) -> nn.Module:
    return shard(ctx, model, list(model.blocks), engine, **kwargs)


def _train_gpt(
    ctx: Ctx, model: nn.Module, cfg: GPTConfig, steps: int = PARITY_STEPS
) -> list[float]:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(1)
    batch = 2 if ctx.dry else 8
    losses = []
    for _ in range(steps):
        rows = torch.randint(0, cfg.vocab_size, (batch, cfg.seq_len + 1), generator=gen)
        rows = rows.to(ctx.device)
        logits = model(rows[:, :-1])
        loss = F.cross_entropy(logits.float().flatten(0, 1), rows[:, 1:].flatten())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
    return losses


def _shape(cfg: GPTConfig) -> str:
    return f"GPT {cfg.n_layer}x{cfg.d_model}, {PARITY_STEPS} AdamW steps"


def check_parity(ctx: Ctx) -> list[Row]:
    cfg = PARITY_GPT[ctx.dry]
    ref = _train_gpt(ctx, _gpt(cfg, ctx.device), cfg)
    fp32, bf16 = {}, {}
    for engine in ENGINES:
        model = _gpt(cfg, ctx.device)
        fp32[engine] = rel(_train_gpt(ctx, _shard_blocks(ctx, model, engine), cfg), ref)
        model = _gpt(cfg, ctx.device)
        sharded = _shard_blocks(ctx, model, engine, mp_policy=bf16_policy(engine))
        bf16[engine] = _train_gpt(ctx, sharded, cfg)
    fs_vs_peer = rel(bf16["fullshard"], bf16["fsdp2"])
    vs_ref = {e: rel(bf16[e], ref) for e in ENGINES}
    backend = "NCCL" if ctx.cuda else "gloo"
    return [
        Row(
            f"{backend} parity fp32: max rel. loss err vs unsharded",
            f"{fp32['fullshard']:.1e}",
            f"{fp32['fsdp2']:.1e}",
            f"{_shape(cfg)}, tol {FP32_RTOL:g}",
            "PASS" if fp32["fullshard"] <= FP32_RTOL else "FAIL",
        ),
        Row(
            f"{backend} parity bf16: fullshard vs FSDP2, same policy",
            f"{fs_vs_peer:.1e}",
            "(reference)",
            f"bf16 params, fp32 reduce; vs fp32 unsharded: {vs_ref['fullshard']:.1e} / "
            f"{vs_ref['fsdp2']:.1e}; tol {BF16_RTOL:g}",
            "PASS" if fs_vs_peer <= BF16_RTOL else "FAIL",
        ),
    ]


KNOBS = {  # FSDPModule knob -> (how to turn it on for a unit, needs CUDA)
    "process-group allocator": (
        lambda u: u.set_allocate_memory_from_process_group_for_comm(True),
        False,  # accepted on a CPU unit, where it changes nothing
    ),
    "symmetric memory": (lambda u: u.set_symm_mem_for_comm(), True),
}


def _knob_cell(ctx: Ctx, engine: str, turn_on: Any, cfg: GPTConfig, ref: list[float]) -> str:
    try:
        model = _gpt(cfg, ctx.device)
        _shard_blocks(ctx, model, engine)
        for unit in [model, *model.blocks]:
            turn_on(unit)
        return f"{rel(_train_gpt(ctx, model, cfg), ref):.1e}"
    except Exception as e:  # FSDP2 may lack it on this machine: say so, keep ours
        if engine == "fullshard":
            raise
        return f"{type(e).__name__}: {e}"[:60]


def _torch_has(method: str) -> bool:
    since = FSDP_MODULE_METHODS_SINCE.get(method, (0, 0))
    return TorchFeature(method, since).available


def _too_old(knob: str) -> str:
    since = FSDP_MODULE_METHODS_SINCE["set_symm_mem_for_comm"]
    return f"{knob}: FSDP2 has it from torch {since[0]}.{since[1]}; this is {torch.__version__}"


def check_comm_buffers(ctx: Ctx) -> list[Row]:
    """The comm-buffer knobs on every unit: fp32 parity vs unsharded, under both engines."""
    cfg = PARITY_GPT[ctx.dry]
    ref = _train_gpt(ctx, _gpt(cfg, ctx.device), cfg)
    rows = []
    for knob, (turn_on, needs_cuda) in KNOBS.items():
        if needs_cuda and not ctx.cuda:
            continue
        if knob == "symmetric memory" and not _torch_has("set_symm_mem_for_comm"):
            rows.append(Row(f"comm buffers from {knob}", "-", "-", _too_old(knob), "INFO"))
            continue
        cells = {e: _knob_cell(ctx, e, turn_on, cfg, ref) for e in ENGINES}
        rows.append(
            Row(
                f"comm buffers from {knob}: max rel. loss err vs unsharded",
                cells["fullshard"],
                cells["fsdp2"],
                f"every unit, {_shape(cfg)}, tol {FP32_RTOL:g}",
                "PASS" if float(cells["fullshard"]) <= FP32_RTOL else "FAIL",
            )
        )
    return rows


def _offload_model(ctx: Ctx, engine: str, cfg: GPTConfig) -> nn.Module:
    _, offload = policies(engine)
    # fullshard shards a host-built model straight into (pinned) host memory, as in
    # tests/test_gpu.py; FSDP2 expects the model on the device and moves the shards off it.
    model = _gpt(cfg, "cpu" if engine == "fullshard" else ctx.device)
    return _shard_blocks(ctx, model, engine, offload_policy=offload(pin_memory=ctx.cuda))


def _shards_on_host(model: nn.Module, pinned: bool) -> bool:
    locals_ = [p.to_local() if hasattr(p, "to_local") else p for p in model.parameters()]
    return all(t.device.type == "cpu" and (t.is_pinned() or not pinned) for t in locals_)


def _copy_cell(overlap: dict[str, Any], direction: str) -> str:
    c = overlap[direction]
    return f"{c['overlapped_fraction'] * 100:.0f}% of {c['us'] / 1e3:.1f} ms ({c['copies']} copies)"


def check_offload(ctx: Ctx) -> list[Row]:
    cfg = OFFLOAD_GPT[ctx.dry]
    ref = _train_gpt(ctx, _gpt(cfg, ctx.device), cfg)
    errs, on_host, overlap, step_ms = {}, {}, {}, {}
    for engine in ENGINES:
        net = _offload_model(ctx, engine, cfg)
        on_host[engine] = _shards_on_host(net, pinned=ctx.cuda)
        t0 = ctx.sync()
        errs[engine] = rel(_train_gpt(ctx, net, cfg), ref)
        step_ms[engine] = (ctx.sync() - t0) * 1e3 / PARITY_STEPS
        trace = ctx.trace_dir / f"offload_{engine}.json"
        overlap[engine] = copy_overlap(profile(ctx, partial(_train_gpt, ctx, net, cfg, 1), trace))
    ctx.details["offload_copy_overlap"] = overlap
    ok = on_host["fullshard"] and errs["fullshard"] <= OFFLOAD_RTOL
    host = "pinned host shards" if ctx.cuda else "host shards (not pinned: CPU run)"
    where = {e: "" if on_host[e] else f" (shards NOT {host})" for e in ENGINES}
    no_gpu = "" if ctx.cuda else "; no device copies on the CPU"
    return [
        Row(
            "CPU offload parity: max rel. loss err vs unsharded",
            f"{errs['fullshard']:.1e}{where['fullshard']}",
            f"{errs['fsdp2']:.1e}{where['fsdp2']}",
            f"{_shape(cfg)}, {host}; tol {OFFLOAD_RTOL:g}; ms/step "
            f"{step_ms['fullshard']:.0f} / {step_ms['fsdp2']:.0f}",
            "PASS" if ok else "FAIL",
        ),
        Row(
            "CPU offload H2D under compute",
            _copy_cell(overlap["fullshard"], "HtoD"),
            _copy_cell(overlap["fsdp2"], "HtoD"),
            "share of copy time overlapped by kernels on other streams (1 step)" + no_gpu,
            "INFO",
        ),
        Row(
            "CPU offload D2H under compute",
            _copy_cell(overlap["fullshard"], "DtoH"),
            _copy_cell(overlap["fsdp2"], "DtoH"),
            "0% = copies serialised with compute" + no_gpu,
            "INFO",
        ),
    ]
