"""Sleep / wake: a trained model's device memory handed back between training steps.

RL post-training alternates a training phase with a rollout phase whose inference engine
(vLLM, SGLang) wants the accelerator's memory. :func:`sleep` moves the trainer's parameters
(each rank's local shards, as they are), gradients, optimizer state and module buffers to
host memory and frees their device memory; :func:`wake` brings every byte back, so training
continues exactly as a run that never slept::

    report = fullshard.rl.sleep(model, optimizer)   # between optimizer.step() and rollout
    print(report)                                   # bytes moved, device memory before/after
    ...                                             # rollout: the device is free
    fullshard.rl.wake(model)                        # same tensors, same values

    with fullshard.rl.asleep(model, optimizer):     # the same, as a context manager
        engine.generate(...)

[Note: sleeping in place]
Nothing is re-created: every tensor keeps its identity (the optimizer's state dict keys, the
``DTensor`` parameters, gradients and the engine's own references stay valid) because what
moves is each tensor's *storage*. For each distinct storage on the compute device, its bytes
are copied into one host buffer (pinned when CUDA is available; on a CPU run a separate
allocation, so the code path is the one CUDA runs; see [Note: one host buffer per model]) and
the storage is resized to 0 bytes —
the same ``resize_`` the engine uses to free unsharded parameters ([Note: why storage is
resized, not freed] in ``fullshard.engine.gather``). Waking resizes each storage back and
copies its bytes in, so the values are bit-exact and version counters are untouched. Views
and storages shared by several tensors (a unit's gradients carved from one slab, tied
weights) move once. The engine's own device memory holds nothing that cannot be rebuilt:
units are resharded, pooled buffers dropped, and a unit's kept unsharded buffer
(``set_keep_unsharded_storage``) is freed and given its size back on wake (its next gather
fills it).

[Note: one host buffer per model]
Pinning gigabytes of host memory takes seconds, longer than the copies, so the host buffer is
allocated once and kept: the model's root unit state holds it (``FSDPState.sleep_host``) from
the first :func:`sleep` on, and every later sleep whose bytes fit reuses it (the report's
``host_reused``); a larger one replaces it. ``wake(model, keep_host=False)`` lets it go. The
cost is the host memory of one sleep kept while awake, which the next sleep needs anyway.

Under CPU offload a unit's shards, gradients and optimizer state already live in host memory:
sleep leaves them where they are (reported as ``on_host``) and moves only what is on the
device (buffers, parameters outside offloaded units).

While asleep the model refuses a forward, a ``state_dict`` and (given the optimizer) a
``step`` with one line naming :func:`wake`. Sleeping is refused in the middle of a forward or
backward, and while gradient reductions are in flight.
"""

from __future__ import annotations

import contextlib
import time
import weakref
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils.hooks import RemovableHandle

from ..engine import FSDPState, ParamGroup, ShardedState, TrainingState, states_under

__all__ = ["SleepReport", "asleep", "is_asleep", "sleep", "wake"]

KINDS = ("params", "grads", "optimizer", "buffers")


@dataclass(frozen=True)
class SleepReport:
    """What one :func:`sleep` or :func:`wake` did on this rank."""

    action: str  # "sleep" | "wake"
    device: torch.device  # the model's compute device
    # bytes copied between the device and host memory, per kind (params, grads, optimizer,
    # buffers); each storage counted once
    moved: Mapping[str, int]
    # bytes of the engine's own device memory freed without a copy (gathered parameters a
    # unit kept, pooled buffers; sleep only): the next gather rebuilds them
    freed: int
    # bytes that already lived in host memory and stayed there (CPU offload), per kind
    on_host: Mapping[str, int]
    pinned: bool  # the host copy is pinned memory (CUDA available)
    # bytes of the model's storages on the device, before and after
    device_bytes_before: int
    device_bytes_after: int
    # ``torch.cuda.memory_allocated`` before and after (None off CUDA)
    allocated_before: int | None = None
    allocated_after: int | None = None
    seconds: float = 0.0
    kept: int = 0  # bytes on the device that could not be freed (a non-resizable storage)
    # the host buffer of an earlier sleep held these bytes ([Note: one host buffer per model])
    host_reused: bool = False

    @property
    def moved_bytes(self) -> int:
        """Bytes copied in all."""
        return sum(self.moved.values())

    def __str__(self) -> str:
        moved = ", ".join(f"{k} {_mib(v)}" for k, v in self.moved.items() if v)
        host = ", ".join(f"{k} {_mib(v)}" for k, v in self.on_host.items() if v)
        return (
            f"{self.action} on {self.device}: moved {moved or 'nothing'}"
            f"{f'; already in host memory: {host}' if host else ''}; device memory of the "
            f"model {_mib(self.device_bytes_before)} -> {_mib(self.device_bytes_after)}"
            f" ({self.seconds * 1e3:.1f} ms{', pinned' if self.pinned else ''})"
        )


def _mib(n: int) -> str:
    return f"{n / 2**20:.2f} MiB"


@dataclass
class _Moved:
    """One storage that sleeps: its bytes live at ``host[offset : offset + nbytes]``."""

    storage: torch.UntypedStorage
    nbytes: int
    offset: int


@dataclass
class _Sleeping:
    """What a sleeping model holds until :func:`wake`."""

    device: torch.device
    host: torch.Tensor  # 1-D uint8, every moved storage back to back (a prefix of the buffer)
    moved: list[_Moved]
    freed: list[tuple[torch.UntypedStorage, int]]  # engine buffers: given their size back
    kinds: dict[str, int]
    guards: list[RemovableHandle] = field(default_factory=list)


_ASLEEP: weakref.WeakKeyDictionary[nn.Module, _Sleeping] = weakref.WeakKeyDictionary()


# ------------------------------------------------------------------------------- public API
def is_asleep(model: nn.Module) -> bool:
    """Whether :func:`sleep` was called on ``model`` and :func:`wake` not yet."""
    return model in _ASLEEP


def sleep(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    params: bool = True,
    empty_cache: bool = True,
) -> SleepReport:
    """Move ``model``'s parameters, gradients, buffers and ``optimizer``'s state to host
    memory and free their device memory ([Note: sleeping in place]).

    ``model`` is the root ``fully_shard`` module (or any module holding the units). With
    ``params=False`` the parameters and buffers stay (a rollout on the actor itself frees only
    the gradients and optimizer state). ``empty_cache``: hand the freed blocks back to the
    driver too (``torch.cuda.empty_cache``), for another process (the inference engine) to
    use. Returns what moved; :func:`wake` brings it back.
    """
    states = _root_states(model, "sleep")
    if model in _ASLEEP:
        raise RuntimeError(
            f"{type(model).__name__} is already asleep: call fullshard.rl.wake(model) first"
        )
    _check_between_steps(states)
    device = states[0].group.device
    allocated_before = _allocated(device)
    start = time.perf_counter()
    for st in states:  # gathered parameters are rebuilt by the next gather
        if st.group.state is not ShardedState.SHARDED:
            st.group.reshard()
    _drop_pooled(states)
    plan = _Plan(device)
    _collect(plan, model, states, optimizer, params)
    freed = _engine_buffers(states)
    before = plan.device_bytes() + sum(n for _, n in freed)
    root = states[0]
    reused = root.sleep_host is not None and root.sleep_host.numel() >= plan.host_bytes()
    if not reused:
        root.sleep_host = None  # the old buffer goes before the new one is pinned
        root.sleep_host = _host_buffer(plan.host_bytes())
    assert root.sleep_host is not None
    asleep_ = plan.copy_out(root.sleep_host)
    for storage, _ in freed:
        storage.resize_(0)
    asleep_.freed = freed
    asleep_.guards = _guards(model, optimizer, params)
    _ASLEEP[model] = asleep_
    if empty_cache and device.type == "cuda":
        torch.cuda.empty_cache()
    return SleepReport(
        "sleep",
        device,
        dict(plan.kinds),
        sum(n for _, n in freed),
        dict(plan.on_host),
        asleep_.host.is_pinned(),
        before,
        plan.kept,
        allocated_before,
        _allocated(device),
        time.perf_counter() - start,
        plan.kept,
        reused,
    )


def wake(model: nn.Module, *, keep_host: bool = True) -> SleepReport:
    """Bring back everything :func:`sleep` moved, bit for bit, into the same tensors.

    ``keep_host``: keep the host buffer for the next sleep ([Note: one host buffer per
    model]); ``False`` frees it."""
    asleep_ = _ASLEEP.pop(model, None)
    if asleep_ is None:
        raise RuntimeError(
            f"{type(model).__name__} is not asleep: fullshard.rl.wake(model) undoes "
            f"fullshard.rl.sleep(model, ...)"
        )
    device = asleep_.device
    allocated_before = _allocated(device)
    start = time.perf_counter()
    for handle in asleep_.guards:
        handle.remove()
    pinned = asleep_.host.is_pinned()
    last = len(asleep_.moved) - 1
    for i, m in enumerate(asleep_.moved):
        m.storage.resize_(m.nbytes)
        # non-blocking from pinned memory, but the last copy blocks: when it returns, every
        # copy queued before it on the stream has landed and the host buffer may go
        _bytes_of(m.storage).copy_(
            asleep_.host[m.offset : m.offset + m.nbytes], non_blocking=pinned and i < last
        )
    for storage, nbytes in asleep_.freed:
        storage.resize_(nbytes)
    if not keep_host:
        states_under([model])[0].sleep_host = None
    total = sum(m.nbytes for m in asleep_.moved)
    return SleepReport(
        "wake",
        device,
        dict(asleep_.kinds),
        0,
        {},
        pinned,
        0,
        total + sum(n for _, n in asleep_.freed),
        allocated_before,
        _allocated(device),
        time.perf_counter() - start,
    )


@contextlib.contextmanager
def asleep(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    params: bool = True,
    empty_cache: bool = True,
) -> Iterator[SleepReport]:
    """:func:`sleep` on entry (yielding its report) and :func:`wake` on exit, also when the
    block raises."""
    report = sleep(model, optimizer, params=params, empty_cache=empty_cache)
    try:
        yield report
    finally:
        wake(model)


# ------------------------------------------------------------------------------ the checks
def _root_states(model: nn.Module, what: str) -> list[FSDPState]:
    """The units under ``model``; refuses a model with none, or a unit inside a larger root."""
    states = states_under([model])
    if not states:
        raise ValueError(
            f"fullshard.rl.{what}: {type(model).__name__} holds no fully_shard unit; call it "
            f"on the module fully_shard was applied to last"
        )
    outer = states[0].outermost()
    if outer not in states:
        raise ValueError(
            f"fullshard.rl.{what}: unit {states[0].name!r} is inside a larger fully_shard "
            f"root; call it on the root module (the one fully_shard was applied to last)"
        )
    return states


def _check_between_steps(states: list[FSDPState]) -> None:
    """Refuse in the middle of a forward or backward, or with reductions in flight."""
    if torch._C._current_graph_task_id() != -1:
        raise RuntimeError(
            "fullshard.rl.sleep was called during a backward; call it between steps "
            "(after optimizer.step())"
        )
    busy = [st for st in states if st.training_state is not TrainingState.IDLE]
    if busy:
        st = busy[0]
        raise RuntimeError(
            f"fullshard.rl.sleep was called in the middle of a forward or backward (unit "
            f"{st.name!r} is in {st.training_state.value}); call it between steps (after "
            f"optimizer.step())"
        )
    ctx = states[0].ctx
    if ctx is not None and (ctx.pending or ctx.replicating or ctx.backward_task is not None):
        raise RuntimeError(
            "fullshard.rl.sleep: gradient reductions are still in flight (a backward with "
            "set_is_last_backward(False) or manual finalization); finish the step first"
        )


def _drop_pooled(states: list[FSDPState]) -> None:
    """The CPU's pooled buffers (fullshard.engine.host) hold freed memory only, and the comm
    buffers kept for a capturable step are scratch (made again by the next step)."""
    ctx = states[0].ctx
    host = ctx.host if ctx is not None else None
    if host is not None and host.pool is not None:
        host.pool.clear()
    for st in states:
        for g in (st.group, *st.group.subgroups):
            g.kept.clear()


def _engine_buffers(states: list[FSDPState]) -> list[tuple[torch.UntypedStorage, int]]:
    """Unsharded memory a sharded unit still holds (``set_keep_unsharded_storage``)."""
    out: list[tuple[torch.UntypedStorage, int]] = []
    seen: set[int] = set()

    def visit(g: ParamGroup) -> None:
        tensors = [g.unsharded_buf] + [sp.unsharded_data for sp in g.layout]
        for t in tensors:
            if t is None:
                continue
            storage = t.untyped_storage()
            if storage.nbytes() and storage._cdata not in seen and storage.resizable():
                seen.add(storage._cdata)
                out.append((storage, storage.nbytes()))
        for child in g.subgroups:
            visit(child)

    for st in states:
        visit(st.group)
    return out


# ------------------------------------------------------------------------------- the plan
class _Plan:
    """The distinct device storages to move, by kind, and what stays in host memory."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.storages: list[torch.UntypedStorage] = []
        self.kinds = dict.fromkeys(KINDS, 0)
        self.on_host = dict.fromkeys(KINDS, 0)
        self.kept = 0
        self._seen: set[int] = set()

    def add(self, kind: str, tensor: torch.Tensor | None, offloaded: bool = False) -> None:
        if tensor is None:
            return
        if isinstance(tensor, DTensor):
            tensor = tensor._local_tensor
        storage = tensor.untyped_storage()
        key, nbytes = storage._cdata, storage.nbytes()
        if key in self._seen or not nbytes:
            return
        self._seen.add(key)
        if offloaded:
            self.on_host[kind] += nbytes
        elif tensor.device != self.device:
            return  # on another device (a CPU step counter of a CUDA optimizer)
        elif not storage.resizable():
            self.kept += nbytes
        else:
            self.storages.append(storage)
            self.kinds[kind] += nbytes

    def device_bytes(self) -> int:
        return sum(s.nbytes() for s in self.storages) + self.kept

    def host_bytes(self) -> int:
        """Bytes the host buffer needs."""
        return sum(s.nbytes() for s in self.storages)

    def copy_out(self, buffer: torch.Tensor) -> _Sleeping:
        """Copy every storage into ``buffer`` (1-D uint8 host memory, at least
        :meth:`host_bytes`), then free the device storages."""
        host = buffer[: self.host_bytes()]
        pin = host.is_pinned()
        moved, offset = [], 0
        last = len(self.storages) - 1
        for i, storage in enumerate(self.storages):
            n = storage.nbytes()
            # the last copy blocks, so every earlier non-blocking one has landed after it
            host[offset : offset + n].copy_(_bytes_of(storage), non_blocking=pin and i < last)
            moved.append(_Moved(storage, n, offset))
            offset += n
        for m in moved:
            m.storage.resize_(0)
        return _Sleeping(self.device, host, moved, [], dict(self.kinds))


def _collect(
    plan: _Plan,
    model: nn.Module,
    states: list[FSDPState],
    optimizer: torch.optim.Optimizer | None,
    params: bool,
) -> None:
    """Every tensor that sleeps, by kind: the units' shards and gradients (and what a unit
    accumulates unreduced), the optimizer's state, then the model's other parameters and
    buffers."""
    offloaded: dict[int, bool] = {}
    for st in states:
        for g in (st.group, *st.group.subgroups):
            for sp in g.params:
                offloaded[id(sp.sharded_param)] = g.offloaded
                if params:
                    plan.add("params", sp.local, g.offloaded)
                plan.add("grads", sp.sharded_param.grad, g.offloaded)
                plan.add("grads", sp.unsharded_accum_grad)
            plan.add("grads", g.partial.total)
    if optimizer is not None:
        for p, state in optimizer.state.items():
            for value in state.values():
                if isinstance(value, torch.Tensor):
                    plan.add("optimizer", value, offloaded.get(id(p), False))
    if params:
        for p in model.parameters():
            if id(p) not in offloaded:
                plan.add("params", p)
                plan.add("grads", p.grad)
        for b in model.buffers():
            plan.add("buffers", b)


def _host_buffer(nbytes: int) -> torch.Tensor:
    """A 1-D uint8 host buffer of ``nbytes``, pinned when CUDA is available (pinned memory only
    exists with an accelerator)."""
    pin = torch.cuda.is_available()
    return torch.empty(nbytes, dtype=torch.uint8, device="cpu", pin_memory=pin)


def _bytes_of(storage: torch.UntypedStorage) -> torch.Tensor:
    """A 1-D uint8 tensor over all of ``storage`` (valid across its resizes)."""
    out = torch.empty(0, dtype=torch.uint8, device=storage.device)
    return out.set_(storage, 0, (storage.nbytes(),), (1,))  # type: ignore[call-overload]


def _allocated(device: torch.device) -> int | None:
    return torch.cuda.memory_allocated(device) if device.type == "cuda" else None


# ------------------------------------------------------------------------------- guards
def _guards(
    model: nn.Module, optimizer: torch.optim.Optimizer | None, params: bool
) -> list[RemovableHandle]:
    """Refuse what would read freed memory while the model sleeps."""
    name = type(model).__name__

    def refuse(what: str) -> Any:
        def hook(*_: Any, **__: Any) -> None:
            raise RuntimeError(
                f"{name} is asleep ({what} would read freed memory): call "
                f"fullshard.rl.wake(model) first"
            )

        return hook

    out = []
    if params:
        out.append(model.register_forward_pre_hook(refuse("a forward"), prepend=True))
        out.append(model.register_state_dict_pre_hook(refuse("state_dict()")))
    if optimizer is not None:
        out.append(optimizer.register_step_pre_hook(refuse("optimizer.step()")))
    return out
