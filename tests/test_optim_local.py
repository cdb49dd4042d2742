"""fullshard.optim.local_step: element-wise optimizers stepped on the local shards.

The oracle is the same optimizer stepping on the DTensor parameters (itself checked against
one process by the engine's parity tests): every parameter, state and state dict must be
bit-for-bit the same, and outside ``step()`` the optimizer must hold the very DTensors the
model does. One 2-rank spawn runs every sub-case (eleven optimizers, foreach on and off, a
closure, LR schedulers installed before and after, a failing step, a frozen and an unsharded
parameter, a checkpoint round trip); one 1-rank spawn covers the local transport, whose
unsharded parameters alias the shards.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

import fullshard.checkpoint as ckpt
from fullshard import fully_shard
from fullshard.optim import ELEMENTWISE, Muon, WholeTensor, local_step
from fullshard.testing import run_distributed

STEPS = 3

#: (name, optimizer class, options): every class of ELEMENTWISE, the usual options on.
CASES: list[tuple[str, type[torch.optim.Optimizer], dict[str, Any]]] = [
    ("sgd", torch.optim.SGD, {"lr": 0.1, "momentum": 0.9, "nesterov": True, "weight_decay": 0.1}),
    ("sgd-foreach", torch.optim.SGD, {"lr": 0.1, "momentum": 0.9, "foreach": True}),
    ("adam-amsgrad", torch.optim.Adam, {"lr": 0.01, "amsgrad": True, "weight_decay": 0.1}),
    ("adamw", torch.optim.AdamW, {"lr": 0.01, "betas": (0.9, 0.95), "weight_decay": 0.1}),
    ("adamw-foreach", torch.optim.AdamW, {"lr": 0.01, "foreach": True, "maximize": True}),
    ("adamax", torch.optim.Adamax, {"lr": 0.01, "weight_decay": 0.1}),
    ("nadam", torch.optim.NAdam, {"lr": 0.01, "decoupled_weight_decay": True}),
    ("radam", torch.optim.RAdam, {"lr": 0.01, "weight_decay": 0.1}),
    ("adagrad", torch.optim.Adagrad, {"lr": 0.1, "lr_decay": 0.01}),
    ("adadelta", torch.optim.Adadelta, {"lr": 1.0, "weight_decay": 0.1}),
    ("rmsprop", torch.optim.RMSprop, {"lr": 0.01, "momentum": 0.5, "centered": True}),
    # Rprop does not run on DTensors at all (index_put_ / _foreach_copy_ have no sharding
    # rule in torch 2.13): its oracle is Rprop on plain copies of the shards (_shadow_case).
    ("rprop", torch.optim.Rprop, {"lr": 0.01}),
    ("asgd", torch.optim.ASGD, {"lr": 0.01, "t0": 1}),
]


class Net(nn.Module):
    """Two sharded blocks with uneven rows (7 and 3 over 2 ranks), a frozen matrix and one
    parameter of the root that stays a plain tensor."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(6, 7), nn.Tanh(), nn.Linear(7, 6), nn.LayerNorm(6))
            for _ in range(2)
        )
        self.frozen = nn.Linear(6, 3)
        self.frozen.weight.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = x + b(x)
        return self.frozen(x)


def make(
    kind: type[torch.optim.Optimizer], opts: dict[str, Any], local: bool
) -> tuple[Net, torch.optim.Optimizer, nn.Parameter]:
    torch.manual_seed(0)
    model = Net()
    for b in model.blocks:
        fully_shard(b)
    fully_shard(model)
    plain = nn.Parameter(torch.randn(3))  # not a model parameter: no DTensor at all
    params = [{"params": list(model.parameters())}, {"params": [plain], "lr": 0.05}]
    opt = kind(params, **opts)
    return model, (local_step(opt) if local else opt), plain


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + dist.get_rank())
    return torch.randn(5, 6, generator=g), torch.randn(5, 3, generator=g)


def train(model: Net, opt: torch.optim.Optimizer, plain: nn.Parameter, steps: int) -> list[float]:
    losses = []
    for step in range(steps):
        x, y = batch(step)
        loss = F.mse_loss(model(x), y) + (plain * plain).sum()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return losses


def _locals(obj: Any) -> Any:
    """Every tensor of a state dict as its local tensor (for bitwise comparison)."""
    if isinstance(obj, dict):
        return {k: _locals(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_locals(v) for v in obj]
    if isinstance(obj, DTensor):
        return ("dtensor", obj.placements, tuple(obj.shape), obj._local_tensor)
    return obj


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, torch.Tensor):
        return (
            isinstance(b, torch.Tensor)
            and a.dtype == b.dtype
            and a.shape == b.shape
            and torch.equal(a, b)
        )
    return bool(a == b)


def _holds_model_dtensors(model: Net, opt: torch.optim.Optimizer, plain: nn.Parameter) -> bool:
    """Outside step(): param_groups and state keys are the model's own DTensor parameters."""
    params = list(model.parameters())
    grouped = opt.param_groups[0]["params"]
    return (
        len(grouped) == len(params)
        and all(a is b for a, b in zip(grouped, params, strict=True))
        and opt.param_groups[1]["params"][0] is plain
        and all(isinstance(k, DTensor) or k is plain for k in opt.state)
        and all(p._local_tensor.grad is None for p in params if isinstance(p, DTensor))
    )


def _state_types(model: Net, opt: torch.optim.Optimizer) -> list[Any]:
    """Per model parameter (in order): each state's type and placements."""
    return [
        sorted((k, type(v).__name__, getattr(v, "placements", None)) for k, v in st.items())
        for st in (opt.state.get(p, {}) for p in model.parameters())
    ]


def _parity_cases() -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, kind, opts in CASES:
        if kind is torch.optim.Rprop:
            out[name] = _shadow_case(kind, opts)
            continue
        ref_model, ref_opt, ref_plain = make(kind, opts, local=False)
        model, opt, plain = make(kind, opts, local=True)
        ref_losses = train(ref_model, ref_opt, ref_plain, STEPS)
        losses = train(model, opt, plain, STEPS)
        states, ref_states = _state_types(model, opt), _state_types(ref_model, ref_opt)
        out[name] = {
            "losses": losses == ref_losses,
            "params": _same(_locals(model.state_dict()), _locals(ref_model.state_dict())),
            "plain": torch.equal(plain, ref_plain),
            "state_dict": _same(_locals(opt.state_dict()), _locals(ref_opt.state_dict())),
            "state_types": states == ref_states and any(states),
            "holds_dtensors": _holds_model_dtensors(model, opt, plain),
        }
    return out


def _shadow_case(kind: type[torch.optim.Optimizer], opts: dict[str, Any]) -> dict[str, Any]:
    """local_step against the same optimizer on plain clones of this rank's shards, fed the
    shards' gradients: for an optimizer DTensor cannot step, that is what it must compute."""
    model, opt, plain = make(kind, opts, local=True)
    sharded = [p for p in model.parameters() if isinstance(p, DTensor)]
    shadows = [nn.Parameter(p._local_tensor.detach().clone()) for p in sharded]
    shadow_opt = kind(shadows, **opts)
    same = True
    for step in range(STEPS):
        x, y = batch(step)
        (F.mse_loss(model(x), y) + (plain * plain).sum()).backward()
        for s, p in zip(shadows, sharded, strict=True):
            s.grad = None if p.grad is None else p.grad._local_tensor.clone()
        opt.step()
        shadow_opt.step()
        opt.zero_grad()
        same = same and all(
            torch.equal(s, p._local_tensor) for s, p in zip(shadows, sharded, strict=True)
        )
    return {"params": same, "holds_dtensors": _holds_model_dtensors(model, opt, plain)}


def _closure_and_schedulers() -> dict[str, Any]:
    out: dict[str, Any] = {}
    ref_model, ref_opt, ref_plain = make(torch.optim.AdamW, {"lr": 0.01}, local=False)
    model, opt, plain = make(torch.optim.AdamW, {"lr": 0.01}, local=True)
    x, y = batch(0)

    def closure_of(m: Net, o: torch.optim.Optimizer, p: nn.Parameter) -> Any:
        def closure() -> torch.Tensor:
            o.zero_grad()
            loss = F.mse_loss(m(x), y) + (p * p).sum()
            loss.backward()
            return loss

        return closure

    ref_loss = ref_opt.step(closure_of(ref_model, ref_opt, ref_plain))
    loss = opt.step(closure_of(model, opt, plain))
    out["closure_loss"] = torch.equal(loss, ref_loss)
    out["closure_params"] = _same(_locals(model.state_dict()), _locals(ref_model.state_dict()))

    # A scheduler made before local_step and one made after: lr follows, no warning that
    # optimizer.step() was overridden, and the steps still count.
    caught: list[str] = []
    for before in (True, False):
        m, o, p = make(torch.optim.SGD, {"lr": 0.1}, local=False)
        if before:
            sched = torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.5)
            local_step(o)
        else:
            local_step(o)
            sched = torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.5)
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            train(m, o, p, 1)
            sched.step()
            train(m, o, p, 1)
            sched.step()
        caught += [str(x.message) for x in w]
        out[f"sched_lr_{before}"] = o.param_groups[0]["lr"] == pytest.approx(0.025)
    out["sched_warnings"] = caught

    # Step hooks run inside the step: they see the local tensors, and the DTensors are back
    # afterwards even when the step raises.
    m, o, p = make(torch.optim.AdamW, {"lr": 0.01}, local=True)
    seen: list[type] = []
    o.register_step_pre_hook(lambda opt, a, k: seen.append(type(opt.param_groups[0]["params"][0])))
    train(m, o, p, 1)
    out["hook_sees"] = [t.__name__ for t in seen]

    def boom(opt: Any, args: Any, kwargs: Any) -> None:
        raise ValueError("boom")

    handle = o.register_step_pre_hook(boom)
    x, y = batch(1)
    F.mse_loss(m(x), y).backward()
    try:
        o.step()
        out["raised"] = False
    except ValueError:
        out["raised"] = True
    handle.remove()
    out["restored_after_raise"] = _holds_model_dtensors(m, o, p)
    out["twice_is_noop"] = local_step(o) is o
    return out


def _checkpoint(root: str) -> dict[str, Any]:
    """Saved from a local-step AdamW, loaded into a DTensor-step one: training continues
    identically to an optimizer that never used local_step."""

    def build(local: bool) -> tuple[Net, torch.optim.Optimizer, nn.Parameter]:
        model, _, plain = make(torch.optim.AdamW, {}, local=False)
        plain.requires_grad_(False)  # the checkpoint holds the model's parameters only
        opt = torch.optim.AdamW(model.parameters(), lr=0.01)
        return model, (local_step(opt) if local else opt), plain

    (ref_model, ref_opt, ref_plain), (model, opt, plain) = build(False), build(True)
    train(ref_model, ref_opt, ref_plain, 2)
    train(model, opt, plain, 2)
    path = Path(root) / "ckpt"
    ckpt.save(path, model=model, optimizer=opt)
    loaded_model, loaded_opt, loaded_plain = build(False)
    ckpt.load(path, model=loaded_model, optimizer=loaded_opt)
    ref_losses = train(ref_model, ref_opt, ref_plain, 2)
    losses = train(loaded_model, loaded_opt, loaded_plain, 2)
    return {
        "losses": losses == ref_losses,
        "params": _same(_locals(loaded_model.state_dict()), _locals(ref_model.state_dict())),
    }


def _two_ranks(root: str) -> dict[str, Any]:
    return {
        "parity": _parity_cases(),
        "closure": _closure_and_schedulers(),
        "checkpoint": _checkpoint(root),
    }


def _one_rank() -> dict[str, Any]:
    return _parity_cases()


@pytest.fixture(scope="module")
def two(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    root = tmp_path_factory.mktemp("local_step")
    return run_distributed(_two_ranks, 2, str(root), timeout=300)


def _all_true(d: dict[str, Any]) -> list[str]:
    return [f"{case}.{k}" for case, r in d.items() for k, v in r.items() if v is not True]


def test_every_elementwise_optimizer_is_bitwise_the_dtensor_step(two: Any) -> None:
    assert {kind for _, kind, _ in CASES} == ELEMENTWISE
    for rank in two:
        assert _all_true(rank["parity"]) == []


def test_closure_schedulers_hooks_and_a_failing_step(two: Any) -> None:
    for rank in two:
        r = rank["closure"]
        assert r["closure_loss"] and r["closure_params"]
        assert r["sched_lr_True"] and r["sched_lr_False"]
        assert r["sched_warnings"] == []
        assert r["hook_sees"] == ["Tensor"]  # documented: hooks inside step see local tensors
        assert r["raised"] and r["restored_after_raise"]
        assert r["twice_is_noop"]


def test_checkpoint_from_local_step_resumes_exactly(two: Any) -> None:
    for rank in two:
        assert rank["checkpoint"] == {"losses": True, "params": True}


def test_one_rank_local_transport() -> None:
    (out,) = run_distributed(_one_rank, 1, timeout=180)
    assert _all_true(out) == []


def test_refuses_optimizers_that_are_not_elementwise() -> None:
    w = nn.Parameter(torch.randn(4, 4))
    for opt in (torch.optim.LBFGS([w]), Muon([w]), WholeTensor(torch.optim.SGD, [w], lr=0.1)):
        with pytest.raises(TypeError, match=type(opt).__name__) as info:
            local_step(opt)
        assert "WholeTensor" in str(info.value) and "elementwise=True" in str(info.value)

    class MySGD(torch.optim.SGD):
        pass

    with pytest.raises(TypeError, match="MySGD"):
        local_step(MySGD([w], lr=0.1))
    opt = local_step(MySGD([w], lr=0.1), elementwise=True)
    w.grad = torch.ones_like(w)
    before = w.detach().clone()
    opt.step()
    assert torch.equal(w.detach(), before - 0.1)  # plain tensors step as they are
