"""FSDP1's communication hooks (``register_comm_hook``) as a unit's custom reduce-scatter.

FSDP1 hands a sharded strategy's hook ``hook(state, grad, output)`` the unit's flattened,
padded gradient (every rank's part, rank-major) and the shard-sized output to reduce into;
the hook communicates and divides (``reduce_scatter_hook`` and the low-precision hooks of
``torch.distributed.algorithms._comm_hooks`` pre- and post-divide themselves). fullshard's
unit packs its gradients in the same rank-major, padded layout for a reduce-scatter, so the
hook runs as the unit's custom reduce-scatter (torch's ``ReduceScatter`` protocol) and the
unit divides by 1 (the hook's division is the only one).

The ``NO_SHARD`` form ``hook(state, grad)`` (an all-reduce) is not supported: fullshard's
``NO_SHARD`` reduces across replicas itself (``NotImplementedError`` at registration).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from ..engine import FSDPState

__all__ = ["CommHookReduceScatter", "install_comm_hook"]


class CommHookReduceScatter:
    """torch's ``ReduceScatter`` protocol around an FSDP1 hook ``hook(state, grad, output)``."""

    def __init__(self, hook: Callable[..., None], hook_state: object) -> None:
        self.hook = hook
        self.hook_state = hook_state

    def allocate(
        self, size: Sequence[int], *, dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        op: Any,
        async_op: bool = False,
    ) -> None:
        """Run the hook (synchronously: it returns nothing to wait on)."""
        self.hook(self.hook_state, input_tensor, output_tensor)


def install_comm_hook(
    states: list[FSDPState], hook_state: object, hook: Callable[..., None]
) -> None:
    """Run ``hook`` as every unit's gradient reduction (checked by the caller)."""
    comm = CommHookReduceScatter(hook, hook_state)
    for st in states:
        if st.ctx is not None and st.group.transport.local:
            raise RuntimeError(
                f"register_comm_hook after the first forward on unit {st.name!r}, whose shard "
                f"group has one rank: register the hook before the first forward"
            )
        st.group.overrides.reduce_scatter = comm
        st.group.overrides.gradient_divide_factor = 1.0
        st.group.settings_changed()
