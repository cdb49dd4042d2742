"""The GPU check's RL rows (``fullshard.rl``) at world size 1, on a Llama-shaped model (every
decoder layer a unit, bf16 compute, fp32 AdamW at an RL-sized learning rate): all weights in
bf16 by :func:`~fullshard.rl.publish` against the frameworks' per-weight ``full_tensor()`` then
``.to(bf16)`` (each into a preallocated receiver on the device; seconds, GB/s, gathers, bit for
bit), one :class:`~fullshard.rl.ShardDeltas` delta after a step, :func:`~fullshard.rl.sleep` /
``wake`` (seconds, ``memory_allocated`` before / asleep / woken, the pinned host copy, state bit
for bit, the next step's loss against a model that never slept) and
:func:`~fullshard.rl.gathered_for_rollout`'s gathers in N no-grad forwards.
"""

from __future__ import annotations

import contextlib
import gc
import statistics
from collections.abc import Callable
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from gpu_check_common import Ctx, bf16_policy, shard
from gpu_check_llama import llama_config
from gpu_check_report import Row
from torch import nn
from torch.distributed.tensor import DTensor

from fullshard.engine.events import record_events
from fullshard.rl import ShardDeltas, gathered_for_rollout, named_weights, publish
from fullshard.rl.delta import DeltaRows, bits
from fullshard.rl.names import local_tensor
from fullshard.rl.sleep import SleepReport, sleep, wake

WIRE = torch.bfloat16
LR = 1e-5  # RL-sized: most bf16 weights do not change in a step
TOKENS = ((2, 512), (2, 32))  # (batch, sequence) of a training step: (GPU, --dry-run)
FORWARDS = 4  # the rollout's no-grad forwards
PUBLISH_GATHER = "fullshard::rl publish: all-gather"  # publish's profiler range per gather
Receiver = dict[str, torch.Tensor]


def _model(ctx: Ctx) -> tuple[nn.Module, torch.optim.Optimizer, int]:
    """The Llama, ``--rl-layers`` deep, every decoder layer a unit; its AdamW; its units."""
    from fullshard.train import hf

    torch.manual_seed(0)
    with torch.device(ctx.device):
        model = hf.build(llama_config(ctx) | {"num_hidden_layers": ctx.args.rl_layers})
    layers = hf.decoder_layers(model)
    shard(ctx, model, layers, "fullshard", mp_policy=bf16_policy("fullshard"))
    return model, torch.optim.AdamW(model.parameters(), lr=LR), len(layers) + 1


def _batch(ctx: Ctx, seed: int) -> torch.Tensor:
    batch, seq = TOKENS[ctx.dry]
    gen = torch.Generator().manual_seed(seed)
    vocab = int(llama_config(ctx)["vocab_size"])
    return torch.randint(0, vocab, (batch, seq + 1), generator=gen).to(ctx.device)


def _step(model: nn.Module, opt: torch.optim.Optimizer, rows: torch.Tensor) -> float:
    logits = model(input_ids=rows[:, :-1]).logits
    loss = F.cross_entropy(logits.float().flatten(0, 1), rows[:, 1:].flatten())
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return float(loss.detach())


def _seconds(ctx: Ctx, fn: Callable[[], object]) -> float:
    t0 = ctx.sync()
    fn()
    return ctx.sync() - t0


def _median_s(ctx: Ctx, fn: Callable[[], object], repeats: int) -> float:
    """Median seconds of ``fn`` over ``repeats`` runs, after one untimed."""
    fn()
    return statistics.median(_seconds(ctx, fn) for _ in range(repeats))


def _by_full_tensor(model: nn.Module, into: Receiver) -> None:
    """The frameworks' way: per weight ``full_tensor()`` in the training dtype (one all-gather
    each), cast to the wire dtype."""
    for name, p in named_weights(model):
        into[name].copy_((p.full_tensor() if isinstance(p, DTensor) else p).to(WIRE))


def _by_publish(model: nn.Module, into: Receiver) -> None:
    for name, t in publish(model, dtype=WIRE):
        into[name].copy_(t)


def _publish_gathers(model: nn.Module, into: Receiver) -> int:
    """publish's all-gathers, read off its profiler ranges (``count_collectives`` records none at
    world size 1, where a group of one sends nothing)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        _by_publish(model, into)
    return sum(e.name.startswith(PUBLISH_GATHER) for e in prof.events())


def _differ(a: Receiver, b: Receiver) -> list[str]:  # the names whose bits differ
    return [n for n in a if not torch.equal(bits(a[n]), bits(b[n]))]


def _sync(ctx: Ctx, model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    """full_tensor against publish, then one AdamW step's deltas (the receivers go with it)."""
    weights = named_weights(model)
    ft, pub = ({n: torch.zeros(p.shape, dtype=WIRE, device=ctx.device) for n, p in weights}
               for _ in range(2))  # fmt: skip
    out: dict[str, Any] = {
        "full_tensor_s": _median_s(ctx, lambda: _by_full_tensor(model, ft), ctx.args.rl_repeats),
        "publish_s": _median_s(ctx, lambda: _by_publish(model, pub), ctx.args.rl_repeats),
        "full_tensor_gathers": sum(isinstance(p, DTensor) for _, p in weights),
        "publish_gathers": _publish_gathers(model, pub),
        "differ": _differ(ft, pub),
        "numel": sum(p.numel() for _, p in weights),
        "weights": len(weights),
    }
    deltas = ShardDeltas(model, dtype=WIRE)  # the base: what the receivers hold
    _step(model, opt, _batch(ctx, 2))
    masks: list[DeltaRows] = []
    out["delta_s"] = _seconds(ctx, lambda: masks.extend(deltas.delta()))
    out["changed"] = sum(m.changed for m in masks)
    for m in masks:  # the old weights (the frameworks' way) XOR the masks
        bits(ft[m.name]).narrow(m.dim, m.start, m.stop - m.start).bitwise_xor_(m.mask)
    _by_full_tensor(model, pub)  # the new weights
    out["delta_differ"] = _differ(ft, pub)
    return out


def _state(model: nn.Module, opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The local parameter shards and the optimizer's state tensors, in a fixed order."""
    params = list(model.parameters())
    out = [local_tensor(p) for p in params]
    for p in params:
        state = sorted(opt.state.get(p, {}).items())
        out += [local_tensor(v) for _, v in state if isinstance(v, torch.Tensor)]
    return out


def _held(ctx: Ctx, state: list[torch.Tensor]) -> int:
    """``torch.cuda.memory_allocated``; on the CPU the bytes of ``state``'s storages."""
    if ctx.cuda:
        return torch.cuda.memory_allocated()
    return sum({t.untyped_storage()._cdata: t.untyped_storage().nbytes() for t in state}.values())


def _sleep_wake(
    ctx: Ctx, model: nn.Module, opt: torch.optim.Optimizer
) -> tuple[dict[str, Any], list[torch.Tensor]]:
    """Sleep and wake, timed and measured; the state as it was before (host copies)."""
    state = _state(model, opt)
    saved = [t.to("cpu", copy=True) for t in state]
    on_device = [t for t in state if t.device.type == ctx.device]  # not a CPU step counter
    out: dict[str, Any] = {"expected": sum(t.numel() * t.element_size() for t in on_device)}
    gc.collect()
    out["before"] = _held(ctx, state)
    reports: list[SleepReport] = []
    out["sleep_s"] = _seconds(ctx, lambda: reports.append(sleep(model, opt)))
    out["asleep"] = _held(ctx, state)
    out["pinned"], out["host"] = reports[0].pinned, reports[0].moved_bytes  # its host copy
    out["wake_s"] = _seconds(ctx, partial(wake, model))
    out["woken"] = _held(ctx, state)
    now = _state(model, opt)
    out["tensors"] = len(now)
    out["exact"] = sum(torch.equal(bits(a), bits(b.to(a.device))) for a, b in zip(now, saved))
    return out, saved


def _next_step(
    ctx: Ctx, model: nn.Module, opt: torch.optim.Optimizer, saved: list[torch.Tensor]
) -> list[float]:
    """The next step's loss on the woken model, and on a new one that never slept, given the
    state ``saved`` before the sleep."""
    ref, ref_opt, _ = _model(ctx)
    _step(ref, ref_opt, _batch(ctx, 1))  # AdamW's state exists
    for dst, src in zip(_state(ref, ref_opt), saved, strict=True):
        dst.copy_(src)
    rows = _batch(ctx, 3)
    return [_step(model, opt, rows), _step(ref, ref_opt, rows)]


def _rollout(ctx: Ctx, model: nn.Module) -> list[int]:
    """Unit gathers in :data:`FORWARDS` no-grad forwards: without, then inside the block."""
    ids = _batch(ctx, 4)[:1, :16]
    counts = []
    for block in (contextlib.nullcontext, partial(gathered_for_rollout, model)):
        with record_events() as log, block(), torch.no_grad():
            for _ in range(FORWARDS):
                model(input_ids=ids)
        counts.append(sum(e.kind == "gather_issue" for e in log))
    return counts


def _sync_rows(ctx: Ctx, s: dict[str, Any]) -> list[Row]:
    n, bad, changed = s["numel"], s["differ"], s["changed"]
    cells = {
        m: f"{s[m + '_s'] * 1e3:.2f} ({n * 2 / s[m + '_s'] / 1e9:.1f} GB/s, "
        f"{s[m + '_gathers']} gathers)"
        for m in ("publish", "full_tensor")
    }
    patched = f"NO ({s['delta_differ'][0]}...)" if s["delta_differ"] else "yes"
    return [
        Row(
            "RL weight sync to bf16: publish vs full_tensor() (ms, median)",
            cells["publish"],
            cells["full_tensor"],
            f"{s['publish_s'] / s['full_tensor_s']:.2f}x full_tensor(); Llama {n / 1e9:.3g}B, "
            f"{ctx.args.rl_layers} layers each a unit, into a bf16 receiver on the device, "
            f"median of {ctx.args.rl_repeats}; gathers: at world > 1 (world size 1 sends none)",
            "INFO",
        ),
        Row(
            "RL publish == full_tensor().to(bf16), bit for bit",
            f"{s['weights'] - len(bad)}/{s['weights']} weights equal",
            "(reference)",
            f"differ: {', '.join(bad[:3])}" if bad else "every weight, every bit",
            "FAIL" if bad else "PASS",
        ),
        Row(
            "RL ShardDeltas after 1 AdamW step (ms)",
            f"{s['delta_s'] * 1e3:.2f}",
            "-",
            f"{changed:,} of {n:,} bf16 elements changed ({changed / n:.1%} of the bytes), lr "
            f"{LR:g}; old weights XOR the masks == new weights: {patched}",
            "FAIL" if s["delta_differ"] else "PASS",
        ),
    ]


def _sleep_rows(ctx: Ctx, m: dict[str, Any], losses: list[float], gathers: list[int]) -> list[Row]:
    gib = {k: f"{m[k] / 2**30:.3g}" for k in ("before", "asleep", "woken", "expected", "host")}
    freed = m["before"] - m["asleep"]
    pinned = "pinned" if m["pinned"] else "NOT pinned" if ctx.cuda else "not pinned: CPU run"
    freed_ok = freed >= m["expected"] and (m["pinned"] or not ctx.cuda)
    same, units = losses[0] == losses[1], m["units"]
    return [
        Row(
            f"RL sleep/wake: {'memory_allocated' if ctx.cuda else 'state storages'} before / "
            "asleep / woken (GiB)",
            f"{gib['before']} / {gib['asleep']} / {gib['woken']}",
            f">= {gib['expected']} freed",
            f"freed {freed / 2**30:.3g} (params + AdamW state: {gib['expected']}); sleep "
            f"{m['sleep_s']:.3f} s, wake {m['wake_s']:.3f} s; host copy {gib['host']} GiB, {pinned}",
            "PASS" if freed_ok else "FAIL",
        ),
        Row(
            "RL wake: state bit for bit, next step's loss vs never slept",
            f"{losses[0]:.6g}",
            f"{losses[1]:.6g}",
            f"{m['exact']}/{m['tensors']} parameter and AdamW state tensors bit-exact after wake; "
            f"reference: a new model given the pre-sleep state{'' if same else '; loss DIFFERS'}",
            "PASS" if m["exact"] == m["tensors"] and same else "FAIL",
        ),
        Row(
            f"RL gathered_for_rollout: unit gathers in {FORWARDS} no-grad forwards",
            f"{gathers[1]}",
            f"{gathers[0]} (without it)",
            f"{units} units: each gathered once inside the block (the check), {FORWARDS} times "
            f"without ({FORWARDS * units} expected)",
            "PASS" if gathers[1] == units else "FAIL",
        ),
    ]


def check_rl(ctx: Ctx) -> list[Row]:
    model, opt, units = _model(ctx)
    _step(model, opt, _batch(ctx, 1))  # AdamW's state exists from here
    sync = _sync(ctx, model, opt)
    mem, saved = _sleep_wake(ctx, model, opt)
    losses = _next_step(ctx, model, opt, saved)
    del saved
    gathers = _rollout(ctx, model)
    ctx.details["rl"] = {**sync, **mem, "units": units, "losses": losses, "gathers": gathers}
    return [*_sync_rows(ctx, sync), *_sleep_rows(ctx, ctx.details["rl"], losses, gathers)]
