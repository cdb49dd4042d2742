"""The GPU check's ``graph`` line: a small Llama's whole training step (forward, loss,
backward, ``finalize_backward``) captured with ``torch.cuda.graphs.CUDAGraph`` at world size 1
after warm-up, replayed step after step, and checked bit for bit against the same steps run
eagerly by a second, identical model; both step times.

Both models are fullshard's (the llama-1b shape, ``--graph-layers`` deep, every decoder layer
a unit, bf16 compute: each unit gathers and casts through the packed path), set up by
:func:`fullshard.capture.make_capturable` ([Note: a capturable step] in
``fullshard.engine.kept``). AdamW steps eagerly outside the graph on each, and the gradients
are zeroed in place (``zero_grad(set_to_none=False)``), so the graph adds into the same
gradient memory every replay. Attention runs on SDPA's math backend, whose backward is
deterministic (flash attention's accumulates with atomics), so eager and replay can agree
to the bit. Before capturing, one steady-state step runs under
:func:`fullshard.capture.count_engine_work`: the engine must create no tensor and make no host
wait (the capture-readiness row; warm-up: ``--warmup`` + 2 steps, the last one counted).

On the CPU (``--dry-run``) nothing can be captured: the same code runs up to the capture (the
warm-up and the readiness step), and the "replays" are eager steps of the second model.
"""

from __future__ import annotations

import contextlib
import gc
import statistics
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from gpu_check_common import Ctx, bf16_policy, shard
from gpu_check_llama import llama_config
from gpu_check_report import Row
from torch import nn

from fullshard.capture import count_engine_work, finalize, make_capturable

Step = Callable[[torch.Tensor], torch.Tensor]


def _model(ctx: Ctx) -> nn.Module:
    from fullshard.train import hf

    cfg = llama_config(ctx)
    cfg["num_hidden_layers"] = ctx.args.graph_layers
    torch.manual_seed(0)
    with torch.device(ctx.device):
        model = hf.build(cfg)
    shard(ctx, model, hf.decoder_layers(model), "fullshard", mp_policy=bf16_policy("fullshard"))
    make_capturable(model)
    return model


def _math_attention() -> contextlib.AbstractContextManager[Any]:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([SDPBackend.MATH])


def _stepper(model: nn.Module) -> Step:
    """Forward, loss, backward and finalize on ``rows``; the loss (no host read)."""

    def step(rows: torch.Tensor) -> torch.Tensor:
        with _math_attention():
            logits = model(input_ids=rows[:, :-1]).logits
            loss = F.cross_entropy(logits.float().flatten(0, 1), rows[:, 1:].flatten())
            del logits
            loss.backward()
        finalize(model)
        return loss.detach()

    return step


def _optimize(opt: torch.optim.Optimizer) -> None:
    opt.step()
    opt.zero_grad(set_to_none=False)  # the steady state: the gradients keep their memory


def _eager_run(ctx: Ctx, data: torch.Tensor) -> tuple[list[torch.Tensor], list[float], Any]:
    model = _model(ctx)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    step, losses, times = _stepper(model), [], []
    for rows in data:
        t0 = ctx.sync()
        losses.append(step(rows))
        times.append(ctx.sync() - t0)
        _optimize(opt)
    return losses, times, model


def _warm(
    ctx: Ctx, step: Step, opt: torch.optim.Optimizer, data: torch.Tensor
) -> tuple[list[torch.Tensor], Any]:
    """Eager warm-up steps (on a side stream on CUDA, as capture wants), the last one counted."""
    side = torch.cuda.Stream() if ctx.cuda else None
    if side is not None:
        side.wait_stream(torch.cuda.current_stream())
    out, seen = [], None
    with torch.cuda.stream(side) if side is not None else contextlib.nullcontext():
        for i, rows in enumerate(data):
            counting = count_engine_work() if i == len(data) - 1 else contextlib.nullcontext()
            with counting as counted:
                out.append(step(rows))
            seen = counted
            _optimize(opt)
    if side is not None:
        torch.cuda.current_stream().wait_stream(side)
    return out, seen


def _captured_run(ctx: Ctx, data: torch.Tensor, warm: int) -> dict[str, Any]:
    model = _model(ctx)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    step = _stepper(model)
    losses, seen = _warm(ctx, step, opt, data[:warm])
    static = data[warm].clone()
    if ctx.cuda:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_loss = step(static)
        replay: Callable[[], torch.Tensor] = lambda: (graph.replay(), static_loss)[1]  # noqa: E731
    else:  # no capture on the CPU: each "replay" is the eager step on the static input
        replay = lambda: step(static)  # noqa: E731
    times = []
    for rows in data[warm:]:
        static.copy_(rows)
        t0 = ctx.sync()
        losses.append(replay().clone())
        times.append(ctx.sync() - t0)
        _optimize(opt)
    return {"losses": losses, "times": times, "model": model, "seen": seen}


def _differing(a: nn.Module, b: nn.Module) -> list[str]:
    """Names of the parameters that differ between ``a`` and ``b`` (bit for bit)."""
    sb = b.state_dict()
    return [
        k
        for k, v in a.state_dict().items()
        if not torch.equal(v.full_tensor(), sb[k].full_tensor())
    ]


def check_graph(ctx: Ctx) -> list[Row]:
    a = ctx.args
    # the first step allocates the kept buffers and hands its reduce-scatter outputs over as
    # the gradients; from the second on the gradients exist: the steady state
    warm = a.warmup + 2
    vocab = int(llama_config(ctx)["vocab_size"])
    gen = torch.Generator().manual_seed(3)
    n = warm + a.graph_steps
    data = torch.randint(0, vocab, (n, a.batch, a.seq + 1), generator=gen).to(ctx.device)
    losses, eager_times, eager = _eager_run(ctx, data)
    cap = _captured_run(ctx, data, warm)
    seen = cap["seen"]
    bad_loss = [i for i, (x, y) in enumerate(zip(cap["losses"], losses)) if not torch.equal(x, y)]
    bad_params = _differing(cap["model"], eager)
    ctx.details["graph"] = {"created": seen.created, "syncs": seen.syncs, "losses_differ": bad_loss}
    del cap["model"], eager  # with the graph and its memory pool: give the next checks the GPU
    gc.collect()
    if ctx.cuda:
        torch.cuda.empty_cache()
    ms = {"graph": statistics.median(cap["times"]), "eager": statistics.median(eager_times[warm:])}
    how = "replays" if ctx.cuda else "eager steps standing in for replays (no capture on the CPU)"
    return [
        Row(
            "graph: engine tensors created / host waits in a steady-state step",
            f"{len(seen.created)} / {len(seen.syncs)}",
            "0 / 0",
            f"count_engine_work over step {warm - 1}, {seen.ops} engine ops; "
            f"{(seen.created + seen.syncs)[:3] or 'capture-ready'}",
            "PASS" if not seen.created and not seen.syncs else "FAIL",
        ),
        Row(
            f"graph: {a.graph_steps} captured steps == eager, bit for bit",
            "equal" if not bad_loss and not bad_params else "differ",
            "(eager)",
            f"{how}; losses differing at steps {bad_loss or 'none'}, parameters "
            f"{bad_params[:3] or 'none'}; Llama {a.graph_layers} layers, batch {a.batch} x {a.seq}",
            "PASS" if not bad_loss and not bad_params else "FAIL",
        ),
        Row(
            "graph: step time, captured vs eager (ms, median)",
            f"{ms['graph'] * 1e3:.1f}",
            f"{ms['eager'] * 1e3:.1f} (eager)",
            "forward + loss + backward + finalize; AdamW outside the graph, untimed",
            ("met" if ms["graph"] <= ms["eager"] else "missed") if ctx.cuda else "INFO",
        ),
    ]
