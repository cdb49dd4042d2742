"""Optimizers built before wrapping.

FSDP1 with ``use_orig_params=True`` keeps the module's parameter objects, so an optimizer built
on the unwrapped model trains the wrapped one; Accelerate's ``prepare(model, optimizer)`` relies
on it. fullshard's wrapper replaces each parameter with a ``DTensor`` shard, a new object, which
such an optimizer would never see (it would step nothing, silently). So each wrapper records
which parameter replaced which (:func:`record_replaced`), and a global optimizer step pre-hook
swaps the replaced parameters in any optimizer that still holds them, moving their state
along, before its step (:func:`swap_replaced`; the FSDP1 optimizer-state methods call it too).
A replaced parameter's memory is released at once (its data becomes an empty tensor), as FSDP1
frees the unsharded originals.

The hook is there only while a replaced parameter is alive (something may still hand it to an
optimizer): installed by the record, removed when the last one is collected. That is at once
after wrapping when nothing else held them, or once the optimizers built before wrapping have
swapped them out; then, since torch is looping over the global hooks, the optimizer's own
step post-hook (registered by the swap, left there as a no-op) removes it.

An optimizer in backward (torch's ``_apply_optimizer_in_backward``) is refused at the root's
first forward (:func:`refuse_in_backward_optimizers`).
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils.hooks import RemovableHandle
from torch.utils.weak import WeakIdKeyDictionary

from .state_dict import clean_fqn

__all__ = [
    "named_originals",
    "note_replaced",
    "record_replaced",
    "refuse_in_backward_optimizers",
    "swap_replaced",
]

_REPLACED = WeakIdKeyDictionary()  # a replaced parameter -> the one that replaced it
_HOOK: list[RemovableHandle] = []  # the global step pre-hook, while installed
_STEPPING = [False]  # the hook runs: torch loops over the hooks, none may be removed
_AFTER = WeakIdKeyDictionary()  # optimizers given the post-hook that removes the hook


def named_originals(module: nn.Module) -> dict[str, nn.Parameter]:
    """``module``'s parameters by FSDP1's clean names (tied ones under each of their names)."""
    return {clean_fqn(n): p for n, p in module.named_parameters(remove_duplicate=False)}


def record_replaced(before: dict[str, nn.Parameter], wrapper: nn.Module) -> None:
    """Record each parameter of ``before`` (:func:`named_originals` of the module, taken before
    wrapping it) that ``wrapper`` now holds another parameter in place of, and free its data."""
    after = named_originals(wrapper)
    for name, old in before.items():
        new = after.get(name)
        if new is None or new is old:
            continue
        if old not in _REPLACED:
            weakref.finalize(old, _released)
        _REPLACED[old] = new
        old.data = torch.empty(0, dtype=old.dtype, device=old.device)
    if len(_REPLACED):
        _install_hook()


def note_replaced(old: nn.Parameter, new: nn.Parameter) -> None:
    """Record that ``new`` took ``old``'s place in a wrapper (a writeback: see
    ``fullshard.fsdp1.writeback``), so optimizers holding ``old`` step ``new``; ``old``'s
    data is left as it is."""
    _REPLACED.pop(new, None)  # the current one replaces nothing (no cycle if ``old`` returns)
    if old not in _REPLACED:
        weakref.finalize(old, _released)
    _REPLACED[old] = new
    _install_hook()


def _install_hook() -> None:
    if not _HOOK:
        _HOOK.append(register_optimizer_step_pre_hook(_before_step))


def _released() -> None:
    """A replaced parameter was collected: remove the hook if it was the last one, unless the
    hook is running (then the optimizer's post-hook does, see the module's docstring)."""
    if not _STEPPING[0]:
        _remove_if_unneeded()


def _remove_if_unneeded(*_: Any) -> None:
    """Remove the hook if no replaced parameter is alive (a dead one's entry may not be gone
    from ``_REPLACED`` yet, but iterating yields live ones only)."""
    if _HOOK and next(iter(_REPLACED.keys()), None) is None:
        _HOOK.pop().remove()


def swap_replaced(optim: torch.optim.Optimizer) -> None:
    """Put the parameters that replaced ``optim``'s (and their state) in their place."""
    if not len(_REPLACED):
        return
    for group in optim.param_groups:
        params = group["params"]
        for i, p in enumerate(params):
            new = _REPLACED.get(p)
            if new is None:
                continue
            while (newer := _REPLACED.get(new)) is not None:  # replaced again since
                new = newer
            params[i] = new
            if p in optim.state:
                optim.state[new] = optim.state.pop(p)


def _before_step(optim: torch.optim.Optimizer, _args: Any, _kwargs: Any) -> None:
    _STEPPING[0] = True
    try:
        swap_replaced(optim)
    finally:
        _STEPPING[0] = False
    if optim not in _AFTER:  # after its step, torch's loop is over: remove what is unneeded
        _AFTER[optim] = optim.register_step_post_hook(_remove_if_unneeded)


def refuse_in_backward_optimizers(wrappers: list[Any]) -> None:
    """Refuse parameters given an optimizer in backward (torch's
    ``_apply_optimizer_in_backward``): FSDP1's refusal without ``use_orig_params``, and
    fullshard's with it, since nothing would step them (the engine sets the sharded gradients
    after the reduce-scatter, not through autograd's accumulation)."""
    for w in wrappers:
        for name, p in w.named_parameters():
            if not hasattr(p, "_in_backward_optimizers"):
                continue
            if not w._use_orig_params:
                raise RuntimeError(
                    "FSDP optimizer in backward only supported with use_orig_params=True!"
                )
            raise NotImplementedError(
                f"an optimizer in backward (_apply_optimizer_in_backward) on {name} is not "
                f"supported by fullshard's FullyShardedDataParallel: nothing would step it. "
                f"Build the optimizer on model.parameters() and call step() after backward"
            )
