"""Predict per-rank peak memory of a fully sharded training step before launching it.

[Note: how the plan is made]
A step's memory is the sum of two parts that the planner gets in different ways.

1. Activations and a unit's unsharded gradients are *measured*: the unsharded model is built
   under ``FakeTensorMode`` (no storage is allocated; shapes, dtypes and the CPU/GPU kernel
   choices such as SDPA's are the real ones) and one forward + backward runs at the per-rank
   micro-batch under :class:`~fullshard.memory.tracker.LiveTensorBytes`. Parameters are counted
   apart; each gradient is tagged when accumulated and dropped once its whole unit has its
   gradients — the moment a fully sharded engine reduce-scatters and frees them. Module hooks
   cut the run into segments (``forward blocks.3``, ``backward blocks.3``, ...) and record the
   live bytes at each segment's start, its peak, and at each unit's reduce-scatter.
2. Model states and engine buffers are *computed* per segment from the units' shapes: sharded
   parameters, sharded gradients (only after the unit's reduce-scatter; ``zero_grad`` frees them),
   optimizer states, the gathered units (the current one, the root — never resharded after
   forward — and the prefetched ones), the transient all-gather/reduce-scatter buffers, and the
   optimizer's temporaries. How an engine holds those buffers is an :class:`EngineModel`.

The peak is the maximum over the segments' events; the event and its breakdown are reported.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from fullshard.engine import BackendPlan
from fullshard.memory.ac import checkpointed
from fullshard.memory.cost import OpCost
from fullshard.memory.engines import ENGINES, EngineModel
from fullshard.memory.layers import TRACED_BLOCKS, block_count, expand, with_blocks
from fullshard.memory.spec import OPTIMIZER_STATES, Event, Plan, PlanSpec, Segment, Unit
from fullshard.memory.tracker import LiveTensorBytes
from fullshard.models import GPT

__all__ = [
    "ENGINES",
    "EngineModel",
    "Event",
    "Plan",
    "PlanSpec",
    "Segment",
    "Unit",
    "build_model",
    "find_units",
    "plan",
    "trace_activations",
]

# ---- model construction and the fake step --------------------------------------------------


def build_model(spec: PlanSpec) -> nn.Module:
    """The unsharded model (call under ``FakeTensorMode`` to allocate nothing)."""
    if spec.model is not None:
        return GPT(spec.model)
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = spec.hf_config
    if isinstance(cfg, (str, os.PathLike)):
        cfg = AutoConfig.from_pretrained(str(cfg), local_files_only=True)
    model = AutoModelForCausalLM.from_config(cfg)
    model.config.use_cache = False  # training: no KV cache (it would grow in AC's recompute)
    return model


def find_units(model: nn.Module, how: str) -> list[tuple[str, nn.Module]]:
    """``[(name, module)]``: the root first, then the repeated blocks (the longest ModuleList)."""
    if how == "model":
        return [("root", model)]
    best: tuple[str, nn.ModuleList] | None = None
    for name, mod in model.named_modules():
        if isinstance(mod, nn.ModuleList) and len(mod) > (len(best[1]) if best else 1):
            best = (name, mod)
    if best is None:
        return [("root", model)]
    return [("root", model)] + [(f"{best[0]}.{i}", m) for i, m in enumerate(best[1])]


def _unit_shapes(units: list[tuple[str, nn.Module]]) -> list[Unit]:
    seen: set[int] = set()
    out: list[list[tuple[int, ...]]] = []
    for _, mod in reversed(units):  # blocks claim their parameters first; the root the rest
        out.append([])
        for p in mod.parameters():
            if id(p) not in seen and p.requires_grad:
                seen.add(id(p))
                out[-1].append(tuple(p.shape))
    return [Unit(name=n, shapes=s) for (n, _), s in zip(units, reversed(out))]


def _logits(out: Any) -> torch.Tensor:
    return out if isinstance(out, torch.Tensor) else out.logits


def trace_activations(spec: PlanSpec) -> tuple[list[Unit], list[Segment], int]:
    """Run one fake forward+backward; return the units, the segments and the parameter count."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    traced, n_blocks = spec, None
    if spec.units == "block" and spec.max_traced_blocks:
        hf_cfg = spec.hf_config
        if isinstance(hf_cfg, (str, os.PathLike)):
            from transformers import AutoConfig

            hf_cfg = AutoConfig.from_pretrained(str(hf_cfg), local_files_only=True)
        n = block_count(spec.model, hf_cfg)
        if n is not None and n > max(spec.max_traced_blocks, TRACED_BLOCKS):
            model_cfg, hf_cfg = with_blocks(spec.model, hf_cfg, TRACED_BLOCKS)
            traced, n_blocks = dataclasses.replace(spec, model=model_cfg, hf_config=hf_cfg), n
    with FakeTensorMode(), _default_dtype(spec.param_dtype), _hf_eager_masks(traced.hf_config):
        model = build_model(traced)
        named = find_units(model, spec.units)
        units = _unit_shapes(named)
        for u in units:
            u.pad(spec.shard_size)
        vocab = _vocab(model)
        x = torch.randint(0, vocab, (spec.batch, spec.seq))
        y = torch.randint(0, vocab, (spec.batch, spec.seq))
        segments = _run_fake(spec, model, named, units, x, y)
    if n_blocks is not None:
        units, segments = expand(units, segments, n_blocks)
    n_params = sum(u.numel for u in units)
    return units, segments, n_params


@contextlib.contextmanager
def _hf_eager_masks(hf_config: Any) -> Iterator[None]:
    """Let Hugging Face models take the path a real eager run takes. ``transformers`` treats a
    fake tensor as graph tracing and then builds an explicit [b, 1, s, s] causal mask instead
    of calling SDPA with ``is_causal=True`` (its eager choice for unpadded training batches),
    which would make the traced step cost what a GPU run does not (a masked, non-flash
    kernel, the mask's bytes, no causal skip in the time model)."""
    if hf_config is None:
        yield
        return
    try:
        import transformers.masking_utils as mu
    except ImportError:  # an older transformers: nothing to adjust
        yield
        return
    orig = getattr(mu, "_ignore_causal_mask_sdpa", None)
    if orig is None:
        yield
        return

    def eager(padding_mask: Any, q_length: int, kv_length: int, *args: Any, **kwargs: Any) -> bool:
        local = kwargs.get("local_attention_size", args[2] if len(args) > 2 else None)
        if padding_mask is None and (local is None or kv_length < local):
            if q_length == 1 or kv_length == q_length:  # what the eager check decides
                return True
        return bool(orig(padding_mask, q_length, kv_length, *args, **kwargs))

    packed = getattr(mu, "find_packed_sequence_indices", None)
    mu._ignore_causal_mask_sdpa = eager
    if packed is not None:  # the planner's batches are whole sequences, never packed
        mu.find_packed_sequence_indices = lambda *a, **k: None
    try:
        yield
    finally:
        mu._ignore_causal_mask_sdpa = orig
        if packed is not None:
            mu.find_packed_sequence_indices = packed


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    """Build the model directly in the compute dtype (``.to()`` cannot swap fake parameters)."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def _vocab(model: nn.Module) -> int:
    cfg = getattr(model, "cfg", None) or getattr(model, "config", None)
    return int(getattr(cfg, "vocab_size", 256))


def _width(model: nn.Module) -> int:
    cfg = getattr(model, "cfg", None) or getattr(model, "config", None)
    for name in ("d_model", "hidden_size", "n_embd"):
        if isinstance(getattr(cfg, name, None), int):
            return int(getattr(cfg, name))
    return 0


F32 = 4  # bytes of an fp32 element (master weights, gradient shards, states)


def _run_fake(
    spec: PlanSpec,
    model: nn.Module,
    named: list[tuple[str, nn.Module]],
    units: list[Unit],
    x: torch.Tensor,
    y: torch.Tensor,
) -> list[Segment]:
    """One forward and backward of ``model`` on fake tensors, cut into segments at unit
    boundaries (see :class:`_SegmentRecorder`)."""
    return _SegmentRecorder(spec, model, named).run(x, y)


class _SegmentRecorder:
    """Live bytes and op costs of one fake step, one :class:`Segment` per stretch between unit
    boundaries (a unit's forward, its backward, the root between them, the loss); a unit's
    gradients are freed (reduced) when the last one of them is accumulated."""

    def __init__(self, spec: PlanSpec, model: nn.Module, named: list[tuple[str, nn.Module]]):
        self.spec, self.model, self.named = spec, model, named
        self.width, self.tokens = _width(model), spec.batch * spec.seq
        self.tracker = LiveTensorBytes(
            classify=lambda t: "hidden" if self._is_hidden(t) else "other"
        )
        self.cost = OpCost(classify=self._is_hidden, on_matmul_input=self._gathered)
        self.segments: list[Segment] = []
        self.owner: dict[int, int] = {}  # id(param) -> unit index
        for i, (_, mod) in reversed(list(enumerate(named))):
            for p in mod.parameters():
                self.owner.setdefault(id(p), i)
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.by_unit: dict[int, list[nn.Parameter]] = {i: [] for i in range(len(named))}
        for p in self.params:
            self.by_unit[self.owner[id(p)]].append(p)
        self.pending = {i: len(ps) for i, ps in self.by_unit.items()}
        self.mark = self.cost.totals()

    def _is_hidden(self, t: torch.Tensor) -> bool:
        """A residual-stream-shaped tensor ([b, s, d] or [b*s, d])."""
        return t.dim() >= 2 and t.shape[-1] == self.width and t.numel() == self.tokens * self.width

    def _gathered(self, t: torch.Tensor) -> None:
        """A matmul reads this residual-stream tensor: under sequence parallelism it is the
        all-gathered, full-length copy (what a column-parallel linear saves), not a shard."""
        self.tracker.recategorize(t, "hidden", "gathered")

    def _live(self) -> int:
        return self.tracker.current - self.tracker.by_category.get("param", 0)

    def _grads(self) -> int:
        return self.tracker.by_category.get("grad", 0)

    def _hidden(self) -> int:
        return self.tracker.by_category.get("hidden", 0)

    def _close(self) -> None:
        """The ops since the last segment began are the last segment's."""
        now = self.cost.totals()
        if self.segments:
            seg = self.segments[-1]
            d = [a - b for a, b in zip(now, self.mark)]
            seg.mm_flops, seg.attn_flops = seg.mm_flops + d[0], seg.attn_flops + d[1]
            seg.mem_bytes, seg.hidden_mem_bytes = seg.mem_bytes + d[2], seg.hidden_mem_bytes + d[3]
            seg.mm_operand_bytes += d[4]
            seg.causal_attn_flops += d[5]
        self.mark = now

    def _begin(self, label: str, unit: int, phase: str) -> None:
        self._close()
        now, g, h = self._live(), self._grads(), self._hidden()
        last = self.segments[-1] if self.segments else None
        after = unit if unit > 0 else (last.after if last and last.phase == phase else 0)
        seg = Segment(
            label=label,
            unit=unit,
            phase=phase,
            after=after,
            start=now,
            start_grads=g,
            start_hidden=h,
        )
        seg.peak, seg.peak_grads, seg.peak_hidden = now, g, h
        self.segments.append(seg)

    def _on_op(self, t: LiveTensorBytes) -> None:
        seg = self.segments[-1]
        now = self._live()
        if now > seg.peak:
            seg.peak, seg.peak_grads, seg.peak_hidden = now, self._grads(), self._hidden()

    def _reduce_point(self) -> None:
        seg = self.segments[-1]
        self._on_op(self.tracker)
        seg.reduce_at, seg.reduce_grads, seg.reduce_hidden = (
            self._live(),
            self._grads(),
            self._hidden(),
        )

    def _accumulated(self, p: torch.Tensor) -> None:
        i = self.owner[id(p)]
        self.tracker.set_category(p.grad, "grad")  # type: ignore[arg-type]
        self.pending[i] -= 1
        if self.pending[i] == 0 and i != 0:  # the unit's gradients are all here: reduce, free
            self._reduce_point()
            for q in self.by_unit[i]:
                q.grad = None
            self._begin("backward root", 0, "backward")

    def _enter(self, label: str, unit: int, phase: str) -> Callable[..., None]:
        def hook(*_: Any) -> None:
            self._begin(label, unit, phase)

        return hook

    def _hooks(self) -> list[Any]:
        handles: list[Any] = []
        for i, (name, mod) in enumerate(self.named):
            if i == 0:
                continue
            handles.append(
                mod.register_forward_pre_hook(self._enter(f"forward {name}", i, "forward"))
            )
            handles.append(mod.register_forward_hook(self._enter("forward root", 0, "forward")))
            handles.append(
                mod.register_full_backward_pre_hook(self._enter(f"backward {name}", i, "backward"))
            )
        for p in self.params:
            handles.append(p.register_post_accumulate_grad_hook(self._accumulated))
        return handles

    def run(self, x: torch.Tensor, y: torch.Tensor) -> list[Segment]:
        handles = self._hooks()
        blocks = [m for _, m in self.named[1:]]
        try:
            with self.tracker, self.cost, checkpointed(blocks, self.spec.ac_mode):
                self.tracker.track(self.params, "param")
                self.tracker.on_op = self._on_op
                self._begin("forward root", 0, "forward")
                logits = _logits(self.model(x))
                self._begin("loss", -1, "forward")
                loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), y.reshape(-1))
                del logits
                self._begin("backward root", 0, "backward")
                loss.backward()
                del loss
                self._reduce_point()
                self._close()
        finally:
            for h in handles:
                h.remove()
        return self.segments


# ---- the timeline ----------------------------------------------------------------------------


def plan(spec: PlanSpec) -> Plan:
    """Predict the per-rank memory timeline of one steady-state training step."""
    units, segments, n_params = trace_activations(spec)
    events = _timeline(spec, units, segments)
    return Plan(spec=spec, units=units, events=events, n_params=n_params, segments=segments)


def _timeline(spec: PlanSpec, units: list[Unit], segments: list[Segment]) -> list[Event]:
    """The memory events of one step: per segment, the all-gathers entering it, its peak and
    its reduce-scatter, then the optimizer step (see :class:`_Timeline`)."""
    timeline = _Timeline(spec, units)
    for seg in segments:
        timeline.add(seg)
    return timeline.events + [timeline.optimizer_step()]


class _Timeline:
    """Walks the segments of one step, keeping what the engine holds between them: the
    gathered units, the reductions in flight and the gradient shards so far."""

    def __init__(self, spec: PlanSpec, units: list[Unit]) -> None:
        self.spec, self.units = spec, units
        self.eng = eng = ENGINES[spec.engine]
        self.pbytes = torch.empty((), dtype=spec.param_dtype).element_size()
        self.host = "host:" if spec.offload else ""
        self.shard = sum(u.shard_numel for u in units) * F32
        self.n_states = OPTIMIZER_STATES[spec.optimizer]
        unit_bytes = [u.padded_numel * self.pbytes for u in units]
        # [Note: a window for small units] in fullshard.engine.window: fullshard's backend plan
        # on the CPU gathers and reduces small units further ahead ([Note: the backend plan])
        self.window = (
            BackendPlan.choose(eng.transport[1], eng.transport[0]).window_bytes
            if eng.transport
            else 0
        )
        # The engine aliases a unit's unsharded parameters to its shards when the two would be
        # the same tensors: one rank, compute in the masters' dtype, no offload, no replicas.
        aliasable = spec.param_dtype == torch.float32 and not spec.offload and spec.world_size == 1
        self.per_unit = [eng.for_unit(spec.shard_size, b, aliasable=aliasable) for b in unit_bytes]
        # new bytes held per unit gathered
        self.gathered = [0 if e.aliases else b for e, b in zip(self.per_unit, unit_bytes)]
        n = len(units)
        self.orders = {"forward": list(range(n)), "backward": [0] + list(range(n - 1, 0, -1))}
        self.reduced: set[int] = set()  # units whose gradients are already reduced (sharded)
        self.ever: set[int] = set()  # units gathered so far in this step
        self.was: set[int] = set()  # units gathered during the previous segment
        self.pending = 0  # a reduce-scatter input still alive (EngineModel.reduce_pending)
        # the window's reductions: (unit bytes, input bytes)
        self.in_flight: list[tuple[int, int]] = []
        self.alive = 0  # the input bytes of those not counted in ``pending``
        self.events: list[Event] = []

    def held(self, seg: Segment) -> set[int]:
        """Units gathered during ``seg``: the root (gathered from the model's pre-forward to
        its post-forward, and from its pre-backward to the end), the computing unit, and the
        units prefetched ahead of it."""
        eng = self.eng
        if seg.unit < 0:  # the loss, between the model's forward and backward
            out: set[int] = set()
        else:
            order = self.orders[seg.phase]
            ahead = eng.forward_prefetch if seg.phase == "forward" else eng.backward_prefetch
            k = order.index(seg.after)
            lo = k if seg.unit > 0 else k + 1
            end, extra = k + 1 + ahead, 0
            while ahead and end < len(order):  # the small units gathered further ahead
                extra += self.gathered[order[end]]
                if extra > self.window:
                    break
                end += 1
            out = {0, *order[lo:end]}
        if not self.spec.reshard_after_forward:  # what was gathered once stays until backward
            out |= self.ever - self.reduced
            self.ever.update(out)
        return out

    def _act(self, live: int, grads: int, hidden: int) -> int:
        """Activation bytes; sequence parallelism shards the residual stream's over TP."""
        return live - grads - hidden + hidden // self.spec.tp

    def _event(self, label: str, gath: int, comm: int, at: tuple[int, int, int]) -> None:
        live, grads, hidden = at
        host = self.host
        ev = {
            f"{host}sharded params": self.shard,
            f"{host}sharded grads": sum(self.units[i].shard_numel * F32 for i in self.reduced),
            f"{host}optimizer states": self.n_states * self.shard,
            "gathered units": gath,
            "comm buffers": comm,
            "activations": self._act(live, grads, hidden),
            "unsharded grads": grads,
        }
        self.events.append(Event(label, ev))

    def add(self, seg: Segment) -> None:
        """The events of ``seg``: the all-gathers entering it, its peak, its reduce-scatter."""
        now = self.held(seg)
        gath = sum(self.gathered[i] for i in now)
        new = now - self.was
        if new:  # all-gathers issued on entering this segment
            extra = sum(self.gathered[i] for i in new if self.per_unit[i].copy_out)
            low_precision = self.spec.param_dtype != torch.float32
            for i in new:  # the shard sent, where it is a separate (packed, cast) copy
                if self.eng.gather_input_copy or (low_precision and self.per_unit[i].copy_out):
                    extra += self.units[i].shard_numel * self.pbytes
            names = ", ".join(self.units[i].name for i in sorted(new))
            start = (seg.start, seg.start_grads, seg.start_hidden)
            comm = extra + self.pending + self.alive
            self._event(f"all-gather of {names} (entering {seg.label})", gath, comm, start)
        self.was = now
        peak = (seg.peak, seg.peak_grads, seg.peak_hidden)
        self._event(seg.label, gath, self.pending + self.alive, peak)
        if seg.reduce_at is not None:
            self._reduce(seg, gath)

    def _reduce(self, seg: Segment, gath: int) -> None:
        spec, u, engine_unit = self.spec, self.units[seg.unit], self.per_unit[seg.unit]
        # Full gradients and the packed reduce-scatter input coexist for the copy-in; the new
        # gradient shard is the output.
        send = u.padded_numel * self.pbytes
        if engine_unit.reduce_from_grads and spec.param_dtype != torch.float16:
            send = 0
        out = u.shard_numel * F32
        if engine_unit.aliases:  # the gradients are the shards' gradients
            send = out = 0
        # make_room: earlier reductions stay in flight while those beyond the first (and this
        # one) fit the window
        in_flight = self.in_flight
        while (
            in_flight and sum(b for b, _ in in_flight[1:]) + self.gathered[seg.unit] > self.window
        ):
            in_flight.pop(0)
        earlier = sum(s for _, s in in_flight)
        at = (seg.reduce_at or 0, seg.reduce_grads, seg.reduce_hidden)
        comm = self.pending + earlier + send + out
        self._event(f"reduce-scatter of {u.name}", gath, comm, at)
        self.reduced.add(seg.unit)  # its output buffer is now the gradient shards
        self.pending = send if self.eng.reduce_pending and seg.unit != 0 else 0
        in_flight.append((self.gathered[seg.unit], send))
        self.alive = sum(s for _, s in in_flight[:-1])  # the newest, as ever, not counted
        if seg.unit != 0 or spec.reshard_after_forward:
            self.was = self.was - {seg.unit}

    def optimizer_step(self) -> Event:
        """All gradient shards, states, and per-parameter temporaries (AdamW's single-tensor
        path builds sqrt(v) and its scaled copy before the update)."""
        temps = (2 if self.n_states == 2 else 0) * max(u.largest_shard_numel for u in self.units)
        host = self.host
        ev = {
            f"{host}sharded params": self.shard,
            f"{host}sharded grads": self.shard,
            f"{host}optimizer states": self.n_states * self.shard,
            "optimizer temporaries": temps * F32,
        }
        return Event("optimizer step", ev)
