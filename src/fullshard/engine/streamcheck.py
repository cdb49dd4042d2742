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

On the CPU there are no streams, so nothing would check these rules. :func:`check_streams`
runs the same calls on logical streams instead: ``CommStreams`` and ``Handle`` report to the
active :class:`StreamChecker`, which keeps a vector clock per stream (each op ticks its
stream; a wait merges the waited stream's clock into the waiter's), and a
``TorchDispatchMode`` notes which stream reads and writes each storage (collectives from
c10d's ops: their output tensors are written). It reports

- a read or write of a storage on one stream after a write (or, for a write, a read) on
  another with no wait ordering them;
- a storage freed while another stream's use of it is not ordered before the free.

The parity matrix runs once under the checker in CI (``tests/test_stream_order.py``), and a
test removes each of the waits above in turn (rules 1, 2 and 4: both of rule 4's) and shows
the checker fails. A DTensor's accesses are its local tensor's (the optimizer reads the
sharded gradients as DTensors).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["COMPUTE", "StreamChecker", "active_checker", "check_streams", "freed"]

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


def _key(t: torch.Tensor) -> int | None:
    """The storage of a plain tensor, or of a DTensor's local tensor (an optimizer reads the
    sharded gradients as DTensors); other subclasses and meta tensors have none to check."""
    if isinstance(t, DTensor):
        t = t._local_tensor
    if type(t) not in (torch.Tensor, torch.nn.Parameter) or t.device.type == "meta":
        return None
    return t.untyped_storage()._cdata


class StreamChecker(TorchDispatchMode):
    """Logical streams with vector clocks, and the storage accesses made on each."""

    def __init__(self) -> None:
        super().__init__()
        self.current = COMPUTE
        self.clocks: dict[str, Clock] = {COMPUTE: {COMPUTE: 0}}
        self._writes: dict[int, tuple[str, int, str]] = {}  # storage -> (stream, time, op)
        self._reads: dict[int, dict[str, tuple[int, str]]] = {}  # storage -> stream -> ...
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
        self._access(storage._cdata, True, f"free ({what})")

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
                key = _key(t)
                if key is not None:
                    self._access(key, i in written, str(func))
        return func(*args, **kwargs)


def freed(storage: torch.UntypedStorage, what: str) -> None:
    """Rule 3: tell the active checker (if any) that ``storage`` is freed now."""
    if _active:
        _active[-1].release(storage, what)


@contextlib.contextmanager
def check_streams() -> Iterator[StreamChecker]:
    """Record the engine's stream calls and storage accesses on this process; the yielded
    checker's ``violations`` lists every unordered access (see the module's Note)."""
    checker = StreamChecker()
    _active.append(checker)
    try:
        with checker:
            yield checker
    finally:
        _active.remove(checker)
