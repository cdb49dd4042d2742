"""fullshard's ``FullyShardedDataParallel`` against torch's FSDP1: ``summon_full_params``, auto
wrapping with torch's policies, meta-device init, ignored states, ``sync_module_states``, and
the wrapper's own API (identity, refusals, ``apply``, comm hooks, ``no_sync``); training and
state dicts are in ``tests/test_fsdp1.py``. Both engines run in one spawn (gloo, CPU).
"""

from __future__ import annotations

import functools
import sys
import types
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.fsdp as tfsdp
from torch import nn
from torch.distributed.algorithms._comm_hooks.default_hooks import (
    DefaultState,
    reduce_scatter_hook,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import (
    MixedPrecision,
    ShardedStateDictConfig,
    ShardingStrategy,
    StateDictType,
)
from torch.distributed.fsdp.wrap import (
    CustomPolicy,
    ModuleWrapPolicy,
    always_wrap_policy,
    enable_wrap,
    lambda_auto_wrap_policy,
    size_based_auto_wrap_policy,
    transformer_auto_wrap_policy,
)
from torch.distributed.fsdp.wrap import wrap as wrap_module
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

import fullshard
from fsdp1_cases import (
    BF16,
    CPU,
    DIM,
    ENGINES,
    VOCAB,
    Block,
    Net,
    batch,
    full_state,
    loss_of,
    make_net,
    max_diff,
    train,
    wrap,
)
from fullshard import count_collectives
from fullshard.fsdp1 import FullyShardedDataParallel as OurFSDP
from fullshard.fsdp1.materialize import BROADCAST_BUCKET_BYTES, sync_module_states
from fullshard.testing import run_distributed

S = ShardingStrategy


# --------------------------------------------------------------------- summon_full_params
def _summon_cases() -> dict[str, Any]:
    out: dict[str, Any] = {}
    for e, cls in ENGINES.items():
        for strategy in (S.FULL_SHARD, S.NO_SHARD):
            key = f"{e}/{strategy.name}"
            model = wrap(e, sharding_strategy=strategy)
            train(model, 1)
            with cls.summon_full_params(model):
                out[f"inside/{key}"] = {
                    n: (tuple(p.shape), p.detach().clone()) for n, p in model.named_parameters()
                }
                out[f"state/{key}"] = model.training_state.name
                with pytest.raises(AssertionError, match="already unsharding"):
                    with cls.summon_full_params(model):
                        pass
                model.module.head.weight.data.add_(1.0)  # written back
            with cls.summon_full_params(model, writeback=False):
                model.module.head.bias.data.add_(1.0)  # dropped (kept under NO_SHARD)
            out[f"after/{key}"] = full_state(model)
            with cls.summon_full_params(model, rank0_only=True, writeback=False):
                out[f"rank0/{key}"] = tuple(model.module.head.weight.shape)
            with cls.summon_full_params(model, recurse=False):
                out[f"recurse=False/{key}"] = (
                    tuple(model.module.head.weight.shape),
                    model.module.blocks[0].module.up.weight.dim(),
                )
            for bad in ({"rank0_only": True}, {"offload_to_cpu": True, "with_grads": True}):
                with pytest.raises(NotImplementedError):
                    with cls.summon_full_params(model, **bad):
                        pass
            if strategy is S.NO_SHARD:
                with pytest.raises(NotImplementedError):
                    with cls.summon_full_params(model, offload_to_cpu=True):
                        pass
    return out


def test_summon_full_params_matches_fsdp1() -> None:
    """Inside: clean names, full shapes and values, training_state SUMMON_FULL_PARAMS, no
    nesting; writeback keeps changes, writeback=False drops them (not under NO_SHARD, as
    FSDP1); rank0_only, recurse=False; FSDP1's refusals. FSDP1's shards are 1-D views of its
    flat parameter, fullshard's are DTensors of the full shape: recurse=False is compared on
    the unit summoned (and, for the child, on its being left sharded)."""
    for rank, out in enumerate(run_distributed(_summon_cases, 2)):
        for strategy in ("FULL_SHARD", "NO_SHARD"):
            t, o = f"torch/{strategy}", f"fullshard/{strategy}"
            inside_t, inside_o = out[f"inside/{t}"], out[f"inside/{o}"]
            assert list(inside_t) == list(inside_o)
            assert "head.weight" in inside_o
            for name, (shape, value) in inside_t.items():
                assert inside_o[name][0] == shape, name
                assert torch.allclose(inside_o[name][1], value, atol=1e-6), name
            assert out[f"state/{t}"] == out[f"state/{o}"] == "SUMMON_FULL_PARAMS"
            after_t, after_o = out[f"after/{t}"], out[f"after/{o}"]
            assert max_diff(after_t, after_o) <= 1e-6, strategy
            kept = strategy == "NO_SHARD"
            bias = after_o["head.bias"] - inside_o["head.bias"][1]
            assert torch.allclose(bias, torch.full_like(bias, float(kept))), strategy
            assert out[f"rank0/{t}"][0] == out[f"rank0/{o}"][0] == 13 or rank != 0
            assert out[f"recurse=False/{o}"] == ((13, 10), 2)  # the child: a 2-D DTensor
            assert out[f"recurse=False/{t}"][0] == (13, 10)


# ------------------------------------------------------------------------- wrap policies
class BNNet(torch.nn.Module):
    """A BatchNorm between linears: FSDP1 wraps it apart, in full precision, under a policy."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, DIM)
        self.a = torch.nn.Linear(DIM, DIM)
        self.bn = torch.nn.BatchNorm1d(DIM)
        self.b = torch.nn.Linear(DIM, VOCAB)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        h = self.a(self.embed(idx)).flatten(0, 1)
        return self.b(self.bn(h)).view(*idx.shape, VOCAB)


def _policies() -> dict[str, tuple[Any, dict[str, Any]]]:
    def custom(m: torch.nn.Module) -> bool | dict[str, Any]:
        if isinstance(m, torch.nn.Embedding):
            return {"sharding_strategy": S.SHARD_GRAD_OP}
        return isinstance(m, Block)

    return {
        "ModuleWrapPolicy": (ModuleWrapPolicy({Block}), {}),
        "transformer_auto_wrap_policy": (
            functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={Block}),
            {},
        ),
        "size_based_auto_wrap_policy": (
            functools.partial(size_based_auto_wrap_policy, min_num_params=100),
            {},
        ),
        "lambda_auto_wrap_policy": (
            functools.partial(
                lambda_auto_wrap_policy, lambda_fn=lambda m: isinstance(m, torch.nn.Linear)
            ),
            {},
        ),
        "always_wrap_policy": (always_wrap_policy, {}),
        "CustomPolicy": (CustomPolicy(custom), {}),
        "ModuleWrapPolicy+bf16": (ModuleWrapPolicy({Block}), {"mixed_precision": BF16}),
        "size_based+bf16": (
            functools.partial(size_based_auto_wrap_policy, min_num_params=100),
            {"mixed_precision": BF16},
        ),
    }


def _structure(model: torch.nn.Module, cls: Any) -> list[tuple[str, str, Any]]:
    return [
        (n, m.sharding_strategy.name, m.mixed_precision.param_dtype)
        for n, m in model.named_modules()
        if isinstance(m, cls)
    ]


def _policy_cases() -> dict[str, Any]:
    out: dict[str, Any] = {}
    for label, (policy, kwargs) in _policies().items():
        for e, cls in ENGINES.items():
            model = wrap(e, auto_wrap_policy=policy, **kwargs)
            losses, _ = train(model, 2)
            out[f"{label}/{e}"] = (_structure(model, cls), losses, full_state(model))
    for e in ENGINES:  # what a callable policy is asked, in order
        log: list[tuple[str, bool, int]] = []

        def recording(
            module: torch.nn.Module,
            recurse: bool,
            nonwrapped_numel: int,
            log: list[tuple[str, bool, int]] = log,
        ) -> bool:
            log.append((type(module).__name__, recurse, nonwrapped_numel))
            return size_based_auto_wrap_policy(module, recurse, nonwrapped_numel, 100)

        wrap(e, auto_wrap_policy=recording, mixed_precision=BF16)
        out[f"asked/{e}"] = log
    bn_policy = ModuleWrapPolicy({torch.nn.Linear})
    for e, cls in ENGINES.items():  # BatchNorm: its own unit in full precision
        torch.manual_seed(0)
        model = wrap(e, model=BNNet(), auto_wrap_policy=bn_policy, mixed_precision=BF16)
        losses, _ = train(model, 2)
        out[f"BatchNorm+bf16/{e}"] = (_structure(model, cls), losses, full_state(model))
    for e, cls in ENGINES.items():  # enable_wrap / wrap
        torch.manual_seed(0)
        with enable_wrap(wrapper_cls=cls, device_id=CPU, use_orig_params=True):
            inner = torch.nn.Sequential(
                torch.nn.Embedding(VOCAB, DIM),
                wrap_module(Block()),
                wrap_module(Block()),
                torch.nn.Linear(DIM, VOCAB),
            )
        model = cls(inner, device_id=CPU, use_orig_params=True)
        losses, _ = train(model, 2)
        out[f"enable_wrap/{e}"] = (_structure(model, cls), losses, full_state(model))
    return out


def test_auto_wrap_policies_match_fsdp1() -> None:
    """torch's wrap policies (ModuleWrapPolicy, transformer_/size_based_/lambda_auto_wrap_policy,
    always_wrap_policy, CustomPolicy with per-module arguments) and enable_wrap / wrap build
    the same wrappers (names, strategies, mixed precision) as torch's FSDP1 and train alike;
    under mixed precision BatchNorm becomes a unit of its own in full precision. A callable
    policy is asked the same questions (module, recurse, numel left) in the same order."""
    out = run_distributed(_policy_cases, 2)[0]
    assert out["asked/torch"] == out["asked/fullshard"]
    assert ("Block", False, 177) in out["asked/torch"]
    labels = {k.rsplit("/", 1)[0] for k in out if not k.startswith("asked/")}
    assert len(labels) == len(_policies()) + 2
    for label in sorted(labels):
        (st_t, l_t, sd_t), (st_o, l_o, sd_o) = out[f"{label}/torch"], out[f"{label}/fullshard"]
        assert st_t == st_o, label
        assert len(st_o) > 1, label  # something was wrapped below the root
        assert l_t == pytest.approx(l_o, rel=1e-5), label
        assert max_diff(sd_t, sd_o) <= 1e-5, label
    prefix = "_fsdp_wrapped_module."
    bn = {n.removeprefix(prefix): dtype for n, _, dtype in out["BatchNorm+bf16/fullshard"][0]}
    assert bn["bn"] is None and bn["a"] == torch.bfloat16
    custom = {n.removeprefix(prefix): s for n, s, _ in out["CustomPolicy/fullshard"][0]}
    assert custom["embed"] == "SHARD_GRAD_OP" and custom["blocks.0"] == "FULL_SHARD"


# ------------------------------------------------------------------ init, ignored states
class MetaNet(Net):
    """``Net`` whose root initialises its own buffer, as FSDP1's meta-device init asks."""

    def reset_parameters(self) -> None:
        self.scale.fill_(1.5)


def _fill(module: torch.nn.Module) -> None:
    """A ``param_init_fn``: materialise ``module``'s own tensors on the CPU, deterministically."""
    module.to_empty(device=CPU, recurse=False)
    with torch.no_grad():
        own = [*module.parameters(recurse=False), *module.buffers(recurse=False)]
        for i, t in enumerate(own):
            t.copy_(torch.linspace(-1, 1, t.numel()).view(t.shape) * (i + 1))


def _marked(model: torch.nn.Module) -> dict[str, bool]:
    """Which parameters carry FSDP1's ``_fsdp_flattened`` mark (frameworks read it as "managed
    by FSDP"), by clean name."""
    return {
        n.replace("_fsdp_wrapped_module.", ""): getattr(p, "_fsdp_flattened", False)
        for n, p in model.named_parameters()
    }


def _init_cases() -> dict[str, Any]:
    out: dict[str, Any] = {}
    for e in ENGINES:
        with torch.device("meta"):
            net = Net()
        out[f"param_init_fn/{e}"] = full_state(wrap(e, model=net, param_init_fn=_fill))
        with torch.device("meta"):
            meta = MetaNet()
        torch.manual_seed(3)
        out[f"reset_parameters/{e}"] = full_state(wrap(e, model=meta))
        for how, kwargs in (
            ("ignored_modules", {"ignored_modules": ["head"]}),
            ("ignored_states", {"ignored_states": ["head.weight", "head.bias"]}),
        ):
            net = make_net()
            for key in list(kwargs):  # names -> the model's objects
                kwargs[key] = [
                    net.get_submodule(n) if key == "ignored_modules" else net.get_parameter(n)
                    for n in kwargs[key]
                ]
            model = wrap(e, model=net, **kwargs)
            out[f"{how}/types/{e}"] = type(model.module.head.weight).__name__
            out[f"{how}/marked/{e}"] = _marked(model)
            out[f"{how}/{e}"] = (train(model, 2)[0], full_state(model))
    # sync_module_states: every rank starts from its own weights, all end with rank 0's
    # (torch's FSDP1 refuses CPU tensors here, so the reference is rank 0's model)
    synced = wrap("fullshard", model=make_net(seed=dist.get_rank()), sync_module_states=True)
    out["sync_module_states"] = max_diff(full_state(synced), make_net(seed=0).state_dict())
    with pytest.raises(ValueError, match="requires them to be on GPU"):
        wrap("torch", model=make_net(seed=dist.get_rank()), sync_module_states=True)
    return out


def test_meta_init_ignored_states_and_sync_module_states() -> None:
    """Meta-device models materialised by ``param_init_fn`` or by ``reset_parameters()`` hold
    what torch's FSDP1 gives them; ignored modules / parameters stay plain, unsharded and
    unsynchronised in both (each rank's own), without FSDP1's ``_fsdp_flattened`` mark, which
    the managed ones carry in both; ``sync_module_states`` starts every rank from
    rank 0's weights (on the CPU too, which torch's FSDP1 refuses)."""
    for rank, out in enumerate(run_distributed(_init_cases, 2)):
        for how in ("param_init_fn", "reset_parameters"):
            assert max_diff(out[f"{how}/torch"], out[f"{how}/fullshard"]) == 0.0, how
        assert out["param_init_fn/fullshard"]["head.bias"][-1].item() == 2.0
        for how in ("ignored_modules", "ignored_states"):
            (l_t, sd_t), (l_o, sd_o) = out[f"{how}/torch"], out[f"{how}/fullshard"]
            assert l_t == pytest.approx(l_o, rel=1e-5), how
            assert max_diff(sd_t, sd_o) <= 1e-5, (how, rank)
            assert out[f"{how}/types/fullshard"] == "Parameter"
            marked = out[f"{how}/marked/fullshard"]
            assert marked == out[f"{how}/marked/torch"], (how, marked)
            assert not marked["head.weight"] and marked["embed.weight"], (how, marked)
        assert out["sync_module_states"] == 0.0


class _MixedStates(nn.Module):
    """fp32 and bf16 parameters (one not contiguous, one tied), int64 and bool buffers."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(DIM, DIM)
        self.low = nn.Linear(DIM, 3).to(torch.bfloat16)
        self.turned = nn.Parameter(torch.randn(5, 3).t())  # not contiguous
        self.tied = self.lin.weight
        self.register_buffer("steps", torch.randint(0, 1000, (7,)))
        self.register_buffer("mask", torch.rand(6) > 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x)


def _mixed(seed: int) -> _MixedStates:
    torch.manual_seed(seed)
    return _MixedStates()


class _Broadcasts(TorchDispatchMode):
    """Counts the c10d broadcasts dispatched while active."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.count += str(func.overloadpacket) == "c10d.broadcast_"
        return func(*args, **(kwargs or {}))


def _sync_cases() -> dict[str, Any]:
    out: dict[str, Any] = {}
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    want = {k: v.clone() for k, v in _mixed(0).state_dict().items()}
    for bucket_bytes in (BROADCAST_BUCKET_BYTES, 64):  # 64: more buckets, each under 64 bytes
        model = _mixed(dist.get_rank())
        with _Broadcasts() as seen:
            sync_module_states(list(model.modules()), mesh, bucket_bytes=bucket_bytes)
        out[bucket_bytes] = (seen.count, max_diff(model.state_dict(), want))
        out[f"{bucket_bytes}/dtypes"] = {k: v.dtype for k, v in model.state_dict().items()}
        out[f"{bucket_bytes}/contiguous"] = model.turned.is_contiguous()
    with _Broadcasts() as seen:  # through the wrapper: one unit, its own tensors
        synced = OurFSDP(_mixed(dist.get_rank()), device_id=CPU, sync_module_states=True)
    out["wrapper"] = (seen.count, max_diff(full_state(synced), want))
    return out


def test_sync_module_states_broadcasts_in_buckets() -> None:
    """``sync_module_states`` leaves every rank with rank 0's parameters and buffers (mixed
    dtypes, a tensor that is not contiguous, a tied one) in one broadcast per dtype (fp32,
    bf16, int64, bool) rather than one per tensor; a smaller bucket size cuts them into more
    broadcasts with the same values."""
    for rank, out in enumerate(run_distributed(_sync_cases, 2)):
        count, diff = out[BROADCAST_BUCKET_BYTES]
        assert (count, diff) == (4, 0.0), (rank, out)
        small_count, small_diff = out[64]
        # fp32: turned (60 B), the tied weight (400 B), bias (40 B); bf16: weight (60 B), bias
        # (6 B); int64 and bool one each
        assert small_diff == 0.0 and small_count == 3 + 2 + 1 + 1, (rank, out)
        assert out["wrapper"] == (4, 0.0), (rank, out)
        assert out[f"{BROADCAST_BUCKET_BYTES}/contiguous"] is False, (rank, out)
        for key in (BROADCAST_BUCKET_BYTES, 64):
            assert out[f"{key}/dtypes"]["low.weight"] == torch.bfloat16, out


def _our_step_hooks() -> int:
    from torch.optim.optimizer import _global_optimizer_pre_hooks

    return sum(
        getattr(h, "__module__", "") == "fullshard.fsdp1.orig_params"
        for h in _global_optimizer_pre_hooks.values()
    )


def _hook_cases() -> dict[str, Any]:
    """An optimizer built before wrapping steps the wrapped model through the hook, which is
    there until it has swapped the originals out (twice: it comes back); wrapping with
    nothing holding the originals leaves no hook."""
    out: dict[str, Any] = {"before": _our_step_hooks()}
    wrapped = wrap("fullshard", model=make_net())
    out["no optimizer yet"] = _our_step_hooks()
    for round_ in range(2):
        model = make_net()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)  # holds the originals
        wrapped = wrap("fullshard", model=model)
        out[f"{round_}/wrapped"] = _our_step_hooks()
        before = full_state(wrapped)
        loss_of(wrapped, *batch(0)).backward()
        opt.step()
        out[f"{round_}/stepped"] = max_diff(full_state(wrapped), before) > 0
        out[f"{round_}/swapped"] = [type(p) for g in opt.param_groups for p in g["params"]]
        out[f"{round_}/after"] = _our_step_hooks()
        loss_of(wrapped, *batch(1)).backward()
        opt.step()  # and steps on without it
        out[f"{round_}/stepped again"] = max_diff(full_state(wrapped), before) > 0
    return out


def test_the_optimizer_hook_lives_only_while_it_is_needed() -> None:
    """The global step pre-hook that swaps the wrapped parameters into an optimizer built
    before wrapping is installed by a wrapper that replaced parameters and removed once no
    replaced parameter is left (it used to stay for the life of the process): at once when
    nothing held them, after the early optimizer's first step otherwise, which trains the
    wrapped model as before."""
    out = run_distributed(_hook_cases, 2)[0]
    assert out["before"] == 0 and out["no optimizer yet"] == 0, out
    for round_ in range(2):
        assert out[f"{round_}/wrapped"] == 1, out
        assert out[f"{round_}/stepped"] and out[f"{round_}/stepped again"], out
        assert all(issubclass(t, DTensor) for t in out[f"{round_}/swapped"]), out
        assert out[f"{round_}/after"] == 0, out


# ----------------------------------------------------------------- the wrapper's own API
def _counting_hook(calls: list[int]) -> Any:
    def hook(state: DefaultState, grad: torch.Tensor, output: torch.Tensor) -> None:
        calls.append(grad.numel())
        reduce_scatter_hook(state, grad, output)

    return hook


def _api_cases() -> dict[str, Any]:
    out: dict[str, Any] = {}
    for e, cls in ENGINES.items():
        net = make_net()
        model = wrap(e, model=net)
        child = model.module.blocks[0]
        out[f"identity/{e}"] = (
            isinstance(model, tfsdp.FullyShardedDataParallel),
            model.module is net,
            model.embed is net.embed,  # attributes come from the wrapped module
            len(cls.fsdp_modules(model)),
            cls.fsdp_modules(model, root_only=True) == [model],
        )
        train(model, 1)
        out[f"roots/{e}"] = (model.check_is_root(), child.check_is_root(), model._is_root)
        flat = child._flat_param  # what Accelerate reads of it under mixed precision
        out[f"flat_param/{e}"] = (flat.dtype, flat.device.type, flat.requires_grad)
        # FSDP1's mark on what parameters() yields: the FlatParameters or the originals
        out[f"marked/{e}"] = [
            {getattr(p, "_fsdp_flattened", False) for p in wrap(e, use_orig_params=o).parameters()}
            for o in (True, False)
        ]
        for what, refusal in _refusals(e, model, child).items():
            out[f"refused/{what}/{e}"] = refusal
        cls.set_state_dict_type(child, StateDictType.SHARDED_STATE_DICT)
        with pytest.raises(AssertionError, match="same state dict settings"):
            cls.get_state_dict_type(model)
        # apply(): fn sees full parameters, and what it writes stays
        fresh = wrap(e)
        fresh.apply(_fill_linear)
        out[f"apply/{e}"] = full_state(fresh)
        # a communication hook: FSDP1's reduce_scatter_hook, counted
        calls: list[int] = []
        hooked = wrap(e)
        hooked.register_comm_hook(DefaultState(dist.group.WORLD), _counting_hook(calls))
        with pytest.raises(AssertionError, match="already registered"):
            hooked.register_comm_hook(DefaultState(dist.group.WORLD), _counting_hook(calls))
        losses, _ = train(hooked, 2)
        out[f"comm_hook/{e}"] = (len(calls), losses, full_state(hooked))
        # an optimizer built on the unwrapped model (FSDP1 allows it with use_orig_params)
        net = make_net()
        early = torch.optim.AdamW(net.parameters(), lr=1e-2, weight_decay=0.1)
        model = wrap(e, model=net)
        losses, _ = train(model, 3, optim=early)
        out[f"optim_before/{e}"] = (losses, full_state(model))
    # no FlatParameter to cast in place (Accelerate's upcast of a low-precision model)
    with pytest.raises(NotImplementedError, match="Load the model in float32"):
        wrap("fullshard")._flat_param.data  # noqa: B018
    # a deliberate difference: gradients stay in the parameters' dtype
    keep = MixedPrecision(param_dtype=torch.bfloat16, keep_low_precision_grads=True)
    with pytest.raises(NotImplementedError, match="keep_low_precision_grads"):
        wrap("fullshard", mixed_precision=keep)
    # no_sync: no gradient reduction inside, the reduction after it
    model = wrap("fullshard")
    x, y = batch(0)
    with count_collectives() as inside, model.no_sync():
        loss_of(model, x, y).backward()
    with count_collectives() as after:
        loss_of(model, x, y).backward()
    out["no_sync reductions"] = (inside.calls("reduce_scatter"), after.calls("reduce_scatter"))
    return out


def _refusals(e: str, model: Any, child: Any) -> dict[str, Any]:
    """What each misuse raises under engine ``e``: (type name, first line), or None."""
    cls = ENGINES[e]
    refusals = {
        "no_sync on a child": lambda: child.no_sync().__enter__(),
        "clip on a child": lambda: child.clip_grad_norm_(1.0),
        "comm hook on a child": lambda: child.register_comm_hook(None, reduce_scatter_hook),
        "wrong config type": lambda: cls.set_state_dict_type(
            model, StateDictType.FULL_STATE_DICT, ShardedStateDictConfig()
        ),
        "manual hybrid without groups": lambda: cls(
            torch.nn.Linear(2, 2), sharding_strategy=S.HYBRID_SHARD, device_id=CPU
        ),
        "groups and mesh": lambda: cls(
            torch.nn.Linear(2, 2),
            process_group=dist.group.WORLD,
            device_mesh=init_device_mesh("cpu", (2,)),
            device_id=CPU,
        ),
        "ignored_modules and ignored_states": lambda: cls(
            torch.nn.Linear(2, 2), ignored_modules=[], ignored_states=[], device_id=CPU
        ),
        "auto wrap over a wrapper": lambda: wrap(e, model=torch.nn.Sequential(model)),
    }
    out: dict[str, Any] = {}
    for what, call in refusals.items():
        try:
            call()
            out[what] = None
        except Exception as err:
            out[what] = (type(err).__name__, str(err).split("\n")[0])
    return out


def _fill_linear(m: torch.nn.Module) -> None:
    if isinstance(m, torch.nn.Linear):
        assert m.weight.dim() == 2 and not hasattr(m.weight, "to_local")
        with torch.no_grad():
            m.weight.fill_(0.25)


def test_wrapper_api_refusals_comm_hook_and_no_sync() -> None:
    """The wrapper's identity (torch's FSDP1 class, .module, attributes of the wrapped module,
    fsdp_modules, roots, what frameworks read of ``_flat_param``, FSDP1's ``_fsdp_flattened``
    mark on the parameters, with ``use_orig_params`` either way); FSDP1's refusals with its exception types and first lines; apply()
    on full parameters; a comm hook (torch's reduce_scatter_hook, counted: once per unit and
    backward) trains as under torch's FSDP1; no_sync() reduces nothing until it ends;
    keep_low_precision_grads is refused (fullshard keeps gradients in the parameters' dtype);
    an optimizer built on the unwrapped model trains the wrapped one, as under torch's FSDP1
    with ``use_orig_params=True`` (fullshard's parameters are new objects: swapped in at its
    first step)."""
    out = run_distributed(_api_cases, 2)[0]
    assert out["identity/torch"] == out["identity/fullshard"] == (True, True, True, 3, True)
    assert out["roots/torch"] == out["roots/fullshard"] == (True, False, True)
    assert out["flat_param/torch"] == out["flat_param/fullshard"] == (torch.float32, "cpu", True)
    assert out["marked/torch"] == out["marked/fullshard"] == [{True}, {True}]
    refused = sorted({k.split("/")[1] for k in out if k.startswith("refused/")})
    assert len(refused) == 8
    for what in refused:
        theirs, ours = out[f"refused/{what}/torch"], out[f"refused/{what}/fullshard"]
        assert theirs is not None and ours is not None, what
        assert ours[0] == theirs[0], (what, ours, theirs)
        assert ours[1][:40] == theirs[1][:40], (what, ours, theirs)
    assert max_diff(out["apply/torch"], out["apply/fullshard"]) == 0.0
    assert out["apply/fullshard"]["head.weight"].eq(0.25).all()
    (n_t, l_t, sd_t), (n_o, l_o, sd_o) = out["comm_hook/torch"], out["comm_hook/fullshard"]
    assert n_t == n_o == 2 * 3
    assert l_t == pytest.approx(l_o, rel=1e-6)
    assert max_diff(sd_t, sd_o) <= 1e-6
    inside, after = out["no_sync reductions"]
    assert inside == 0 and after == 3
    (l_t, sd_t), (l_o, sd_o) = out["optim_before/torch"], out["optim_before/fullshard"]
    assert l_t == pytest.approx(l_o, rel=1e-6)
    assert max_diff(sd_t, sd_o) <= 1e-6


# ---------------------------------------------------------------------- patch_torch_fsdp
def test_patch_torch_fsdp_rebinds_fsdp1s_class() -> None:
    """``patch_torch_fsdp()`` rebinds torch's ``FullyShardedDataParallel`` (and a framework's
    ``FSDP`` alias) to fullshard's wrapper, in its defining module too (Accelerate imports it
    from there); torch's private FSDP1 modules keep theirs; undo restores."""
    torch_cls = tfsdp.FullyShardedDataParallel
    defining = sys.modules["torch.distributed.fsdp.fully_sharded_data_parallel"]
    private = types.ModuleType("torch.distributed.fsdp._fake_private")  # torch's FSDP1 package
    private.FullyShardedDataParallel = torch_cls  # type: ignore[attr-defined]
    sys.modules[private.__name__] = private
    fake = types.ModuleType("fake_fsdp1_framework")  # a framework that imported torch's class
    fake.FSDP = fake.FullyShardedDataParallel = fake.Other = torch_cls  # type: ignore[attr-defined]
    sys.modules["fake_fsdp1_framework"] = fake
    try:
        handle = fullshard.patch_torch_fsdp()
        try:
            assert tfsdp.FullyShardedDataParallel is OurFSDP
            assert fake.FSDP is fake.FullyShardedDataParallel is OurFSDP
            assert fake.Other is torch_cls  # not one of the names
            assert defining.FullyShardedDataParallel is OurFSDP
            assert private.FullyShardedDataParallel is torch_cls
            assert "fake_fsdp1_framework.FSDP" in handle.modules
        finally:
            handle.undo()
        assert tfsdp.FullyShardedDataParallel is defining.FullyShardedDataParallel is torch_cls
        assert fake.FSDP is fake.FullyShardedDataParallel is torch_cls
    finally:
        del sys.modules["fake_fsdp1_framework"], sys.modules[private.__name__]


def test_patch_torch_fsdp_answers_lightnings_dtensor_test() -> None:
    """Where Lightning is imported, ``patch_torch_fsdp()`` rebinds its ``_has_dtensor_modules``
    (the test by which it loads a full checkpoint the FSDP2 way) to one that answers ``False``
    for a model holding one of fullshard's FSDP1 wrappers and asks Lightning's otherwise; a
    second patch keeps it, undo restores Lightning's (a stand-in module under Lightning's
    name: the real one is checked by ``tests/clients``)."""
    name = "lightning_fabric.strategies.model_parallel"
    real = sys.modules.get(name)
    fake = types.ModuleType(name)
    lightnings = fake._has_dtensor_modules = lambda module: "asked Lightning's"  # type: ignore[attr-defined]
    sys.modules[name] = fake
    wrapper = OurFSDP.__new__(OurFSDP)  # an instance is all the test looks at
    torch.nn.Module.__init__(wrapper)
    try:
        handle = fullshard.patch_torch_fsdp()
        try:
            ours = fake._has_dtensor_modules  # type: ignore[attr-defined]
            assert ours is not lightnings and f"{name}._has_dtensor_modules" in handle.modules
            assert ours(torch.nn.Sequential(torch.nn.Linear(1, 1), wrapper)) is False
            assert ours(torch.nn.Linear(1, 1)) == ours(None) == "asked Lightning's"
            assert fullshard.patch_torch_fsdp() is handle
            assert fake._has_dtensor_modules is ours  # type: ignore[attr-defined]
        finally:
            handle.undo()
        assert fake._has_dtensor_modules is lightnings  # type: ignore[attr-defined]
    finally:
        if real is None:
            del sys.modules[name]
        else:
            sys.modules[name] = real


def _dcp_cases() -> dict[str, Any]:
    """torch DCP's get/set_state_dict on fullshard's wrapper under patch_torch_fsdp() (DCP then
    calls fullshard's static methods), full and sharded, resuming training."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_state_dict,
        set_state_dict,
    )

    out: dict[str, Any] = {}
    handle = fullshard.patch_torch_fsdp()
    try:
        for full in (True, False):
            options = StateDictOptions(full_state_dict=full)
            model = wrap("fullshard")
            _, opt = train(model, 2)
            msd, osd = get_state_dict(model, opt, options=options)
            out[f"keys/{full}"] = (list(msd), sorted(osd["state"]))
            fresh = wrap("fullshard", model=make_net(seed=5))
            new_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-2, weight_decay=0.1)
            set_state_dict(
                fresh, new_opt, model_state_dict=msd, optim_state_dict=osd, options=options
            )
            out[f"resumed/{full}"] = train(fresh, 1, optim=new_opt, first_step=2)[0]
            out[f"continued/{full}"] = train(model, 1, optim=opt, first_step=2)[0]
    finally:
        handle.undo()
    return out


def test_torch_dcp_state_dict_under_the_patch() -> None:
    """With ``patch_torch_fsdp()``, torch DCP's ``get_state_dict`` / ``set_state_dict`` (full and
    sharded) work on fullshard's FSDP1 wrappers: FSDP1's keys, and training resumes exactly.
    (Without the patch DCP runs torch's FSDP1 code on them, which fullshard cannot support.)"""
    for out in run_distributed(_dcp_cases, 2):
        for full in (True, False):
            keys, state = out[f"keys/{full}"]
            assert keys[:2] == ["scale", "embed.weight"] and "head.weight" in state, full
            assert out[f"resumed/{full}"] == pytest.approx(out[f"continued/{full}"], rel=1e-6)
