"""FSDP1's optimizer-state static methods of ``FullyShardedDataParallel``.

A base class of the wrapper (``fullshard.fsdp1.wrapper``) so that each of torch's FSDP1
optimizer methods, private ones included, is replaced by one that runs fullshard's
conversions (``fullshard.fsdp1.optim_state``): ``optim_state_dict`` and
``optim_state_dict_to_load`` follow the model's ``state_dict_type`` and optimizer config, the
legacy ``full_`` / ``sharded_`` / ``shard_full_`` / ``flatten_sharded_`` /
``scatter_full_optim_state_dict`` and ``rekey_optim_state_dict`` do what their names say.
``optim_input`` (deprecated in FSDP1) is accepted: the parameter order it gives replaces the
optimizer's.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import OptimStateKeyType, StateDictSettings, StateDictType

from . import optim_state as O
from .state_dict import get_state_dict_type

__all__ = ["OptimStateDictMethods"]

OptimInput = list[dict[str, Any]] | Iterable[torch.nn.Parameter] | None


def _settings(model: nn.Module) -> StateDictSettings:
    wrappers = [m for m in model.modules() if isinstance(m, OptimStateDictMethods)]
    return get_state_dict_type(wrappers)


def _sorted(model: nn.Module) -> bool:
    """FSDP1 orders the entries by name when the model uses its original parameters."""
    return any(getattr(m, "_use_orig_params", False) for m in model.modules())


def _order(
    model: nn.Module, optim: torch.optim.Optimizer | None, optim_input: OptimInput
) -> list[nn.Parameter]:
    if optim_input is None:
        return O.param_order(model, optim)
    OptimStateDictMethods._warn_optim_input(optim_input, stacklevel=3)  # FSDP1's warning
    items: list[Any] = list(optim_input)
    if items and isinstance(items[0], dict):
        return [p for group in items for p in group["params"]]
    return items


class OptimStateDictMethods:
    """FSDP1's optimizer-state static methods (see the module docstring)."""

    @staticmethod
    def _warn_optim_input(optim_input: Any, *, stacklevel: int = 1) -> None:
        if optim_input is not None:
            warnings.warn(
                "The `optim_input` argument is deprecated and will be removed after PyTorch "
                "1.13. You may remove it from your code without changing its functionality.",
                FutureWarning,
                stacklevel=stacklevel + 1,
            )

    @staticmethod
    def _is_using_optim_input(optim_input: Any, optim: Any) -> bool:
        return optim_input is not None or optim is None

    @staticmethod
    def _warn_legacy_optim_state_dict(curr: str, new: str, *, stacklevel: int = 1) -> None:
        warnings.warn(
            f"``FullyShardedDataParallel.{curr}``is being deprecated and is replaced by "
            f"``FullyShardedDataParallel.{new}``.",
            FutureWarning,
            stacklevel=stacklevel + 1,
        )

    @staticmethod
    def _optim_state_dict_impl(
        model: torch.nn.Module,
        optim: torch.optim.Optimizer,
        optim_state_dict: dict[str, Any],
        optim_input: OptimInput = None,
        rank0_only: bool = True,
        full_state_dict: bool = True,
        group: dist.ProcessGroup | None = None,
        cpu_offload: bool = True,
        *,
        _stacklevel: int = 1,
    ) -> dict[str, Any]:
        """``optim_state_dict`` keyed by FQN, full or sharded (``fullshard.fsdp1.optim_state``)."""
        if not full_state_dict and (optim_input is not None or rank0_only):
            raise AssertionError(
                f"Expected optim_input to be None and rank0_only to be False, got "
                f"optim_input={optim_input}, rank0_only={rank0_only}"
            )
        return O.export_optim_state(
            model,
            _order(model, optim, optim_input),
            optim_state_dict,
            "full" if full_state_dict else "sharded",
            offload_to_cpu=cpu_offload and full_state_dict,
            rank0_only=rank0_only,
            sort=_sorted(model),
        )

    @staticmethod
    def _optim_state_dict_to_load_impl(
        optim_state_dict: dict[str, Any],
        model: torch.nn.Module,
        optim_input: OptimInput = None,
        optim: torch.optim.Optimizer | None = None,
        full_state_dict: bool = True,
        rank0_only: bool = False,
        is_named_optimizer: bool = False,
        group: dist.ProcessGroup | None = None,
    ) -> dict[str, Any]:
        """An FQN-keyed optimizer state dict keyed by position, this rank's rows only."""
        if is_named_optimizer:
            raise NotImplementedError(
                "is_named_optimizer=True (torchrec's KeyedOptimizer) is not supported by "
                "fullshard's FullyShardedDataParallel"
            )
        if rank0_only:
            optim_state_dict = O.scatter_from_rank0(optim_state_dict, group)
        return O.import_optim_state(model, _order(model, optim, optim_input), optim_state_dict)

    @staticmethod
    def full_optim_state_dict(
        model: torch.nn.Module,
        optim: torch.optim.Optimizer,
        optim_input: OptimInput = None,
        rank0_only: bool = True,
        group: dist.ProcessGroup | None = None,
    ) -> dict[str, Any]:
        """The full optimizer state keyed by FQN, on rank 0 only by default ({} elsewhere)."""
        return OptimStateDictMethods._optim_state_dict_impl(
            model, optim, optim.state_dict(), optim_input, rank0_only, True, group
        )

    @staticmethod
    def sharded_optim_state_dict(
        model: torch.nn.Module,
        optim: torch.optim.Optimizer,
        group: dist.ProcessGroup | None = None,
    ) -> dict[str, Any]:
        """The optimizer state keyed by FQN, its tensors ``DTensor`` shards."""
        return OptimStateDictMethods._optim_state_dict_impl(
            model, optim, optim.state_dict(), None, False, False, group, False
        )

    @staticmethod
    def shard_full_optim_state_dict(
        full_optim_state_dict: dict[str, Any],
        model: torch.nn.Module,
        optim_input: OptimInput = None,
        optim: torch.optim.Optimizer | None = None,
    ) -> dict[str, Any]:
        """A full optimizer state dict (every rank has it) ready for ``optim.load_state_dict``."""
        return OptimStateDictMethods._optim_state_dict_to_load_impl(
            full_optim_state_dict, model, optim_input, optim
        )

    @staticmethod
    def flatten_sharded_optim_state_dict(
        sharded_optim_state_dict: dict[str, Any],
        model: torch.nn.Module,
        optim: torch.optim.Optimizer,
    ) -> dict[str, Any]:
        """A sharded optimizer state dict ready for ``optim.load_state_dict``."""
        return OptimStateDictMethods._optim_state_dict_to_load_impl(
            sharded_optim_state_dict, model, None, optim, full_state_dict=False
        )

    @staticmethod
    def scatter_full_optim_state_dict(
        full_optim_state_dict: dict[str, Any] | None,
        model: torch.nn.Module,
        optim_input: OptimInput = None,
        optim: torch.optim.Optimizer | None = None,
        group: Any | None = None,
    ) -> dict[str, Any]:
        """Rank 0's full optimizer state dict, on every rank ready for its optimizer (rank 0
        broadcasts it; each rank keeps its rows)."""
        return OptimStateDictMethods._optim_state_dict_to_load_impl(
            full_optim_state_dict or {}, model, optim_input, optim, rank0_only=True, group=group
        )

    @staticmethod
    def rekey_optim_state_dict(
        optim_state_dict: dict[str, Any],
        optim_state_key_type: OptimStateKeyType,
        model: torch.nn.Module,
        optim_input: OptimInput = None,
        optim: torch.optim.Optimizer | None = None,
    ) -> dict[str, Any]:
        """Re-key between parameter names (``PARAM_NAME``) and positions (``PARAM_ID``)."""
        return O.rekey(
            optim_state_dict, optim_state_key_type, model, _order(model, optim, optim_input)
        )

    @staticmethod
    def optim_state_dict(
        model: torch.nn.Module,
        optim: torch.optim.Optimizer,
        optim_state_dict: dict[str, Any] | None = None,
        group: dist.ProcessGroup | None = None,
    ) -> dict[str, Any]:
        """The optimizer state keyed by FQN, in the form the model's ``state_dict_type`` and
        optimizer config say (full / sharded / local; CPU; rank 0 only)."""
        settings = _settings(model)
        config = settings.optim_state_dict_config
        kind = settings.state_dict_type
        form: O.Form = (
            "full"
            if kind is StateDictType.FULL_STATE_DICT
            else "local"
            if kind is StateDictType.LOCAL_STATE_DICT
            else "sharded"
        )
        return O.export_optim_state(
            model,
            O.param_order(model, optim),
            optim.state_dict() if optim_state_dict is None else optim_state_dict,
            form,
            offload_to_cpu=getattr(config, "offload_to_cpu", True),
            rank0_only=getattr(config, "rank0_only", False),
            sort=_sorted(model),
        )

    @staticmethod
    def optim_state_dict_to_load(
        model: torch.nn.Module,
        optim: torch.optim.Optimizer,
        optim_state_dict: dict[str, Any],
        is_named_optimizer: bool = False,
        load_directly: bool = False,
        group: dist.ProcessGroup | None = None,
    ) -> dict[str, Any]:
        """An :meth:`optim_state_dict` (any form) keyed for ``optim``, this rank's rows only;
        ``load_directly`` loads it too."""
        settings = _settings(model)
        if is_named_optimizer:
            return OptimStateDictMethods._optim_state_dict_to_load_impl(
                optim_state_dict, model, None, optim, is_named_optimizer=True
            )
        rank0_only = getattr(settings.optim_state_dict_config, "rank0_only", False)
        if rank0_only:
            optim_state_dict = O.scatter_from_rank0(optim_state_dict, group)
        result = O.import_optim_state(
            model,
            O.param_order(model, optim),
            optim_state_dict,
            local=settings.state_dict_type is StateDictType.LOCAL_STATE_DICT,
        )
        if load_directly:
            optim.load_state_dict(result)
        return result
