"""FSDP1's state dicts on fullshard's sharded parameters.

Each wrapper carries FSDP1's three settings (``_state_dict_type``, ``_state_dict_config``,
``_optim_state_dict_config``), set together on every wrapper under a module by
:func:`set_state_dict_type` (``FSDP.state_dict_type(...)``), and three hooks that make
``state_dict()`` / ``load_state_dict()`` speak FSDP1's format, with the original parameter
names (no ``_fsdp_wrapped_module.`` in the keys, as FSDP1; torch's checkpoint wrapper strips
its own ``_checkpoint_wrapped_module.`` on save and adds it back on load):

- after ``state_dict()``: keys under the wrapper lose its ``_fsdp_wrapped_module.`` part, and
  the wrapper's sharded parameters (``DTensor``) become, per type,

  * ``FULL_STATE_DICT``: full tensors (all-gathered one at a time), on the CPU with
    ``offload_to_cpu``, and only on rank 0 with ``rank0_only`` (other ranks get none of the
    wrapper's parameters or buffers, as FSDP1); buffers in the dtype they were built in
    under ``buffer_dtype`` (as FSDP1);
  * ``SHARDED_STATE_DICT``: the ``DTensor`` shards themselves (FSDP1 gives ``ShardedTensor``
    unless ``_use_dtensor``; the pieces are the same ``torch.chunk`` rows of dim 0);
  * ``LOCAL_STATE_DICT``: FSDP1's ``_flat_param`` entry, its flat parameter's shard
    (``fullshard.fsdp1.local_state``: a gather per wrapper); under ``NO_SHARD`` a full state
    dict, with FSDP1's warning.

  Ignored parameters and buffers are the module's own tensors (no copy), as FSDP1's.

- before ``load_state_dict()``: the keys get ``_fsdp_wrapped_module.`` back, a ``_flat_param``
  entry (``LOCAL``) becomes the wrapper's full parameters, and a value meant for one of the
  wrapper's sharded parameters that is not a ``DTensor`` is cut to this rank's rows: a full
  tensor, or under ``LOCAL`` a parameter's local shard (what ``LOCAL_STATE_DICT`` held before
  fullshard gave FSDP1's entries); a ``DTensor`` laid out like the parameter is copied as it
  is, one laid out otherwise (another strategy's or mesh's) or torch's FSDP1's
  ``ShardedTensor`` is gathered and cut. So a full state dict, a sharded one from any
  strategy, or torch's FSDP1's ``SHARDED_STATE_DICT`` loads whatever type is set. A
  tensor-like value that is no ``torch.Tensor`` (Lightning's lazily loaded checkpoint tensors,
  which ``nn.Module.load_state_dict`` takes) is loaded first.

- after ``load_state_dict()``: the missing and unexpected keys it reports (its result, and
  the ``strict`` error) lose the wrappers' prefixes, as FSDP1's do.

The hooks run bottom-up on save (each wrapper renames its own prefix after its children did)
and top-down on load, as FSDP1's do.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Generator, Sequence
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import _CHECKPOINT_PREFIX
from torch.distributed.fsdp import (
    FullOptimStateDictConfig,
    FullStateDictConfig,
    LocalOptimStateDictConfig,
    LocalStateDictConfig,
    OptimStateDictConfig,
    ShardedOptimStateDictConfig,
    ShardedStateDictConfig,
    ShardingStrategy,
    StateDictConfig,
    StateDictSettings,
    StateDictType,
)
from torch.distributed.tensor import DTensor
from torch.overrides import is_tensor_like

from ..checkpoint.shards import local_box, slices, wrap_like
from .local_state import load_flat_param, save_flat_param

__all__ = [
    "FSDP_PREFIX",
    "StateDictTypeMethods",
    "clean_fqn",
    "full_of_sharded_tensor",
    "get_state_dict_type",
    "install_state_dict_hooks",
    "is_sharded_tensor",
    "set_state_dict_type",
    "shard_like",
]

FSDP_PREFIX = "_fsdp_wrapped_module."
_CONFIGS: dict[StateDictType, tuple[type[StateDictConfig], type[OptimStateDictConfig]]] = {
    StateDictType.FULL_STATE_DICT: (FullStateDictConfig, FullOptimStateDictConfig),
    StateDictType.LOCAL_STATE_DICT: (LocalStateDictConfig, LocalOptimStateDictConfig),
    StateDictType.SHARDED_STATE_DICT: (ShardedStateDictConfig, ShardedOptimStateDictConfig),
}


def clean_fqn(name: str) -> str:
    """A parameter's name as FSDP1's state dicts spell it (no wrapper prefixes)."""
    return name.replace(FSDP_PREFIX, "").replace(_CHECKPOINT_PREFIX, "")


def shard_like(target: torch.Tensor, full: torch.Tensor) -> torch.Tensor:
    """This rank's part of the full tensor ``full``, placed like ``target`` (no collective); a
    copy, never a view of ``full`` (an optimizer would otherwise update the caller's dict)."""
    if not isinstance(target, DTensor):
        return full
    if tuple(full.shape) != tuple(target.shape):
        raise ValueError(
            f"a full tensor of shape {list(full.shape)} cannot be loaded into a parameter of "
            f"shape {list(target.shape)}"
        )
    return wrap_like(target, full.detach()[slices(local_box(target, "state dict"))].clone())


def is_sharded_tensor(value: object) -> bool:
    """torch's ``ShardedTensor`` (FSDP1's sharded state dicts), recognised without importing it."""
    return isinstance(value, torch.Tensor) and callable(getattr(value, "local_shards", None))


def full_of_sharded_tensor(value: Any) -> torch.Tensor:
    """The whole tensor of a ``ShardedTensor``: every rank's pieces gathered (collective; each
    rank holds the whole tensor for a moment, so a load from FSDP1's sharded state dicts costs
    one full tensor of memory at a time)."""
    pieces = [
        (tuple(s.metadata.shard_offsets), s.tensor.detach().cpu()) for s in value.local_shards()
    ]
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, pieces)
    props = value.metadata().tensor_properties
    full = torch.empty(tuple(value.size()), dtype=props.dtype)
    for rank_pieces in everyone:
        for offsets, piece in rank_pieces:
            full[slices((offsets, tuple(piece.shape)))] = piece
    return full


# ------------------------------------------------------------------------------ settings
def set_state_dict_type(
    wrappers: Sequence[nn.Module],
    state_dict_type: StateDictType,
    state_dict_config: StateDictConfig | None = None,
    optim_state_dict_config: OptimStateDictConfig | None = None,
) -> StateDictSettings:
    """Set the three settings on ``wrappers`` (FSDP1's checks and messages); return the
    previous settings (of the first wrapper)."""
    config_type, optim_config_type = _CONFIGS[state_dict_type]
    state_dict_config = state_dict_config or config_type()
    optim_state_dict_config = optim_state_dict_config or optim_config_type()
    if type(state_dict_config) is not config_type:
        raise RuntimeError(
            f"Expected state_dict_config of type {config_type} but got {type(state_dict_config)}"
        )
    if type(optim_state_dict_config) is not optim_config_type:
        raise RuntimeError(
            f"Expected optim_state_dict_config of type {optim_config_type} but got "
            f"{type(optim_state_dict_config)}"
        )
    previous = None
    for w in wrappers:
        if previous is None:
            previous = _settings(w)
        w._state_dict_type = state_dict_type  # type: ignore[assignment]
        w._state_dict_config = state_dict_config  # type: ignore[assignment]
        w._optim_state_dict_config = optim_state_dict_config  # type: ignore[assignment]
    if previous is None:
        raise ValueError("set_state_dict_type found no FullyShardedDataParallel module")
    return previous


def get_state_dict_type(wrappers: Sequence[nn.Module]) -> StateDictSettings:
    """The settings ``wrappers`` share (``AssertionError`` if they differ, as FSDP1)."""
    settings = None
    for w in wrappers:
        mine = _settings(w)
        if settings is None:
            settings = mine
        elif mine != settings:
            raise AssertionError(
                f"All FSDP modules must have the same state dict settings.Got {mine} and "
                f"{settings}."
            )
    if settings is None:
        raise ValueError("get_state_dict_type found no FullyShardedDataParallel module")
    return settings


class StateDictTypeMethods:
    """FSDP1's state-dict-type static methods: a base class of ``FullyShardedDataParallel``
    (``fullshard.fsdp1.wrapper``), acting on every wrapper in ``module`` (itself included)."""

    @staticmethod
    def set_state_dict_type(
        module: nn.Module,
        state_dict_type: StateDictType,
        state_dict_config: StateDictConfig | None = None,
        optim_state_dict_config: OptimStateDictConfig | None = None,
    ) -> StateDictSettings:
        """Set the state-dict type and configs of every wrapper in ``module``; returns the
        previous settings."""
        return set_state_dict_type(
            _wrappers(module), state_dict_type, state_dict_config, optim_state_dict_config
        )

    @staticmethod
    def get_state_dict_type(module: nn.Module) -> StateDictSettings:
        """The settings every wrapper in ``module`` shares."""
        return get_state_dict_type(_wrappers(module))

    @staticmethod
    @contextlib.contextmanager
    def state_dict_type(
        module: nn.Module,
        state_dict_type: StateDictType,
        state_dict_config: StateDictConfig | None = None,
        optim_state_dict_config: OptimStateDictConfig | None = None,
    ) -> Generator:
        """:meth:`set_state_dict_type` for the length of the block."""
        previous = set_state_dict_type(
            _wrappers(module), state_dict_type, state_dict_config, optim_state_dict_config
        )
        try:
            yield
        finally:
            set_state_dict_type(
                _wrappers(module),
                previous.state_dict_type,
                previous.state_dict_config,
                previous.optim_state_dict_config,
            )


def _wrappers(module: nn.Module) -> list[nn.Module]:
    return [m for m in module.modules() if isinstance(m, StateDictTypeMethods)]


def _settings(w: nn.Module) -> StateDictSettings:
    return StateDictSettings(
        w._state_dict_type,  # type: ignore[arg-type]
        w._state_dict_config,  # type: ignore[arg-type]
        w._optim_state_dict_config,  # type: ignore[arg-type]
    )


# --------------------------------------------------------------------------------- hooks
def install_state_dict_hooks(wrapper: nn.Module) -> None:
    """Register the save and load hooks of one wrapper (see the module docstring)."""
    wrapper.register_state_dict_post_hook(_after_state_dict)
    wrapper.register_load_state_dict_pre_hook(_before_load)
    wrapper.register_load_state_dict_post_hook(_clean_incompatible)


def _clean_incompatible(_module: nn.Module, incompatible: Any) -> None:
    """Missing and unexpected keys by FSDP1's clean names (``load_state_dict``'s result and
    its ``strict`` error), as FSDP1 reports them."""
    for keys in (incompatible.missing_keys, incompatible.unexpected_keys):
        keys[:] = [clean_fqn(k) for k in keys]


def _type_of(module: nn.Module) -> tuple[StateDictType, Any]:
    """The wrapper's state-dict type and config, but ``FULL_STATE_DICT`` (default config) for
    ``LOCAL_STATE_DICT`` under ``NO_SHARD``: FSDP1's flat parameter is not sharded there, so it
    gives and takes full state dicts, with its warning."""
    wrapper = cast(Any, module)
    kind, config = wrapper._state_dict_type, wrapper._state_dict_config
    no_shard = wrapper.sharding_strategy is ShardingStrategy.NO_SHARD
    if kind is StateDictType.LOCAL_STATE_DICT and no_shard:
        warnings.warn(
            "When using ``NO_SHARD`` for ``ShardingStrategy``, full_state_dict will be returned.",
            stacklevel=3,
        )
        return StateDictType.FULL_STATE_DICT, FullStateDictConfig()
    return kind, config


def _rename(state_dict: dict[str, Any], rename: Callable[[str], str]) -> None:
    """Rename keys in place, keeping their order."""
    items = list(state_dict.items())
    state_dict.clear()
    for key, value in items:
        state_dict[rename(key)] = value


def _after_state_dict(
    module: nn.Module, state_dict: dict[str, Any], prefix: str, _meta: Any
) -> None:
    inner = prefix + FSDP_PREFIX
    _rename(state_dict, lambda k: prefix + k[len(inner) :] if k.startswith(inner) else k)
    kind, config = _type_of(module)
    keys = [k for k, v in state_dict.items() if k.startswith(prefix) and isinstance(v, DTensor)]
    if kind is StateDictType.SHARDED_STATE_DICT:
        for k in keys:
            value = state_dict[k].detach()
            state_dict[k] = value.cpu() if config.offload_to_cpu else value
    elif kind is StateDictType.LOCAL_STATE_DICT:
        save_flat_param(module, state_dict, prefix, config.offload_to_cpu)
    else:
        done: dict[int, torch.Tensor] = {}  # tied parameters are gathered once
        for k in keys:
            value = state_dict[k]
            full = done.get(id(value))
            if full is None:
                full = _full_copy(value.detach())
                done[id(value)] = full = full.cpu() if config.offload_to_cpu else full
            state_dict[k] = full
        _restore_buffer_dtypes(module, state_dict, prefix, config.offload_to_cpu)
        if config.rank0_only and dist.get_rank() != 0:
            for k in keys + [prefix + n for n in cast(Any, module)._buffer_dtypes]:
                state_dict.pop(k, None)


def _restore_buffer_dtypes(
    module: nn.Module, state_dict: dict[str, Any], prefix: str, offload_to_cpu: bool
) -> None:
    """Full state dicts hold buffers in the dtype they were built in (as FSDP1), whatever
    ``buffer_dtype`` they compute in, on the CPU with ``offload_to_cpu``."""
    wrapper = cast(Any, module)
    low = wrapper.mixed_precision.buffer_dtype is not None
    for name, dtype in wrapper._buffer_dtypes.items():
        buf = state_dict.get(prefix + name)
        if buf is None:
            continue
        if offload_to_cpu:
            buf = buf.cpu()
        if low and buf.is_floating_point() and buf.dtype != dtype:
            buf = buf.to(dtype)
        state_dict[prefix + name] = buf


def _full_copy(t: DTensor) -> torch.Tensor:
    """``t`` unsharded, never sharing memory with the parameter (a shard group of one rank
    can hand back the local tensor itself)."""
    full = t.full_tensor()
    local = t.to_local()
    if local.numel() and full.untyped_storage().data_ptr() == local.untyped_storage().data_ptr():
        return full.clone()
    return full


def _tensor_of(value: object) -> object:
    """``value``, or the tensor a tensor-like ``value`` stands for: one that is no
    ``torch.Tensor`` but overrides torch's functions (Lightning's ``_NotYetLoadedTensor``, which
    its full-checkpoint loads hand over; torch's ``copy_`` would load it, but into a plain
    tensor, which a ``DTensor`` parameter refuses)."""
    if isinstance(value, torch.Tensor) or not is_tensor_like(value):
        return value
    return torch.detach(cast(torch.Tensor, value))


def _before_load(
    module: nn.Module,
    state_dict: dict[str, Any],
    prefix: str,
    _meta: Any,
    *_: Any,
) -> None:
    inner = prefix + FSDP_PREFIX
    _rename(
        state_dict,
        lambda k: (
            inner + k[len(prefix) :] if k.startswith(prefix) and not k.startswith(inner) else k
        ),
    )
    local = _type_of(module)[0] is StateDictType.LOCAL_STATE_DICT
    full = load_flat_param(module, state_dict, inner) if local else set()
    wrapped: nn.Module = cast(Any, module)._fsdp_wrapped_module
    # nn.Module's names: a checkpoint wrapper's own named_parameters would strip its prefix
    # from ``inner`` too; below this wrapper, checkpoint wrappers add theirs after this hook
    for rel, p in nn.Module.named_parameters(wrapped, remove_duplicate=False):
        name = inner + rel.replace(_CHECKPOINT_PREFIX, "")
        value = _tensor_of(state_dict.get(name))
        if not (isinstance(p, DTensor) and isinstance(value, torch.Tensor)):
            continue
        state_dict[name] = value  # loaded, if it was a tensor-like
        if is_sharded_tensor(value):  # FSDP1's SHARDED_STATE_DICT
            state_dict[name] = shard_like(p, full_of_sharded_tensor(value))
        elif not isinstance(value, DTensor):
            local_shard = local and name not in full
            state_dict[name] = wrap_like(p, value) if local_shard else shard_like(p, value)
        elif value.device_mesh != p.device_mesh or value.placements != p.placements:
            state_dict[name] = shard_like(p, value.full_tensor())  # another layout: reshard
