"""``WholeTensor``'s state in the usual sharded form, and back onto the owners.

[Note: sharded state form] Inside a step the inner optimizer's state lives whole on each
tensor's owner. Its ``state_dict()`` presents it as any sharded optimizer's would: a state
tensor of its parameter's shape becomes a DTensor with the parameter's placements, another
tensor of one or more dims a DTensor split along dim 0 over the same shard group, a 0-d tensor
a plain tensor on every rank, and a Python scalar stays one. Every rank then holds the same
keys, shapes and dtypes, which is what ``fullshard.checkpoint`` (and DCP) need: the owner
never writes a tensor alone, and a checkpoint written by ``WholeTensor(AdamW)`` is
indistinguishable from a plain sharded AdamW's. Building it costs one metadata exchange (JSON
bytes: names, dtypes, shapes, scalars; never pickle) and one :func:`exchange.scatter` per shard
group; loading, one :func:`exchange.gather` per shard group onto the *current* owners, so a
checkpoint from another world size lands where the tensors are owned now.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

import torch
from torch.distributed.tensor import DTensor, Shard

from . import exchange
from .layout import ShardLayout, layout_of

if TYPE_CHECKING:
    from .whole import WholeTensor, _Item

__all__ = ["load_sharded_state", "sharded_state"]


def _describe(value: Any) -> list[Any]:
    """A state entry as JSON: ``["t", dtype, shape]``, ``["0d", dtype, value]`` or
    ``["s", value]``."""
    if isinstance(value, torch.Tensor):
        dtype = str(value.dtype).removeprefix("torch.")
        if value.dim() == 0:
            return ["0d", dtype, value.item()]
        return ["t", dtype, list(value.shape)]
    if value is None or isinstance(value, bool | int | float | str):
        return ["s", value]
    raise TypeError(
        f"WholeTensor: optimizer state value of type {type(value).__name__} cannot "
        "be presented as a state dict (tensors and JSON scalars only)"
    )


def _split_dim(item: _Item, shape: tuple[int, ...]) -> int:
    return item.layout.dim if shape == item.layout.shape else 0


def _wrap(
    param: torch.Tensor, local: torch.Tensor, shape: tuple[int, ...], dim: int
) -> torch.Tensor:
    """``local`` as a DTensor on ``param``'s mesh, split along ``dim`` where it splits."""
    if not isinstance(param, DTensor):
        return local
    placements = tuple(Shard(dim) if type(p) is Shard else p for p in param.placements)
    return DTensor.from_local(
        local,
        param.device_mesh,
        placements,
        run_check=False,
        shape=torch.Size(shape),
        stride=torch.empty(shape, device="meta").stride(),
    )


def sharded_state(opt: WholeTensor) -> dict[int, dict[str, Any]]:
    """Collective: every parameter's state in the [Note: sharded state form], by position."""
    inner_state = opt.inner.state if opt.inner is not None else {}
    index = {id(item): n for n, item in enumerate(opt._items)}
    out: dict[int, dict[str, Any]] = {}
    for item in opt._items:
        if item.whole and item.proxy is not None and inner_state.get(item.proxy):
            out[index[id(item)]] = {
                name: _wrap(item.param, v, tuple(v.shape), _split_dim(item, tuple(v.shape)))
                if isinstance(v, torch.Tensor) and v.dim()
                else v
                for name, v in inner_state[item.proxy].items()
            }
    for items in opt._groups.values():
        group = items[0].layout.group
        assert group is not None
        mine = {
            str(index[id(i)]): [[name, *_describe(v)] for name, v in inner_state[i.proxy].items()]
            for i in items
            if i.mine and i.proxy is not None and inner_state.get(i.proxy)
        }
        device = items[0].local().device
        meta: dict[str, list[list[Any]]] = {}
        for payload in exchange.all_gather_json(group, json.dumps(mine).encode(), device):
            meta.update(json.loads(payload))
        lays: list[ShardLayout] = []
        owners: list[int] = []
        fulls: list[torch.Tensor | None] = []
        outs: list[torch.Tensor] = []
        placed: list[tuple[int, str, _Item, int]] = []
        for item in items:
            n = index[id(item)]
            entries = meta.get(str(n))
            if entries is None:
                continue
            state = out.setdefault(n, {})
            own = inner_state[item.proxy] if item.mine and item.proxy is not None else {}
            for name, kind, *rest in entries:
                if kind == "s":
                    state[name] = rest[0]
                elif kind == "0d":
                    dtype = getattr(torch, rest[0])
                    state[name] = own[name] if own else torch.tensor(rest[1], dtype=dtype)
                else:
                    dtype, shape = getattr(torch, rest[0]), tuple(rest[1])
                    dim = _split_dim(item, shape)
                    lay = item.layout.along(shape, dim)
                    lays.append(lay)
                    owners.append(item.owner)
                    fulls.append(own[name] if own else None)
                    outs.append(torch.empty(lay.piece_shape(lay.rank), dtype=dtype, device=device))
                    placed.append((n, name, item, dim))
                    state[name] = None  # filled below, keeping the owner's entry order
        exchange.scatter(group, lays, owners, fulls, outs)
        for (n, name, item, dim), lay, local in zip(placed, lays, outs):
            out[n][name] = _wrap(item.param, local, lay.shape, dim)
    return dict(sorted(out.items()))


def load_sharded_state(opt: WholeTensor, state_dict: dict[str, Any]) -> None:
    """Collective: load a state dict (of :func:`sharded_state`'s form, or a plain sharded or
    unsharded optimizer's) onto the current owners."""
    saved_groups = state_dict["param_groups"]
    if [len(g["params"]) for g in saved_groups] != [len(g["params"]) for g in opt.param_groups]:
        raise ValueError(
            "WholeTensor.load_state_dict: the state dict has param groups of sizes "
            f"{[len(g['params']) for g in saved_groups]}, this optimizer "
            f"{[len(g['params']) for g in opt.param_groups]}; build it with the same groups"
        )
    for outer, saved in zip(opt.param_groups, saved_groups):
        outer.update({k: v for k, v in saved.items() if k != "params"})
    saved_state = {int(k): v for k, v in state_dict["state"].items()}
    whole: dict[int, dict[str, Any]] = {}  # item position -> its state, whole, on the owner
    positions = {id(item): n for n, item in enumerate(opt._items)}
    for n, item in enumerate(opt._items):
        if item.whole and n in saved_state:
            whole[n] = {k: _whole_local(v, item) for k, v in saved_state[n].items()}
    for items in opt._groups.values():
        group = items[0].layout.group
        assert group is not None
        lays: list[ShardLayout] = []
        owners: list[int] = []
        locals_: list[torch.Tensor] = []
        wanted: list[tuple[int, str]] = []
        for item in items:
            n = positions[id(item)]
            if n not in saved_state:
                continue
            mine = whole.setdefault(n, {}) if item.mine else {}
            for name, v in saved_state[n].items():
                if isinstance(v, DTensor) and v.dim():
                    lay = layout_of(v, f"optimizer state {name!r} of parameter {n}")
                    if lay.size > 1 and lay.ranks != item.layout.ranks:
                        raise ValueError(
                            f"WholeTensor.load_state_dict: state {name!r} of parameter {n} is "
                            f"sharded over ranks {list(lay.ranks)}, its parameter over "
                            f"{list(item.layout.ranks)}"
                        )
                    if lay.size > 1:
                        lays.append(lay)
                        owners.append(item.owner)
                        locals_.append(v._local_tensor)
                        wanted.append((n, name))
                        mine[name] = None
                        continue
                if item.mine:
                    mine[name] = _whole_local(v, item)
        fulls, _, _ = exchange.gather(group, lays, owners, locals_)
        for (n, name), full in zip(wanted, fulls):
            if full is not None:
                whole[n][name] = full
    _load_inner(opt, whole)


def _whole_local(v: Any, item: _Item) -> Any:
    """A state value held whole on this rank, on the parameter's device."""
    if isinstance(v, DTensor):
        v = v.full_tensor() if layout_of(v, "optimizer state").size > 1 else v._local_tensor
    if isinstance(v, torch.Tensor) and v.dim():
        return v.to(item.local().device)
    return v


def _load_inner(opt: WholeTensor, whole: dict[int, dict[str, Any]]) -> None:
    if opt.inner is None:
        return
    inner = opt.inner
    for inner_group, group in zip(inner.param_groups, opt.param_groups):
        inner_group.update({k: v for k, v in group.items() if k != "params"})
    position = {id(p): k for k, p in enumerate(p for g in inner.param_groups for p in g["params"])}
    state: dict[int, dict[str, Any]] = {}
    for n, entries in whole.items():
        proxy = opt._items[n].proxy
        if proxy is not None:
            state[position[id(proxy)]] = entries
    sd = inner.state_dict()
    inner.load_state_dict({"state": state, "param_groups": sd["param_groups"]})
