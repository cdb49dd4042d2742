"""How one unit's parameters are partitioned into buffers: one per mesh, one per dtype.

A packed buffer is gathered and reduced by one collective over one process group, in one
dtype. :class:`~fullshard.engine.group.ParamGroup` keeps the parameters that share its mesh and
its dtype in its own buffer and gives every other mesh and dtype a child group
(:func:`split_by_mesh`, :func:`split_by_dtype`), issued, waited on, freed and reduced with it.

[Note: one group per mesh]
``shard_placement_fn`` may give a parameter its own mesh (FSDP2's ``ShardPlacementResult``;
e.g. MoE experts on an expert-parallel mesh). A collective runs over one process group, so
each other mesh gets a child group with its own buffer, all-gather and reduce-scatter (and
dtype split), issued, waited on, freed and reduced with this one; the unit's knobs apply to
every child. With int ``reshard_after_forward`` the children reshard fully.

[Note: one buffer per dtype]
A packed buffer has one dtype. With ``param_dtype`` set every parameter is cast to it and the
unit has one buffer (except parameters ``MixedPrecisionPolicy.param_dtype_override_fn`` keeps in
their own dtype, torch 2.15: each such dtype gets a child group, which gathers in that dtype
and reduces its own gradients). Otherwise the parameters are split by dtype: the dtype of the
trainable ones keeps the unit's buffer (and the gradient reduction); each other dtype, which
may only hold frozen parameters, gets a child group with its own buffer and all-gather. Gradients
of two dtypes in one unit would need one reduction per dtype: refused.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .mesh import MeshInfo
from .param import ShardedParam
from .policies import MixedPrecisionPolicy

__all__ = ["mesh_name", "ranks_of", "split_by_dtype", "split_by_mesh"]

Split = tuple[list[ShardedParam], list[list[ShardedParam]]]


def ranks_of(info: MeshInfo) -> tuple[tuple[int, ...], ...]:
    """The global ranks of a unit's shard and replicate groups: what a collective runs over."""
    groups = (info.shard_group, info.replicate_group)
    return tuple(tuple(dist.get_process_group_ranks(g)) for g in groups if g is not None)


def mesh_name(info: MeshInfo) -> str:
    """A mesh as a child group's name shows it."""
    names = info.mesh.mesh_dim_names
    return f"mesh {names}" if names else f"mesh {info.mesh.mesh.tolist()}"


def split_by_mesh(params: list[ShardedParam], info: MeshInfo) -> Split:
    """The parameters on ``info``'s mesh and, per other mesh, those sharded over it
    ([Note: one group per mesh])."""
    by_mesh: dict[tuple[tuple[int, ...], ...], list[ShardedParam]] = {}
    for sp in params:  # by ranks: units' MeshInfo objects differ (a tied parameter moves)
        by_mesh.setdefault(ranks_of(sp.info), []).append(sp)
    own = by_mesh.pop(ranks_of(info), [])
    return own, list(by_mesh.values())


def split_by_dtype(params: list[ShardedParam], mp: MixedPrecisionPolicy, unit: str) -> Split:
    """The parameters of the unit's own buffer and, per other dtype, those gathered apart
    ([Note: one buffer per dtype]); ``unit`` names the unit in errors."""
    if mp.param_dtype is not None:
        kept: dict[torch.dtype, list[ShardedParam]] = {}
        for sp in params:
            if sp.keeps_own_dtype and sp.orig_dtype != mp.param_dtype:
                kept.setdefault(sp.orig_dtype, []).append(sp)
        cast = [sp for sp in params if not any(sp in v for v in kept.values())]
        return cast, list(kept.values())
    by_dtype: dict[torch.dtype, list[ShardedParam]] = {}
    for sp in params:
        by_dtype.setdefault(sp.orig_dtype, []).append(sp)
    if len(by_dtype) <= 1:
        return params, []
    trainable = {sp.orig_dtype for sp in params if sp.requires_grad}
    if len(trainable) > 1:
        listing = ", ".join(f"{sp.fqn}: {sp.orig_dtype}" for sp in params if sp.requires_grad)
        raise ValueError(
            f"unit {unit!r} has trainable parameters of several dtypes ({listing}); a unit "
            f"reduces gradients in one dtype (frozen parameters may differ). Cast the module "
            f"to one dtype, set MixedPrecisionPolicy(param_dtype=...), or shard the odd "
            f"parameters in their own fully_shard call"
        )
    main = trainable.pop() if trainable else params[0].orig_dtype
    others = [group for dtype, group in by_dtype.items() if dtype != main]
    return by_dtype[main], others
