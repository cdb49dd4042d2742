"""HostBufferPool: recycle freed unsharded buffers between units on the CPU.

[Note: recycling unsharded buffers]
A unit frees its unsharded buffer by resizing the storage to 0 bytes (see [Note: why storage
is resized, not freed] in ``fullshard.gather``) and gets it back by resizing again. On the
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
will come for (``FSDPState._recycles_in_forward`` / ``_recycles_in_backward``): in forward,
unit ``i``'s memory is taken by unit ``i + 2``'s prefetch (when that unit gathers the same
bytes), and the root's and the last two units' survive the loss to be taken by the first
gathers of backward (their own: the root's, the last unit's and its backward prefetch). Those
bytes would be allocated again right at the start of backward, where the prefetched unit is
held anyway, so on the benchmarks' configurations peak RSS does not change; only where the
loss itself is the peak (a large vocabulary's logits) do they add to it. In backward, unit
``i``'s is taken by unit ``i - 2``'s prefetch, and the last two units of backward free theirs
(a pooled buffer there would sit beside the gradients of every unit, measured +8 MiB peak RSS
on ``memory`` at N = 2). The root's context also empties it when a forward begins, when a
backward ends (the optimizer step runs with no pooled memory) and when a forward runs without
gradients. Pooled bytes are not
tensor bytes (``unsharded_bytes_allocated`` and the memory tracker do not see them): like a
caching allocator's reserve they show in RSS only.

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
"""

from __future__ import annotations

from collections.abc import Callable

import torch

__all__ = ["HostBufferPool"]


class HostBufferPool:
    """Freed CPU storages kept for the next same-size gather (see the Note above)."""

    def __init__(self, device: torch.device, capacity: int = 3) -> None:
        # CUDA has its caching allocator; the swap is a private torch API (checked once).
        self.enabled = device.type == "cpu" and hasattr(torch.UntypedStorage, "_swap_data_ptr_")
        self.capacity = capacity
        # (carrier storage, content token or None), oldest first
        self._free: list[tuple[torch.UntypedStorage, object]] = []

    def put(self, storage: torch.UntypedStorage, content: object = None) -> None:
        """Free ``storage`` (resize it to 0 bytes), keeping its memory for a later ``take``;
        ``content``: what the memory holds, for :meth:`reclaim` (see the Notes above)."""
        nbytes = storage.nbytes()
        if not self.enabled or nbytes == 0:
            storage.resize_(0)
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
        """Give every pooled buffer back to the allocator."""
        self._free.clear()
