"""fullshard: fully sharded data parallel (ZeRO-3) training for PyTorch.

The public API mirrors PyTorch FSDP2, so existing code switches with one import::

    from fullshard import fully_shard, FSDPModule, MixedPrecisionPolicy
"""

from .api import (
    FSDPModule,
    UnshardHandle,
    fully_shard,
    register_fsdp_forward_method,
    share_comm_ctx,
)
from .clip import clip_grad_norm_
from .collectives import CollectiveStats, count_collectives
from .module import FullyShardError
from .patch import TorchFSDPPatch, patch_torch_fsdp
from .policies import CommPolicy, CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy

__all__ = [
    "CPUOffloadPolicy",
    "CollectiveStats",
    "CommPolicy",
    "FSDPModule",
    "FullyShardError",
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
