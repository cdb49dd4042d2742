"""A capturable step: set a model up for CUDA graph capture, and count what the engine does.

:func:`make_capturable` turns on what [Note: a capturable step] (``fullshard.engine.kept``)
asks of a model: ``set_keep_unsharded_storage(True)`` on every unit and manual backward
finalization on the root, on every supported torch (the ``FSDPModule`` methods of those
names are torch 2.15's API and are refused on older torch, as torch's own class lacks them).
Each step then ends with ``model.finalize_backward()`` (or :func:`finalize`, on every torch).

:func:`count_engine_work` records, over a block, the tensors the engine creates and the host
waits it makes: what a steady-state step must have none of to be captured. Engine work is
told from the model's by the Python stack: an op counts as the engine's when the innermost
frame outside torch, the standard library and this module is in the ``fullshard`` package
(not ``fullshard.models``): the model's forward and autograd's backward kernels are entered
from the caller's frames, the engine's hooks, collectives and reductions from the engine's.
A created tensor is an op output whose storage is none of the op's inputs' (views, in-place
and ``out=`` ops create none); ``UntypedStorage.resize_`` counts too. Host waits:
``_local_scalar_dense`` / ``is_nonzero`` / ``equal`` (``.item()``, ``bool(t)``) and
``synchronize`` on the engine's logical streams and events (on the CPU, where CUDA would
block the host). Used by ``tests/test_capturable_step.py`` and the GPU check's ``graph`` line.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from .engine import LogicalEvent, LogicalStream, finalize_backward, set_manual_backward_finalization
from .module import FSDPModule, unit_state

__all__ = ["EngineWork", "count_engine_work", "finalize", "make_capturable"]

_PKG = os.path.dirname(os.path.abspath(__file__))
_NOT_ENGINE = (os.path.join(_PKG, "models.py"),)
_SKIP = (
    os.path.dirname(torch.__file__),
    os.path.dirname(contextlib.__file__),
    os.path.abspath(__file__),
)
_SYNCS = {
    torch.ops.aten._local_scalar_dense.default,
    torch.ops.aten.is_nonzero.default,
    torch.ops.aten.equal.default,
}


def make_capturable(model: nn.Module) -> None:
    """Keep every unit's unsharded storage (and comm buffers) and finalize backward by hand,
    on ``model``, the root unit (see the module docstring)."""
    if not isinstance(model, FSDPModule):
        raise TypeError(
            f"make_capturable takes the root FSDP module, got {type(model).__name__}: call "
            f"fully_shard on it (and its units) first"
        )
    for m in model.modules():
        if isinstance(m, FSDPModule):
            st = unit_state(m)
            for g in (st.group, *st.group.subgroups):
                g.keep_unsharded_storage = True
    set_manual_backward_finalization(unit_state(model), True)


def finalize(model: nn.Module) -> None:
    """``model.finalize_backward()`` on every torch: end the step's backward (reductions
    waited on, the iteration closed)."""
    finalize_backward(unit_state(model), False)


def _engine_caller() -> str | None:
    """``file:line`` of the innermost frame outside torch, the standard library and this
    module, if it is the engine's (see the module docstring)."""
    f: Any = sys._getframe(2)
    while f is not None and f.f_code.co_filename.startswith(_SKIP):
        f = f.f_back
    if f is None:
        return None
    name = f.f_code.co_filename
    if not name.startswith(_PKG) or name in _NOT_ENGINE:
        return None
    return f"{os.path.relpath(name, _PKG)}:{f.f_lineno}"


def _storages(tree: Any) -> set[int]:
    return {t.untyped_storage()._cdata for t in tree_leaves(tree) if isinstance(t, torch.Tensor)}


class EngineWork(TorchDispatchMode):
    """The tensors engine code created (``created``), its host waits (``syncs``), each as
    ``"op at file:line"``, and how many ops it issued in all (``ops``)."""

    def __init__(self) -> None:
        super().__init__()
        self.created: list[str] = []
        self.syncs: list[str] = []
        self.ops = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        where = _engine_caller()
        if where is not None:
            self.ops += 1
            if func in _SYNCS:
                self.syncs.append(f"{func} at {where}")
            elif _storages(out) - _storages((args, kwargs)):
                self.created.append(f"{func} at {where}")
        return out


@contextlib.contextmanager
def count_engine_work() -> Iterator[EngineWork]:
    """Record the engine's tensor creations and host waits in the block (module docstring)."""
    work = EngineWork()
    saved = (torch.UntypedStorage.resize_, LogicalEvent.synchronize, LogicalStream.synchronize)

    def resize(storage: torch.UntypedStorage, size: int) -> Any:
        where = _engine_caller()
        if where is not None:
            work.created.append(f"UntypedStorage.resize_({size}) at {where}")
        return saved[0](storage, size)

    def event_sync(self: LogicalEvent) -> None:
        work.syncs.append("LogicalEvent.synchronize")
        saved[1](self)

    def stream_sync(self: LogicalStream) -> None:
        work.syncs.append("LogicalStream.synchronize")
        saved[2](self)

    torch.UntypedStorage.resize_ = resize  # type: ignore[method-assign,assignment]
    LogicalEvent.synchronize = event_sync  # type: ignore[method-assign]
    LogicalStream.synchronize = stream_sync  # type: ignore[method-assign]
    try:
        with work:
            yield work
    finally:
        torch.UntypedStorage.resize_ = saved[0]  # type: ignore[method-assign]
        LogicalEvent.synchronize = saved[1]  # type: ignore[method-assign]
        LogicalStream.synchronize = saved[2]  # type: ignore[method-assign]
