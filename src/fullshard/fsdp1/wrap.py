"""FSDP1's auto wrapping: torch's wrap policies decide, fullshard's wrapper wraps, bottom-up.

The policies are torch's own objects (``torch.distributed.fsdp.wrap``), taken as user input:

- a ``_Policy`` (``ModuleWrapPolicy``, ``CustomPolicy``) names its target modules and their
  keyword arguments itself (``_run_policy``, the policy's one method), as FSDP1 asks it;
- a callable (``size_based_auto_wrap_policy``, ``transformer_auto_wrap_policy``,
  ``lambda_auto_wrap_policy`` as ``functools.partial``, ``always_wrap_policy``) is asked
  ``policy(module=, recurse=, nonwrapped_numel=)`` on the way down and back up, with FSDP1's
  meaning: recurse into a module when asked with ``recurse=True``; wrap it when asked with
  ``recurse=False`` and the parameters its wrapped children left over; the root is wrapped by
  the caller, not here.

Modules of ``MixedPrecision._module_classes_to_ignore`` (BatchNorm by default) become units of
their own in full precision, with their inputs cast to float32 and their outputs back, as FSDP1
does when a policy and mixed precision are both given. Then every target is wrapped, children
before parents, and replaces the module in its parent.

A ``_Policy``'s targets are checked first, as FSDP1 checks them: a unit whose own parameters
(those its wrapped children leave it) mix ``requires_grad=True`` and ``False`` is refused with
``use_orig_params=False`` (``ValueError``) and warned about with ``True``, naming both lists.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp.wrap import _Policy
from torch.utils._pytree import tree_map

__all__ = ["auto_wrap"]


def auto_wrap(
    root: nn.Module,
    policy: Any,
    ignored_modules: set[nn.Module],
    ignored_params: set[nn.Parameter],
    root_kwargs: dict[str, Any],
    wrapper_cls: Callable[..., nn.Module],
    is_unit: Callable[[nn.Module], bool],
) -> None:
    """Wrap ``root``'s submodules the way ``policy`` says (``root`` itself is the caller's)."""
    for name, m in root.named_modules():
        if is_unit(m):
            raise ValueError(
                f"FSDP auto wrapping requires modules to not already have FSDP applied but "
                f"found {name} in\n{root}"
            )
    mp = root_kwargs.get("mixed_precision")
    classes = tuple(getattr(mp, "_module_classes_to_ignore", ()) or ()) if mp else ()
    if isinstance(policy, _Policy):
        targets = policy._run_policy(root, ignored_modules, dict(root_kwargs))
        _check_frozen_mix(root, targets, ignored_params, bool(root_kwargs.get("use_orig_params")))
    elif callable(policy):
        targets = {
            m: dict(root_kwargs)
            for m in _recursive_targets(root, policy, ignored_modules, ignored_params, classes)
        }
    else:
        raise TypeError(
            f"auto_wrap_policy must be a torch.distributed.fsdp.wrap policy or a callable, got "
            f"{type(policy).__name__}"
        )
    mixed = [m for m in root.modules() if classes and isinstance(m, classes)]
    overridden = {type(m) for m in mixed if m not in ignored_modules}
    if overridden:
        warnings.warn(  # FSDP1's warning (its "These modules will be wrapped..." sentence)
            f"mixed_precision with an auto_wrap_policy: the module has submodules of type "
            f"{sorted(c.__name__ for c in overridden)}. These modules will be wrapped as "
            f"separate FSDP units with mixed precision disabled.",
            stacklevel=3,
        )
    for m in mixed:
        if m not in ignored_modules:
            targets.setdefault(m, dict(root_kwargs))["mixed_precision"] = None
            _cast_in_full_precision(m)
    _apply_bottom_up(root, targets, wrapper_cls)


def _recursive_targets(
    root: nn.Module,
    policy: Callable[..., bool],
    ignored_modules: set[nn.Module],
    ignored_params: set[nn.Parameter],
    classes: tuple[type, ...],
) -> list[nn.Module]:
    """The modules a callable policy wraps, children first (FSDP1's recursive walk)."""
    out: list[nn.Module] = []

    def visit(module: nn.Module, is_root: bool) -> int:
        """Numel ``module``'s subtree hands to a wrapper (all of it when it is wrapped)."""
        total = sum(p.numel() for p in module.parameters() if p not in ignored_params)
        # With mixed precision FSDP1 ORs the policy with "wrap the ignored classes
        # individually", which always recurses
        if not (policy(module=module, recurse=True, nonwrapped_numel=total) or classes):
            return 0
        wrapped = sum(visit(c, False) for c in module.children() if c not in ignored_modules)
        if is_root:  # not asked: the caller wraps the root
            return wrapped
        wrap = policy(module=module, recurse=False, nonwrapped_numel=total - wrapped)
        if wrap or (classes and isinstance(module, classes)):
            out.append(module)
            return total
        return wrapped

    visit(root, True)
    return out


def _post_order(module: nn.Module, name: str = "") -> Iterator[tuple[str, nn.Module]]:
    """``(fqn, module)`` for ``module``'s tree, children first, in registration order."""
    for child_name, child in module.named_children():
        yield from _post_order(child, f"{name}.{child_name}" if name else child_name)
    yield name, module


def _check_frozen_mix(
    root: nn.Module,
    targets: dict[nn.Module, dict[str, Any]],
    ignored_params: set[nn.Parameter],
    use_orig_params: bool,
) -> None:
    """FSDP1's rule for a policy's targets: each unit's own parameters are all trainable or all
    frozen (refused with ``use_orig_params=False``, warned about with ``True``)."""
    claimed: set[nn.Module] = set()  # modules whose parameters a unit below already took
    for fqn, unit in _post_order(root):
        if unit not in targets or unit in claimed:
            continue
        trainable: list[str] = []
        frozen: list[str] = []
        for sub_fqn, sub in _post_order(unit, fqn):
            if sub in claimed:
                continue
            claimed.add(sub)
            for pname, p in sub.named_parameters(recurse=False):
                if p not in ignored_params:
                    name = f"{sub_fqn}.{pname}" if sub_fqn else pname
                    (trainable if p.requires_grad else frozen).append(name)
        if trainable and frozen:
            _refuse_frozen_mix(fqn, trainable, frozen, use_orig_params)


def _refuse_frozen_mix(
    fqn: str, trainable: list[str], frozen: list[str], use_orig_params: bool
) -> None:
    head = f"{fqn} has both parameters with requires_grad=True and False. "
    lists = (
        f"Wrap the frozen parameters in their own unit (a policy target of their own).\n"
        f"requires_grad=True: {trainable}\nrequires_grad=False: {frozen}"
    )
    if not use_orig_params:
        raise ValueError(
            head
            + "FSDP does not support wrapping such modules when use_orig_params=False. "
            + lists
        )
    warnings.warn(
        head + "We do not recommend wrapping such modules: with use_orig_params=True their "
        "frozen parameters still take gradient memory. " + lists,
        stacklevel=4,
    )


def _apply_bottom_up(
    root: nn.Module,
    targets: dict[nn.Module, dict[str, Any]],
    wrapper_cls: Callable[..., nn.Module],
) -> None:
    """Replace each target (not ``root``) by ``wrapper_cls(target, **kwargs)``, children first;
    a module shared by several parents is wrapped once."""
    seen: set[nn.Module] = {root}

    def visit(module: nn.Module) -> None:
        for name, child in list(module.named_children()):
            if child in seen:
                continue
            seen.add(child)
            visit(child)
            if child in targets:
                kwargs = {**targets[child], **getattr(child, "_wrap_overrides", {})}
                setattr(module, name, wrapper_cls(child, **kwargs))

    visit(root)


def _cast_in_full_precision(module: nn.Module) -> None:
    """Run ``module`` in float32 inside a low-precision model: float inputs are cast up, and
    its outputs back to the dtype the inputs had (FSDP1's treatment of BatchNorm)."""
    seen: list[torch.dtype] = []

    def cast(dtype: torch.dtype, t: Any) -> Any:
        if isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype != dtype:
            seen.append(t.dtype)
            return t.to(dtype)
        return t

    def pre(_: nn.Module, args: Any) -> Any:
        seen.clear()
        return tree_map(lambda t: cast(torch.float32, t), args)

    def post(_: nn.Module, __: Any, output: Any) -> Any:
        if not seen:
            return output
        return tree_map(lambda t: cast(seen[0], t), output)

    module.register_forward_pre_hook(pre)
    module.register_forward_hook(post)
