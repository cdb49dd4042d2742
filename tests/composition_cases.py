"""Shared model and sub-cases of the composition tests.

:class:`BlockNet` (an embedding, a few blocks of one class, a linear head) is the model of
``tests/test_composition.py`` and ``tests/test_composition_extra.py``. The rest are sub-cases
of the 4-rank composition spawn (tests/test_composition.py): dp_mesh_dims (its plain, HSDP
and flattened forms, and beside per-parameter meshes), per-parameter meshes, the all-gather
extension on TP parameters, and TP with meta-device init, CPU offload and the packed
transport. Each trains against one process (and, where FSDP2 can run it, against torch FSDP2)
on the same global batch."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard, distribute_tensor

from fullshard import CommPolicy, CPUOffloadPolicy, count_collectives, fully_shard
from fullshard.engine.compat import DataParallelMeshDims
from parity import DIM, VOCAB, full_state


class BlockNet(nn.Module):
    """An embedding, ``n_blocks`` blocks ``block_cls()`` (each maps ``[batch, seq, DIM]`` to
    the same shape) and a linear head: the skeleton every composition test model shares."""

    def __init__(self, block_cls: Callable[[], nn.Module], n_blocks: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList([block_cls() for _ in range(n_blocks)])
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.embed(idx)
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def block_net(block_cls: Callable[[], nn.Module], seed: int = 0) -> BlockNet:
    """A :class:`BlockNet` initialised from ``seed`` (every rank and the reference agree)."""
    torch.manual_seed(seed)
    return BlockNet(block_cls)


HIDDEN = 14

# Placement on the tp dim of each TPBlock parameter (everything else: Replicate()).
TP_PLACEMENTS = {"up.weight": Shard(0), "up.bias": Shard(0), "down.weight": Shard(1)}


def tp_placements(fqn: str) -> list[Placement]:
    """On a (dp, tp) mesh: Replicate() on dp; the blocks' up/down colwise/rowwise on tp."""
    return [Replicate(), TP_PLACEMENTS.get(".".join(fqn.split(".")[-2:]), Replicate())]


def spmd_distribute(
    model: nn.Module, mesh: DeviceMesh, placements: Callable[[str], list[Placement]]
) -> nn.Module:
    """Make every parameter a DTensor on the full mesh with ``placements(fqn)`` (Replicate()
    on the dp dims); the model's input and output are local tensors (each dp rank its own
    batch slice, as in plain FSDP)."""
    for fqn, p in list(model.named_parameters()):
        owner, _, name = fqn.rpartition(".")
        mod = model.get_submodule(owner)
        dt = distribute_tensor(p.detach(), mesh, placements(fqn))
        mod.register_parameter(name, nn.Parameter(dt))
    replicated = [Replicate()] * mesh.ndim

    def to_dtensor(_m, args):
        return (DTensor.from_local(args[0], mesh, replicated, run_check=False),)

    def to_local(_m, _args, out):
        return out.redistribute(mesh, replicated).to_local()

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
        model = spmd_shard(spmd_distribute(_tp_net(), mesh, tp_placements), mesh, shard_fn)
        w = model.blocks[0].up.weight
        out[f"{name}_placements"] = (
            w.device_mesh.mesh_dim_names,
            [(type(p).__name__, p.dim) for p in w.placements],
        )
        losses = _train(model, STEPS, dp, 2)
        out[f"{name}_losses"] = losses
        _compare(name, losses, ref_losses, full_state(model), ref_state, out)


class MoEBlock(nn.Module):
    """A dense MLP and two "experts" whose dim 0 (2) is smaller than the 4 dp ranks."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.up = nn.Linear(DIM, HIDDEN)
        self.down = nn.Linear(HIDDEN, DIM)
        self.experts = nn.Parameter(torch.randn(2, DIM, DIM) * 0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.down(F.gelu(self.up(self.norm(x))))
        return h + torch.einsum("btd,edk->btk", h, self.experts) / 2


def _moe_net() -> BlockNet:
    return block_net(MoEBlock)


def per_param_mesh_case(out: dict) -> None:
    """Experts sharded over a (replicate=2, shard=2) mesh, the dense rest over all 4 ranks,
    in one unit per block (FSDP2's ShardPlacementResult); against one process and FSDP2."""
    from torch.distributed.fsdp._fully_shard._fsdp_common import (  # FSDP2's own types
        HSDPMeshInfo,
        ShardPlacementResult,
    )

    from test_composition import STEPS, _compare, _reference, _train

    ref_losses, ref_state = _reference(_moe_net, STEPS, clip=None)
    world = init_device_mesh("cpu", (4,), mesh_dim_names=("dp",))
    ep = init_device_mesh("cpu", (2, 2), mesh_dim_names=("ep_replicate", "ep_shard"))
    ep_info = HSDPMeshInfo(ep, shard_mesh_dim=1, replicate_mesh_dim=0)

    def experts_on_ep(p: nn.Parameter):
        return ShardPlacementResult(placement=Shard(0), mesh_info=ep_info) if p.dim() == 3 else None

    for name, shard_fn in (
        ("per_param_mesh", fully_shard),
        ("per_param_mesh_fsdp2", torch_fully_shard),
    ):
        model = _moe_net()
        for b in model.blocks:
            shard_fn(b, mesh=world, shard_placement_fn=experts_on_ep)
        shard_fn(model, mesh=world)
        w = model.blocks[0].experts
        out[f"{name}_experts"] = (
            w.device_mesh.mesh_dim_names,
            [type(p).__name__ for p in w.placements],
        )
        with count_collectives() as stats:
            losses = _train(model, STEPS, dist.get_rank(), 4)
        out[f"{name}_groups"] = sorted({(r.kind, r.group_size) for r in stats.records})
        _compare(name, losses, ref_losses, full_state(model), ref_state, out)


def _placements(w: DTensor) -> tuple:
    return w.device_mesh.mesh_dim_names, [
        (type(p).__name__, getattr(p, "dim", None)) for p in w.placements
    ]


def spmd_forms_case(out: dict) -> None:
    """dp_mesh_dims' HSDP form (``replicate=``) and flattened form (two shard names) on a full
    (r=2, s=2) mesh, each beside experts that ``shard_placement_fn`` gives the other form
    (FSDP2's per-parameter mesh_info with dp_mesh_dims); against one process and FSDP2."""
    from torch.distributed.fsdp._fully_shard._fsdp_common import (  # FSDP2's own types
        FSDPMeshInfo,
        ShardPlacementResult,
    )
    from torch.distributed.fsdp._fully_shard._fsdp_init import _get_mesh_info

    from test_composition import STEPS, _compare, _reference, _train

    ref_losses, ref_state = _reference(_moe_net, STEPS, clip=None)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("r", "s"))
    hsdp = DataParallelMeshDims(shard="s", replicate="r")
    flat = DataParallelMeshDims(shard=("r", "s"))
    # A mesh_info with dp_mesh_dims must say which full mesh the parameter lives on.
    no_spmd = FSDPMeshInfo(mesh["s"], shard_mesh_dim=0, dp_mesh_dims=flat)
    with pytest.raises(ValueError, match=r"'experts' a mesh_info.*no spmd_mesh"):
        fully_shard(
            spmd_distribute(_moe_net(), mesh, lambda _fqn: [Replicate(), Replicate()]).blocks[0],
            mesh=mesh,
            dp_mesh_dims=hsdp,
            shard_placement_fn=lambda p: (
                ShardPlacementResult(Shard(0), no_spmd) if p.dim() == 3 else None
            ),
        )
    for form, unit_dims, expert_dims in (("hsdp", hsdp, flat), ("flat", flat, hsdp)):
        expert_info = _get_mesh_info(mesh, expert_dims)  # FSDP2's, with spmd_mesh=mesh

        def experts(p: nn.Parameter, info=expert_info):
            return (
                ShardPlacementResult(placement=Shard(0), mesh_info=info) if p.dim() == 3 else None
            )

        for name, shard_fn in (
            (f"spmd_{form}", fully_shard),
            (f"spmd_{form}_fsdp2", torch_fully_shard),
        ):
            model = spmd_distribute(_moe_net(), mesh, lambda _fqn: [Replicate(), Replicate()])
            for b in model.blocks:
                shard_fn(b, mesh=mesh, dp_mesh_dims=unit_dims, shard_placement_fn=experts)
            shard_fn(model, mesh=mesh, dp_mesh_dims=unit_dims)
            b = model.blocks[0]
            out[f"{name}_placements"] = (_placements(b.up.weight), _placements(b.experts))
            with count_collectives() as stats:
                losses = _train(model, STEPS, dist.get_rank(), 4)
            out[f"{name}_groups"] = sorted({(r.kind, r.group_size) for r in stats.records})
            out[f"{name}_losses"] = losses
            _compare(name, losses, ref_losses, full_state(model), ref_state, out)


def _bits_weights(model: nn.Module) -> None:
    """Make the blocks' TP weights' local tensors BitsGather (the extension, on TP)."""
    from test_composition_extra import BitsGather

    for b in model.blocks:
        for lin in (b.up, b.down):
            w = lin.weight
            local = BitsGather(w._local_tensor.detach().clone())
            lin.weight = nn.Parameter(
                DTensor.from_local(
                    local, w.device_mesh, w.placements, shape=w.shape, stride=w.stride()
                )
            )


def tp_variants_case(out: dict, mesh: DeviceMesh, ref: tuple[list[float], dict]) -> None:
    """TP x FSDP on (dp=2, tp=2) with CPU offload, the packed transport, the all-gather
    extension on TP weights, and meta-device init; each against one process."""
    from fullshard import clip_grad_norm_
    from test_composition import STEPS, TPBlock, _compare, _reference, _tp_fsdp, _train

    dp = mesh["dp"].get_local_rank()
    variants = {
        "tp_offload": {"offload_policy": CPUOffloadPolicy(pin_memory=False)},
        "tp_packed": {"comm_policy": CommPolicy(transport="packed")},
        "tp_extension": {"prepare": _bits_weights},
    }
    for name, kwargs in variants.items():
        model = _tp_fsdp(mesh, **kwargs)
        with count_collectives() as stats:
            losses = _train(model, STEPS, dp, 2, clip=clip_grad_norm_)
        out[f"{name}_gather_dtypes"] = sorted(
            {str(r.dtype) for r in stats.records if r.kind == "all_gather"}
        )
        _compare(name, losses, ref[0], full_state(model), ref[1], out)
    # Meta-device init: TP and fully_shard on meta, then to_empty and an init of the shards.
    with torch.device("meta"):
        model = _tp_fsdp(mesh, make=lambda: BlockNet(TPBlock))
    model.to_empty(device="cpu")
    torch.manual_seed(dp)  # the tp ranks of one dp rank draw the same replicated values
    with torch.no_grad():
        for p in model.parameters():
            p._local_tensor.normal_(0.0, 0.3)
    init = full_state(model)

    def from_init() -> BlockNet:
        net = BlockNet(TPBlock)
        net.load_state_dict(init)
        return net

    meta_ref = _reference(from_init, STEPS)
    losses = _train(model, STEPS, dp, 2, clip=clip_grad_norm_)
    _compare("tp_meta_init", losses, meta_ref[0], full_state(model), meta_ref[1], out)
