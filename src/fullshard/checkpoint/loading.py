"""Load a checkpoint into a model (and optimizer) of any world size and mesh: resharding.

Nothing here is collective. Each rank asks the target tensor which box of the global tensor it
holds (``shards.local_box``: its DTensor placements, or everything for a plain tensor), reads
that box from whatever saved shards overlap it (``CheckpointReader.read_box``), and hands the
result back through ``model.load_state_dict`` / ``optimizer.load_state_dict`` as DTensors with
the target's own placements. So a checkpoint saved on 2 ranks loads on 1, 3 or 4 ranks, or on
an HSDP mesh, and each rank reads only the rows it keeps.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from .manifest import CheckpointError, CheckpointMismatchError, Manifest, TensorRecord
from .reader import CheckpointReader
from .safetensors_io import ST_TO_DTYPE
from .saving import wait_for_pending_save
from .shards import Box, local_box, model_aliases, wrap_like

__all__ = ["apply_model_state", "load", "optimizer_state_dict"]

# model.load_state_dict is called once per this many bytes of local shards, bounding the extra
# memory a load needs to about this much (plus one tensor).
_LOAD_BATCH_BYTES = 256 << 20


def load(
    path: str | os.PathLike[str],
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    strict: bool = True,
) -> dict[str, Any]:
    """Load the checkpoint at ``path`` into ``model`` (and ``optimizer``); return its ``extra``.

    ``path`` is a checkpoint directory, or a root / run directory meaning its newest complete
    checkpoint. The model may be sharded differently from when it was saved (any world size,
    1-D or HSDP mesh, or not sharded at all). With ``strict`` every model key must be in the
    checkpoint and vice versa. The optimizer must hold the same parameters (by FQN) in the same
    param groups as the saved one; its state and hyperparameters are replaced.
    """
    wait_for_pending_save()  # a background save may be writing the checkpoint asked for
    reader = CheckpointReader(path)
    m = reader.manifest
    where = str(reader.path)

    def source(fqn: str) -> Callable[[Box], torch.Tensor] | None:
        key = fqn if fqn in m.model else m.model_aliases.get(fqn)
        if key is None:
            return None
        rec = m.model[key]
        return lambda box: reader.read_box(rec, f"model/{key}", box)

    shapes = {k: v.shape for k, v in m.model.items()}
    shapes.update({k: m.model[v].shape for k, v in m.model_aliases.items()})
    # Build the optimizer state first: a mismatch is reported before the model is touched.
    optim_sd = None if optimizer is None else optimizer_state_dict(reader, model, optimizer)
    apply_model_state(model, source, shapes, where, strict=strict)
    if optimizer is not None:
        optimizer.load_state_dict(optim_sd)  # type: ignore[arg-type]
    return copy.deepcopy(m.extra)


def apply_model_state(
    model: nn.Module,
    source: Callable[[str], Callable[[Box], torch.Tensor] | None],
    shapes: dict[str, tuple[int, ...]],
    where: str,
    *,
    strict: bool,
) -> None:
    """Fill every tensor of ``model.state_dict()`` from ``source(fqn)(box)``.

    ``shapes`` is the global shape of every tensor the source has (checked before anything is
    read or written, so a mismatch changes nothing); also used by :mod:`full_state_dict`.
    """
    targets = model.state_dict()
    aliases = model_aliases(model)  # tied name -> first name
    tied: dict[str, list[str]] = {}  # first name -> every name of that tensor
    for name, first in aliases.items():
        tied.setdefault(first, [first]).append(name)

    def find(fqn: str) -> Callable[[Box], torch.Tensor] | None:
        """A source for ``fqn``, or for any name tied to it (e.g. only lm_head in a file)."""
        first = aliases.get(fqn, fqn)
        for name in [fqn, *tied.get(first, [first])]:
            got = source(name)
            if got is not None:
                return got
        return None

    missing = [k for k in targets if find(k) is None]
    unexpected = [k for k in shapes if k not in targets]
    wrong = [
        f"{k}: checkpoint {list(shapes[k])} vs model {list(t.shape)}"
        for k, t in targets.items()
        if k in shapes and tuple(t.shape) != tuple(shapes[k])
    ]
    if wrong or (strict and (missing or unexpected)):
        raise CheckpointMismatchError(
            f"{where} does not fit the model",
            "Load it into the model it was saved from"
            + (", or pass strict=False to skip missing/unexpected keys" if strict else ""),
            missing=missing if strict else [],
            unexpected=unexpected if strict else [],
            shapes=wrong,
        )
    batch: dict[str, torch.Tensor] = {}
    batch_bytes = 0
    for fqn, target in targets.items():
        if fqn in aliases and aliases[fqn] in targets:
            continue  # tied: filled through the tensor it aliases
        get = find(fqn)
        if get is None:
            continue
        local = get(local_box(target, fqn))
        value = wrap_like(target, local)
        batch.update({n: value for n in tied.get(fqn, [fqn]) if n in targets})
        batch_bytes += local.numel() * local.element_size()
        if batch_bytes >= _LOAD_BATCH_BYTES:
            _load_batch(model, batch)
            batch, batch_bytes = {}, 0
    _load_batch(model, batch)


def _load_batch(model: nn.Module, batch: dict[str, torch.Tensor]) -> None:
    if not batch:
        return
    result = model.load_state_dict(batch, strict=False)
    if result.unexpected_keys:  # cannot happen: keys come from model.state_dict()
        raise RuntimeError(f"model rejected keys {result.unexpected_keys}")


def optimizer_state_dict(
    reader: CheckpointReader, model: nn.Module, optimizer: torch.optim.Optimizer
) -> dict[str, Any]:
    """The checkpoint's optimizer state resharded onto ``optimizer``'s parameters (matched by
    FQN), as a state dict for ``optimizer.load_state_dict``."""
    m: Manifest = reader.manifest
    where = str(reader.path)
    if m.optimizer is None:
        raise CheckpointError(f"{where} has no optimizer state; call load(..., optimizer=None)")
    fqn_of = {id(p): fqn for fqn, p in model.named_parameters()}
    saved_groups = m.optimizer.param_groups
    if len(saved_groups) != len(optimizer.param_groups):
        raise CheckpointError(
            f"{where}: the checkpoint has {len(saved_groups)} optimizer param groups, the "
            f"optimizer has {len(optimizer.param_groups)}; build the optimizer with the same groups"
        )
    state: dict[int, dict[str, Any]] = {}
    groups: list[dict[str, Any]] = []
    index = 0
    for gi, (saved, group) in enumerate(zip(saved_groups, optimizer.param_groups)):
        fqns = [fqn_of.get(id(p), "<not in model>") for p in group["params"]]
        if set(fqns) != set(saved["params"]):
            raise CheckpointMismatchError(
                f"{where}: optimizer param group {gi} holds other parameters than the optimizer's",
                "Build the model and optimizer the checkpoint was saved from",
                missing=sorted(set(fqns) - set(saved["params"])),
                unexpected=sorted(set(saved["params"]) - set(fqns)),
            )
        # Saved options win; options the live group has and the checkpoint lacks are kept.
        options = {k: v for k, v in group.items() if k != "params"}
        options.update({k: _decode_option(v, group.get(k)) for k, v in saved["options"].items()})
        groups.append({**options, "params": list(range(index, index + len(fqns)))})
        for p, fqn in zip(group["params"], fqns):
            entries = m.optimizer.state.get(fqn)
            if entries:
                state[index] = {
                    name: _state_value(reader, fqn, name, v, p) for name, v in entries.items()
                }
            index += 1
    return {"state": state, "param_groups": groups}


def _state_value(reader: CheckpointReader, fqn: str, name: str, v: Any, param: torch.Tensor) -> Any:
    """One optimizer state entry for ``param``: sharded like it when it has its shape."""
    if not isinstance(v, TensorRecord):
        return v
    label = f"optim/{fqn}/{name}"
    if isinstance(param, DTensor) and v.shape == tuple(param.shape):
        local = reader.read_box(v, label, local_box(param, fqn))
        return wrap_like(param, local)
    full = reader.read_full(v, label)
    return full.to(param.to_local().device if isinstance(param, DTensor) else param.device)


def _decode_option(v: Any, current: Any) -> Any:
    """Undo ``save.encode_option``: tagged 0-d tensors, and lists back to tuples where the
    optimizer currently has a tuple (e.g. AdamW's ``betas``)."""
    if isinstance(v, dict) and "__tensor__" in v:
        dtype = ST_TO_DTYPE.get(v.get("dtype", ""), torch.float32)
        device = current.device if isinstance(current, torch.Tensor) else "cpu"
        return torch.tensor(v["__tensor__"], dtype=dtype, device=device)
    if isinstance(v, list):
        items = [_decode_option(x, None) for x in v]
        return tuple(items) if isinstance(current, tuple) else items
    return v
