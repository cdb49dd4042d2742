"""Composition: TP x FSDP on a (dp, tp) mesh, sub-meshes, Shard(d) placements, dtype casts.

Every case trains against one process on the same global batch (fp32: rel. loss < 1e-5 at
every step, full weights < 1e-4). One spawn of 4 ranks runs them all: the 2- and 3-rank jobs
(Shard(-1), float64, loading the TP checkpoint on plain FSDP) run on subgroup meshes.
"""

from __future__ import annotations

import tempfile

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    parallelize_module,
)

import composition_cases
from composition_cases import BlockNet, block_net
from fullshard import checkpoint as ckpt
from fullshard import clip_grad_norm_, count_collectives, fully_shard
from fullshard.engine.compat import DP_MESH_DIMS, TORCH_VERSION
from fullshard.testing import run_distributed
from parity import GLOBAL_BATCH, batch, full_state, loss_fn, make_net, make_optimizer, shard_net
from test_composition_extra import BitsGather

VOCAB, DIM, HIDDEN = 13, 10, 14  # HIDDEN / tp = 7 rows: uneven over dp = 2
STEPS = 4
LOSS_TOL, WEIGHT_TOL = 1e-5, 1e-4
CLIP = 0.05  # below every step's gradient norm, so clipping always acts


class TPBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.up = nn.Linear(DIM, HIDDEN)
        self.down = nn.Linear(HIDDEN, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x))))


def _tp_net() -> BlockNet:
    return block_net(TPBlock)


def _train(model, steps, dp_rank, dp_size, clip=None, dtype=torch.float32, group=None):
    """Train on this dp rank's slice of the global batch; per step the global mean loss (over
    ``group``'s ranks, default all)."""
    opt = make_optimizer(model)
    losses = []
    per = GLOBAL_BATCH // dp_size
    for step in range(steps):
        x, y = batch(step)
        x, y = x[dp_rank * per : (dp_rank + 1) * per], y[dp_rank * per : (dp_rank + 1) * per]
        loss = loss_fn(model(x).to(dtype), y)
        loss.backward()
        if clip is not None:  # the norm joins the losses: both must match the reference
            norm = clip(model.parameters(), CLIP)
            assert norm.item() > CLIP  # it clips
            losses.append(norm.item())
        opt.step()
        opt.zero_grad()
        total = loss.detach().clone()
        if dist.is_initialized() and dp_size > 1:
            dist.all_reduce(total, group=group)  # every rank of a dp slice holds the same loss
            total /= dist.get_world_size(group)
        losses.append(total.item())
    return losses


def _compare(name, losses, ref_losses, state, ref_state, out):
    loss_err = max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses))
    w_err = max((state[k] - ref_state[k]).abs().max().item() for k in ref_state)
    out[name] = (loss_err, w_err)


def _reference(make, steps, dtype=torch.float32, clip=torch.nn.utils.clip_grad_norm_):
    model = make().to(dtype)
    losses = _train(model, steps, 0, 1, clip=clip, dtype=dtype)
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def _tp_fsdp(mesh: DeviceMesh, make=None, prepare=None, **fully_shard_kwargs) -> BlockNet:
    """TP on each block (``prepare`` runs after it), then fully_shard over dp, bottom-up."""
    model = (make or _tp_net)()
    dp = mesh["dp"] if "dp" in (mesh.mesh_dim_names or ()) else mesh["replicate", "shard"]
    for b in model.blocks:
        parallelize_module(b, mesh["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
    if prepare is not None:
        prepare(model)
    for b in model.blocks:
        fully_shard(b, mesh=dp, **fully_shard_kwargs)
    fully_shard(model, mesh=dp, **fully_shard_kwargs)
    return model


def _four_ranks(path: str) -> dict:
    out: dict = {}
    rank = dist.get_rank()
    ref_losses, ref_state = _reference(_tp_net, STEPS)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    model = _tp_fsdp(mesh)
    w = model.blocks[0].up.weight
    out["placements"] = [(type(p).__name__, p.dim) for p in w.placements]
    assert isinstance(w, DTensor) and w.device_mesh.mesh_dim_names == ("dp", "tp")
    losses = _train(model, STEPS, mesh["dp"].get_local_rank(), 2, clip=clip_grad_norm_)
    out["saved"] = full_state(model)
    _compare("tp_fsdp", losses, ref_losses, out["saved"], ref_state, out)
    ckpt.save(path, model=model)
    composition_cases.tp_variants_case(out, mesh, (ref_losses, ref_state))
    if DP_MESH_DIMS.available:  # torch 2.12: the full-SPMD mesh form, per-parameter meshes
        composition_cases.dp_mesh_dims_case(out)
        composition_cases.per_param_mesh_case(out)
        composition_cases.spmd_forms_case(out)
    # A sub-mesh from a subgroup: ranks {0, 1} and {2, 3} each train the whole model.
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    trio = dist.new_group([0, 1, 2])  # every rank creates every group
    pair = pairs[rank // 2]
    sub = DeviceMesh.from_group(pair, "cpu")
    net_ref = _reference(lambda: make_net(), STEPS)
    net = shard_net(make_net(), mesh=sub)
    losses = _train(net, STEPS, rank % 2, 2, clip=clip_grad_norm_, group=pair)
    _compare("from_group", losses, net_ref[0], full_state(net), net_ref[1], out)
    # Then 2- and 3-rank jobs on subgroups (one spawn, not three): Shard(-1) on {0, 1}
    # while {2, 3} load the checkpoint on plain FSDP and train in float64; then uneven
    # Shard(-1) on {0, 1, 2}.
    if rank < 2:
        _shard_last_dim(out, sub, pair, net_ref)
    else:
        loaded = shard_net_tp_free(sub)
        ckpt.load(path, model=loaded)
        out["ckpt_2"] = full_state(loaded)
        ref64 = _reference(lambda: make_net(), STEPS, dtype=torch.float64)
        net64 = shard_net(make_net(), mesh=sub)
        net64.to(torch.float64)
        out["dtype64"] = str(net64.blocks[0].up.weight.dtype)
        losses = _train(net64, STEPS, rank % 2, 2, clip_grad_norm_, torch.float64, pair)
        _compare("float64", losses, ref64[0], full_state(net64), ref64[1], out)
    if rank < 3:
        _shard_last_dim(out, DeviceMesh.from_group(trio, "cpu"), trio, net_ref)
    return out


def _shard_dim(p: nn.Parameter):
    return Shard(-1) if p.dim() > 1 else None


def _shard_last_dim(out: dict, mesh: DeviceMesh, group, ref: tuple[list[float], dict]) -> None:
    """Shard(-1) on ``mesh`` (2 or 3 ranks; uneven on 3), plain and with the extension."""
    world, rank = mesh.size(), mesh.get_local_rank()
    net = shard_net(make_net(), mesh=mesh, shard_placement_fn=_shard_dim)
    up = net.blocks[0].up.weight  # [7, 10]: dim 1 splits 5 + 5 on 2 ranks, 4 + 4 + 2 on 3
    out[f"placement_{world}"] = [(type(p).__name__, p.dim) for p in up.placements]
    out[f"local_shape_{world}"] = tuple(up.to_local().shape)
    losses = _train(net, STEPS, rank, world, clip=clip_grad_norm_, group=group)
    _compare(f"shard_last_dim_{world}", losses, ref[0], full_state(net), ref[1], out)
    out[f"unsharded_after_step_{world}"] = sum(
        st.group.unsharded_bytes_allocated for st in _states(net)
    )
    # The all-gather extension on Shard(-1) weights (uneven on 3 ranks): gathered as int32.
    ext = make_net()
    for b in ext.blocks:
        b.up.weight = nn.Parameter(BitsGather(b.up.weight.detach().clone()))
    ext = shard_net(ext, mesh=mesh, shard_placement_fn=_shard_dim)
    with count_collectives() as stats:
        losses = _train(ext, STEPS, rank, world, clip=clip_grad_norm_, group=group)
    out[f"ext_gather_dtypes_{world}"] = sorted(
        {str(r.dtype) for r in stats.records if r.kind == "all_gather"}
    )
    _compare(f"extension_last_dim_{world}", losses, ref[0], full_state(ext), ref[1], out)


def shard_net_tp_free(mesh: DeviceMesh) -> BlockNet:
    model = _tp_net()
    for b in model.blocks:
        fully_shard(b, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _states(model):
    from fullshard.api import _all_states

    return _all_states(model)


def _check(out: dict, name: str) -> None:
    loss_err, w_err = out[name]
    assert loss_err < LOSS_TOL, (name, loss_err)
    assert w_err < WEIGHT_TOL, (name, w_err)


def _check_spmd_forms(r: dict) -> None:
    """The full-SPMD mesh form and per-parameter meshes (torch 2.12), against FSDP2."""
    # dp_mesh_dims: sharded on the full (dp, tp) mesh, as torch FSDP2 shards it.
    for name in ("spmd", "spmd_fsdp2"):
        _check(r, name)
        assert r[f"{name}_placements"] == (
            ("dp", "tp"),
            [("_StridedShard", 0), ("Shard", 0)],
        )
    assert r["spmd_losses"] == r["spmd_fsdp2_losses"]
    # Per-parameter mesh: experts on (ep_replicate, ep_shard), the rest on 4 ranks.
    for name in ("per_param_mesh", "per_param_mesh_fsdp2"):
        _check(r, name)
        assert r[f"{name}_experts"] == (
            ("ep_replicate", "ep_shard"),
            ["Replicate", "Shard"],
        )
    hsdp_beside_flat = [
        ("all_gather", 2),
        ("all_gather", 4),
        ("all_reduce", 2),
        ("reduce_scatter", 2),
        ("reduce_scatter", 4),
    ]
    assert r["per_param_mesh_groups"] == hsdp_beside_flat
    # dp_mesh_dims' HSDP (replicate=) and flattened forms on a full (r, s) mesh, each
    # beside experts given the other form by shard_placement_fn: as torch FSDP2 does.
    hsdp = ("r", "s"), [("Replicate", None), ("Shard", 0)]
    flat = ("r_s",), [("Shard", 0)]
    # torch 2.12's FSDP2 keeps a flattened form's parameter on the full mesh, sharded twice
    # (the same rows per rank); fullshard and 2.13's FSDP2 put it on the flattened mesh
    torch_flat = flat if TORCH_VERSION >= (2, 13) else (("r", "s"), [("Shard", 0), ("Shard", 0)])
    for form, dense, experts in (("hsdp", hsdp, flat), ("flat", flat, hsdp)):
        ours, fsdp2 = f"spmd_{form}", f"spmd_{form}_fsdp2"
        _check(r, ours)
        _check(r, fsdp2)
        assert r[f"{ours}_placements"] == (dense, experts), r[f"{ours}_placements"]
        theirs = tuple(torch_flat if x == flat else x for x in (dense, experts))
        assert r[f"{fsdp2}_placements"] == theirs, r[f"{fsdp2}_placements"]
        assert r[f"{ours}_groups"] == hsdp_beside_flat
        assert r[f"{ours}_losses"] == r[f"{fsdp2}_losses"], form


def test_tp_fsdp_submesh_shard_dim_and_casts() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = f"{tmp}/ckpt"
        four = run_distributed(_four_ranks, 4, path, start_method="forkserver")
        assert four[0]["placements"] == [("_StridedShard", 0), ("Shard", 0)]
        for r in four:
            for name in ("tp_fsdp", "from_group", "tp_offload", "tp_packed", "tp_meta_init"):
                _check(r, name)
            # The all-gather extension on TP weights: their bytes go on the wire as int32.
            _check(r, "tp_extension")
            assert r["tp_extension_gather_dtypes"] == ["torch.float32", "torch.int32"]
            if DP_MESH_DIMS.available:  # torch 2.12
                _check_spmd_forms(r)
        # Shard(-1) on 2 ranks ({0, 1}) and uneven on 3 ({0, 1, 2}), with the extension.
        assert [r["local_shape_2"] for r in four[:2]] == [(7, 5), (7, 5)]
        assert [r["local_shape_3"] for r in four[:3]] == [(7, 4), (7, 4), (7, 2)]
        for world, ranks in ((2, four[:2]), (3, four[:3])):
            for r in ranks:
                assert r[f"placement_{world}"] == [("Shard", 1)]
                assert r[f"unsharded_after_step_{world}"] == 0
                _check(r, f"shard_last_dim_{world}")
                _check(r, f"extension_last_dim_{world}")
                assert r[f"ext_gather_dtypes_{world}"] == ["torch.float32", "torch.int32"]
        for r in four[2:]:  # float64 after fully_shard, on {2, 3}
            assert r["dtype64"] == "torch.float64"
            _check(r, "float64")
        # The checkpoint saved on (dp=2, tp=2) loads on 2 plain FSDP ranks ({2, 3}) and on 1
        # process with the full weights it was saved with, bit for bit.
        single = _tp_net()
        ckpt.load(path, model=single)
        saved = four[0]["saved"]
        assert set(single.state_dict()) == set(saved) == set(four[2]["ckpt_2"])
        for k, v in single.state_dict().items():
            assert torch.equal(v, saved[k]), k
            for r in four[2:]:
                assert torch.equal(r["ckpt_2"][k], saved[k]), k
