"""Stream-order checking on the CPU: the engine's stream and event calls, recorded and checked.

[Note: checking stream order on the CPU]
On CUDA the engine issues collectives on side streams and relies on a few waits for every
buffer's safety ([Note: streams and buffer lifetimes] in ``fullshard.engine.streams``):

1. a side stream waits for the compute stream before its work (``CommStreams.use``), so a
   collective sees the buffer the compute stream just filled;
2. the compute stream waits for a collective before using its result (``Handle.wait``, which
   on NCCL makes the current stream wait for the work: ``Handle._order_after`` here);
3. a buffer is freed (its storage resized to 0, or handed to the pool) only after the waits
   above, on the compute stream;
4. under CPU offload the host reads a gradient shard only after its device-to-host copy on the
   offload stream has landed (``CommStreams.wait_host_copies``: at the end of backward, and at
   once where the shard is added into an existing gradient or a hook reads it); on the CPU
   the copy runs while a checker records ([Note: the offload copy on the CPU] in
   ``fullshard.engine.streams``).

On the CPU there are no streams, so nothing would check these rules. The engine's stream
calls are the same lines on every device ([Note: the stream interface] in
``fullshard.engine.streams``): on the CPU they are made on :class:`LogicalStream` and
:class:`LogicalEvent` objects ([Note: logical streams]), which report to the active
:class:`StreamChecker` while :func:`check_streams` records (and do nothing otherwise). The
checker keeps a vector clock per stream (each op ticks its stream; a wait merges the waited
stream's clock into the waiter's), and a
``TorchDispatchMode`` notes which stream reads and writes each storage (collectives from
c10d's ops: their output tensors are written; a storage deallocated leaves no history to a new
one the allocator puts at its address). It reports

- a read or write of a storage on one stream after a write (or, for a write, a read) on
  another with no wait ordering them;
- a storage freed while another stream's use of it is not ordered before the free (a free:
  :func:`freed`, which names what is freed, or any ``UntypedStorage.resize_(0)`` in the block).

The parity matrix runs once under the checker in CI (``tests/test_stream_order.py``), and
``tests/test_stream_mutations.py`` deletes each stream call in ``src/`` in turn (on a copy)
and shows a case fails. A DTensor's accesses are its local tensor's (the optimizer reads the
sharded gradients as DTensors).
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator
from typing import Any

import torch
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = [
    "COMPUTE",
    "LogicalEvent",
    "LogicalStream",
    "StreamChecker",
    "active_checker",
    "check_streams",
    "current_logical",
    "freed",
    "on_logical",
]

COMPUTE = "compute"  # the stream the model's own ops run on

# c10d ops (the collectives and p2p messages the engine issues): which arguments they write
_C10D_WRITES = {
    "_allgather_base_": (0,),
    "allgather_": (0,),
    "allgather_into_tensor_coalesced_": (0,),
    "_reduce_scatter_base_": (0,),
    "reduce_scatter_": (0,),
    "allreduce_": (0,),
    "broadcast_": (0,),
    "recv_": (0,),
    "recv_any_source_": (0,),
}

Clock = dict[str, int]

# ops that touch only a tensor's metadata (views are skipped by their schema)
_NO_DATA = {
    "empty_like",
    "new_empty",
    "new_empty_strided",
    "new_zeros",
    "new_ones",
    "new_full",
    "zeros_like",
    "ones_like",
    "full_like",
}

_active: list[StreamChecker] = []  # explicit and scoped by check_streams (no other state)


def active_checker() -> StreamChecker | None:
    """The checker recording on this process, if any (see :func:`check_streams`)."""
    return _active[-1] if _active else None


def _tensors(tree: Any) -> Iterator[torch.Tensor]:
    if isinstance(tree, torch.Tensor):
        yield tree
    elif isinstance(tree, (list, tuple)):
        for t in tree:
            yield from _tensors(t)


def _storage(t: torch.Tensor) -> torch.UntypedStorage | None:
    """The storage of a plain tensor, or of a DTensor's local tensor (an optimizer reads the
    sharded gradients as DTensors); other subclasses and meta tensors have none to check."""
    if isinstance(t, DTensor):
        t = t._local_tensor
    if type(t) not in (torch.Tensor, torch.nn.Parameter) or t.device.type == "meta":
        return None
    return t.untyped_storage()


class StreamChecker(TorchDispatchMode):
    """Logical streams with vector clocks, and the storage accesses made on each."""

    def __init__(self) -> None:
        super().__init__()
        self.current = COMPUTE
        self.clocks: dict[str, Clock] = {COMPUTE: {COMPUTE: 0}}
        self._writes: dict[int, tuple[str, int, str]] = {}  # storage -> (stream, time, op)
        self._reads: dict[int, dict[str, tuple[int, str]]] = {}  # storage -> stream -> ...
        # storage -> the storage object itself: a storage deallocated (its last tensor gone)
        # may leave its address to a new one, which starts with no history
        self._alive: dict[int, weakref.ref[torch.UntypedStorage]] = {}
        self.violations: list[str] = []
        self.accesses = 0  # a statistic: storage accesses seen

    # ------------------------------------------------------------ the stream calls
    def snapshot(self, stream: str | None = None) -> Clock:
        """What ``stream`` (default: the current one) has done so far."""
        return dict(self.clocks.setdefault(stream or self.current, {stream or self.current: 0}))

    def wait(self, waiter: str, done: Clock) -> None:
        """``waiter`` waits for the work recorded in ``done`` (an event / another stream)."""
        clock = self.clocks.setdefault(waiter, {waiter: 0})
        for s, t in done.items():
            if clock.get(s, -1) < t:
                clock[s] = t

    @contextlib.contextmanager
    def on(self, stream: str) -> Iterator[None]:
        """Run the block's ops on ``stream``."""
        prev, self.current = self.current, stream
        self.clocks.setdefault(stream, {stream: 0})
        try:
            yield
        finally:
            self.current = prev

    def release(self, storage: torch.UntypedStorage, what: str) -> None:
        """``storage`` is freed (resized to 0 or handed to the pool) on the current stream."""
        self._access(self._known(storage), True, f"free ({what})")

    def _known(self, storage: torch.UntypedStorage) -> int:
        """``storage``'s key, its history dropped if the key last named another storage."""
        key = storage._cdata
        ref = self._alive.get(key)
        if ref is None or ref() is not storage:
            self._writes.pop(key, None)
            self._reads.pop(key, None)
            self._alive[key] = weakref.ref(storage)
        return key

    # ------------------------------------------------------------ the accesses
    def _tick(self) -> tuple[str, int]:
        s = self.current
        clock = self.clocks[s]
        clock[s] = clock.get(s, 0) + 1
        return s, clock[s]

    def _ordered(self, by: str, stream: str, time: int) -> bool:
        return stream == by or self.clocks[by].get(stream, 0) >= time

    def _access(self, key: int, write: bool, op: str) -> None:
        s, now = self._tick()
        self.accesses += 1
        last = self._writes.get(key)
        if last is not None and not self._ordered(s, last[0], last[1]):
            self.violations.append(
                f"{op} on stream {s!r} {'writes' if write else 'reads'} a storage written on "
                f"{last[0]!r} by {last[2]} with no wait between"
            )
        if write:
            for other, (t, rop) in self._reads.get(key, {}).items():
                if not self._ordered(s, other, t):
                    self.violations.append(
                        f"{op} on stream {s!r} writes a storage that {other!r} read in {rop} "
                        f"with no wait between"
                    )
            self._writes[key] = (s, now, op)
            self._reads.pop(key, None)
        else:
            self._reads.setdefault(key, {})[s] = (now, op)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        kwargs = kwargs or {}
        if func.is_view or func._opname in _NO_DATA:  # no data read or written
            return func(*args, **kwargs)
        name = func.__name__ if func.namespace == "c10d" else None
        schema = func._schema.arguments
        written: set[int] = set()
        if name is not None:
            written = set(_C10D_WRITES.get(name.split(".")[0], ()))
        else:
            written = {
                i
                for i, a in enumerate(schema)
                if a.alias_info is not None and a.alias_info.is_write
            }
        positional = list(args) + [kwargs.get(a.name) for a in schema[len(args) :]]
        for i, arg in enumerate(positional):
            for t in _tensors(arg):
                storage = _storage(t)
                if storage is not None:
                    self._access(self._known(storage), i in written, str(func))
        return func(*args, **kwargs)


def freed(storage: torch.UntypedStorage, what: str) -> None:
    """Rule 3: tell the active checker (if any) that ``storage`` is freed now."""
    if _active:
        _active[-1].release(storage, what)


@contextlib.contextmanager
def _watching_resizes(checker: StreamChecker) -> Iterator[None]:
    """Every storage resized to 0 bytes while the block runs is a free (rule 3) the checker
    sees, whether or not the code announced it with :func:`freed` (which names it)."""
    resize = torch.UntypedStorage.resize_

    def resize_(storage: torch.UntypedStorage, size: int) -> Any:
        if size == 0 and storage.nbytes():
            checker.release(storage, "resize_(0)")
        return resize(storage, size)

    torch.UntypedStorage.resize_ = resize_  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        torch.UntypedStorage.resize_ = resize  # type: ignore[method-assign]


@contextlib.contextmanager
def check_streams() -> Iterator[StreamChecker]:
    """Record the engine's stream calls and storage accesses on this process; the yielded
    checker's ``violations`` lists every unordered access (see the module's Note). A storage
    resized to 0 bytes in the block counts as freed, announced by :func:`freed` or not."""
    checker = StreamChecker()
    _active.append(checker)
    try:
        with checker, _watching_resizes(checker):
            yield checker
    finally:
        _active.remove(checker)


# [Note: logical streams]
# A LogicalStream is a stream's name with torch's stream methods (``wait_stream``,
# ``wait_event``, ``record_event``, ``synchronize``); a LogicalEvent is what a stream had done
# when it was recorded (a vector clock). Each method reports to the checker active when it is
# called and does nothing when none is: the engine creates its CPU streams once, at lazy
# init, whether or not a checker records then, and the same objects serve every later
# ``check_streams``. Waiting on an event recorded under no checker (or another one) orders
# nothing. ``synchronize`` is a host wait: what the host does next, on the current stream, is
# ordered after it.


class LogicalEvent:
    """A CPU stand-in for ``torch.cuda.Event`` (see [Note: logical streams])."""

    __slots__ = ("_clock",)

    def __init__(self) -> None:
        self._clock: Clock | None = None

    def record(self, stream: LogicalStream | None = None) -> None:
        """Capture what ``stream`` (default: the current one) has done so far."""
        checker = active_checker()
        name = (stream or current_logical()).name
        self._clock = checker.snapshot(name) if checker is not None else None

    def wait(self, stream: LogicalStream | None = None) -> None:
        """``stream`` (default: the current one) waits for the recorded work."""
        (stream or current_logical()).wait_event(self)

    def synchronize(self) -> None:
        """The host waits for the recorded work (its next ops are on the current stream)."""
        checker = active_checker()
        if checker is not None and self._clock is not None:
            checker.wait(checker.current, self._clock)

    def query(self) -> bool:
        return True


class LogicalStream:
    """A CPU stand-in for ``torch.cuda.Stream`` (see [Note: logical streams])."""

    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        self.name = name

    def wait_stream(self, other: LogicalStream) -> None:
        """Work queued on this stream from now on waits for ``other``'s work so far."""
        checker = active_checker()
        if checker is not None:
            checker.wait(self.name, checker.snapshot(other.name))

    def wait_event(self, event: LogicalEvent) -> None:
        """Work queued on this stream from now on waits for ``event``'s work."""
        checker = active_checker()
        if checker is not None and event._clock is not None:
            checker.wait(self.name, event._clock)

    def record_event(self, event: LogicalEvent | None = None) -> LogicalEvent:
        """An event recording this stream's work so far."""
        event = event if event is not None else LogicalEvent()
        event.record(self)
        return event

    def synchronize(self) -> None:
        """The host waits for this stream's work so far."""
        checker = active_checker()
        if checker is not None:
            checker.wait(checker.current, checker.snapshot(self.name))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, LogicalStream) and other.name == self.name

    def __hash__(self) -> int:
        return hash(self.name)

    def __repr__(self) -> str:
        return f"LogicalStream({self.name!r})"


def current_logical() -> LogicalStream:
    """The stream ops run on now: the checker's current one, else the compute stream."""
    checker = active_checker()
    return LogicalStream(checker.current if checker is not None else COMPUTE)


@contextlib.contextmanager
def on_logical(stream: LogicalStream) -> Iterator[None]:
    """Run the block's ops on ``stream`` (while a checker records; else just run it)."""
    checker = active_checker()
    if checker is None:
        yield
        return
    with checker.on(stream.name):
        yield
