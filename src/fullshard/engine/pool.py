"""HostBufferPool: recycle freed unsharded buffers between units on the CPU.

[Note: recycling unsharded buffers]
A unit frees its unsharded buffer by resizing the storage to 0 bytes (see [Note: why storage
is resized, not freed] in ``fullshard.engine.gather``) and gets it back by resizing again. On the
GPU the caching allocator hands the same block to the next unit's gather. On the CPU every
resize is a fresh ``malloc``: for buffers above glibc's mmap threshold (always, with the
benchmarks' ``MALLOC_MMAP_THRESHOLD_=65536``; and for any large buffer once the heap is
trimmed) that is a new mapping whose every 4 KiB page faults when first written: 12.6 MiB
costs ~3,000 page faults, ~10 ms of CPU on the benchmark VM, against ~2 ms for the copy
itself — twice per unit per step.

So on the CPU a unit's freed memory is kept here for the next gather of a unit of the same
size, as the GPU allocator would: ``put`` moves the memory out of the unit's storage (which is
left at 0 bytes, exactly as a resize would leave it) into a carrier storage; ``take`` moves a
carrier's memory into the storage being gathered. Both swap the storages' data pointers, so
the views autograd saved of the unsharded parameters follow, as they follow a resize. The pool
holds at most ``capacity`` (3) buffers, the most recently freed, and only buffers a gather
will come for (``HostStrategy.keeps_after_forward`` / ``after_backward`` in
``fullshard.engine.host``): in forward,
unit ``i``'s memory is taken by unit ``i + 2``'s prefetch (when that unit gathers the same
bytes), and the root's and the last two units' survive the loss to be taken by the first
gathers of backward (their own: the root's, the last unit's and its backward prefetch). Those
bytes would be allocated again right at the start of backward, where the prefetched unit is
held anyway, so on the benchmarks' configurations peak RSS does not change; only where the
loss itself is the peak (a large vocabulary's logits) do they add to it. In backward, unit
``i``'s is taken by unit ``i - 2``'s prefetch, and the last two units of backward free theirs
or lend them as gradient memory (a pooled buffer there would sit beside the gradients of
every unit, measured +8 MiB peak RSS on ``memory`` at N = 2; see the third Note). The root's
context also empties the pool when a forward begins (then fills it with lent gradient memory
that came back), when a backward ends (the optimizer step runs with no pooled memory) and when
a forward runs without gradients. Pooled bytes are not tensor bytes
(``unsharded_bytes_allocated`` and the memory tracker do not see them): like a caching
allocator's reserve they show in RSS only.

[Note: taking back a unit's own gathered memory]
A pooled buffer still holds what it held when its unit freed it. Between forward and backward
the root's and the last two units' buffers wait in the pool for their own backward gathers; if
the unit's shards have not changed since (the same shard tensors at the same version counters)
and nothing wrote into the gathered parameters, those buffers already hold exactly what a
gather would bring. So ``put`` records a *content* token with the buffer, and a unit's gather
first tries ``reclaim``: its own memory back, with the same token, in place of the all-gather —
no collective, no copy, and no wait on the peers at the start of backward. The memory is the
same the plain recycle would have used, so peak memory does not change; the bytes on the wire
drop by those units' backward gathers (``fullshard bench --config speed`` or ``comm``: 3 of 14
all-gathers per step, 0.88x the ZeRO-3 theory's bytes). The version counters are both the
DTensor's and its local tensor's: an in-place update through the DTensor bumps only the
first, the local optimizer step only the second. A unit with a custom all-gather, an all-gather
extension, an int ``reshard_after_forward`` copy or CPU offload always gathers
(``ParamGroup._content``); so does any unit once the pool is emptied (a forward begins, a
backward ends).

[Note: gradient memory lent for the next forward]
Two kinds of fresh memory were left each step: every reduce-scatter output (a unit's gradient
shards, freed by ``zero_grad``) and the first gathers of a forward (the root's and the first
two blocks', before any unit has freed memory to recycle). On 2 ranks two equal blocks'
gradient shards are exactly one block's unsharded buffer, and they are freed right before
the forward that needs those buffers. So the pool lends slabs for the last reductions of a
backward and takes them back when the next forward begins:

- ``HostStrategy._plan_slabs`` walks the reductions from the last one back; each run of
  consecutive units whose outputs add up to exactly the size of one of the next forward's
  first gathers shares one slab (on ``comm``: blocks 3 + 2 and blocks 1 + 0).
- The run's first unit opens it (``start_slab``): with its own freed unsharded buffer when no
  gather takes that (the last units of backward), else fresh memory. Its reduce-scatter
  output and the next units' are carved from it (``grad_output``) and become the gradient
  shards, exactly as a fresh output would.
- When a forward begins (``adopt_returned``), a slab that nothing but the pool references
  any more (its gradients were set to ``None``; the storage's use count says so) becomes
  pooled memory for a first gather of its size. A slab still in use (gradients kept by the
  user, zeroed in place, accumulated over backwards, a reduction still in flight) is only
  forgotten: its memory stays with the gradients, and nothing is ever written into memory
  something else holds. At the end of a backward, slabs no gradient holds (outputs added
  into gradients that already existed) are freed at once.

Memory is the same at every moment as without lending except in two places: a run's later
outputs exist from its first unit's reduction on (one unit's backward early; the runs are the
last reductions, after the activation peak), and freed gradient memory stays allocated from
``zero_grad`` until the next forward begins, where nothing usually runs. Something big run
in between (a checkpoint save after ``zero_grad``) sees at most ``capacity`` slabs more.
Measured on ``fullshard bench --config comm|speed|memory``: peak RSS unchanged (467 / 609 /
1598 MiB at N = 2, 1073 at N = 4), 2 fresh unsharded buffers fewer per step (all of the
forward's block gathers recycled), and ~5% off ``comm``'s step (benchmarks/NOTES.md).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from .streamcheck import freed

__all__ = ["BufferContent", "HostBufferPool"]


@dataclass(frozen=True, eq=False)
class BufferContent:
    """What a freed unsharded buffer holds: ``group``'s gather of these shards (each
    parameter's DTensor and local tensor) at these version counters ([Note: taking back a
    unit's own gathered memory])."""

    group: object  # the ParamGroup (fullshard.engine.group imports this module)
    shards: tuple[torch.Tensor, ...]
    versions: tuple[int, ...]

    @classmethod
    def of(cls, group: object, shards: tuple[torch.Tensor, ...]) -> BufferContent:
        """``group``'s gather of ``shards`` as they are now."""
        return cls(group, shards, tuple(t._version for t in shards))

    def is_current(self, group: object, shards: tuple[torch.Tensor, ...]) -> bool:
        """Still ``group``'s gather of ``shards``: the same tensors, none written since."""
        return (
            self.group is group
            and len(shards) == len(self.shards)
            and all(
                a is b and a._version == v for a, b, v in zip(shards, self.shards, self.versions)
            )
        )


class HostBufferPool:
    """Freed CPU storages kept for the next same-size gather (see the Note above)."""

    def __init__(self, device: torch.device, capacity: int = 3) -> None:
        # Made by the root's host strategy only where the backend plan recycles (the CPU:
        # CUDA has its caching allocator; [Note: the host strategy] in fullshard.engine.host).
        self.capacity = capacity
        self.device = device
        # (carrier storage, content token or None), oldest first
        self._free: list[tuple[torch.UntypedStorage, object]] = []
        # [Note: gradient memory lent for the next forward]: slabs lent out as reduce-scatter
        # outputs (they become the gradients), the one being filled and its fill offset.
        self._lent: list[torch.UntypedStorage] = []
        self._open: torch.UntypedStorage | None = None
        self._offset = 0
        self.slabs_started = 0  # a statistic (tests read it)

    def put(self, storage: torch.UntypedStorage, content: object = None) -> None:
        """Free ``storage`` (resize it to 0 bytes), keeping its memory for a later ``take``;
        ``content``: what the memory holds, for :meth:`reclaim` (see the Notes above)."""
        freed(storage, "a buffer handed to the pool")
        nbytes = storage.nbytes()
        if nbytes == 0:
            return
        carrier = torch.UntypedStorage(0, device=storage.device)
        storage._swap_data_ptr_(carrier)  # type: ignore[attr-defined]
        self._free.append((carrier, content))
        if len(self._free) > self.capacity:
            del self._free[0]  # the oldest goes back to the allocator

    def reclaim(
        self, storage: torch.UntypedStorage, nbytes: int, matches: Callable[[object], bool]
    ) -> bool:
        """Give the (0-byte) ``storage`` pooled memory of ``nbytes`` whose content token
        ``matches`` says is still what it needs; ``False`` (nothing changes) when there is
        none."""
        if storage.nbytes() != 0:
            return False
        for i in range(len(self._free) - 1, -1, -1):
            carrier, content = self._free[i]
            if content is not None and carrier.nbytes() == nbytes and matches(content):
                del self._free[i]
                storage._swap_data_ptr_(carrier)  # type: ignore[attr-defined]
                return True
        return False

    def take(self, storage: torch.UntypedStorage, nbytes: int) -> str:
        """Give the (0-byte) ``storage`` ``nbytes`` of memory: pooled memory of that size if
        there is some (most recent first), else a fresh allocation. Returns ``"recycled"``,
        ``"fresh"`` or ``""`` (it already had them)."""
        if storage.nbytes() == nbytes:
            return ""
        for i in range(len(self._free) - 1, -1, -1):
            if self._free[i][0].nbytes() == nbytes and storage.nbytes() == 0:
                storage._swap_data_ptr_(self._free.pop(i)[0])  # type: ignore[attr-defined]
                return "recycled"
        storage.resize_(nbytes)
        return "fresh"

    @property
    def nbytes(self) -> int:
        """Bytes held in the pool right now."""
        return sum(carrier.nbytes() for carrier, _ in self._free)

    def clear(self) -> None:
        """Give every pooled buffer back to the allocator (lent memory stays lent; the slab
        being filled is closed)."""
        self._free.clear()
        self._open = None

    def forget(self) -> None:
        """:meth:`clear`, and forget every lent slab (their gradients keep what they use)."""
        self.clear()
        self._lent.clear()

    # ---------------------------------------------------- [Note: gradient memory lent ...]
    def start_slab(self, storage: torch.UntypedStorage | None, nbytes: int) -> None:
        """Open a slab of ``nbytes`` for the next reduce-scatter outputs: ``storage``'s memory
        (a unit's freed unsharded buffer of that size; the storage is left at 0 bytes, as a
        resize would leave it) or, without one, fresh memory."""
        if storage is None:
            slab = torch.UntypedStorage(nbytes, device=self.device)
        else:
            slab = torch.UntypedStorage(0, device=self.device)
            storage._swap_data_ptr_(slab)  # type: ignore[attr-defined]
        self._lent.append(slab)
        self._open, self._offset = slab, 0
        self.slabs_started += 1

    @property
    def filling_slab(self) -> bool:
        """A slab is open for reduce-scatter outputs."""
        return self._open is not None

    def grad_output(self, numel: int, dtype: torch.dtype) -> torch.Tensor | None:
        """A 1-D ``dtype`` tensor of ``numel`` elements carved from the open slab, or ``None``
        (no slab open, or not enough room left in it)."""
        slab = self._open
        if slab is None:
            return None
        size = numel * dtype.itemsize
        if self._offset % dtype.itemsize or self._offset + size > slab.nbytes():
            return None
        out = torch.empty(0, dtype=dtype, device=self.device)
        out.set_(slab, self._offset // dtype.itemsize, (numel,), (1,))  # type: ignore[call-overload]
        self._offset += size
        if self._offset == slab.nbytes():
            self._open = None
        return out

    def release_unused_slabs(self) -> None:
        """At the end of a backward: slabs no gradient holds any more (outputs accumulated
        into gradients that already existed) go back to the allocator now."""
        self._open = None
        self._lent = [slab for slab in self._lent if _use_count(slab) > 1]

    def adopt_returned(self, wanted: list[int]) -> None:
        """At a forward's start: lent slabs that nothing holds any more (the gradients were
        set to ``None``) and whose size one of the forward's first gathers (``wanted``, their
        byte sizes) needs become pooled memory for those gathers. Every other slab is
        forgotten: memory still in use stays with its gradients, the rest is freed."""
        lent, self._lent, self._open = self._lent, [], None
        wanted = list(wanted)
        for slab in lent:
            nbytes = slab.nbytes()
            if nbytes in wanted and _use_count(slab) == 1:
                wanted.remove(nbytes)
                self._free.append((slab, None))
        del self._free[: max(0, len(self._free) - self.capacity)]


def _use_count(storage: torch.UntypedStorage) -> int:
    """References to ``storage``'s memory (ours, through ``storage``, counts one)."""
    return int(torch._C._storage_Use_Count(storage._cdata))  # type: ignore[attr-defined]
