"""A sharded model is garbage-collected once the user drops it, whatever it has done: built,
run forward, backward, an optimizer step, ``summon_full_params`` / ``unshard``, a state dict,
``no_sync`` / ``set_requires_gradient_sync(False)``, under each sharding strategy, mixed
precision, CPU offload, activation checkpointing, HSDP, comm hooks, explicit prefetching and
frozen parameters. Collected means the module object is gone
and so is every tensor storage the model and its engine held (sharded and unsharded
parameters, gradients, gather buffers), so a process that builds models one after another
(sweeps, notebooks, test suites, RL that rebuilds its policy) does not keep each one's memory.

The control is torch doing the same in the same spawn: torch's FSDP1 for the FSDP1 wrapper,
torch's ``fully_shard`` for fullshard's. Each case drops the model and its optimizer, runs
``gc.collect()`` and reads weak references taken before.
"""

from __future__ import annotations

import gc
import types
import weakref
from collections.abc import Callable
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    apply_activation_checkpointing,
)
from torch.distributed.algorithms._comm_hooks import default_hooks
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import (
    CPUOffload,
    MixedPrecisionPolicy,
    ShardingStrategy,
    StateDictType,
)
from torch.distributed.fsdp import fully_shard as torch_fully_shard

import fullshard
from fsdp1_cases import BF16, Block, batch, loss_of, make_net, wrap
from fullshard.testing import run_distributed

# What a case does with its model (and optimizer) before dropping it.
Action = Callable[[nn.Module, torch.optim.Optimizer], None]


def _forward(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    loss_of(model, *batch(0))  # a graph built, then dropped without a backward


def _eval(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    with torch.no_grad():
        loss_of(model, *batch(0))


def _backward(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    loss_of(model, *batch(0)).backward()


def _step(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    for step in range(2):
        loss_of(model, *batch(step)).backward()
        opt.step()
        opt.zero_grad()


def _fsdp1_no_sync(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    with model.no_sync():  # type: ignore[operator]
        loss_of(model, *batch(0)).backward()
    loss_of(model, *batch(1)).backward()
    opt.step()


def _fsdp1_summon(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    _step(model, opt)
    with type(model).summon_full_params(model, with_grads=True):  # type: ignore[attr-defined]
        sum(p.sum() for p in model.parameters())


def _fsdp1_state_dict(kind: StateDictType) -> Action:
    def act(model: nn.Module, opt: torch.optim.Optimizer) -> None:
        _step(model, opt)
        cls: Any = type(model)
        with cls.state_dict_type(model, kind):
            model.state_dict()
            cls.optim_state_dict(model, opt)

    return act


def _fsdp1_clip(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    loss_of(model, *batch(0)).backward()
    model.clip_grad_norm_(1.0)  # type: ignore[operator]
    opt.step()


def _fsdp2_no_sync(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    model.set_requires_gradient_sync(False)  # type: ignore[operator]
    loss_of(model, *batch(0)).backward()
    model.set_requires_gradient_sync(True)  # type: ignore[operator]
    loss_of(model, *batch(1)).backward()
    opt.step()


def _fsdp2_unshard(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    _step(model, opt)
    model.unshard()  # type: ignore[operator]
    sum(p.sum() for p in model.parameters())
    model.reshard()  # type: ignore[operator]


def _fsdp2_state_dict(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    _step(model, opt)
    model.state_dict()
    opt.state_dict()


def _fsdp2_not_last_backward(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    model.set_is_last_backward(False)  # type: ignore[operator]
    loss_of(model, *batch(0)).backward()  # its reductions stay in flight


FSDP1_ACTIONS: dict[str, Action] = {
    "construct": lambda model, opt: None,
    "forward": _forward,
    "eval": _eval,
    "forward_backward": _backward,
    "step": _step,
    "no_sync": _fsdp1_no_sync,
    "summon_full_params": _fsdp1_summon,
    "full_state_dict": _fsdp1_state_dict(StateDictType.FULL_STATE_DICT),
    "sharded_state_dict": _fsdp1_state_dict(StateDictType.SHARDED_STATE_DICT),
    "clip_grad_norm_": _fsdp1_clip,
}


def _checkpointed() -> nn.Module:
    net = make_net()
    apply_activation_checkpointing(net, check_fn=lambda m: isinstance(m, Block))
    return net


def _fsdp1_comm_hook(engine: str) -> nn.Module:
    model = wrap(engine)
    state = default_hooks.DefaultState(dist.group.WORLD)
    model.register_comm_hook(state, default_hooks.reduce_scatter_hook)  # type: ignore[operator]
    return model


# FSDP1 models: the first runs every action, the variants a step and no_sync
FSDP1_BUILDS: dict[str, Callable[[str], nn.Module]] = {
    "": lambda e: wrap(e),
    "flat": lambda e: wrap(e, use_orig_params=False),
    "grad_op": lambda e: wrap(e, sharding_strategy=ShardingStrategy.SHARD_GRAD_OP),
    "no_shard": lambda e: wrap(e, sharding_strategy=ShardingStrategy.NO_SHARD),
    "hybrid": lambda e: wrap(e, sharding_strategy=ShardingStrategy.HYBRID_SHARD),
    "bf16": lambda e: wrap(e, mixed_precision=BF16),
    "offload": lambda e: wrap(e, cpu_offload=CPUOffload(offload_params=True)),
    "checkpointed": lambda e: wrap(e, _checkpointed()),
    "comm_hook": _fsdp1_comm_hook,
}
FSDP2_ACTIONS: dict[str, Action] = {
    "construct": lambda model, opt: None,
    "forward": _forward,
    "eval": _eval,
    "forward_backward": _backward,
    "step": _step,
    "no_sync": _fsdp2_no_sync,
    "unshard": _fsdp2_unshard,
    "state_dict": _fsdp2_state_dict,
    "not_last_backward": _fsdp2_not_last_backward,
}


def _fsdp2(engine: str, net: nn.Module | None = None, **kwargs: Any) -> nn.Module:
    """``make_net()`` with each block and the root sharded by ``engine``'s ``fully_shard``."""
    shard: Any = torch_fully_shard if engine == "torch" else fullshard.fully_shard
    net = net or make_net()
    for block in net.blocks:  # type: ignore[union-attr]
        shard(block, **kwargs)
    return shard(net, **kwargs)  # type: ignore[no-any-return]


def _fsdp2_hooked(engine: str) -> nn.Module:
    model: Any = _fsdp2(engine)
    model.set_all_reduce_hook(lambda output: None)
    model.set_modules_to_forward_prefetch([model.blocks[0]])
    model.blocks[1].set_modules_to_backward_prefetch([model.blocks[0]])
    return model  # type: ignore[no-any-return]


def _fsdp2_frozen(engine: str) -> nn.Module:
    model: Any = _fsdp2(engine)
    model.blocks[0].up.weight.requires_grad_(False)
    return model  # type: ignore[no-any-return]


def _hsdp() -> DeviceMesh:
    return init_device_mesh("cpu", (1, dist.get_world_size()), mesh_dim_names=("rep", "shard"))


# fully_shard models: the first runs every action, the variants a step and a forward
FSDP2_BUILDS: dict[str, Callable[[str], nn.Module]] = {
    "": lambda e: _fsdp2(e),
    "keep_after_forward": lambda e: _fsdp2(e, reshard_after_forward=False),
    "reshard_to_1": lambda e: _fsdp2(e, reshard_after_forward=1),
    "bf16": lambda e: _fsdp2(e, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16)),
    "hsdp": lambda e: _fsdp2(e, mesh=_hsdp()),
    "checkpointed": lambda e: _fsdp2(e, _checkpointed()),
    "hooks_and_prefetch": _fsdp2_hooked,
    "frozen": _fsdp2_frozen,
}


def _storages(root: nn.Module) -> list[weakref.ref[torch.UntypedStorage]]:
    """Weak references to the storage of every tensor reachable from ``root`` through Python
    objects (the model, its engine's state, hooks, closures), meshes and process groups aside
    (torch caches those)."""
    seen: set[int] = set()
    refs: dict[int, weakref.ref[torch.UntypedStorage]] = {}
    stack: list[Any] = [root]
    while stack:
        obj = stack.pop()
        if id(obj) in seen or isinstance(obj, (type, types.ModuleType, DeviceMesh)):
            continue
        if isinstance(obj, (dist.ProcessGroup, weakref.ref)):
            continue
        if isinstance(obj, dict) and "__builtins__" in obj:  # a module's globals
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            for t in (obj, getattr(obj, "_local_tensor", None), obj.grad):
                if t is not None and type(t) in (torch.Tensor, nn.Parameter):  # not a wrapper
                    storage = t.untyped_storage()
                    refs.setdefault(storage._cdata, weakref.ref(storage))
        children = gc.get_referents(obj)
        if isinstance(obj, types.FunctionType):  # its closure, not its module's globals
            children = list(obj.__closure__ or ())
        stack.extend(children)
    return list(refs.values())


def _collected(build: Callable[[], nn.Module], act: Action) -> tuple[bool, int]:
    """Build, run ``act``, drop: whether the module was collected, and how many of the
    storages it held are still alive."""
    model = build()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    act(model, opt)
    ref, storages = weakref.ref(model), _storages(model)
    assert storages, "no storage found to watch"
    del model, opt
    gc.collect()
    return ref() is None, sum(s() is not None for s in storages)


def _gc_cases() -> dict[str, tuple[bool, int]]:
    out = {}
    for engine in ("torch", "fullshard"):
        for cfg, build in FSDP1_BUILDS.items():
            if engine == "torch" and cfg == "offload":
                continue  # torch's FSDP1 pins the offloaded shards: it needs a GPU
            actions = FSDP1_ACTIONS if not cfg else {"step": _step, "no_sync": _fsdp1_no_sync}
            for name, act in actions.items():
                out[f"fsdp1 {engine} {cfg} {name}"] = _collected(partial(build, engine), act)
        for cfg, build in FSDP2_BUILDS.items():
            actions = FSDP2_ACTIONS if not cfg else {"step": _step, "forward": _forward}
            for name, act in actions.items():
                out[f"fsdp2 {engine} {cfg} {name}"] = _collected(partial(build, engine), act)
    return out


def test_a_dropped_model_is_collected() -> None:
    """Every case, both APIs, 2 ranks: fullshard's model and every storage it held are
    collected; torch in the same spawn is the control (its ``fully_shard`` collects every case,
    its FSDP1 the module in every case but a forward without backward, where it keeps it)."""
    for rank, out in enumerate(run_distributed(_gc_cases, 2)):
        ours = {case: got for case, got in out.items() if " fullshard " in case}
        assert {case.replace(" torch ", " fullshard ") for case in out} - {""} <= set(ours)
        kept = {case: got for case, got in ours.items() if got != (True, 0)}
        assert not kept, f"rank {rank}: (collected, storages alive) of the models kept: {kept}"
        for case, (collected, alive) in out.items():
            if case.startswith("fsdp2 torch"):
                assert (collected, alive) == (True, 0), (rank, case)
            elif case.startswith("fsdp1 torch") and not case.endswith(" forward"):
                assert collected, (rank, case)
