"""The torch range (2.9 to 2.15): what differs between releases is named in
``fullshard.engine.compat``, matches the installed torch, and a feature the installed torch
lacks is refused where it is used, in one line naming it and the torch that has it.

The refusals are checked on every torch by pretending to be the oldest supported one
(``compat.TORCH_VERSION``); the table itself is checked against the installed torch, so CI's
runs on the oldest and the newest torch check both ends."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed.fsdp as tfsdp
from torch import nn
from torch.distributed.tensor import Shard

import fullshard
from fullshard.engine import compat
from fullshard.testing import run_distributed


def test_the_table_matches_the_installed_torch() -> None:
    torch_fsdp = importlib.import_module("torch.distributed.fsdp._fully_shard._fully_shard")
    common = importlib.import_module("torch.distributed.fsdp._fully_shard._fsdp_common")
    assert compat.DP_MESH_DIMS.available == hasattr(tfsdp, "DataParallelMeshDims")
    assert compat.PER_PARAMETER_MESH.available == hasattr(common, "ShardPlacementResult")
    assert compat.SHARE_COMM_CTX.available == hasattr(torch_fsdp, "share_comm_ctx")
    assert compat.STORAGE_SWAP == hasattr(torch.UntypedStorage, "_swap_data_ptr_")
    for name, since in compat.FSDP_MODULE_METHODS_SINCE.items():
        assert hasattr(tfsdp.FSDPModule, name) == (compat.TORCH_VERSION >= since), name
    if compat.DP_MESH_DIMS.available:
        assert compat.DataParallelMeshDims is tfsdp.DataParallelMeshDims
    else:  # a stand-in nothing is an instance of, refusing to be built
        with pytest.raises(compat.UnsupportedByTorchError, match=r"torch 2\.12"):
            compat.DataParallelMeshDims(shard="dp")
    lo, hi = compat.SUPPORTED_TORCH
    assert lo <= compat.TORCH_VERSION < hi


class _PlacementOnAnotherMesh:
    """What FSDP2's ``ShardPlacementResult`` looks like to fullshard (placement, mesh_info)."""

    def __init__(self, mesh: Any) -> None:
        self.placement = Shard(0)
        self.mesh_info = type("Info", (), {"mesh": mesh})()


def _refusals() -> dict[str, str]:
    """Each feature newer than torch 2.9 used as torch 2.9 would see it: the messages."""
    from torch.distributed.device_mesh import init_device_mesh

    out: dict[str, str] = {}
    saved = compat.TORCH_VERSION
    compat.TORCH_VERSION = compat.SUPPORTED_TORCH[0]  # the oldest supported torch
    try:
        mesh = init_device_mesh("cpu", (1,))
        calls: dict[str, Callable[[], Any]] = {
            "dp_mesh_dims": lambda: fullshard.fully_shard(nn.Linear(2, 2), dp_mesh_dims=object()),
            "shard_placement_fn": lambda: fullshard.fully_shard(
                nn.Linear(2, 2), shard_placement_fn=lambda p: _PlacementOnAnotherMesh(mesh)
            ),
        }
        unit = fullshard.fully_shard(nn.Linear(2, 2))
        calls["share_comm_ctx"] = lambda: fullshard.share_comm_ctx([unit])
        args: dict[str, tuple[Any, ...]] = {
            "set_reduce_scatter_max_input_buffers": (1,),
            "set_reduce_scatter_unused_params": (True,),
            "set_keep_unsharded_storage": (True,),
            "set_manual_backward_finalization": (True,),
        }
        for name in compat.FSDP_MODULE_METHODS_SINCE:
            calls[name] = lambda n=name: getattr(unit, n)(*args.get(n, ()))
        for what, call in calls.items():
            try:
                call()
                out[what] = "accepted"
            except compat.UnsupportedByTorchError as e:
                out[what] = str(e)
        unit(torch.randn(3, 2)).sum().backward()  # the rest works as before
    finally:
        compat.TORCH_VERSION = saved
    return out


def test_newer_features_are_refused_on_an_older_torch() -> None:
    out = run_distributed(_refusals, 1, timeout=120)[0]
    since = {
        "dp_mesh_dims": "2.12",
        "shard_placement_fn": "2.12",
        "share_comm_ctx": "2.10",
        **{n: f"{v[0]}.{v[1]}" for n, v in compat.FSDP_MODULE_METHODS_SINCE.items()},
    }
    assert out.keys() == since.keys()
    for what, msg in out.items():
        assert "\n" not in msg, (what, msg)
        assert what in msg and f"needs torch {since[what]} or newer" in msg, (what, msg)
        assert torch.__version__ in msg and f"pip install 'torch>={since[what]}'" in msg


def test_refusal_is_a_not_implemented_error() -> None:
    feature = compat.TorchFeature("a feature of a torch to come", (9, 0))
    assert not feature.available
    with pytest.raises(NotImplementedError, match=r"a feature of a torch to come needs torch 9\.0"):
        compat.require(feature)
    compat.require(compat.TorchFeature("a feature of every torch", (2, 0)))  # no error
