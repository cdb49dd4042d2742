"""Behaviours FSDP2 users observe, each run under fullshard and under torch FSDP2 in the same
spawn and compared: post-accumulate-grad hooks on the sharded parameters (optimizer in
backward), ``output_dtype`` under activation-checkpoint recomputation, the gradient divide
factor on one rank, the process-group allocator knob on CPU, ``dp_mesh_dims`` messages."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, ClassVar

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import checkpoint

from fullshard import CommPolicy, fully_shard
from fullshard.engine.backend import CPU_CHOICES
from fullshard.engine.compat import DP_MESH_DIMS, TORCH_VERSION, DataParallelMeshDims
from fullshard.testing import run_distributed
from test_composition_extra import _GatherExt
from torch_versions import needs

DIM = 16
ENGINES: dict[str, Callable[..., Any]] = {"fullshard": fully_shard, "fsdp2": torch_fully_shard}


def _mlp(n: int = 3, seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(*[nn.Linear(DIM, DIM) for _ in range(n)])


def _data(step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(10 * step + dist.get_rank())
    return torch.randn(4, DIM, generator=g)


def _full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def _optimizer_in_backward(shard: Callable[..., Any]) -> dict[str, Any]:
    """An SGD step per parameter from its post-accumulate-grad hook, registered on the
    sharded parameters after fully_shard (torch's optimizer-in-backward recipe)."""
    model = _mlp()
    for lin in model:
        shard(lin)
    shard(model)
    calls: list[str] = []
    names = {p: n for n, p in model.named_parameters()}
    opts = {p: torch.optim.SGD([p], lr=0.1) for p in model.parameters()}

    def step(p: torch.Tensor) -> None:
        assert isinstance(p.grad, DTensor)  # the reduced shard, already its .grad
        calls.append(names[p])
        opts[p].step()
        opts[p].zero_grad()

    for p in model.parameters():
        p.register_post_accumulate_grad_hook(step)
    losses = []
    for s in range(3):
        loss = model(_data(s)).pow(2).mean()
        loss.backward()
        losses.append(loss.item())
    return {
        "calls": calls,
        "losses": losses,
        "grads_left": [p.grad is None for p in model.parameters()],
        "weights": {n: _full(p) for n, p in model.named_parameters()},
    }


class _Recorder(nn.Module):
    """Notes the dtype of each input it sees (forward and recomputation)."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[torch.dtype] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen.append(x.dtype)
        return x * x  # saves x: the recomputation runs up to here


class _Checkpointed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.unit = nn.Linear(DIM, DIM)
        self.after = _Recorder()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return checkpoint(lambda y: self.after(self.unit(y)), x, use_reentrant=False)


def _output_dtype_under_recompute(shard: Callable[..., Any]) -> dict[str, Any]:
    """param_dtype bf16 with output_dtype fp32: the unit's output is fp32 in the forward and
    in the recomputation that activation checkpointing runs in backward."""
    torch.manual_seed(1)
    model = _Checkpointed()
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, output_dtype=torch.float32)
    shard(model.unit, mp_policy=mp)
    shard(model)
    model(_data(0)).sum().backward()
    return {
        "seen": list(model.after.seen),
        "grads": [_full(p.grad) for p in model.parameters()],  # type: ignore[arg-type]
    }


class _Divisions(TorchDispatchMode):
    """Counts the division ops dispatched while active."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        if func.overloadpacket in (
            torch.ops.aten.div,
            torch.ops.aten.div_,
            torch.ops.aten._foreach_div_,
        ):
            self.count += 1
        return func(*args, **(kwargs or {}))


def _divide_factor_one_rank(shard: Callable[..., Any]) -> dict[str, Any]:
    """set_gradient_divide_factor on one rank: every gradient is divided by the factor, in
    backward (FSDP2's test traces the division). A factor of 1 gives the same gradients;
    fullshard skips dividing by 1, FSDP2 runs it (a documented difference). torch 2.9's FSDP2
    divides with ReduceOp.PREMUL_SUM, which gloo lacks: it fails where fullshard runs."""
    if shard is torch_fully_shard and TORCH_VERSION < (2, 10):
        return {"fsdp2_fails": True}
    out: dict[str, Any] = {}
    for factor in (4.0, 1.0):
        model = _mlp(2)
        for lin in model:
            shard(lin)
        shard(model)
        for unit in [*model, model]:
            unit.set_gradient_divide_factor(factor)
        loss = model(_data(0)).sum()
        with _Divisions() as mode:
            loss.backward()
        out[f"grads_{factor}"] = [_full(p.grad) for p in model.parameters()]
        out[f"divisions_{factor}"] = mode.count
    return out


FACTOR = 3.0


def _summed_grads(shard: Callable[..., Any], transport: str, knobs: bool, hook: bool) -> Any:
    """One backward, with ``set_force_sum_reduction_for_comms(True)`` and
    ``set_gradient_divide_factor(FACTOR)`` on every unit (``knobs``); ``hook``: an identity
    all-reduce hook, which makes a one-rank unit reduce through its collectives."""
    model = _mlp(2)
    kw = {"comm_policy": CommPolicy(transport=transport)} if shard is fully_shard else {}
    for lin in model:
        shard(lin, **kw)
    shard(model, **kw)
    for unit in [*model, model]:
        if knobs:
            unit.set_force_sum_reduction_for_comms(True)
            unit.set_gradient_divide_factor(FACTOR)
        if hook:
            unit.set_all_reduce_hook(lambda t: None)
    model(_data(0)).sum().backward()
    return [_full(p.grad) for p in model.parameters()]


def _force_sum_division() -> dict[str, Any]:
    """The gradients under force-sum with a divide factor: each fullshard transport (with the
    hook: never the one-rank ``local`` one), FSDP2's, and the unsharded model's summed over
    the ranks."""
    ref = _mlp(2)
    ref(_data(0)).sum().backward()
    out: dict[Any, Any] = {"sum": [p.grad for p in ref.parameters()]}
    for grad in out["sum"]:
        dist.all_reduce(grad)
    out["fsdp2"] = _summed_grads(torch_fully_shard, "", knobs=True, hook=False)
    for transport in ("packed", "p2p"):
        for hook in (False, True):
            out[transport, hook] = _summed_grads(fully_shard, transport, True, hook)
    return out


@pytest.mark.parametrize("world", [1, 2])
def test_force_sum_keeps_the_divide_factor_on_every_transport(world: int) -> None:
    """The sum divided by the factor, whichever transport a unit runs (on one rank the plain
    units run none: ``local``), as FSDP2 does; on one rank FSDP2 (torch 2.10+) divides twice
    (its one-rank copy divides by the factor, then its post-division again), which fullshard
    does not copy."""
    r = run_distributed(_force_sum_division, world, timeout=120)[0]
    want = [g / FACTOR for g in r["sum"]]  # the sum over ranks, divided once
    for key in [k for k in r if isinstance(k, tuple)]:
        _same(r[key], want, f"transport {key}")
    theirs = r["fsdp2"]
    if world == 1 and not torch.allclose(theirs[0], want[0]):
        theirs = [t * FACTOR for t in theirs]  # FSDP2's second division on one rank
    _same(theirs, want, "fsdp2")


def _process_group_allocator(shard: Callable[..., Any]) -> dict[str, Any]:
    """set_allocate_memory_from_process_group_for_comm(True) on CPU: accepted, training as
    without it (gloo has no allocator of its own)."""
    model = _mlp()
    for lin in model:
        shard(lin)
    shard(model)
    for unit in [*model, model]:
        unit.set_allocate_memory_from_process_group_for_comm(True)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for s in range(2):
        loss = model(_data(s)).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return {"losses": losses}


class _WithRoot(nn.Module):
    """Blocks as units under a root that owns parameters of its own (the head)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(2)
        self.blocks = _mlp(3, seed=2)
        self.head = nn.Linear(DIM, 8192)  # 512 KiB: gathered in pieces off the tool

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(x))


def _comm_debug_mode(shard: Callable[..., Any]) -> dict[str, Any]:
    """torch's CommDebugMode counts the collectives of a forward and of a backward: on the
    core path (every CPU fast path off: what CUDA runs), the engine's are FSDP2's (sizes above
    and below the fast paths' thresholds, resharding after forward or not). The fast paths'
    counts differ, as what ran differs (README, "torch's debugging tools";
    tests/test_observed.py)."""
    from torch.distributed.tensor.debug import CommDebugMode

    if shard is fully_shard:
        shard = functools.partial(
            fully_shard, comm_policy=CommPolicy(cpu_fast_paths_off=CPU_CHOICES)
        )
    out: dict[str, Any] = {}
    for raf in (True, False):
        model = _WithRoot()
        for lin in model.blocks:
            shard(lin, reshard_after_forward=raf)
        shard(model, reshard_after_forward=raf)
        for step in range(2):  # the second step runs with the lazy init done
            with CommDebugMode() as fwd:
                loss = model(_data(step)).sum()
            with CommDebugMode() as bwd:
                loss.backward()
            out[f"raf={raf} step {step}"] = [
                {str(k): v for k, v in mode.get_comm_counts().items()} for mode in (fwd, bwd)
            ]
        out[f"raf={raf} grads"] = [_full(p.grad) for p in model.parameters()]  # type: ignore[arg-type]
    return out


def _forward_mode_ad(shard: Callable[..., Any]) -> dict[str, Any]:
    """torch.func.jvp through a sharded forward (FSDP2 supports it since torch 2.13), then
    a training step as usual; the primal and tangent equal the unsharded model's. fullshard
    does it on every supported torch; FSDP2 before 2.13 fails in its all-gather copy-out."""
    if shard is torch_fully_shard and TORCH_VERSION < (2, 13):
        return {"fsdp2_fails": True}
    model, ref = _mlp(seed=3), _mlp(seed=3)
    for lin in model:
        shard(lin)
    shard(model)
    x, tangent = _data(0), _data(1)
    out, jvp_out = torch.func.jvp(model, (x,), (tangent,))
    ref_out, ref_jvp = torch.func.jvp(ref, (x,), (tangent,))
    torch.testing.assert_close(out, ref_out)
    torch.testing.assert_close(jvp_out, ref_jvp)
    model(x).sum().backward()
    return {
        "primal": out.detach(),
        "tangent": jvp_out.detach(),
        "grads": [_full(p.grad) for p in model.parameters()],
    }  # type: ignore[arg-type]


class _Overlapped(nn.Module):
    """FSDP2's unshard-async test shape: plain layers (left to torch's replicate(), which is
    DDP) each start an async all-reduce, then unshard the sharded MLP that consumes it."""

    def __init__(self) -> None:
        super().__init__()
        self.pre = nn.ModuleList(nn.Linear(DIM, DIM) for _ in range(3))
        self.mlps = nn.ModuleList(_mlp(2, seed=4) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.zeros(())
        for pre, mlp in zip(self.pre, self.mlps):
            y = torch.relu(pre(x))
            work = dist.all_reduce(y.detach().clone(), async_op=True)  # overlapped, unused
            if hasattr(mlp, "unshard"):
                mlp.unshard(async_op=True)
            work.wait()
            out = out + mlp(y).sum()
        return out


def _unshard_before_forward(shard: Callable[..., Any]) -> dict[str, Any]:
    """unshard() on non-root units ahead of the root's first forward: asynchronously inside
    a model that torch's replicate() (composable DDP) wraps, as FSDP2's test does, and
    synchronously, before anything ran."""
    from torch.distributed._composable import replicate

    out: dict[str, Any] = {}
    torch.manual_seed(5)
    ref = replicate(_Overlapped())
    torch.manual_seed(5)
    model = _Overlapped()
    for mlp in model.mlps:
        shard(mlp, reshard_after_forward=False)  # each MLP its own root
    replicate(model)  # DDP for the plain layers; the units are fully_shard's
    opts = [torch.optim.Adam(m.parameters(), lr=1e-2) for m in (ref, model)]
    losses = []
    for step in range(3):
        pair = []
        for m, opt in zip((ref, model), opts):
            loss = m(_data(step))
            loss.backward()
            opt.step()
            opt.zero_grad()
            pair.append(loss.item())
        losses.append(pair)
    out["losses"] = losses  # [replicate reference, sharded] per step
    model = _mlp()
    for lin in model:
        shard(lin)
    shard(model)
    model[1].unshard()  # before any forward: the root's lazy init runs, not a root of its own
    out["registered"] = [type(p).__name__ for p in model[1].parameters()]
    model(_data(0)).sum().backward()
    out["sync_grads"] = [_full(p.grad) for p in model.parameters()]  # type: ignore[arg-type]
    return out


class _InPlaceGather(_GatherExt):
    """An extension that computes with its gathered output as it is (no copy, as float8
    weights do): the unsharded parameter aliases ``outputs[0]``, so every later
    ``fsdp_post_all_gather(..., out=)`` must be handed that same storage, refilled."""

    same_storage: ClassVar[list[bool]] = []

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):  # type: ignore[override]
        out = super().__torch_dispatch__(func, types, args, kwargs)
        # FSDP2 pads the shard with new_zeros: stay the subclass, so torch runs it too
        return cls(out) if func is torch.ops.aten.new_zeros.default else out

    def fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):
        return (self._data,), None

    def fsdp_post_all_gather(self, outputs, metadata, param_dtype, *, out=None):
        (data,) = outputs
        if out is not None:
            same = out.untyped_storage().data_ptr() == data.untyped_storage().data_ptr()
            _InPlaceGather.same_storage.append(same)
            return None
        return data, (data,)


def _extension_out_storage(shard: Callable[..., Any]) -> dict[str, Any]:
    """Gathers in forward and again in backward (resharded after forward): ``out=`` is the
    storage of the outputs that fsdp_post_all_gather is given, every time."""
    _InPlaceGather.same_storage = []
    model = _mlp(2, seed=6)
    for lin in model:
        lin.weight = nn.Parameter(_InPlaceGather(lin.weight.detach().clone()))
        shard(lin)
    shard(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for step in range(3):
        loss = model(_data(step)).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "same_storage": list(_InPlaceGather.same_storage)}


def _mesh_dims_errors(shard: Callable[..., Any]) -> dict[str, Any]:
    """dp_mesh_dims refusals: the exception type and FSDP2's message (first line)."""
    world = dist.get_world_size()
    named = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    unnamed = init_device_mesh("cpu", (world,))
    out: dict[str, Any] = {}
    cases = {
        "unnamed_mesh": (unnamed, DataParallelMeshDims(shard="dp")),
        "unknown_name": (named, DataParallelMeshDims(shard="tp")),
    }
    for case, (mesh, dims) in cases.items():
        try:
            shard(nn.Linear(4, 4), mesh=mesh, dp_mesh_dims=dims)
            out[case] = None
        except Exception as e:  # the type and message are what is compared
            out[case] = (type(e).__name__, str(e))
    return out


def _int_reshard_with_mesh_dims() -> dict[str, Any]:
    """An int ``reshard_after_forward`` with ``dp_mesh_dims``, under each engine: the error
    type ``fully_shard`` raises when the mesh dims are wrong too, and whether
    ``set_reshard_after_forward(1)`` is refused on a ``dp_mesh_dims`` unit."""
    from torch.distributed.tensor import distribute_module

    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("dp",))
    out: dict[str, Any] = {}
    for engine, shard in ENGINES.items():
        try:
            shard(
                nn.Linear(4, 4),
                mesh=mesh,
                dp_mesh_dims=DataParallelMeshDims(shard="tp"),
                reshard_after_forward=1,
            )
            out[engine, "fully_shard"] = None
        except Exception as e:  # the type is what is compared
            out[engine, "fully_shard"] = type(e).__name__
        unit = shard(
            distribute_module(nn.Linear(4, 4), mesh),
            mesh=mesh,
            dp_mesh_dims=DataParallelMeshDims(shard="dp"),
        )
        try:
            unit.set_reshard_after_forward(1)
            out[engine, "set_reshard_after_forward"] = None
        except Exception as e:
            out[engine, "set_reshard_after_forward"] = type(e).__name__
    return out


@needs(DP_MESH_DIMS)
def test_int_reshard_after_forward_with_mesh_dims_is_refused_once_the_mesh_is_valid() -> None:
    """One validation of ``reshard_after_forward`` for ``fully_shard`` and
    ``set_reshard_after_forward``: after the mesh's (FSDP2's order: a wrong dim name is what
    it reports), and refusing the int form with ``dp_mesh_dims`` in both (FSDP2's
    ``set_reshard_after_forward`` takes only bools: its ``ValueError``)."""
    r = run_distributed(_int_reshard_with_mesh_dims, 1, timeout=120)[0]
    assert r["fullshard", "fully_shard"] == r["fsdp2", "fully_shard"] == "ValueError", r
    assert r["fsdp2", "set_reshard_after_forward"] == "ValueError", r
    assert r["fullshard", "set_reshard_after_forward"] == "NotImplementedError", r


CASES: dict[str, Callable[[Callable[..., Any]], dict[str, Any]]] = {
    "optimizer_in_backward": _optimizer_in_backward,
    "output_dtype_under_recompute": _output_dtype_under_recompute,
    "process_group_allocator": _process_group_allocator,
    "comm_debug_mode": _comm_debug_mode,
    "forward_mode_ad": _forward_mode_ad,
    "unshard_before_forward": _unshard_before_forward,
    "extension_out_storage": _extension_out_storage,
}
if DP_MESH_DIMS.available:  # torch 2.12
    CASES["mesh_dims_errors"] = _mesh_dims_errors
ONE_RANK_CASES = {"divide_factor_one_rank": _divide_factor_one_rank}


def _run(cases: dict[str, Callable[[Callable[..., Any]], dict[str, Any]]]) -> dict[str, Any]:
    return {
        (name, engine): fn(shard) for name, fn in cases.items() for engine, shard in ENGINES.items()
    }


@pytest.fixture(scope="module")
def two_ranks() -> dict[tuple[str, str], dict[str, Any]]:
    return run_distributed(_run, 2, CASES, timeout=300)[0]


def _same(ours: Any, theirs: Any, where: str) -> None:
    if isinstance(theirs, dict):
        assert ours.keys() == theirs.keys(), where
        for k in theirs:
            _same(ours[k], theirs[k], f"{where}.{k}")
    elif isinstance(theirs, list | tuple) and theirs and isinstance(theirs[0], torch.Tensor):
        assert len(ours) == len(theirs), where
        for i, (a, b) in enumerate(zip(ours, theirs)):
            torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5, msg=f"{where}[{i}]")
    elif isinstance(theirs, torch.Tensor):
        torch.testing.assert_close(ours, theirs, atol=1e-6, rtol=1e-5, msg=where)
    elif isinstance(theirs, list) and theirs and isinstance(theirs[0], float):
        assert ours == pytest.approx(theirs, rel=1e-5), where
    else:
        assert ours == theirs, f"{where}: fullshard {ours!r}, FSDP2 {theirs!r}"


@pytest.mark.parametrize(
    "case",
    [
        "optimizer_in_backward",
        "output_dtype_under_recompute",
        "process_group_allocator",
        "comm_debug_mode",
        "forward_mode_ad",
        "unshard_before_forward",
        "extension_out_storage",
    ],
)
def test_same_as_fsdp2(case: str, two_ranks) -> None:
    ours, theirs = two_ranks[(case, "fullshard")], two_ranks[(case, "fsdp2")]
    if theirs.get("fsdp2_fails"):  # ours was checked against the unsharded model
        assert set(ours) == {"primal", "tangent", "grads"}, ours.keys()
        return
    _same(ours, theirs, case)
    if case == "optimizer_in_backward":  # the hooks ran: every parameter, every step
        assert len(ours["calls"]) == 3 * 6 and all(ours["grads_left"])
    if case == "comm_debug_mode":  # the tool saw collectives at all
        assert ours["raf=True step 1"][0] == {"c10d._allgather_base_": 4}
    if case == "unshard_before_forward":  # trains as the replicate() reference does
        for ref_loss, loss in ours["losses"]:
            assert loss == pytest.approx(ref_loss, rel=1e-5)
    if case == "extension_out_storage":  # out= came on every gather after the first
        assert len(ours["same_storage"]) >= 2 * 3 and all(ours["same_storage"])
    if case == "output_dtype_under_recompute":
        assert ours["seen"] == [torch.float32, torch.float32]


@needs(DP_MESH_DIMS)
def test_dp_mesh_dims_errors_are_fsdp2s(two_ranks) -> None:
    ours, theirs = (
        two_ranks[("mesh_dims_errors", "fullshard")],
        two_ranks[("mesh_dims_errors", "fsdp2")],
    )
    for case, want in theirs.items():
        assert want is not None, f"{case}: FSDP2 accepted it"
        got = ours[case]
        assert got is not None, f"{case}: fullshard accepted it"
        assert got[0] == want[0], f"{case}: {got[0]} vs FSDP2's {want[0]}"
        assert got[1].startswith(want[1]), f"{case}: {got[1]!r} does not start with {want[1]!r}"


def test_divide_factor_on_one_rank() -> None:
    r = run_distributed(_run, 1, ONE_RANK_CASES, timeout=120)[0]
    ours, theirs = (
        r[("divide_factor_one_rank", "fullshard")],
        r[("divide_factor_one_rank", "fsdp2")],
    )
    if theirs.get("fsdp2_fails"):  # then the factor's division is what is checked
        for a, b in zip(ours["grads_4.0"], ours["grads_1.0"]):
            torch.testing.assert_close(4 * a, b)
    else:
        for factor in (4.0, 1.0):
            _same(ours[f"grads_{factor}"], theirs[f"grads_{factor}"], f"grads, factor {factor}")
        assert theirs["divisions_4.0"] > 0
    assert ours["divisions_4.0"] > 0
    assert ours["divisions_1.0"] == 0  # a division by 1 is skipped (FSDP2 runs it)
