"""What torch's debugging tools see of the engine's collectives.

[Note: collectives under torch's tools]
The engine runs the same path whether or not a tool watches: under ``CommDebugMode``, the
profiler and the stream checker it issues the same collectives, in the same order, with the
same results (``tests/test_observed.py``). What differs from FSDP2 on gloo is how some
collectives move their bytes: a p2p exchange (pieces, or a small packed buffer on 2 ranks), a
reduce-scatter run as an in-place all-reduce, or a unit that takes back its own gathered
memory instead of gathering. ``CommDebugMode`` counts the c10d collectives it sees
dispatched, so those would show counts that differ from FSDP2's. This module makes them
count as what they stand for: :func:`report` tells every active ``CommDebugMode`` that one
all-gather or reduce-scatter ran (a logical op, dispatched to the mode alone: nothing runs),
and :func:`as_logical` hides the stand-in all-reduce it would count and reports the
reduce-scatter instead. So ``CommDebugMode`` counts one all-gather per unit gather and one
reduce-scatter per unit reduction (and the all-reduce across HSDP replicas), as FSDP2 on
NCCL. The profiler shows what ran (``record_param_comms`` ranges for gloo's collectives,
send/recv for p2p exchanges) inside the engine's ``fullshard::`` ranges, which name the
unit and the logical operation. Without an active dispatch mode each call costs one check.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator
from typing import Any

import torch
from torch.distributed.tensor.debug import CommDebugMode
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

__all__ = ["as_logical", "report"]

_C10D = torch.ops.c10d
_PACKETS = {
    "all_gather": _C10D._allgather_base_,
    "reduce_scatter": _C10D._reduce_scatter_base_,
}


class _LogicalOp:
    """What a ``CommDebugMode`` needs of a dispatched op to count it; running it does nothing."""

    def __init__(self, packet: Any) -> None:
        self._overloadpacket = packet

    def __call__(self, *args: Any, **kwargs: Any) -> None:
        return None


def _watchers() -> list[CommDebugMode]:
    if not torch._C._len_torch_dispatch_stack():  # no mode at all: the common case
        return []
    return [m for m in _get_current_dispatch_mode_stack() if isinstance(m, CommDebugMode)]


def report(kind: str) -> None:
    """Count one ``kind`` collective (``"all_gather"`` / ``"reduce_scatter"``) in every
    active ``CommDebugMode`` (see the Note)."""
    for mode in _watchers():
        mode.__torch_dispatch__(_LogicalOp(_PACKETS[kind]), (), (), {})


@contextlib.contextmanager
def as_logical(kind: str) -> Iterator[None]:
    """Run the block's collective as a stand-in for one ``kind``: active ``CommDebugMode``\\ s
    count ``kind`` instead of what the block dispatches."""
    saved = [(m, copy.deepcopy((m.comm_counts, m.comm_module_counts))) for m in _watchers()]
    try:
        yield
    finally:
        for mode, (counts, module_counts) in saved:
            mode.comm_counts, mode.comm_module_counts = counts, module_counts
        if saved:
            report(kind)
