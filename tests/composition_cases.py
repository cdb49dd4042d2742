"""Sub-cases of the 4-rank composition spawn (tests/test_composition.py): dp_mesh_dims,
per-parameter meshes, the all-gather extension on TP parameters, and TP with meta-device
init, CPU offload and the packed transport. Each trains against one process (and, where
FSDP2 can run it, against torch FSDP2) on the same global batch."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import DataParallelMeshDims
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from fullshard import CommPolicy, CPUOffloadPolicy, count_collectives, fully_shard
from parity import full_state

# Placement on the tp dim of each TPNet parameter (everything else: Replicate()).
TP_PLACEMENTS = {"up.weight": Shard(0), "up.bias": Shard(0), "down.weight": Shard(1)}


def spmd_distribute(model: nn.Module, mesh: DeviceMesh) -> nn.Module:
    """Make every parameter a DTensor on the full (dp, tp) mesh, Replicate() on dp: the
    blocks' up/down tensor-parallel (colwise/rowwise), the rest replicated; the model's
    input and output are local tensors (each dp rank its own batch slice, as in plain FSDP)."""
    for fqn, p in list(model.named_parameters()):
        owner, _, name = fqn.rpartition(".")
        tp = TP_PLACEMENTS.get(".".join(fqn.split(".")[-2:]), Replicate())
        mod = model.get_submodule(owner)
        mod.register_parameter(
            name, nn.Parameter(distribute_tensor(p.detach(), mesh, [Replicate(), tp]))
        )

    def to_dtensor(_m, args):
        return (DTensor.from_local(args[0], mesh, [Replicate(), Replicate()], run_check=False),)

    def to_local(_m, _args, out):
        return out.redistribute(mesh, [Replicate(), Replicate()]).to_local()

    model.register_forward_pre_hook(to_dtensor)
    model.register_forward_hook(to_local)
    return model


def spmd_shard(model: nn.Module, mesh: DeviceMesh, shard_fn=fully_shard) -> nn.Module:
    dims = DataParallelMeshDims(shard="dp")
    for b in model.blocks:
        shard_fn(b, mesh=mesh, dp_mesh_dims=dims)
    shard_fn(model, mesh=mesh, dp_mesh_dims=dims)
    return model



def dp_mesh_dims_case(out: dict) -> None:
    """TP + FSDP in FSDP2's full-SPMD-mesh form, against one process and torch FSDP2."""
    from test_composition import STEPS, _compare, _reference, _tp_net, _train

    ref_losses, ref_state = _reference(_tp_net, STEPS, clip=None)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    dp = mesh["dp"].get_local_rank()
    for name, shard_fn in (("spmd", fully_shard), ("spmd_fsdp2", torch_fully_shard)):
        model = spmd_shard(spmd_distribute(_tp_net(), mesh), mesh, shard_fn)
        w = model.blocks[0].up.weight
        out[f"{name}_placements"] = (
            w.device_mesh.mesh_dim_names,
            [(type(p).__name__, p.dim) for p in w.placements],
        )
        losses = _train(model, STEPS, dp, 2)
        out[f"{name}_losses"] = losses
        _compare(name, losses, ref_losses, full_state(model), ref_state, out)
