"""Measure memory while a real (or fake) run executes.

Three meters, each answering a different question:

- :class:`LiveTensorBytes` — bytes of tensor storages alive right now and the peak, counted by a
  ``TorchDispatchMode`` that sees every tensor an op returns (including the local shards inside
  ``DTensor`` outputs) and a weak reference per storage, so a storage leaves the count when it is
  freed. ``UntypedStorage.resize_`` (how FSDP-style engines free gathered buffers while keeping
  autograd's views valid) is not an op the mode sees, so it is patched while the meter is active
  (and so is ``UntypedStorage._swap_data_ptr_``, how fullshard's CPU buffer pool does the same).
  This is what :mod:`fullshard.memory.planner` predicts: the same quantity as
  ``torch.cuda.max_memory_allocated`` on a GPU, with no allocator caching or fragmentation and no
  interpreter/runtime overhead. It works on fake tensors too, which is how the planner measures
  activations without allocating them.
- :func:`reset_peak_rss` / :func:`peak_rss_bytes` — the process's resident-set high-water mark
  (``VmHWM``), reset by writing ``5`` to ``/proc/self/clear_refs`` (Linux). Freed buffers only
  leave RSS when glibc returns them to the kernel, so benchmark children run with
  ``MALLOC_MMAP_THRESHOLD_=65536`` (every allocation >= 64 KiB is its own ``mmap`` and is
  ``munmap``-ed on free). This is what ``fullshard bench`` reports on CPU.
- :func:`reset_peak_device` / :func:`peak_device_bytes` — ``torch.cuda.max_memory_allocated``.
"""

from __future__ import annotations

import functools
import re
import weakref
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_flatten

__all__ = [
    "MALLOC_ENV",
    "LiveTensorBytes",
    "PeakMemory",
    "current_rss_bytes",
    "peak_device_bytes",
    "peak_rss_bytes",
    "reset_peak_device",
    "reset_peak_rss",
]

#: Environment for child processes whose RSS is measured: freed buffers >= 64 KiB leave RSS.
MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": "65536"}

_KIB = 1024


def _status_field(name: str) -> int:
    """Read one ``kB`` field of ``/proc/self/status`` in bytes (0 where unavailable)."""
    try:
        with open("/proc/self/status") as f:
            m = re.search(rf"^{name}:\s+(\d+)\s+kB", f.read(), re.MULTILINE)
    except OSError:
        return 0
    return int(m.group(1)) * _KIB if m else 0


def reset_peak_rss() -> bool:
    """Reset the RSS high-water mark to the current RSS; ``False`` where the kernel refuses."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return False
    return True


def peak_rss_bytes() -> int:
    """Resident-set high-water mark (``VmHWM``) of this process since start or the last reset."""
    return _status_field("VmHWM")


def current_rss_bytes() -> int:
    """Resident set size (``VmRSS``) of this process now."""
    return _status_field("VmRSS")


def reset_peak_device() -> None:
    """Reset ``torch.cuda``'s peak counter (no-op without CUDA)."""
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()


def peak_device_bytes() -> int:
    """``torch.cuda.max_memory_allocated`` (0 without CUDA)."""
    return int(torch.cuda.max_memory_allocated()) if torch.cuda.is_available() else 0


def _storages(t: torch.Tensor) -> list[torch.UntypedStorage]:
    """The storages behind ``t``: its own, or its inner tensors' for a wrapper subclass (DTensor)."""
    out: list[torch.UntypedStorage] = []
    todo: list[Any] = [t]
    while todo:
        x = todo.pop()
        if is_traceable_wrapper_subclass(x):
            attrs, _ = x.__tensor_flatten__()
            todo.extend(getattr(x, a) for a in attrs if isinstance(getattr(x, a), torch.Tensor))
        else:
            try:
                out.append(x.untyped_storage())
            except (RuntimeError, NotImplementedError):  # sparse / storage-less tensors
                pass
    return out


class _Entry:
    __slots__ = ("category", "nbytes", "ref")

    def __init__(self, nbytes: int, category: str) -> None:
        self.nbytes = nbytes  # bytes counted now (follows resize_)
        self.category = category
        self.ref: weakref.ref[torch.UntypedStorage] | None = None


class LiveTensorBytes(TorchDispatchMode):
    """Count the bytes of live tensor storages, by category, with the peak and where it occurred.

    Use as a context manager around the code to measure. Tensors that exist before entering are
    not seen until an op returns them; call :meth:`track` on them (parameters, optimizer states)
    to count them from the start. Each storage has a category (``"other"`` unless
    :meth:`track`/:meth:`set_category` says otherwise); :attr:`peak_by_category` is the
    breakdown at the moment of the peak. :attr:`label` is copied into :attr:`peak_label` when a
    new peak is reached, so callers can mark phases (e.g. ``"backward blocks.3"``).
    """

    def __init__(self, classify: Callable[[torch.Tensor], str] | None = None) -> None:
        super().__init__()
        self.classify = classify  # the category of a new op output (default "other")
        self._entries: dict[int, _Entry] = {}  # id(storage) -> entry; removed when freed
        self.current = 0
        self.by_category: dict[str, int] = {}
        self.peak = 0
        self.peak_by_category: dict[str, int] = {}
        self.label = ""
        self.peak_label = ""
        self.on_op: Callable[[LiveTensorBytes], None] | None = None  # called after every op
        self._orig_resize: Any = None
        self._orig_swap: Any = None

    # ---- accounting -------------------------------------------------------------------------
    def _add(self, cat: str, delta: int) -> None:
        self.current += delta
        self.by_category[cat] = self.by_category.get(cat, 0) + delta
        if self.current > self.peak:
            self.peak = self.current
            self.peak_by_category = dict(self.by_category)
            self.peak_label = self.label

    def _freed(self, key: int, _ref: Any) -> None:
        entry = self._entries.get(key)
        if entry is None or entry.ref is not _ref:  # a newer storage reuses the id
            return
        del self._entries[key]
        if entry.nbytes:
            self._add(entry.category, -entry.nbytes)

    def _register(self, st: torch.UntypedStorage, category: str) -> _Entry:
        key = id(st)
        entry = self._entries.get(key)
        if entry is not None and entry.ref is not None and entry.ref() is st:
            if entry.nbytes != st.nbytes():  # resized behind our back
                self._add(entry.category, st.nbytes() - entry.nbytes)
                entry.nbytes = st.nbytes()
            return entry
        entry = _Entry(st.nbytes(), category)
        entry.ref = weakref.ref(st, functools.partial(self._freed, key))
        self._entries[key] = entry
        if entry.nbytes:
            self._add(category, entry.nbytes)
        return entry

    def track(self, tensors: Iterable[torch.Tensor], category: str = "other") -> None:
        """Count existing tensors (e.g. parameters) from now on, under ``category``."""
        for t in tensors:
            if isinstance(t, torch.Tensor):
                for st in _storages(t):
                    self.set_category_storage(st, category)

    def set_category(self, t: torch.Tensor, category: str) -> None:
        """Move ``t``'s storages to ``category`` (registering them if new)."""
        for st in _storages(t):
            self.set_category_storage(st, category)

    def set_category_storage(self, st: torch.UntypedStorage, category: str) -> None:
        entry = self._register(st, category)
        if entry.category != category:
            self.by_category[entry.category] -= entry.nbytes
            self.by_category[category] = self.by_category.get(category, 0) + entry.nbytes
            entry.category = category

    def recategorize(self, t: torch.Tensor, old: str, new: str) -> None:
        """Move those of ``t``'s storages that are counted under ``old`` to ``new``."""
        for st in _storages(t):
            entry = self._entries.get(id(st))
            if entry is not None and entry.ref is not None and entry.ref() is st:
                if entry.category == old:
                    self.set_category_storage(st, new)

    def reset_peak(self) -> None:
        """Start a new peak from the current live bytes."""
        self.peak = self.current
        self.peak_by_category = dict(self.by_category)
        self.peak_label = self.label

    # ---- interception -----------------------------------------------------------------------
    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                cat = "other" if self.classify is None else self.classify(t)
                for st in _storages(t):
                    self._register(st, cat)
        if self.on_op is not None:
            self.on_op(self)
        return out

    def _resized(self, st: torch.UntypedStorage) -> None:
        entry = self._entries.get(id(st))
        if entry is not None and entry.ref is not None and entry.ref() is st:
            self._add(entry.category, st.nbytes() - entry.nbytes)
            entry.nbytes = st.nbytes()

    def __enter__(self) -> LiveTensorBytes:
        self._orig_resize = torch.UntypedStorage.resize_
        orig = self._orig_resize

        @functools.wraps(orig)
        def resize_(st: torch.UntypedStorage, size: int) -> Any:
            res = orig(st, size)
            self._resized(st)
            return res

        torch.UntypedStorage.resize_ = resize_  # type: ignore[method-assign,assignment]
        # fullshard's buffer pool (fullshard.engine.pool) frees and refills gathered buffers by
        # swapping data pointers with storages no tensor holds: follow both sides.
        self._orig_swap = getattr(torch.UntypedStorage, "_swap_data_ptr_", None)
        swap_orig = self._orig_swap
        if swap_orig is not None:

            @functools.wraps(swap_orig)
            def swap(st: torch.UntypedStorage, other: torch.UntypedStorage) -> Any:
                res = swap_orig(st, other)
                self._resized(st)
                self._resized(other)
                return res

            torch.UntypedStorage._swap_data_ptr_ = swap  # type: ignore[attr-defined]
        super().__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        super().__exit__(*exc)
        torch.UntypedStorage.resize_ = self._orig_resize  # type: ignore[method-assign]
        if self._orig_swap is not None:
            torch.UntypedStorage._swap_data_ptr_ = self._orig_swap  # type: ignore[attr-defined]


class PeakMemory:
    """Peak memory of a block of real work: RSS high-water mark on CPU, max allocated on GPU.

    >>> with PeakMemory() as pm:
    ...     train_steps()
    >>> pm.peak_bytes  # device bytes on CUDA, else resident-set bytes

    On CPU the RSS high-water mark is reset on entry (Linux ``clear_refs``); run the process with
    :data:`MALLOC_ENV` in its environment from start-up so freed buffers leave RSS.
    """

    def __init__(self, device: torch.device | str | None = None) -> None:
        dev = torch.device(device) if device is not None else None
        self.cuda = (dev.type == "cuda") if dev is not None else torch.cuda.is_available()
        self.rss_reset = False
        self.rss_start = 0
        self.peak_rss_bytes = 0
        self.peak_device_bytes = 0

    def __enter__(self) -> PeakMemory:
        self.rss_start = current_rss_bytes()
        self.rss_reset = reset_peak_rss()
        if self.cuda:
            reset_peak_device()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.peak_rss_bytes = peak_rss_bytes()
        if self.cuda:
            self.peak_device_bytes = peak_device_bytes()

    @property
    def peak_bytes(self) -> int:
        """The number that matters on this device."""
        return self.peak_device_bytes if self.cuda else self.peak_rss_bytes
