"""fullshard's ``FullyShardedDataParallel`` against torch's FSDP1 on what torch's own FSDP1 tests
rely on: ``device_id`` as a string, stand-in process groups (torch's wrap-policy tests build the
wrapper structure over one), FSDP1's warnings (a strategy at world size 1, ``NO_SHARD``, the
top-level module ignored) and its checks of ``ignored_modules`` / ``ignored_states`` (nested
wrappers' ignored modules differing across ranks included), ``_assert_state`` with torch's
private ``TrainingState``, the refusal of an optimizer in backward, parameter swaps through a
module's own ``__setattr__``, and no gradient for a layer the loss does not use. Both engines
run on the same inputs in one spawn (gloo, CPU) and are compared on results, messages and
warning categories.
"""

from __future__ import annotations

import functools
import os
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import ShardingStrategy
from torch.distributed.fsdp._common_utils import TrainingState as TorchTrainingState
from torch.distributed.fsdp.wrap import always_wrap_policy, size_based_auto_wrap_policy
from torch.distributed.optim import _apply_optimizer_in_backward

from fsdp1_cases import CPU, ENGINES, make_net, train, wrap
from fullshard.fsdp1 import FullyShardedDataParallel as OurFSDP
from fullshard.fsdp1 import TrainingState
from fullshard.testing import run_distributed

S = ShardingStrategy
SWITCH = "FSDP is switching to use `NO_SHARD`"


def _warned(call: Callable[[], Any]) -> tuple[Any, list[tuple[str, str]]]:
    """What ``call`` returns and the (category, message) of each warning it gives."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = call()
    return out, [(w.category.__name__, str(w.message)) for w in caught]


def _raised(call: Callable[[], Any]) -> tuple[str, str] | None:
    """(type name, first line) of what ``call`` raises, or None."""
    try:
        call()
    except Exception as err:
        return type(err).__name__, str(err).split("\n")[0]
    return None


# ---------------------------------------------------------------- stand-in process group
class StandInGroup:
    """What torch's ``DummyProcessGroup`` (torch.testing._internal.common_fsdp) is to FSDP1: a
    ``rank()`` and a ``size()``, no communication."""

    def __init__(self, rank: int, size: int) -> None:
        self._rank, self._size = rank, size

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._size


def _nested_sequential() -> nn.Module:
    torch.manual_seed(0)
    inner = nn.Sequential(nn.Linear(5, 5), nn.Linear(5, 5))
    return nn.Sequential(nn.Linear(5, 5), nn.Linear(5, 5), inner)


def _wrapped_structure(cls: Any, group: StandInGroup, policy: Any) -> dict[str, Any]:
    model, warned = _warned(
        lambda: cls(_nested_sequential(), group, auto_wrap_policy=policy, device_id=CPU)
    )
    return {
        "wrapped": [n for n, m in model.named_modules() if isinstance(m, cls)],
        "attrs": [
            (m.rank, m.world_size, m.process_group is group, m.sharding_strategy.name)
            for m in model.modules()
            if isinstance(m, cls)
        ],
        "warned": sorted({(c, m.split(" since")[0]) for c, m in warned if SWITCH in m}),
        "model": model,
    }


def test_stand_in_process_group_builds_fsdp1s_wrapper_structure() -> None:
    """Over a stand-in group (no ``torch.distributed`` at all, as torch's wrap-policy tests),
    the wrapper makes FSDP1's wrap decisions with the group's rank and size, FSDP1's
    warning at size 1 (NO_SHARD), and refuses to run in one line naming the group."""
    policies = {
        "size": functools.partial(size_based_auto_wrap_policy, min_num_params=40),
        "always": always_wrap_policy,
    }
    for size in (1, 2):
        for label, policy in policies.items():
            group = StandInGroup(0, size)
            theirs = _wrapped_structure(ENGINES["torch"], group, policy)
            ours = _wrapped_structure(OurFSDP, group, policy)
            for key in ("wrapped", "attrs", "warned"):
                assert ours[key] == theirs[key], (size, label, key, ours[key], theirs[key])
            assert bool(ours["warned"]) == (size == 1)
            with pytest.raises(RuntimeError, match="StandInGroup, a stand-in that cannot"):
                ours["model"](torch.randn(2, 5))
    assert not dist.is_initialized()


# ---------------------------------------------------------------------- constructor cases
class IgnoredModule(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(4, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weight


class Layered(nn.Module):
    """torch's ignored-modules test model: ``layer1`` holds ``num_ignored`` ignored modules
    (made last, so that the other parameters are the same whatever their number)."""

    def __init__(self, num_ignored: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layer0 = nn.Linear(3, 5)
        first, last = [nn.Linear(5, 4), nn.Linear(4, 4)], nn.Linear(4, 4)
        self.layer2 = nn.Linear(4, 2)
        self.layer3 = nn.Linear(2, 2)
        ignored = [IgnoredModule() for _ in range(num_ignored)]
        self.layer1 = nn.Sequential(*first, *ignored, last)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in (self.layer0, self.layer1, self.layer2, self.layer3):
            x = torch.relu(layer(x))
        return x


def _train_layered(model: nn.Module, steps: int = 3) -> list[float]:
    optim = torch.optim.Adam(model.parameters(), lr=1e-3)
    losses = []
    for step in range(steps):
        torch.manual_seed(10 + step)
        loss = model(torch.randn(8, 3)).sum()
        loss.backward()
        optim.step()
        optim.zero_grad()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(total.item())
    return losses


def _ignored_across_ranks(e: str, ignore_modules: bool) -> list[float]:
    """torch's test: each rank ignores a different number of modules in ``layer1``'s wrapper;
    the root is given none (it must not shard what ``layer1`` ignores)."""
    cls = ENGINES[e]
    model = Layered(num_ignored=dist.get_rank() + 1)
    ignored = [m for m in model.layer1.modules() if isinstance(m, IgnoredModule)]
    kwargs: dict[str, Any] = {"device_id": CPU}
    if ignore_modules:
        kwargs["ignored_modules"] = ignored
    else:
        kwargs["ignored_states"] = [p for m in ignored for p in m.parameters()]
    model.layer1 = cls(model.layer1, **kwargs)
    model.layer3 = cls(model.layer3, device_id=CPU)
    return _train_layered(cls(model, device_id=CPU))


def _ignored_checks(e: str) -> dict[str, Any]:
    cls = ENGINES[e]
    model = Layered(1)
    params = [p for p in model.layer1[1].parameters()]
    out: dict[str, Any] = {
        "params as modules": _raised(lambda: cls(model, ignored_modules=params, device_id=CPU)),
        "mixed states": _raised(
            lambda: cls(model, ignored_states=[model.layer2, *params], device_id=CPU)
        ),
        "not iterable": _raised(lambda: cls(model, ignored_modules=3, device_id=CPU)),
    }
    top = Layered(1)
    _, warned = _warned(lambda: cls(top, ignored_modules=[top], device_id=CPU))
    out["top-level"] = [(c, m[:60]) for c, m in warned if "top-level" in m]
    return out


def _strategy_warnings(e: str) -> dict[str, Any]:
    """FSDP1's warnings: any strategy but NO_SHARD over a group of one rank (it runs NO_SHARD),
    NO_SHARD over two (deprecated)."""
    alone = [dist.new_group([r]) for r in range(dist.get_world_size())][dist.get_rank()]
    out: dict[str, Any] = {}
    for strategy in (None, S.FULL_SHARD, S.SHARD_GRAD_OP, S.NO_SHARD):
        for group_label, group in (("one rank", alone), ("two ranks", None)):

            def build(strategy: Any = strategy, group: Any = group) -> Any:
                return wrap(e, make_net(), process_group=group, sharding_strategy=strategy)

            model, warned = _warned(build)
            relevant = [(c, m) for c, m in warned if SWITCH in m or "`NO_SHARD` sharding" in m]
            key = f"{group_label}/{strategy and strategy.name}"
            out[key] = (
                sorted({(c, m) for c, m in relevant}),
                len(relevant),
                model.sharding_strategy.name,
                model.world_size,
                train(model, 1)[0],
            )
    return out


def _device_ids(e: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for label, device_id in (("str", "cpu"), ("device", torch.device("cpu"))):
        model = wrap(e, make_net(), device_id=device_id)
        devices = {p.device.type for p in model.parameters()}
        out[label] = (devices, model.compute_device.type, train(model, 2)[0])
    if torch.accelerator.current_accelerator() is None:  # an index names an accelerator
        out["index"] = _raised(lambda: ENGINES[e](nn.Linear(2, 2), device_id=0))
    return out


def _constructor_cases() -> dict[str, Any]:
    out: dict[str, Any] = {}
    for e in ENGINES:
        out[f"device_id/{e}"] = _device_ids(e)
        out[f"ignored checks/{e}"] = _ignored_checks(e)
        out[f"strategy warnings/{e}"] = _strategy_warnings(e)
        for ignore_modules in (True, False):
            out[f"ignored across ranks/{ignore_modules}/{e}"] = _ignored_across_ranks(
                e, ignore_modules
            )
    out["ignored across ranks/plain"] = _train_layered(Layered(dist.get_rank() + 1))
    # a root whose own parameters differ across ranks: one clear line, not an abort
    model = Layered(1)
    ignored = [model.layer2] if dist.get_rank() == 0 else []
    with pytest.raises(ValueError, match="differ across ranks"):
        OurFSDP(model, ignored_modules=ignored, device_id=CPU)
    return out


def test_constructor_matches_fsdp1() -> None:
    """``device_id`` as ``"cpu"`` or a device trains as under torch's FSDP1; FSDP1's
    ignored-modules refusals (types, first lines) and top-level warning; its warnings for a
    strategy at world size 1 (and the NO_SHARD it then reports) and for NO_SHARD, with the same
    categories and texts; ignored modules that differ across ranks inside a nested wrapper
    train as under torch's FSDP1, and a root whose own parameters differ across ranks is
    refused in one line."""
    out = run_distributed(_constructor_cases, 2)[0]
    theirs, ours = out["device_id/torch"], out["device_id/fullshard"]
    for label in ("str", "device"):
        assert ours[label][:2] == theirs[label][:2] == ({"cpu"}, "cpu"), label
        assert ours[label][2] == pytest.approx(theirs[label][2], rel=1e-5), label
    if "index" in theirs:
        assert theirs["index"][0] == ours["index"][0] == "RuntimeError", (ours, theirs)
        assert "no accelerator" in ours["index"][1]
    theirs, ours = out["ignored checks/torch"], out["ignored checks/fullshard"]
    assert ours["top-level"] == theirs["top-level"] != []
    for what in ("params as modules", "mixed states", "not iterable"):
        assert theirs[what] is not None and ours[what] is not None, what
        assert ours[what][0] == theirs[what][0], (what, ours[what], theirs[what])
        if what != "not iterable":  # torch's is list()'s own TypeError
            assert ours[what][1].startswith(theirs[what][1][:60]), (what, ours, theirs)
    theirs, ours = out["strategy warnings/torch"], out["strategy warnings/fullshard"]
    assert theirs.keys() == ours.keys()
    for key in theirs:
        assert ours[key][:4] == theirs[key][:4], (key, ours[key], theirs[key])
        assert ours[key][4] == pytest.approx(theirs[key][4], rel=1e-5), key
    assert theirs["one rank/None"][0] == [
        (
            "UserWarning",
            f"{SWITCH} instead of ShardingStrategy.FULL_SHARD since the world size is 1.",
        )
    ]
    assert theirs["two ranks/NO_SHARD"][0][0][0] == "FutureWarning"
    for ignore_modules in (True, False):
        key = f"ignored across ranks/{ignore_modules}"
        assert out[f"{key}/fullshard"] == pytest.approx(out[f"{key}/torch"], rel=1e-5), key
        assert out[f"{key}/fullshard"] == pytest.approx(out["ignored across ranks/plain"], rel=1e-5)


# ------------------------------------------------------------------------ runtime cases
class TwoLayers(nn.Module):
    def __init__(self, use_b: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(10, 10)
        self.b = nn.Linear(10, 10)
        self.use_b = use_b

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> Any:
        return (self.a(x), self.b(y)) if self.use_b else self.a(x)


def _unused_layer_grads(e: str) -> dict[str, Any]:
    """torch's test: ``b`` is unused, or used in forward but not in the loss; after each
    backward ``a``'s parameters have gradients and ``b``'s none (on every rank)."""
    cls = ENGINES[e]
    out: dict[str, Any] = {}
    for use_b in (True, False):
        for strategy in (S.NO_SHARD, S.FULL_SHARD):
            for orig in (True, False):
                model = cls(
                    TwoLayers(use_b),
                    sharding_strategy=strategy,
                    auto_wrap_policy=always_wrap_policy,
                    use_orig_params=orig,
                    device_id=CPU,
                )
                seen = []
                for _ in range(3):
                    x = torch.randn(10, 10)
                    res = model(x, x)
                    (res[0] if use_b else res).sum().backward()
                    # FSDP1's flat parameter or the originals (under use_orig_params, one
                    # whose shard is empty on this rank has none): a has some, b none
                    a = [p.grad is not None for p in model.module.a.parameters()]
                    b = [p.grad is None for p in model.module.b.parameters()]
                    seen.append((any(a), all(b)))
                out[f"{use_b}/{strategy.name}/{orig}"] = seen
    return out


class SetattrLinear(nn.Module):
    """A module whose own ``__setattr__`` counts its calls."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0
        self.weight = nn.Parameter(torch.randn(5, 5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weight

    def __setattr__(self, name: str, value: Any) -> None:
        if name != "calls" and "calls" in self.__dict__:
            self.__dict__["calls"] += 1
        super().__setattr__(name, value)


def _setattr_calls(e: str) -> dict[str, Any]:
    """Whether the forward swaps parameters through the module's ``__setattr__`` (FSDP1 does,
    unless ``FSDP_USE_UNSAFE_SETATTR=1``)."""
    out: dict[str, Any] = {}
    for unsafe in ("", "1", "0"):
        os.environ["FSDP_USE_UNSAFE_SETATTR"] = unsafe
        for orig in (True, False):
            inner = SetattrLinear()
            model = ENGINES[e](inner, use_orig_params=orig, device_id=CPU)
            inner.__dict__["calls"] = 0
            model(torch.randn(8, 5)).sum().backward()
            out[f"{unsafe or 'unset'}/{orig}"] = inner.__dict__["calls"] > 0
    del os.environ["FSDP_USE_UNSAFE_SETATTR"]
    return out


def _optim_in_backward(e: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for orig in (False, True):
        model = wrap(e, make_net(), use_orig_params=orig)
        _apply_optimizer_in_backward(
            torch.optim.SGD, model.parameters(), {"lr": 0.03}, register_hook=False
        )
        x = torch.randint(0, 13, (4, 5))
        out[str(orig)] = _raised(lambda model=model, x=x: model(x).sum().backward())
    return out


def _assert_states(e: str) -> dict[str, Any]:
    model = wrap(e, make_net())
    train(model, 1)
    out: dict[str, Any] = {}
    for label, enum in (("torch", TorchTrainingState), ("fullshard", TrainingState)):
        out[f"{label}/one"] = _raised(lambda enum=enum: model._assert_state(enum.IDLE))
        pair = [enum.IDLE, enum.SUMMON_FULL_PARAMS]
        out[f"{label}/list"] = _raised(lambda pair=pair: model._assert_state(pair))
        wrong = enum.FORWARD_BACKWARD
        out[f"{label}/wrong"] = _raised(lambda wrong=wrong: model._assert_state(wrong))
    return out


def _runtime_cases() -> dict[str, Any]:
    out: dict[str, Any] = {}
    for e in ENGINES:
        out[f"assert_state/{e}"] = _assert_states(e)
        out[f"optim in backward/{e}"] = _optim_in_backward(e)
        out[f"setattr/{e}"] = _setattr_calls(e)
        out[f"unused grads/{e}"] = _unused_layer_grads(e)
    return out


def test_runtime_api_matches_fsdp1() -> None:
    """``_assert_state`` takes one state or a list, fullshard's or torch's private
    ``TrainingState`` (matched by name), and raises FSDP1's ValueError otherwise; an optimizer
    in backward is refused with FSDP1's message without ``use_orig_params`` (and with
    fullshard's with it: nothing would step it); the forward swaps parameters through a
    module's own ``__setattr__`` unless ``FSDP_USE_UNSAFE_SETATTR=1``, as FSDP1; a layer the
    loss does not use gets no gradient (``.grad`` None), with ``use_orig_params`` either way,
    as under torch's FSDP1."""
    for out in run_distributed(_runtime_cases, 2):
        theirs, ours = out["assert_state/torch"], out["assert_state/fullshard"]
        assert theirs["torch/one"] is theirs["torch/list"] is None  # torch's enum, torch's FSDP1
        assert ours["torch/one"] is ours["torch/list"] is None
        assert ours["fullshard/one"] is ours["fullshard/list"] is None
        for key in ("torch/wrong", "fullshard/wrong"):
            assert ours[key] is not None and ours[key][0] == "ValueError", key
            assert "expected to be in states" in ours[key][1], key
        assert theirs["torch/wrong"][0] == "ValueError"
        theirs, ours = out["optim in backward/torch"], out["optim in backward/fullshard"]
        assert ours["False"] == theirs["False"]
        assert ours["False"] == ("RuntimeError", pytest.approx(ours["False"][1]))
        assert "only supported with use_orig_params=True" in ours["False"][1]
        assert ours["True"] is not None and ours["True"][0] == "NotImplementedError"
        assert "_apply_optimizer_in_backward" in ours["True"][1]
        assert out["setattr/fullshard"] == out["setattr/torch"]
        assert out["setattr/torch"]["unset/True"] and not out["setattr/torch"]["1/True"]
        assert out["unused grads/fullshard"] == out["unused grads/torch"]
