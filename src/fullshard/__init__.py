"""fullshard: fully sharded data parallel (ZeRO-3) training for PyTorch.

The public API mirrors PyTorch FSDP2, so existing code switches with one import::

    from fullshard import fully_shard, FSDPModule, MixedPrecisionPolicy

and FSDP1's wrapper runs on the same engine (``fullshard.fsdp1``)::

    from fullshard import FullyShardedDataParallel as FSDP

The names below are imported on first use (PEP 562), so ``import fullshard`` (and the
``fullshard`` command's ``--help``) does not import torch until something needs it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .lazy import lazy_names

if TYPE_CHECKING:
    from .api import (
        FSDPModule,
        UnshardHandle,
        fully_shard,
        register_fsdp_forward_method,
        share_comm_ctx,
    )
    from .clip import clip_grad_norm_
    from .engine import (
        CollectiveStats,
        CommPolicy,
        CPUOffloadPolicy,
        MixedPrecisionPolicy,
        OffloadPolicy,
        count_collectives,
    )
    from .fsdp1 import FSDP, FullyShardedDataParallel
    from .module import FullyShardError, GradientReductionHandle
    from .patch import TorchFSDPPatch, patch_torch_fsdp

# public name -> the submodule that defines it
_LAZY = {
    "FSDPModule": "api",
    "UnshardHandle": "api",
    "fully_shard": "api",
    "register_fsdp_forward_method": "api",
    "share_comm_ctx": "api",
    "FullyShardError": "module",
    "GradientReductionHandle": "module",
    "TorchFSDPPatch": "patch",
    "patch_torch_fsdp": "patch",
    "clip_grad_norm_": "clip",
    "CollectiveStats": "engine",
    "count_collectives": "engine",
    "CommPolicy": "engine",
    "CPUOffloadPolicy": "engine",
    "MixedPrecisionPolicy": "engine",
    "OffloadPolicy": "engine",
    "FSDP": "fsdp1",
    "FullyShardedDataParallel": "fsdp1",
}

__all__ = [
    "FSDP",
    "CPUOffloadPolicy",
    "CollectiveStats",
    "CommPolicy",
    "FSDPModule",
    "FullyShardError",
    "FullyShardedDataParallel",
    "GradientReductionHandle",
    "MixedPrecisionPolicy",
    "OffloadPolicy",
    "TorchFSDPPatch",
    "UnshardHandle",
    "clip_grad_norm_",
    "count_collectives",
    "fully_shard",
    "patch_torch_fsdp",
    "register_fsdp_forward_method",
    "share_comm_ctx",
]

__version__ = "0.1.0"


__getattr__, __dir__ = lazy_names(__name__, globals(), _LAZY)
