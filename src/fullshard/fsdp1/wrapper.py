"""``FullyShardedDataParallel``: FSDP1's wrapper class on fullshard's engine.

[Note: an FSDP1 instance that runs none of FSDP1]
The class subclasses torch's ``torch.distributed.fsdp.FullyShardedDataParallel`` so that code
which recognises FSDP1 by ``isinstance(m, FSDP)`` (Accelerate, Lightning, transformers,
user scripts) recognises fullshard's wrappers. Its ``__init__`` does not call torch's (only
``nn.Module.__init__``), and every method and property torch's class defines is overridden
here (``tests/test_fsdp1.py`` checks that none is inherited), so none of torch's FSDP1 code
(``FlatParameter``, its runtime, state-dict and optimizer utilities) ever runs.

An instance is an ``nn.Module`` holding the wrapped module as ``_fsdp_wrapped_module``
(``.module`` returns it), so parameter names carry FSDP1's ``_fsdp_wrapped_module.``
prefixes, and it is one fullshard unit (``fullshard.api.build_unit``): the wrapped module's
parameters not owned by a nested wrapper become ``DTensor`` shards gathered around the
wrapper's forward. With ``auto_wrap_policy`` the nested wrappers are made first, bottom-up
(``fullshard.fsdp1.wrap``). Strategies and policies map as ``fullshard.fsdp1.config``
describes; state dicts, optimizer state dicts and ``summon_full_params`` live in their own
modules. There is no ``FlatParameter``, whatever ``use_orig_params`` says: parameters are
always the originals (``DTensor`` shards of their full shape, not 1-D views).
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from collections.abc import Callable, Generator, Iterable, Iterator
from enum import Enum, auto
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import (
    BackwardPrefetch,
    CPUOffload,
    MixedPrecision,
    OptimStateDictConfig,
    ShardingStrategy,
    StateDictConfig,
    StateDictType,
)
from torch.distributed.fsdp import FullyShardedDataParallel as _TorchFSDP
from torch.utils._pytree import tree_map

from ..api import build_unit
from ..clip import clip_grad_norm_ as _clip_grad_norm
from ..engine import STATE_ATTR, FSDPState, mesh_info
from ..engine import TrainingState as _EngineState
from ..module import FullyShardError, UnshardHandle, adopt_applied_params
from . import config
from . import state_dict as S
from .comm_hook import install_comm_hook
from .flat_param import FlatParamSummary, mark_flattened
from .materialize import local_modules, materialize, move_to_device
from .materialize import sync_module_states as sync_states
from .optim_api import OptimStateDictMethods
from .orig_params import named_originals, record_replaced, refuse_in_backward_optimizers
from .summon import summon_wrappers
from .wrap import auto_wrap
from .writeback import install as install_writeback
from .writeback import unmark as unmark_writeback

__all__ = ["FSDP", "FullyShardedDataParallel", "TrainingState"]


class TrainingState(Enum):
    """An FSDP1 instance's ``training_state`` (FSDP1's names)."""

    IDLE = auto()
    FORWARD_BACKWARD = auto()
    SUMMON_FULL_PARAMS = auto()


def _is_unit(module: nn.Module) -> bool:
    """A module that already is a fullshard unit (a wrapper, or ``fully_shard``'s)."""
    return STATE_ATTR in module.__dict__ or isinstance(module, FullyShardedDataParallel)


def _cast_floats(tree: Any, dtype: torch.dtype) -> Any:
    return tree_map(
        lambda t: t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t, tree
    )


class FullyShardedDataParallel(OptimStateDictMethods, S.StateDictTypeMethods, _TorchFSDP):
    """FSDP1's ``FullyShardedDataParallel`` (same arguments, torch's types) on fullshard's
    engine; see the module docstring, and the README's FSDP1 section for the differences."""

    def __init__(
        self,
        module: nn.Module,
        process_group: Any = None,
        sharding_strategy: ShardingStrategy | None = None,
        cpu_offload: CPUOffload | None = None,
        auto_wrap_policy: Callable[..., Any] | Any | None = None,
        backward_prefetch: BackwardPrefetch | None = BackwardPrefetch.BACKWARD_PRE,
        mixed_precision: MixedPrecision | None = None,
        ignored_modules: Iterable[nn.Module] | None = None,
        param_init_fn: Callable[[nn.Module], None] | None = None,
        device_id: int | torch.device | None = None,
        sync_module_states: bool = False,
        forward_prefetch: bool = False,
        limit_all_gathers: bool = True,
        use_orig_params: bool = False,
        ignored_states: Iterable[torch.nn.Parameter] | Iterable[torch.nn.Module] | None = None,
        device_mesh: DeviceMesh | None = None,
    ) -> None:
        nn.Module.__init__(self)  # not torch's FSDP1 __init__: see the Note
        originals = named_originals(module)  # what an optimizer built before may hold
        self._summoning = False  # inside summon_full_params
        self._buffers_cast = False  # buffer_dtype applied (the root's first forward)
        config.warn_container(module)
        strategy = config.resolve_strategy(sharding_strategy)
        ignored_mods, ignored_params = config.resolve_ignored(
            module, ignored_modules, ignored_states, _is_unit
        )
        device = config.device_of(device_id)
        # the arguments an auto-wrapped child gets from its root (FSDP1's root_kwargs)
        kwargs: dict[str, Any] = {
            "process_group": process_group,
            "sharding_strategy": sharding_strategy,
            "cpu_offload": cpu_offload,
            "backward_prefetch": backward_prefetch,
            "mixed_precision": mixed_precision,
            "param_init_fn": param_init_fn,
            "device_id": device_id,
            "sync_module_states": sync_module_states,
            "forward_prefetch": forward_prefetch,
            "limit_all_gathers": limit_all_gathers,
            "use_orig_params": use_orig_params,
            "device_mesh": device_mesh,
            "auto_wrap_policy": None,
            "ignored_states": ignored_params,
        }
        if config.is_stand_in(process_group):
            self._init_stand_in(
                module, auto_wrap_policy, kwargs, device, ignored_mods, ignored_params
            )
            return
        mesh = self._mesh_and_children(
            module, strategy, device, auto_wrap_policy, kwargs, ignored_mods, ignored_params
        )
        info = mesh_info(mesh)
        config.check_device(device, info.device)
        own = local_modules(module, ignored_mods)
        materialize(own, param_init_fn, device or info.device)
        if device is not None:
            move_to_device(own, device)
        if sync_module_states:
            sync_states(own, mesh)
        self._fsdp_wrapped_module = module
        # the buffers' dtypes before buffer_dtype (full state dicts give them back so)
        self._buffer_dtypes = {S.clean_fqn(n): b.dtype for n, b in module.named_buffers()}
        build_unit(
            (self,),
            info,
            reshard_after_forward=config.reshard_after_forward_of(strategy),
            mp_policy=config.mp_policy_of(mixed_precision),
            offload_policy=config.offload_policy_of(cpu_offload),
            ignored_params=ignored_params,
        )
        group, size = config.fsdp1_group(info, strategy)
        own_params = [(sp.fqn, sp.orig_shape) for sp in self._unit.group.params]
        config.check_same_params(module, own_params, group)
        record_replaced(originals, self)
        self._finish_init(group, size, info.device, kwargs, ignored_mods, ignored_params)
        self._mark_flattened()

    @staticmethod
    def _mesh_and_children(
        module: nn.Module,
        strategy: ShardingStrategy,
        device: torch.device | None,
        policy: Any,
        kwargs: dict[str, Any],
        ignored_mods: set[nn.Module],
        ignored_params: set[nn.Parameter],
    ) -> DeviceMesh:
        """The root's mesh, from its arguments (``kwargs``), and its auto-wrapped children
        (``policy``), which get the root's arguments as FSDP1 hands them down: its
        intra/inter-node groups for a hybrid default, here the mesh made of them."""
        group, device_mesh = kwargs["process_group"], kwargs["device_mesh"]
        with config.mesh_cache():
            device_type = config.resolve_device_type(device, module)
            mesh = config.resolve_mesh(
                strategy, group, device_mesh, device_type, policy is not None
            )
            if policy is not None:
                hybrid_default = strategy in config.HYBRID and group is device_mesh is None
                auto_wrap(
                    module,
                    policy,
                    ignored_mods,
                    ignored_params,
                    {**kwargs, "device_mesh": mesh if hybrid_default else device_mesh},
                    FullyShardedDataParallel,
                    _is_unit,
                )
        return mesh

    def _init_stand_in(
        self,
        module: nn.Module,
        policy: Any,
        kwargs: dict[str, Any],
        device: torch.device | None,
        ignored_mods: set[nn.Module],
        ignored_params: set[nn.Parameter],
    ) -> None:
        """A wrapper over a stand-in process group (``config.is_stand_in``): the wrapping
        only, as FSDP1 makes it (its auto-wrap decisions, ``rank``/``world_size`` the group's);
        nothing is sharded, and what would communicate refuses (:attr:`_unit`)."""
        if policy is not None:
            auto_wrap(
                module,
                policy,
                ignored_mods,
                ignored_params,
                kwargs,
                FullyShardedDataParallel,
                _is_unit,
            )
        self._fsdp_wrapped_module = module
        self._buffer_dtypes = {S.clean_fqn(n): b.dtype for n, b in module.named_buffers()}
        group = kwargs["process_group"]
        self._finish_init(group, group.size(), device, kwargs, ignored_mods, ignored_params)

    def _finish_init(
        self,
        group: Any,
        world_size: int,
        device: Any,
        kwargs: dict[str, Any],
        ignored_mods: set[nn.Module],
        ignored_params: set[nn.Parameter],
    ) -> None:
        self._set_fsdp1_attributes(group, world_size, device, kwargs)
        self._ignored_modules = ignored_mods
        self._ignored_params = ignored_params
        S.install_state_dict_hooks(self)

    def _set_fsdp1_attributes(
        self, group: Any, world_size: int, device: Any, args: dict[str, Any]
    ) -> None:
        """FSDP1's attributes, which frameworks read (``args``: the constructor's, as handed
        to auto-wrapped children). At world size 1 FSDP1 runs ``NO_SHARD`` whatever the
        strategy, and says so; fullshard's unit over one rank is the same."""
        strategy = config.resolve_strategy(args["sharding_strategy"])
        config.warn_strategy(strategy, world_size)
        self.process_group = group
        self.rank = group.rank() if config.is_stand_in(group) else dist.get_rank(group)
        self.world_size = world_size
        self.sharding_strategy = ShardingStrategy.NO_SHARD if world_size == 1 else strategy
        self._strategy = strategy  # the one the unit runs (its mesh, its resharding)
        self.mixed_precision = args["mixed_precision"] or MixedPrecision()
        self.cpu_offload = args["cpu_offload"] or CPUOffload()
        self.backward_prefetch = args["backward_prefetch"]
        self.forward_prefetch = args["forward_prefetch"]
        self.limit_all_gathers = args["limit_all_gathers"]
        self._use_orig_params = args["use_orig_params"]
        self._device_mesh = args["device_mesh"]
        self.compute_device = device
        self._state_dict_type = StateDictType.FULL_STATE_DICT
        self._state_dict_config: StateDictConfig = S.FullStateDictConfig()
        self._optim_state_dict_config: OptimStateDictConfig = S.FullOptimStateDictConfig()
        self._comm_hook: Callable[..., None] | None = None
        self._comm_hook_state: object = None

    # ------------------------------------------------------------------- identity
    @property
    def _unit(self) -> FSDPState:
        unit = self.__dict__.get(STATE_ATTR)
        if unit is None:
            group = self.__dict__.get("process_group")
            raise RuntimeError(
                f"this FullyShardedDataParallel was built over process_group="
                f"{type(group).__name__}, a stand-in that cannot communicate (not a "
                f"torch.distributed.ProcessGroup): it holds the wrapping only. Pass a "
                f"torch.distributed.ProcessGroup (or none, for the default group) to run it"
            )
        return cast(FSDPState, unit)

    @property
    def module(self) -> nn.Module:  # type: ignore[override]
        """The wrapped module (the innermost one under an activation-checkpoint wrapper)."""
        inner = self._fsdp_wrapped_module
        return cast(nn.Module, getattr(inner, "_checkpoint_wrapped_module", inner))

    @property
    def _has_params(self) -> bool:  # type: ignore[override]
        return bool(self._unit.group.params)

    @property
    def _flat_param(self) -> FlatParamSummary | None:  # type: ignore[override]
        """No ``FlatParameter`` (fullshard keeps the original parameters): ``None`` without
        parameters, else what frameworks read of one (``fullshard.fsdp1.flat_param``)."""
        own = self._unit.group.params
        if not own:
            return None
        return FlatParamSummary([sp.sharded_param for sp in own], [sp.fqn for sp in own])

    @property
    def _is_root(self) -> bool | None:  # type: ignore[override]
        """``None`` before the first forward (FSDP1's lazy init), then whether it is the root."""
        unit = self._unit
        return None if unit.ctx is None else unit.is_root

    @property
    def training_state(self) -> TrainingState:  # type: ignore[override]
        if self._summoning:
            return TrainingState.SUMMON_FULL_PARAMS
        unit = self.__dict__.get(STATE_ATTR)  # None while __init__ builds it
        idle = unit is None or unit.training_state is _EngineState.IDLE
        return TrainingState.IDLE if idle else TrainingState.FORWARD_BACKWARD

    def __getattr__(self, name: str) -> Any:
        """Attributes the wrapper lacks come from the wrapped module (as FSDP1)."""
        try:
            return nn.Module.__getattr__(self, name)
        except AttributeError:
            if name == "_fsdp_wrapped_module":
                raise
            return getattr(self._fsdp_wrapped_module, name)

    def __getitem__(self, key: int) -> Any:
        """Index the wrapped module (an ``nn.Sequential``)."""
        return self._fsdp_wrapped_module.__getitem__(key)  # type: ignore[operator]

    def __deepcopy__(self, memo: Any) -> Any:
        raise FullyShardError(
            "copy.deepcopy of a FullyShardedDataParallel module is not supported: its "
            "parameters are DTensor shards bound to hooks and process groups. Copy the weights "
            "instead (state_dict under FULL_STATE_DICT, then load_state_dict)"
        )

    def check_is_root(self) -> bool:
        """Whether this is the outermost wrapper (the root its forward has)."""
        return self._unit.outermost() is self._unit

    @staticmethod
    def fsdp_modules(  # type: ignore[override]
        module: nn.Module, root_only: bool = False
    ) -> list[FullyShardedDataParallel]:
        """The wrappers in ``module`` (itself included), in module order; with ``root_only``
        those not nested in another one inside ``module``."""
        if not root_only:
            return [m for m in module.modules() if isinstance(m, FullyShardedDataParallel)]
        roots: list[FullyShardedDataParallel] = []

        def visit(m: nn.Module) -> None:
            if isinstance(m, FullyShardedDataParallel):
                roots.append(m)
                return
            for child in m.children():
                visit(child)

        visit(module)
        return roots

    # ------------------------------------------------------------------- forward
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """The wrapped module's forward; the unit's hooks gather and free around it."""
        unit = self._unit
        if unit.is_root and not self._buffers_cast:  # the root's first forward
            refuse_in_backward_optimizers(FullyShardedDataParallel.fsdp_modules(self))
            self._cast_buffers()
        mp = self.mixed_precision
        cast_inputs = mp.cast_forward_inputs or (unit.is_root and mp.cast_root_forward_inputs)
        if mp.param_dtype is not None and cast_inputs:
            args, kwargs = _cast_floats((args, kwargs), mp.param_dtype)
        return self._fsdp_wrapped_module(*args, **kwargs)

    def _cast_buffers(self) -> None:
        """The root's first forward: every wrapper's own floating-point buffers to its
        ``buffer_dtype`` (FSDP1 does it at its lazy init)."""
        for w in FullyShardedDataParallel.fsdp_modules(self):
            dtype = w.mixed_precision.buffer_dtype
            w._buffers_cast = True
            if dtype is None:
                continue
            for m in local_modules(w._fsdp_wrapped_module, w._ignored_modules):
                for buf in m.buffers(recurse=False):
                    if buf.is_floating_point():
                        buf.data = buf.data.to(dtype)

    def _mixed_precision_enabled_for_buffers(self) -> bool:
        return self.mixed_precision.buffer_dtype is not None

    def _low_precision_hook_enabled(self) -> bool:
        """Whether the registered comm hook is one of torch's low-precision hooks."""
        name = getattr(self._comm_hook, "__name__", "")
        return name in ("fp16_compress_hook", "bf16_compress_hook")

    def _reset_lazy_init(self) -> None:
        """Nothing to reset: the engine's lazy init runs at the root's first forward."""

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> Any:  # type: ignore[override]
        if STATE_ATTR not in self.__dict__:  # a stand-in group's wrapper: nothing sharded
            return nn.Module._apply(self, fn, recurse)
        unmark_writeback(self._unit)  # torch re-wraps each parameter (fsdp1/writeback.py)
        try:
            ret = nn.Module._apply(self, fn, recurse)
            adopt_applied_params(self._unit)
        finally:
            self._mark_flattened()  # the unit may have adopted new parameter objects
        return ret

    def _mark_flattened(self) -> None:
        """Mark this wrapper's parameters with FSDP1's ``_fsdp_flattened``, which frameworks
        read as "managed by FSDP" (``fullshard.fsdp1.flat_param``), and give them FSDP1's
        writeback (``fullshard.fsdp1.writeback``)."""
        mark_flattened(sp.sharded_param for sp in self._unit.group.params)
        install_writeback(self._unit, self._strategy)

    def _assert_state(self, state: Any) -> None:
        """Raise unless in ``state`` (one state or a list): ``fullshard.fsdp1.TrainingState``
        or torch's FSDP1 enum (its private ``TrainingState``, which torch's test helpers pass),
        matched by name."""
        states = [state] if isinstance(state, Enum) else list(state)
        if self.training_state.name not in {s.name for s in states}:
            raise ValueError(
                f"expected to be in states {states} but current state is {self.training_state}"
            )

    def _unshard(self, async_op: bool = False) -> UnshardHandle | None:
        """Gather this unit's parameters (the engine's unshard; ``async_op``: a handle)."""
        unit = self._unit
        if unit.ctx is None:
            unit.outermost().lazy_init()
        unit.group.unshard()
        handle = UnshardHandle(unit.group)
        if async_op:
            return handle
        handle.wait()
        return None

    def _wait_unshard_streams_on_current_stream(self) -> None:
        """Nothing to wait for: the engine orders its streams itself."""

    @contextlib.contextmanager
    def _use_training_state(self, training_state: Any, handle_training_state: Any) -> Generator:
        yield

    @contextlib.contextmanager
    def _deregister_orig_params_ctx(self) -> Generator:
        """Nothing to deregister: the original parameters are always the registered ones."""
        yield

    # ------------------------------------------------------------------- names
    def named_parameters(self, *args: Any, **kwargs: Any) -> Iterator[tuple[str, nn.Parameter]]:  # type: ignore[override]
        """``nn.Module.named_parameters``, without ``_fsdp_wrapped_module.`` inside
        ``summon_full_params`` (as FSDP1)."""
        clean = self.training_state is TrainingState.SUMMON_FULL_PARAMS
        for name, p in nn.Module.named_parameters(self, *args, **kwargs):
            yield (name.replace(S.FSDP_PREFIX, "") if clean else name), p

    def named_buffers(self, *args: Any, **kwargs: Any) -> Iterator[tuple[str, torch.Tensor]]:  # type: ignore[override]
        """``nn.Module.named_buffers``, cleaned inside ``summon_full_params`` (as FSDP1)."""
        clean = self.training_state is TrainingState.SUMMON_FULL_PARAMS
        for name, b in nn.Module.named_buffers(self, *args, **kwargs):
            yield (name.replace(S.FSDP_PREFIX, "") if clean else name), b

    # ------------------------------------------------------------------- training
    @contextlib.contextmanager
    def no_sync(self) -> Generator:
        """Accumulate gradients unsharded, without reducing them, inside the block (root only);
        the first backward after it reduces the sum."""
        if not self.check_is_root():
            raise RuntimeError(
                "`no_sync()` on inner FSDP instances is not supported. Please call "
                "`no_sync()` on root FSDP module."
            )
        self._assert_state(TrainingState.IDLE)
        states = self._unit.subtree_states()
        before = [st.group.overrides.requires_gradient_sync for st in states]
        for st in states:
            st.group.overrides.requires_gradient_sync = False
        try:
            yield
        finally:
            for st, value in zip(states, before):
                st.group.overrides.requires_gradient_sync = value

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float | int, norm_type: float | int = 2.0) -> torch.Tensor:
        """Clip all gradients of the module to a total ``norm_type`` norm of ``max_norm``
        (root only, every rank); returns the total norm in the gradients' promoted dtype."""
        if not self.check_is_root():
            raise RuntimeError(
                "`clip_grad_norm_()` should only be called on the root FSDP instance"
            )
        self._assert_state(TrainingState.IDLE)
        params = list(self.parameters())
        norm = _clip_grad_norm(params, float(max_norm), float(norm_type))
        dtypes = [p.grad.dtype for p in params if p.grad is not None]
        if not dtypes:
            warnings.warn(
                f"Called FSDP.clip_grad_norm_() on rank {self.rank} with no gradients -- "
                f"returning the total norm in the default dtype {norm.dtype}",
                stacklevel=2,
            )
            return norm
        if self.cpu_offload.offload_params:
            norm = norm.cpu()
        return norm.to(functools.reduce(torch.promote_types, dtypes))

    def register_comm_hook(self, state: object, hook: Callable[..., None]) -> None:  # type: ignore[override]
        """Reduce gradients with FSDP1's ``hook(state, grad, output)`` (root only, before
        the first forward; see ``fullshard.fsdp1.comm_hook``)."""
        if not self.check_is_root():
            raise AssertionError("register_comm_hook can only be called on a root instance.")
        wrappers = FullyShardedDataParallel.fsdp_modules(self)
        for w in wrappers:
            if w._strategy in config.HYBRID:
                raise AssertionError(
                    f"Communication hook is not supported for hybrid strategies: {w._strategy}"
                )
            if w._strategy is ShardingStrategy.NO_SHARD:
                raise NotImplementedError(
                    "register_comm_hook with NO_SHARD (an all-reduce hook) is not supported by "
                    "fullshard: NO_SHARD reduces across replicas itself"
                )
            if w._comm_hook is not None:
                raise AssertionError("A communication hook is already registered")
        if not callable(hook):
            raise ValueError(f"The communication hook must be callable but got {hook}")
        install_comm_hook([w._unit for w in wrappers], state, hook)
        for w in wrappers:
            w._comm_hook, w._comm_hook_state = hook, state

    def apply(self, fn: Callable[[nn.Module], None]) -> FullyShardedDataParallel:
        """``nn.Module.apply`` with this unit's full parameters (written back)."""
        self._assert_state(TrainingState.IDLE)
        with FullyShardedDataParallel.summon_full_params(self, recurse=False):
            nn.Module.apply(self, fn)
        return self

    # ------------------------------------------------------------------- full params
    @staticmethod
    @contextlib.contextmanager
    def summon_full_params(
        module: nn.Module,
        recurse: bool = True,
        writeback: bool = True,
        rank0_only: bool = False,
        offload_to_cpu: bool = False,
        with_grads: bool = False,
    ) -> Generator:
        """Full parameters on the modules inside the block (``fullshard.fsdp1.summon``)."""
        if recurse:
            wrappers = FullyShardedDataParallel.fsdp_modules(module)
        else:
            wrappers = [module] if isinstance(module, FullyShardedDataParallel) else []
        with summon_wrappers(wrappers, writeback, rank0_only, offload_to_cpu, with_grads):
            yield


FSDP = FullyShardedDataParallel
