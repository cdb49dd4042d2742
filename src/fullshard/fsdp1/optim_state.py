"""FSDP1's optimizer state dicts over fullshard's sharded parameters.

An optimizer over fullshard parameters keeps its state as ``DTensor`` shards shaped like the
parameters, keyed by position (``optim.state_dict()``). FSDP1's forms re-key it by parameter
name (the clean FQN, as in the model's state dict) and choose the tensors:

- *full* (``FULL_STATE_DICT``, ``full_optim_state_dict``): each ``DTensor`` all-gathered, on
  the CPU when asked, on rank 0 only when asked (the others get ``{}``);
- *sharded* (``SHARDED_STATE_DICT``, ``sharded_optim_state_dict``): the ``DTensor`` shards
  (FSDP1: ``ShardedTensor``), on the CPU when asked;
- *local* (``LOCAL_STATE_DICT``): the local shards as plain tensors.

The way back (``optim_state_dict_to_load``, ``shard_full_optim_state_dict``,
``flatten_sharded_optim_state_dict``, ``scatter_full_optim_state_dict``) keys by position
again and cuts every tensor shaped like its parameter to this rank's rows (a ``DTensor`` is
taken as it is; torch's FSDP1's ``ShardedTensor`` is gathered first), so any of the three
forms, or torch's FSDP1's, loads into any world size or strategy. Entries
that are not shaped like the parameter (Adam's ``step``) pass unchanged.

Positions follow the optimizer's parameter order (``optim``), or ``model.parameters()``
where FSDP1's legacy functions are called without one.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import OptimStateKeyType
from torch.distributed.tensor import DTensor

from ..checkpoint.shards import wrap_like
from .orig_params import swap_replaced
from .state_dict import clean_fqn, full_of_sharded_tensor, is_sharded_tensor, shard_like

__all__ = ["export_optim_state", "import_optim_state", "param_order", "rekey", "scatter_from_rank0"]

Form = Literal["full", "sharded", "local"]


def param_order(model: nn.Module, optim: torch.optim.Optimizer | None) -> list[nn.Parameter]:
    """Parameters by position: the optimizer's (``state_dict()`` numbering), else the model's."""
    if optim is None:
        return list(model.parameters())
    swap_replaced(optim)  # an optimizer built before wrapping: the wrapped parameters
    out: list[nn.Parameter] = []
    seen: set[int] = set()
    for group in optim.param_groups:
        for p in group["params"]:
            if id(p) not in seen:
                seen.add(id(p))
                out.append(p)
    return out


def _fqn_of(model: nn.Module) -> dict[int, str]:
    fqns: dict[int, str] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        fqns.setdefault(id(p), clean_fqn(name))
    return fqns


def export_optim_state(
    model: nn.Module,
    params: list[nn.Parameter],
    osd: dict[str, Any],
    form: Form,
    *,
    offload_to_cpu: bool,
    rank0_only: bool,
    sort: bool = False,
) -> dict[str, Any]:
    """``osd`` (keyed by position in ``params``) keyed by FQN, its tensors in ``form``; the
    entries by name with ``sort``, else by position.

    Collective for ``full``: every rank calls it, in the same order.
    """
    fqns = _fqn_of(model)
    name_of = []
    for p in params:
        if id(p) not in fqns:
            raise ValueError(
                f"the optimizer holds a parameter of shape {list(p.shape)} that is not in "
                f"the model; pass the model whose parameters it optimizes"
            )
        name_of.append(fqns[id(p)])
    by_name = {name_of[index]: entries for index, entries in sorted(osd["state"].items())}
    if form == "full":
        _check_same_states(sorted(by_name))
    exported = {  # by name: the same order on every rank, whatever each optimizer's order
        name: {k: _export(v, form, offload_to_cpu) for k, v in by_name[name].items()}
        for name in sorted(by_name)
    }
    # FSDP1's order: by name with use_orig_params=True, by parameter otherwise
    state = exported if sort else {name: exported[name] for name in by_name}
    if form == "full" and rank0_only and dist.get_rank() != 0:
        return {}
    if "param_groups" not in osd:  # FSDP1 leaves them out too
        return {"state": state}
    groups = [
        {
            **{k: v for k, v in g.items() if k != "params"},
            "params": [name_of[i] for i in g["params"]],
        }
        for g in osd["param_groups"]
    ]
    return {"state": state, "param_groups": groups}


def _check_same_states(names: list[str]) -> None:
    """FSDP1's check before a full export, whose gathers every rank must run alike: each rank
    holds optimizer state for the parameters rank 0's optimizer does (and no others)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, names)
    missing = {r: sorted(set(everyone[0]) - set(n)) for r, n in enumerate(everyone)}
    extra = {r: sorted(set(n) - set(everyone[0])) for r, n in enumerate(everyone)}
    bad = {r: (m, extra[r]) for r, m in missing.items() if m or extra[r]}
    if bad:
        r, (m, e) = next(iter(bad.items()))
        raise RuntimeError(
            "FSDP currently requires each rank to have at least the optimizer states needed "
            f"by rank 0's optimizer but some ranks are missing some of those states: rank {r} "
            f"lacks {m[:4]} and has {e[:4]} beyond rank 0's; give every rank's optimizer the "
            "same parameters"
        )


def _export(value: Any, form: Form, offload_to_cpu: bool) -> Any:
    if not isinstance(value, DTensor):
        return value
    if form == "local":
        return value.to_local()
    out = value.full_tensor() if form == "full" else value
    return out.cpu() if offload_to_cpu else out


def import_optim_state(
    model: nn.Module, params: list[nn.Parameter], osd: dict[str, Any], *, local: bool = False
) -> dict[str, Any]:
    """``osd`` (keyed by FQN, any form) keyed by position in ``params``, its tensors shaped
    like the parameters are this rank's part (``local``: they are the local shards)."""
    index_of = {name: i for i, name in _names(model, params)}
    state: dict[int, Any] = {}
    for name, entries in osd["state"].items():
        i = _index(index_of, name)
        state[i] = {k: _import(v, params[i], local) for k, v in entries.items()}
    groups = [
        {
            **{k: v for k, v in g.items() if k != "params"},
            "params": sorted(_index(index_of, n) for n in g["params"]),
        }
        for g in osd.get("param_groups", [])
    ]
    return {"state": state, "param_groups": groups}


def _names(model: nn.Module, params: list[nn.Parameter]) -> Iterable[tuple[int, str]]:
    fqns = _fqn_of(model)
    return ((i, fqns.get(id(p), f"<parameter {i}>")) for i, p in enumerate(params))


def _index(index_of: dict[str, int], name: str) -> int:
    if name not in index_of:
        raise KeyError(
            f"the optimizer state dict has an entry for {name!r}, which is no parameter of "
            f"the model (or not one the optimizer holds)"
        )
    return index_of[name]


def _import(value: Any, param: nn.Parameter, local: bool) -> Any:
    if is_sharded_tensor(value):  # torch's FSDP1's sharded form
        value = full_of_sharded_tensor(value)
    if not isinstance(value, torch.Tensor) or isinstance(value, DTensor):
        return value
    if not isinstance(param, DTensor) or value.dim() == 0:
        return value.clone()  # the optimizer keeps it as it is (Adam's "step")
    if local:
        return wrap_like(param, value.clone()) if value.dim() == param.dim() else value.clone()
    if tuple(value.shape) != tuple(param.shape):
        return value  # e.g. a scalar "step"
    return shard_like(param, value)


def rekey(
    osd: dict[str, Any],
    key_type: OptimStateKeyType,
    model: nn.Module,
    params: list[nn.Parameter],
) -> dict[str, Any]:
    """``rekey_optim_state_dict``: between FQN keys and position keys (each group's list
    sorted, as FSDP1); tensors untouched, ``osd`` returned as is when already keyed so."""
    names = dict(_names(model, params))
    index_of = {n: i for i, n in names.items()}
    want = str if key_type is OptimStateKeyType.PARAM_NAME else int
    keys = list(osd["state"]) + [k for g in osd["param_groups"] for k in g["params"]]
    if all(isinstance(k, want) for k in keys):
        return osd

    def convert(k: Any) -> Any:
        return names[k] if want is str else index_of[k]

    groups = [
        {
            **copy.deepcopy({k: v for k, v in g.items() if k != "params"}),
            "params": sorted(convert(k) for k in g["params"]),
        }
        for g in osd["param_groups"]
    ]
    return {"state": {convert(k): v for k, v in osd["state"].items()}, "param_groups": groups}


def scatter_from_rank0(
    osd: dict[str, Any] | None, group: dist.ProcessGroup | None
) -> dict[str, Any]:
    """Rank 0's ``osd`` on every rank of ``group`` (each then keeps only its own rows)."""
    box: list[Any] = [osd if dist.get_rank() == 0 else None]
    src = 0 if group is None else dist.get_global_rank(group, 0)
    dist.broadcast_object_list(box, src=src, group=group)
    if box[0] is None:
        raise ValueError(
            "scatter_full_optim_state_dict needs the full optimizer state dict on rank 0"
        )
    return box[0]  # type: ignore[no-any-return]
