"""FSDP1's ``use_orig_params=True`` writeback (torch's ``TestFSDPUseOrigParamsWriteback``):
parameters and gradients changed by hand on the wrapped module reach the shards, a replacement
of another shape and a change between forward and backward under ``SHARD_GRAD_OP`` are
refused, each against torch's FSDP1 in one spawn (gloo, CPU, 2 ranks). See [Note:
use_orig_params writeback] in ``fullshard.fsdp1.writeback``.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import ShardingStrategy
from torch.distributed.fsdp.wrap import ModuleWrapPolicy

from fsdp1_cases import CPU, ENGINES
from fullshard.engine import DTENSOR_SUBCLASS_VIEWS
from fullshard.testing import run_distributed

STRATEGIES = {"full": ShardingStrategy.FULL_SHARD, "grad_op": ShardingStrategy.SHARD_GRAD_OP}


class _Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(42)
        self.lin1 = nn.Linear(5, 5)
        self.lin2 = nn.Linear(5, 7)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin2(torch.relu(self.lin1(x)))


def _wrap(engine: str, strategy: str, nested: bool = False) -> nn.Module:
    kwargs: dict[str, Any] = {"sharding_strategy": STRATEGIES[strategy], "use_orig_params": True}
    if nested:
        kwargs["auto_wrap_policy"] = ModuleWrapPolicy({nn.Linear})
    return ENGINES[engine](_Model(), device_id=CPU, **kwargs)  # type: ignore[no-any-return]


def _inp(step: int) -> torch.Tensor:
    torch.manual_seed(100 + step)
    return torch.randn(2, 5)


def _full(engine: str, model: nn.Module) -> dict[str, torch.Tensor]:
    with ENGINES[engine].summon_full_params(model):
        return {n: p.detach().clone() for n, p in model.named_parameters()}


def _train(engine: str, model: nn.Module, steps: int = 2) -> dict[str, torch.Tensor]:
    """Adam built now (on what the module registers), ``steps`` steps; the full parameters."""
    optim = torch.optim.Adam(model.parameters(), lr=1e-2)
    for step in range(steps):
        model(_inp(step)).sum().backward()
        optim.step()
        optim.zero_grad()
    return _full(engine, model)


def _param_case(engine: str, strategy: str, which: str, how: str) -> dict[str, Any]:
    """``model.<which>.weight`` replaced or its ``.data`` set to twos, then read back and
    trained."""
    model = _wrap(engine, strategy)
    model(_inp(9)).sum().backward()  # one step in, so the change lands on a trained unit
    lin = getattr(model.module, which)
    twos = torch.ones_like(lin.weight) * 2
    if how == "replace":
        lin.weight = nn.Parameter(twos)
    else:
        lin.weight.data = twos
    return {"read": _full(engine, model), "trained": _train(engine, model)}


def _grad_case(engine: str, strategy: str, which: str, how: str) -> dict[str, Any]:
    """torch's ``_test_grad_writeback``: a gradient set (twos), set to None or its ``.data``
    set after backward, then steps that do not zero the gradients."""
    model = _wrap(engine, strategy)
    optim = torch.optim.Adam(model.parameters(), lr=1e-2)
    model(_inp(0)).sum().backward()
    weight = getattr(model.module, which).weight
    if how == "none":
        weight.grad = None
    elif how == "set":
        weight.grad = torch.ones_like(weight) * 2
    elif weight.grad is not None:  # FSDP1's empty local shard on one rank has no gradient
        weight.grad.data = torch.ones_like(weight) * 2
    optim.step()
    first = _full(engine, model)
    model(_inp(1)).sum().backward()
    optim.step()
    return {"first": first, "second": _full(engine, model)}


def _outcome(fn: Any) -> str:
    try:
        fn()
    except Exception as e:  # the type and whether FSDP1's phrase is there
        return type(e).__name__ + ": " + str(e)
    return "ok"


def _shape_mismatch(engine: str, strategy: str, grad: bool) -> str:
    """A replacement with one more element in each dim (and such a gradient), then
    ``summon_full_params``."""
    model = _wrap(engine, strategy)
    lin = model.module.lin1 if dist.get_rank() == 0 else model.module.lin2
    shape = [s + 1 for s in lin.weight.shape]

    def change() -> None:
        lin.weight = nn.Parameter(torch.randn(shape))
        if grad:
            lin.weight.grad = torch.randn(shape)
        with ENGINES[engine].summon_full_params(model):
            pass

    return _outcome(change)


def _between_fwd_bwd(engine: str, strategy: str, how: str) -> dict[str, Any]:
    """torch's ``test_writeback_between_fwd_and_bwd_for_no_reshard_raises``: ``lin1.weight``
    changed after forward, then backward (and, where that runs, the step's result)."""
    model = _wrap(engine, strategy, nested=True)
    loss = model(_inp(0)).sum()
    new = model.lin1.weight.detach() * 2
    if how == "data":
        model.lin1.weight.data = new
    else:
        model.lin1._fsdp_wrapped_module.weight = nn.Parameter(new)
    out = _outcome(loss.backward)
    if out != "ok":
        return {"outcome": out}
    # built after the writeback: an optimizer built before steps the replacement under
    # fullshard, never under FSDP1 (which gives the gradient to the new parameter only)
    torch.optim.Adam(model.parameters(), lr=1e-2).step()
    return {"outcome": out, "trained": _full(engine, model)}


def _data_refused() -> str:
    """torch < 2.11: a sharded parameter's ``.data`` set by hand is refused at the next unshard
    (torch's DTensor dropped the values; see the Note)."""
    model = _wrap("fullshard", "full")
    model.module.lin1.weight.data = torch.ones_like(model.module.lin1.weight)
    return _outcome(lambda: model(_inp(0)))


def _moved_case(engine: str, strategy: str, nested: bool) -> dict[str, torch.Tensor]:
    """``FSDP(model).to(device)`` as scripts write it (and a dtype cast that changes
    nothing), then training: ``nn.Module._apply`` swaps each parameter for a converted one."""
    model = _wrap(engine, strategy, nested).to(CPU).to(torch.float32)
    return _train(engine, model)


def _deepcopy_target(engine: str) -> torch.Tensor:
    model = _wrap(engine, "full")
    model(_inp(0)).sum().backward()
    return model.module.lin1.weight  # type: ignore[no-any-return]


def _cases() -> dict[str, Any]:
    out: dict[str, Any] = {}
    # torch < 2.11 cannot take a .data set on a DTensor (see the Note): refused instead
    data = ("data",) if DTENSOR_SUBCLASS_VIEWS else ()
    if not DTENSOR_SUBCLASS_VIEWS:
        out["refused"] = _data_refused()
    for engine in ENGINES:  # a wrapped parameter still deep-copies (and its gradient)
        weight = _deepcopy_target(engine)
        out[f"deepcopy/{engine}"] = _outcome(lambda: copy.deepcopy(weight))  # noqa: B023
        for strategy in STRATEGIES:
            for which in ("lin1", "lin2"):
                for how in ("replace", *data):
                    out[f"param/{strategy}/{which}/{how}/{engine}"] = _param_case(
                        engine, strategy, which, how
                    )
                for how in ("set", "none", *data):
                    out[f"grad/{strategy}/{which}/{how}/{engine}"] = _grad_case(
                        engine, strategy, which, how
                    )
            for grad in (False, True):
                out[f"shape/{strategy}/grad={grad}/{engine}"] = _shape_mismatch(
                    engine, strategy, grad
                )
            for how in (*data, "replace"):
                out[f"between/{strategy}/{how}/{engine}"] = _between_fwd_bwd(engine, strategy, how)
            for nested in (False, True):
                out[f"moved/{strategy}/nested={nested}/{engine}"] = _moved_case(
                    engine, strategy, nested
                )
    return out


def _assert_same(ours: Any, ref: Any, case: str) -> None:
    if isinstance(ours, dict):
        assert list(ours) == list(ref), (case, list(ours), list(ref))
        for k in ours:
            _assert_same(ours[k], ref[k], f"{case}/{k}")
    else:
        torch.testing.assert_close(ours, ref, msg=case)


@functools.cache
def _results() -> list[dict[str, Any]]:
    """Every case on each rank (one spawn for the tests below)."""
    return run_distributed(_cases, 2)


def _pairs(kind: str) -> Iterator[tuple[int, str, Any, Any]]:
    """(rank, case, fullshard's, torch's) for the cases named ``kind/...``."""
    n = 0
    for rank, got in enumerate(_results()):
        for key in sorted(got):
            case, _, engine = key.rpartition("/")
            if engine == "fullshard" and case.startswith(kind + "/"):
                n += 1
                yield rank, case, got[key], got[f"{case}/torch"]
    assert n, kind


def test_param_writeback_matches_fsdp1() -> None:
    """A parameter replaced (``lin.weight = nn.Parameter(...)``) or whose ``.data`` was set
    reads back (``summon_full_params``) and trains (Adam, 2 steps) as under torch's FSDP1, on
    each rank, under FULL_SHARD and SHARD_GRAD_OP."""
    for rank, case, ours, ref in _pairs("param"):
        _assert_same(ours, ref, f"rank {rank} {case}")
    for got in _results():
        assert got["deepcopy/fullshard"] == got["deepcopy/torch"] == "ok", got["deepcopy/fullshard"]
    if not DTENSOR_SUBCLASS_VIEWS:
        for got in _results():
            assert got["refused"].startswith("RuntimeError: Cannot writeback: 'lin1.weight'")
    twos = _results()[0]["param/full/lin1/replace/fullshard"]["read"]["lin1.weight"]
    assert bool((twos == 2).all()), twos  # the change itself, not only agreement


def test_grad_writeback_matches_fsdp1() -> None:
    """A gradient set by hand, set to None or whose ``.data`` was set is what the optimizer
    steps with, and the next backward accumulates into it, as under torch's FSDP1."""
    for rank, case, ours, ref in _pairs("grad"):
        _assert_same(ours, ref, f"rank {rank} {case}")


def test_writeback_shape_mismatch_raises_like_fsdp1() -> None:
    """A replacement of another shape (with or without such a gradient): FSDP1's
    ``RuntimeError: Cannot writeback``, naming the parameter and both shapes."""
    for rank, case, ours, ref in _pairs("shape"):
        what = f"rank {rank} {case}"
        assert ref.startswith("RuntimeError: Cannot writeback"), (what, ref)
        assert ours.startswith("RuntimeError: Cannot writeback"), (what, ours)
        name, old, new = ("lin1.weight", "(5, 5)", "(6, 6)")
        if rank == 1:
            name, old, new = ("lin2.weight", "(7, 5)", "(8, 6)")
        assert all(s in ours for s in (repr(name), old, new)), (what, ours)


def test_change_between_forward_and_backward_matches_fsdp1() -> None:
    """``lin1.weight`` replaced or its ``.data`` set between forward and backward: FSDP1's
    ``AssertionError`` (naming the parameter) under SHARD_GRAD_OP, which keeps the unsharded
    parameters; written back and trained as FSDP1 under FULL_SHARD."""
    phrase = "AssertionError: FSDP does not support changing the parameters between forward"
    for rank, case, ours, ref in _pairs("between"):
        what = f"rank {rank} {case}"
        if "grad_op" in case:
            assert ref["outcome"].startswith(phrase), (what, ref)
            assert ours["outcome"].startswith(phrase), (what, ours)
            assert "'lin1.weight'" in ours["outcome"], (what, ours)
        else:
            assert ref["outcome"] == ours["outcome"] == "ok", (what, ref, ours)
            _assert_same(ours["trained"], ref["trained"], what)


def test_module_to_after_wrapping_trains_like_fsdp1() -> None:
    """``FSDP(model).to(device)`` (and a dtype cast) works and trains as under torch's FSDP1:
    the wrapper's parameters carry no weak references (``swap_tensors`` refuses those) and a
    ``WritableShard`` detaches to its own type (``nn.Parameter`` of a subclass needs it)."""
    for rank, case, ours, ref in _pairs("moved"):
        _assert_same(ours, ref, f"rank {rank} {case}")
