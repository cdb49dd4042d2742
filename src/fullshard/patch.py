"""``patch_torch_fsdp()``: make frameworks that call torch's ``fully_shard`` get fullshard's.

Accelerate, Lightning Fabric, transformers and torch's pipelining call
``torch.distributed.fsdp.fully_shard`` themselves. fullshard's units already *are*
``torch.distributed.fsdp.FSDPModule`` instances and take torch's policy classes, so the one
missing piece is the call: :func:`patch_torch_fsdp` rebinds ``fully_shard``,
``register_fsdp_forward_method`` and ``share_comm_ctx`` to fullshard's in every loaded module
that holds torch's function objects (``torch.distributed.fsdp``, its ``_fully_shard`` package
and module, ``torch.distributed._composable.fsdp[.fully_shard]``, ``torch.distributed.pipelining
.stage`` and any framework module that imported them by name), so nothing else changes::

    import fullshard
    fullshard.patch_torch_fsdp()   # before the framework shards the model

Code that reaches into FSDP2's state through ``fully_shard.state(module)`` (torch's pipelining
stage up to torch 2.14) then gets fullshard's answer: fullshard's ``fully_shard`` carries
``state`` itself (``fullshard.torch_state``). The private helpers RL frameworks import
(``_fsdp_state._get_module_fsdp_state``, ``_fsdp_init._get_post_forward_mesh_info``) are
rebound the same way, to ``fullshard.torch_state``'s, which answer for fullshard's units and
hand anything else to torch's ([Note: FSDP2's private names] there).

FSDP1's class is rebound too: ``FullyShardedDataParallel`` (and the ``FSDP`` alias frameworks
import it as) becomes ``fullshard.fsdp1.FullyShardedDataParallel`` in ``torch.distributed.fsdp``,
in the module that defines it (``torch.distributed.fsdp.fully_sharded_data_parallel``, which
Accelerate and Lightning import it from) and in every module outside torch's FSDP1 package that
holds torch's class under either name, so code that constructs ``FSDP(model, ...)`` gets
fullshard's wrapper (itself an instance of torch's class). torch's private FSDP1 modules keep
their own class, which nothing constructs any more. (torch's class looks its static methods up
in its defining module: while the patch is active, torch's own FSDP1 instances are not for use.)

[Note: Lightning's DTensor test]
One framework helper is rebound too. Lightning loads a full checkpoint into a model
(``lightning.fabric.strategies.model_parallel._load_raw_module_state``, which Fabric's and the
Trainer's ``FSDPStrategy`` call) the FSDP2 way when a parameter is a ``DTensor``
(``_has_dtensor_modules``: it then looks the checkpoint's keys up by module path, which carry
FSDP1's ``_fsdp_wrapped_module.`` where the checkpoint's do not: a ``KeyError``, or with
``strict=False`` nothing loaded), else the FSDP1 way (``load_state_dict`` under
``FULL_STATE_DICT``). torch's FSDP1's parameters never are a ``DTensor``; fullshard's
wrapper's always are. So where Lightning is imported when the patch runs, its
``_has_dtensor_modules`` (in ``lightning.fabric`` and ``lightning_fabric``) answers ``False``
for a model holding one of fullshard's FSDP1 wrappers, as it does for torch's, and asks
Lightning's own otherwise.
"""

from __future__ import annotations

import importlib
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

from torch import nn

from . import api, torch_state
from .fsdp1 import FullyShardedDataParallel

__all__ = ["TorchFSDPPatch", "patch_torch_fsdp"]

# Modules that re-export torch's functions: imported first so the scan finds them even when no
# framework has imported them yet (a later ``from torch... import fully_shard`` then reads the
# patched attribute).
_REEXPORTERS = (
    "torch.distributed.fsdp",
    "torch.distributed.fsdp._fully_shard",
    "torch.distributed.fsdp._fully_shard._fully_shard",
    "torch.distributed._composable.fsdp",
    "torch.distributed._composable.fsdp.fully_shard",
    "torch.distributed.pipelining.stage",
    "torch.distributed.fsdp._fully_shard._fsdp_state",
    "torch.distributed.fsdp._fully_shard._fsdp_init",
)
_NAMES = ("fully_shard", "register_fsdp_forward_method", "share_comm_ctx")
_FSDP1_NAMES = ("FullyShardedDataParallel", "FSDP")
# torch's FSDP1 package (its private modules keep torch's class; the package itself is patched)
_FSDP1_PACKAGE = "torch.distributed.fsdp."
# ... but for the module that defines the class, which frameworks import it from by path
_FSDP1_DEFINING = "torch.distributed.fsdp.fully_sharded_data_parallel"


_TORCH_FUNCS: dict[str, Any] = {}  # torch's original functions, read once before any patch

# Lightning's DTensor test ([Note: Lightning's DTensor test]), in the modules that define it
_LIGHTNING_DTENSOR_TEST = "_has_dtensor_modules"
_LIGHTNING_DEFINING = (
    "lightning.fabric.strategies.model_parallel",
    "lightning_fabric.strategies.model_parallel",
)
_ORIGINAL = "__fullshard_original__"  # on a replacement: the function it stands in for


@dataclass(frozen=True)
class _Replacement:
    names: tuple[str, ...]  # the attribute names to rebind
    ours: Any
    skip_prefix: str | None = None  # modules not to touch...
    unless: str | None = None  # ...but this one

    def skips(self, module: str) -> bool:
        if self.skip_prefix is None or module == self.unless:
            return False
        return module.startswith(self.skip_prefix)


def _originals() -> dict[int, _Replacement]:
    """id(torch's object) -> what replaces it, under which names."""
    ours = {
        "fully_shard": api.fully_shard,
        "register_fsdp_forward_method": api.register_fsdp_forward_method,
        "share_comm_ctx": api.share_comm_ctx,
    }
    if not _TORCH_FUNCS:
        torch_api = importlib.import_module("torch.distributed.fsdp._fully_shard._fully_shard")
        # share_comm_ctx arrived in torch 2.10: patch only what the installed torch has
        _TORCH_FUNCS.update({n: getattr(torch_api, n) for n in _NAMES if hasattr(torch_api, n)})
        fsdp1 = importlib.import_module(_FSDP1_DEFINING)
        _TORCH_FUNCS["FullyShardedDataParallel"] = fsdp1.FullyShardedDataParallel
    out = {id(f): _Replacement((n,), ours[n]) for n, f in _TORCH_FUNCS.items() if n in ours}
    # FSDP2's private helpers: fullshard's units answer, anything else goes to torch's
    private = {
        "_get_module_fsdp_state": torch_state.get_module_fsdp_state,
        "_get_post_forward_mesh_info": torch_state.get_post_forward_mesh_info,
    }
    for name, f in torch_state.torch_originals().items():
        out[id(f)] = _Replacement((name,), private[name])
    torch_class = _TORCH_FUNCS["FullyShardedDataParallel"]
    out[id(torch_class)] = _Replacement(
        _FSDP1_NAMES, FullyShardedDataParallel, _FSDP1_PACKAGE, _FSDP1_DEFINING
    )
    for original in _lightning_originals():  # [Note: Lightning's DTensor test]
        out[id(original)] = _Replacement((_LIGHTNING_DTENSOR_TEST,), _fsdp1_aware(original))
    return out


def _lightning_originals() -> list[Callable[[object], bool]]:
    """Lightning's own ``_has_dtensor_modules`` of each of its modules already imported (none
    is imported here), also where a patch has replaced it."""
    found = (
        getattr(sys.modules.get(n), _LIGHTNING_DTENSOR_TEST, None) for n in _LIGHTNING_DEFINING
    )
    return [getattr(f, _ORIGINAL, f) for f in found if f is not None]


def _fsdp1_aware(original: Callable[[object], bool]) -> Callable[[object], bool]:
    """Lightning's ``original`` DTensor test, ``False`` for a module holding one of fullshard's
    FSDP1 wrappers ([Note: Lightning's DTensor test])."""

    def _has_dtensor_modules(module: object) -> bool:
        if isinstance(module, nn.Module) and any(
            isinstance(m, FullyShardedDataParallel) for m in module.modules()
        ):
            return False
        return original(module)

    setattr(_has_dtensor_modules, _ORIGINAL, original)
    return _has_dtensor_modules


@dataclass
class TorchFSDPPatch:
    """What :func:`patch_torch_fsdp` replaced; :meth:`undo` puts torch's functions back."""

    replaced: list[tuple[ModuleType, str, Any]] = field(default_factory=list)  # module, attr, orig
    active: bool = True

    def undo(self) -> None:
        """Restore torch's functions everywhere they were replaced (idempotent)."""
        global _ACTIVE
        with _LOCK:
            for mod, attr, orig in reversed(self.replaced):
                setattr(mod, attr, orig)
            self.replaced.clear()
            self.active = False
            if _ACTIVE is self:
                _ACTIVE = None

    @property
    def modules(self) -> list[str]:
        """``module.attr`` names currently patched (for logging and tests)."""
        return [f"{m.__name__}.{a}" for m, a, _ in self.replaced]


_ACTIVE: TorchFSDPPatch | None = None
_LOCK = threading.Lock()


def patch_torch_fsdp() -> TorchFSDPPatch:
    """Replace torch's ``fully_shard`` (its two helper functions and FSDP2's private
    ``_get_module_fsdp_state`` / ``_get_post_forward_mesh_info``) and FSDP1's
    ``FullyShardedDataParallel`` class with fullshard's (and, where Lightning is imported, its
    DTensor test: [Note: Lightning's DTensor test]).

    Idempotent: a second call re-scans for modules imported since (patching those too) and
    returns the same handle. ``handle.undo()`` restores torch's functions.
    """
    global _ACTIVE
    with _LOCK:
        for name in _REEXPORTERS:
            importlib.import_module(name)
        originals = _originals()
        handle = _ACTIVE or TorchFSDPPatch()
        for mod in list(sys.modules.values()):
            if not isinstance(mod, ModuleType):
                continue
            try:
                items = list(vars(mod).items())
            except TypeError:  # a module-like object without a __dict__
                continue
            for attr, value in items:
                hit = originals.get(id(value))
                if hit is None or attr not in hit.names:
                    continue
                if hit.skips(mod.__name__):
                    continue
                setattr(mod, attr, hit.ours)
                handle.replaced.append((mod, attr, value))
        _ACTIVE = handle
        return handle
