"""fullshard looks like FSDP2 to code that checks: classes, markers, policies, validation,
every public FSDPModule method of the installed torch, and ``patch_torch_fsdp``."""

from __future__ import annotations

import copy
import inspect
import sys
import types
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.fsdp as tfsdp
from torch import nn

# torch's comm protocols (private module: the classes a user subclasses for set_custom_*)
from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather as _TorchAllGather
from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter as _TorchReduceScatter

import fullshard
from fullshard import FullyShardError, fully_shard
from fullshard.engine.compat import (
    DP_MESH_DIMS,
    FSDP_MODULE_METHODS_SINCE,
    PIPELINING_USES_FINALIZE_BACKWARD,
    SHARE_COMM_CTX,
    STORAGE_SWAP,
    all_gather_single,
    reduce_scatter_single,
)
from fullshard.engine.events import record_events
from fullshard.engine.hooks import FSDPState
from fullshard.engine.state import TrainingState
from fullshard.module import unit_state
from fullshard.testing import run_distributed
from parity import reused_gathers
from test_composition_extra import BitsGather
from torch_versions import has_method

_TORCH_FULLY_SHARD = tfsdp.fully_shard
VAR_POSITIONAL, VAR_KEYWORD = inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD


def test_every_public_fsdp2_method_is_overridden() -> None:
    torch_names = {
        n
        for n, v in vars(tfsdp.FSDPModule).items()
        if callable(v) and (not n.startswith("__") or n == "__new__")
    }
    assert "_set_unshard_async_op" in torch_names
    # compat's table of methods newer than the oldest torch is right for the installed torch
    for name in FSDP_MODULE_METHODS_SINCE:
        assert (name in torch_names) == has_method(name), name
    missing = sorted(n for n in torch_names if n not in vars(fullshard.FSDPModule))
    assert not missing, f"torch's FSDPModule methods would run torch's engine: {missing}"
    # called as FSDP2's are: the same parameters (names, kinds, defaults; types may widen)
    for n in sorted(torch_names - {"__new__"}):
        theirs = inspect.signature(getattr(tfsdp.FSDPModule, n)).parameters.values()
        ours = inspect.signature(getattr(fullshard.FSDPModule, n)).parameters.values()
        shape = [[(p.name, p.kind, p.default) for p in ps] for ps in (ours, theirs)]
        if [k for _, k, _ in shape[1][1:]] == [VAR_POSITIONAL, VAR_KEYWORD]:
            continue  # torch's takes anything (``_apply(*args, **kwargs)`` up to 2.14)
        assert shape[0] == shape[1], (n, *shape)
    assert issubclass(fullshard.FSDPModule, tfsdp.FSDPModule)
    assert issubclass(fullshard.UnshardHandle, tfsdp.UnshardHandle)
    if hasattr(tfsdp, "GradientReductionHandle"):  # torch 2.15
        assert issubclass(fullshard.GradientReductionHandle, tfsdp.GradientReductionHandle)


def test_policies_are_torchs_and_signature_matches() -> None:
    assert fullshard.MixedPrecisionPolicy is tfsdp.MixedPrecisionPolicy
    assert fullshard.OffloadPolicy is tfsdp.OffloadPolicy
    assert fullshard.CPUOffloadPolicy is tfsdp.CPUOffloadPolicy
    ours = inspect.signature(fully_shard).parameters
    for name, p in inspect.signature(_TORCH_FULLY_SHARD).parameters.items():
        assert name in ours, f"fully_shard lacks FSDP2's argument {name!r}"
        assert ours[name].kind == p.kind, name


def test_patch_torch_fsdp_everywhere_idempotent_undo() -> None:
    import torch.distributed._composable.fsdp as composable

    fake = types.ModuleType("fake_framework")  # a framework that imported torch's names
    fake.fully_shard = _TORCH_FULLY_SHARD  # type: ignore[attr-defined]
    fake.other_name = _TORCH_FULLY_SHARD  # type: ignore[attr-defined]  # not rebound by name
    sys.modules["fake_framework"] = fake
    try:
        handle = fullshard.patch_torch_fsdp()
        try:
            assert tfsdp.fully_shard is fully_shard
            assert composable.fully_shard is fully_shard
            assert sys.modules["torch.distributed.fsdp._fully_shard"].fully_shard is fully_shard
            stage = sys.modules["torch.distributed.pipelining.stage"]
            if not PIPELINING_USES_FINALIZE_BACKWARD:  # torch 2.15's stage no longer imports it
                assert stage.fully_shard is fully_shard
            else:
                assert not hasattr(stage, "fully_shard")
            assert tfsdp.register_fsdp_forward_method is fullshard.register_fsdp_forward_method
            if SHARE_COMM_CTX.available:  # torch 2.10
                assert tfsdp.share_comm_ctx is fullshard.share_comm_ctx
            assert fake.fully_shard is fully_shard
            assert fake.other_name is _TORCH_FULLY_SHARD
            n = len(handle.modules)
            assert fullshard.patch_torch_fsdp() is handle and len(handle.modules) == n
        finally:
            handle.undo()
        handle.undo()  # idempotent
        assert tfsdp.fully_shard is _TORCH_FULLY_SHARD
        assert composable.fully_shard is _TORCH_FULLY_SHARD
        assert fake.fully_shard is _TORCH_FULLY_SHARD
        assert fullshard.patch_torch_fsdp() is not handle  # a fresh patch after undo
        fullshard.patch_torch_fsdp().undo()
        assert tfsdp.fully_shard is _TORCH_FULLY_SHARD
    finally:
        del sys.modules["fake_framework"]


# ----------------------------------------------------------------------------- distributed
class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.fail_forward = False
        self.fail_backward = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fail_forward:
            raise RuntimeError("injected forward failure")
        y = torch.tanh(self.lin(x))
        return _FailBackward.apply(y, self) if self.fail_backward else y


class _FailBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, y: torch.Tensor, block: Block) -> torch.Tensor:
        return y.view_as(y)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        raise RuntimeError("injected backward failure")


def _model(shard: Any = fully_shard, middle: type[nn.Module] | None = None, **kw: Any) -> Any:
    """3 blocks and a head, 4 units; ``shard``: fullshard's or torch's ``fully_shard``."""
    torch.manual_seed(0)
    model = nn.Sequential(Block(), (middle or Block)(), Block(), nn.Linear(8, 2))
    for b in model[:3]:
        shard(b, **kw)
    shard(model, **kw)
    return model


def _data(step: int, rank: int | None = None) -> torch.Tensor:
    rank = dist.get_rank() if rank is None else rank
    return torch.randn(4, 8, generator=torch.Generator().manual_seed(step * 10 + rank))


def _reset_cases() -> dict[str, list[float]]:
    """Train with a forward failure and a backward failure (each followed by
    reset_iter_state and a retry) and without failures: the losses must be the same."""
    runs: dict[str, list[float]] = {}
    for failing in (False, True):
        model = _model()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        losses = []
        for step in range(4):
            if failing and step in (1, 2):
                target = model[1]
                attr = "fail_forward" if step == 1 else "fail_backward"
                setattr(target, attr, True)
                with pytest.raises(RuntimeError, match="injected"):
                    model(_data(step)).square().mean().backward()
                setattr(target, attr, False)
                with pytest.raises(RuntimeError, match="root FSDP module"):
                    model[0].reset_iter_state()
                model.reset_iter_state()
                for st in fullshard.api._all_states(model):
                    assert st.training_state is TrainingState.IDLE and st.group._gather is None
                opt.zero_grad()
            loss = model(_data(step)).square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        runs["failing" if failing else "clean"] = losses
    return runs


def _identity_and_validation() -> None:
    from torch.distributed.device_mesh import init_device_mesh

    model = _model()
    units = [model, model[0], model[1], model[2]]
    assert all(isinstance(u, tfsdp.FSDPModule) for u in units)
    assert type(model[0]) is type(model[1])  # one FSDP class per original class
    assert all(getattr(m, "_is_fsdp_managed_module", False) for m in model.modules())
    assert isinstance(unit_state(model), FSDPState)
    # code written for FSDP2 reads FSDPState's shape through _get_fsdp_state() (verl's
    # fallback, trainers' gradient probes): the unit's own parameters, its mesh, lazy init
    torch_shaped = model[0]._get_fsdp_state()
    assert torch_shaped == model[0]._get_fsdp_state() != model._get_fsdp_state()
    group = torch_shaped._fsdp_param_group
    shards = [p.sharded_param for p in group.fsdp_params]
    assert len(shards) == 2 and all(a is b for a, b in zip(shards, model[0].parameters()))
    assert group.mesh_info.shard_mesh_size == dist.get_world_size()
    assert len(torch_shaped._fsdp_param_groups[0].fsdp_params) == 2
    model.to("cpu")  # _apply runs fullshard's code only (torch's would need torch's state)

    # slicing a sharded Sequential builds a plain Sequential; indexing returns the unit
    head = model[1:]
    assert type(head) is nn.Sequential and not isinstance(head, tfsdp.FSDPModule)
    assert isinstance(model[0], fullshard.FSDPModule)

    with pytest.raises(AssertionError, match="deepcopy"):
        copy.deepcopy(model)
    with pytest.raises(AssertionError, match="already applied"):  # FSDP2's type
        fully_shard(model[0])
    for container in (nn.ModuleList([nn.Linear(2, 2)]), nn.ModuleDict({"a": nn.Linear(2, 2)})):
        with pytest.raises(ValueError, match="no forward"):
            fully_shard(container)
    with pytest.raises(AssertionError, match="name its dims"):
        fully_shard(nn.Linear(2, 2), mesh=init_device_mesh("cpu", (1, 2)))
    named = init_device_mesh("cpu", (1, 2), mesh_dim_names=("replicate", "shard"))
    fully_shard(nn.Linear(2, 2), mesh=named)
    fully_shard(nn.Linear(2, 2), dp_mesh_dims=None)
    if DP_MESH_DIMS.available:  # torch 2.12
        dims = tfsdp.DataParallelMeshDims(shard="dp")
        with pytest.raises(ValueError, match="pass that mesh as mesh="):
            fully_shard(nn.Linear(2, 2), dp_mesh_dims=dims)
        spmd = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
        with pytest.raises(ValueError, match=r"must be a DTensor on the full SPMD mesh.*'weight'"):
            fully_shard(nn.Linear(2, 2), mesh=spmd, dp_mesh_dims=dims)  # plain parameters

    # torch's policy objects, as frameworks build them
    lin = nn.Linear(4, 4)
    fully_shard(
        lin,
        mp_policy=tfsdp.MixedPrecisionPolicy(param_dtype=torch.bfloat16),
        offload_policy=tfsdp.CPUOffloadPolicy(pin_memory=False),
    )
    assert lin(torch.randn(2, 4)).dtype == torch.bfloat16
    fully_shard(nn.Linear(4, 4), offload_policy=tfsdp.OffloadPolicy())


def _methods() -> dict[str, Any]:
    out: dict[str, Any] = {}
    model = _model()
    x = _data(0)
    expected = model(x).detach()

    # unshard(async_op=True): a torch UnshardHandle; pre-forward waits for it
    handles = [m.unshard(async_op=True) for m in (model, model[0])]
    assert all(isinstance(h, tfsdp.UnshardHandle) for h in handles)
    torch.testing.assert_close(model(x), expected, rtol=0, atol=0)
    assert model[1].unshard() is None
    model[1].reshard()

    # the deprecated divide-factor name means set_gradient_divide_factor
    for setter in ("set_gradient_divide_factor", "set_reduce_scatter_divide_factor"):
        m = _model()
        getattr(m, setter)(1.0)  # sum instead of mean over 2 ranks
        m(x).sum().backward()
        out[setter] = [p.grad.full_tensor() for p in m.parameters()]
    m = _model()
    m(x).sum().backward()
    out["default"] = [p.grad.full_tensor() for p in m.parameters()]

    # the defaults are accepted; bad arguments refused clearly
    if has_method("set_reduce_scatter_max_input_buffers"):  # torch 2.13
        model.set_reduce_scatter_unused_params(False)
        model.set_separate_reduce_scatter_group(False)
        model.set_reduce_scatter_max_input_buffers(1)
        with pytest.raises(TypeError, match="int"):
            model.set_reduce_scatter_max_input_buffers(True)  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="positive"):
            model.set_reduce_scatter_max_input_buffers(0)
    model.set_allocate_memory_from_process_group_for_comm(False)
    model._set_unshard_async_op(True)
    model._set_unshard_async_op(False)
    with pytest.raises(TypeError, match="allocate"):
        model.set_custom_all_gather(object())  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="allocate"):
        model.set_custom_reduce_scatter(lambda *a: None)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="callable"):
        model.set_all_reduce_hook(3)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="bool"):
        model._set_unshard_async_op("yes")  # type: ignore[arg-type]
    # on a CPU unit the process group's allocator is torch.empty (gloo has none): accepted,
    # nothing changes (as FSDP2); symmetric memory needs CUDA
    model.set_allocate_memory_from_process_group_for_comm(True)
    assert unit_state(model).group.overrides.all_gather is None
    if has_method("set_symm_mem_for_comm"):  # torch 2.12
        with pytest.raises(
            RuntimeError, match=r"on unit 'Sequential \(root\)'.*needs CUDA and an NCCL"
        ):
            model.set_symm_mem_for_comm()
        assert unit_state(model).group.overrides.all_gather is None  # nothing was set
        with pytest.raises(ValueError, match="NCCL"):
            model.set_symm_mem_for_comm("NVSHMEM")  # type: ignore[arg-type]
    model.set_post_optim_event(torch.Event("cpu"))  # accepted on CPU, as FSDP2 (no-op)
    # prefetch lists and share_comm_ctx take units only
    with pytest.raises(ValueError, match="FSDPModule"):
        model.set_modules_to_forward_prefetch([nn.Linear(2, 2)])  # type: ignore[list-item]
    if not SHARE_COMM_CTX.available:  # torch 2.9
        return out
    with pytest.raises(ValueError, match="FSDPModule"):
        fullshard.share_comm_ctx([nn.Linear(2, 2)])  # type: ignore[list-item]
    # share_comm_ctx: the roots use one set of streams (before their first forward)
    a, b, c = _model(), _model(), _model()
    fullshard.share_comm_ctx([a, b])
    for m in (a, b, c):
        m(x)
    streams = [unit_state(m).ctx.comm.streams for m in (a, b, c)]
    assert streams[0] is streams[1] and streams[2] is not streams[0]
    with pytest.raises(RuntimeError, match="before the first forward"):
        fullshard.share_comm_ctx([a, b])
    return out


class EmbedNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(11, 8)
        self.block = Block()
        self.head = nn.Linear(8, 3)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.head(self.block(self.embed(idx)))


def _unshard_in_backward() -> dict[str, Any]:
    """set_unshard_in_backward(False) on an embedding unit: one all-gather fewer in backward,
    the same losses and weights."""
    out: dict[str, Any] = {}
    for unshard in (True, False):
        net = EmbedNet()
        fully_shard(net.embed)
        fully_shard(net.block)
        fully_shard(net)
        net.embed.set_unshard_in_backward(unshard)
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        losses, gathers = [], []
        for step in range(3):
            idx = torch.randint(0, 11, (4, 5), generator=torch.Generator().manual_seed(step))
            loss = net(idx).square().mean()
            with fullshard.count_collectives() as stats, record_events() as log:
                loss.backward()
            # a gather that took back its unit's pooled memory counts as a gather here
            gathers.append(stats.calls("all_gather") + reused_gathers(log))
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        out[unshard] = (losses, gathers, [p.full_tensor() for p in net.parameters()])
    return out


# ------------------------------------------------------ communication overrides (FSDP2 knobs)
class _Counting:
    """Counts a comm's calls, bytes on the wire (``_count``) and allocations (torch's comm
    protocols: ``allocate`` and ``__call__``, which delegates to ``torch.distributed``)."""

    def __init__(self) -> None:
        self.calls = self.nbytes = self.allocs = 0

    def allocate(self, size: Any, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        self.allocs += 1
        return torch.empty(*size, dtype=dtype, device=device)

    def _count(self, wire: torch.Tensor) -> None:
        self.calls += 1
        self.nbytes += wire.numel() * wire.element_size()


class _CountingAllGather(_Counting, _TorchAllGather):
    def __call__(  # type: ignore[override]
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: Any,
        async_op: bool = False,
    ) -> Any:
        self._count(output_tensor)
        return all_gather_single(output_tensor, input_tensor, group=group, async_op=async_op)


class _CountingReduceScatter(_Counting, _TorchReduceScatter):
    def __call__(  # type: ignore[override]
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: Any,
        op: Any = dist.ReduceOp.SUM,
        async_op: bool = False,
    ) -> Any:
        self._count(input_tensor)
        return reduce_scatter_single(
            output=output_tensor, input=input_tensor, op=op, group=group, async_op=async_op
        )


class _Bits(BitsGather):
    """``BitsGather`` (lossless int32 all-gather extension) that also works under FSDP2: it
    stays itself through FSDP2's sharding (which pads the shard with ``new_zeros``), so torch
    runs the extension too, and counts its pre-all-gathers."""

    pre_all_gathers = 0

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):  # type: ignore[override]
        out = super().__torch_dispatch__(func, types, args, kwargs)
        return cls(out) if func is torch.ops.aten.new_zeros.default else out

    def fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):
        _Bits.pre_all_gathers += 1
        return super().fsdp_pre_all_gather(mesh, outer_size, outer_stride, module, mp_policy)

    def fsdp_post_all_gather(self, outputs, metadata, param_dtype, *, out=None):
        if out is None:
            return super().fsdp_post_all_gather(outputs, metadata, param_dtype)
        # FSDP2 leaves it to the extension to refill without autograd seeing a mutation
        with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(out):
            return super().fsdp_post_all_gather(outputs, metadata, param_dtype, out=out)


class ExtBlock(Block):
    """A block whose weight defines FSDP2's all-gather extension (``_Bits``)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin.weight = nn.Parameter(_Bits(self.lin.weight.detach().clone()))


def _train(model: nn.Module, steps: int = 2, data: Any = _data) -> dict[str, Any]:
    """SGD steps; this rank's losses and the full weights after."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for step in range(steps):
        loss = model(data(step)).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "weights": [p.full_tensor() for p in model.parameters()]}


def _units(model: nn.Module) -> list[Any]:
    return [m for m in model.modules() if isinstance(m, tfsdp.FSDPModule)]


def _custom_comms(middle: type[nn.Module] | None = None) -> dict[str, Any]:
    """set_custom_all_gather / set_custom_reduce_scatter on every unit, fullshard and FSDP2;
    plus the default run's traffic as fullshard counts it. ``middle``: the second block's
    class (``ExtBlock``: its weight uses the all-gather extension)."""
    out: dict[str, Any] = {}
    with fullshard.count_collectives() as stats, record_events() as log:
        out["default"] = _train(_model(middle=middle))
    traffic = {k: dict(stats.by_kind()[k]) for k in ("all_gather", "reduce_scatter")}
    # By default a unit may take back its pooled memory instead of gathering ([Note: taking
    # back a unit's own gathered memory]); a custom all-gather sees every gather, as in FSDP2.
    reused = [e for e in log if e.kind == "gather_issue" and e.detail == "reused"]
    traffic["all_gather"]["calls"] += len(reused)
    traffic["all_gather"]["bytes"] += sum(e.nbytes for e in reused)
    out["default_traffic"], out["default_reused"] = traffic, len(reused)
    for name, shard in (("fullshard", fully_shard), ("torch", _TORCH_FULLY_SHARD)):
        model, ag, rs = _model(shard, middle), _CountingAllGather(), _CountingReduceScatter()
        for unit in _units(model):
            unit.set_custom_all_gather(ag)
            unit.set_custom_reduce_scatter(rs)
        _Bits.pre_all_gathers = 0
        out[name] = _train(model)
        out[name]["comms"] = {
            "all_gather": {"calls": ag.calls, "bytes": ag.nbytes},
            "reduce_scatter": {"calls": rs.calls, "bytes": rs.nbytes},
        }
        out[name]["allocs"] = (ag.allocs, rs.allocs)
        out[name]["pre_all_gathers"] = _Bits.pre_all_gathers
    return out


def _backend_buffers() -> dict[str, Any]:
    """The comms behind set_allocate_memory_from_process_group_for_comm /
    set_symm_mem_for_comm carry every collective of the units they are set on (installed
    through the knobs' own helper: on a CPU unit the knobs refuse), with unchanged results;
    the knobs refuse to mix with each other and with custom comms."""
    from fullshard.engine.overrides import BackendAllGather, BackendReduceScatter
    from fullshard.module import _set_backend_buffers

    out: dict[str, Any] = {}
    model = _model()
    states = fullshard.api._all_states(model)
    for st in states:  # gloo has no allocator of its own: torch.empty
        _set_backend_buffers(st, "process_group", True)
    with fullshard.count_collectives() as stats:
        out["process_group"] = _train(model)
    out["algorithms"] = {(r.kind, r.algorithm) for r in stats.records}
    ov = states[0].group.overrides
    assert isinstance(ov.all_gather, BackendAllGather)
    assert isinstance(ov.reduce_scatter, BackendReduceScatter)
    assert ov.reduce_scatter.source == "process_group"
    with pytest.raises(FullyShardError, match="use one of them"):
        _set_backend_buffers(states[0], "symmetric", True)
    model.set_allocate_memory_from_process_group_for_comm(False)  # back to the defaults
    assert ov.all_gather is None and ov.reduce_scatter is None
    # symmetric reduce-scatter buffers: one buffer in flight only (as FSDP2)
    _set_backend_buffers(states[0], "symmetric", True)
    with pytest.raises(ValueError, match="symmetric"):
        model.set_reduce_scatter_max_input_buffers(2)
    assert states[1].group.overrides.max_input_buffers is None  # nothing changed
    with pytest.raises(AssertionError, match="use one of them"):  # FSDP2's exception type
        model.set_allocate_memory_from_process_group_for_comm(False)
    # a custom comm set first: the knobs refuse, naming the unit
    model = _model()
    model.set_custom_all_gather(_CountingAllGather())
    with pytest.raises(FullyShardError, match=r"unit '.*'.*set_custom_all_gather.*use one"):
        model.set_allocate_memory_from_process_group_for_comm(False)
    return out


def _all_reduce_hooks() -> dict[str, Any]:
    """set_all_reduce_hook: a scaling hook on every unit (1-D), and on HSDP (2 replicas of 1
    shard) a hook recording what it sees, under fullshard and FSDP2."""
    from torch.distributed.device_mesh import init_device_mesh

    out: dict[str, Any] = {}
    hsdp = init_device_mesh("cpu", (2, 1), mesh_dim_names=("replicate", "shard"))
    for name, shard in (("fullshard", fully_shard), ("torch", _TORCH_FULLY_SHARD)):
        model = _model(shard)
        for unit in _units(model):
            unit.set_all_reduce_hook(lambda t: t.mul_(0.25))
        model(_data(0)).square().mean().backward()
        out[name, "scaled"] = [p.grad.full_tensor() for p in model.parameters()]
        model = _model(shard, mesh=hsdp)
        seen: list[torch.Tensor] = []
        model.set_all_reduce_hook(lambda t, seen=seen: seen.append(t.clone()))  # root unit only
        model(_data(0)).square().mean().backward()
        head = model[3]
        grads = [head.weight.grad.full_tensor().flatten(), head.bias.grad.full_tensor()]
        out[name, "hsdp"] = (seen, torch.cat(grads))
        if name == "fullshard":
            with pytest.raises(ValueError, match="HSDP"):
                model.set_all_reduce_hook(lambda t: None, stream=object())  # type: ignore[arg-type]
        # force sum: the hook sees the sum, the division follows (1-D)
        model = _model(shard)
        model.set_force_sum_reduction_for_comms(True)
        summed: list[torch.Tensor] = []
        model.set_all_reduce_hook(lambda t, summed=summed: summed.append(t.clone()))
        model(_data(0)).square().mean().backward()
        head = model[3]
        local = torch.cat([head.weight.grad.to_local().flatten(), head.bias.grad.to_local()])
        out[name, "sum"] = (summed, [p.grad.full_tensor() for p in model.parameters()], local)
    model = _model()
    model(_data(0)).square().mean().backward()
    out["default"] = [p.grad.full_tensor() for p in model.parameters()]
    return out


class Experts(nn.Module):
    """Two experts; ``use_b`` decides per rank whether the second one runs."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)
        self.use_b = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.a(x)
        return y + self.b(x) if self.use_b else y


def _unused_params() -> dict[str, Any]:
    """Rank 0 never runs expert ``b`` (rank 1 does), with set_reduce_scatter_unused_params on
    the experts' unit: fullshard, FSDP2 and a single-process reference agree."""
    out: dict[str, Any] = {}
    for name, shard in (("fullshard", fully_shard), ("torch", _TORCH_FULLY_SHARD)):
        model = _model(shard, middle=Experts)
        model[1].use_b = dist.get_rank() == 1
        model[1].set_reduce_scatter_unused_params(True, recurse=False)
        with fullshard.count_collectives() as stats:
            out[name] = _train(model)
        out[name]["reduce_scatters"] = stats.calls("reduce_scatter")
    # the reference: both ranks' losses on one unsharded model, gradients averaged
    ref = _model(lambda m, **_: m, middle=Experts)
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    losses = []
    for step in range(2):
        per_rank = []
        for r in range(2):
            ref[1].use_b = r == 1
            per_rank.append(ref(_data(step, r)).square().mean())
        (sum(per_rank) / 2).backward()
        opt.step()
        opt.zero_grad()
        losses.append(per_rank[dist.get_rank()].item())
    out["reference"] = {"losses": losses, "weights": [p.detach() for p in ref.parameters()]}
    return out


def _peak_in_flight(log: list[Any]) -> int:
    """The most reductions issued and not yet waited on at any point of the event log."""
    n = peak = 0
    for e in log:
        if e.kind == "reduce_issue":
            n += 1
            peak = max(peak, n)
        elif e.kind == "reduce_wait":
            n -= 1
    return peak


def _max_input_buffers() -> dict[str, Any]:
    """set_reduce_scatter_max_input_buffers: the engine keeps at most that many reductions in
    flight (the root's units share the largest cap), with unchanged gradients. Unset (0
    here), the CPU's window for small units keeps all four tiny units' reductions in flight
    ([Note: a window for small units] in fullshard.engine.window)."""
    from fullshard.engine.events import record_events

    out: dict[str, Any] = {}
    for cap in (0, 1, 2, 3):
        model = _model()
        if cap in (1, 2):  # before lazy init, on every unit
            model.set_reduce_scatter_max_input_buffers(cap)
        model(_data(0)).square().mean().backward()
        if cap == 3:  # after lazy init, on one unit: the root's units take the largest cap
            model[0].set_reduce_scatter_max_input_buffers(3, recurse=False)
        model.zero_grad()
        with record_events() as log:
            model(_data(1)).square().mean().backward()
        out[cap] = (_peak_in_flight(log), [p.grad.full_tensor() for p in model.parameters()])
    return out


def _separate_reduce_group() -> dict[str, Any]:
    """set_separate_reduce_scatter_group: reductions run on a group of their own (created
    once, reused), all-gathers on the shard group; same results; False goes back."""
    import fullshard.engine.collectives as C

    out: dict[str, Any] = {"default": _train(_model())}
    model = _model()
    model.set_separate_reduce_scatter_group()
    groups = {st.group.overrides.reduce_scatter_group for st in fullshard.api._all_states(model)}
    model.set_separate_reduce_scatter_group(True)  # again: the same group
    again = {st.group.overrides.reduce_scatter_group for st in fullshard.api._all_states(model)}
    shard_group = unit_state(model).group.info.shard_group
    seen: list[tuple[str, Any]] = []
    start = C.issue

    def spy(kind: str, *args: Any, **kwargs: Any) -> Any:
        seen.append((kind, kwargs.get("group")))
        return start(kind, *args, **kwargs)

    C.issue = spy
    try:
        with fullshard.count_collectives() as stats:
            out["separate"] = _train(model)
    finally:
        C.issue = start
    (rs_group,) = groups
    assert again == groups and rs_group is not shard_group and rs_group is not None
    assert dist.get_process_group_ranks(rs_group) == dist.get_process_group_ranks(shard_group)
    # whichever call implements them (on 2 gloo ranks at this size: p2p exchanges)
    kinds = {k for k, _ in seen}
    assert kinds == {"all_gather", "reduce_scatter"}, kinds
    assert {g for k, g in seen if k == "all_gather"} == {shard_group}
    assert {g for k, g in seen if k == "reduce_scatter"} == {rs_group}
    assert len([k for k, _ in seen if k == "reduce_scatter"]) == stats.calls("reduce_scatter") == 8
    model.set_separate_reduce_scatter_group(False)
    assert unit_state(model).group.reduce_group is shard_group
    return out


def _compat_cases() -> dict[str, Any]:
    _identity_and_validation()
    out = _methods()
    out["unshard_in_backward"] = _unshard_in_backward()
    out["custom_comms"] = _custom_comms()
    out["custom_comms_ext"] = _custom_comms(ExtBlock)
    out["hooks"] = _all_reduce_hooks()
    if has_method("reset_iter_state"):  # torch 2.13's methods
        out["reset"] = _reset_cases()
        out["backend_buffers"] = _backend_buffers()
        out["unused"] = _unused_params()
        out["max_input_buffers"] = _max_input_buffers()
        out["separate"] = _separate_reduce_group()
    return out


def _finalized(model: Any) -> bool:
    """Whether the backward just run ended the step: fullshard waited for every reduction;
    FSDP2 cleared its post-forward order (what it keeps for the next backward otherwise)."""
    if isinstance(model, fullshard.FSDPModule):
        state = unit_state(model)
        return not state.ctx.pending and not state.ctx.replicating
    return not model._get_fsdp_state()._comm_ctx.post_forward_order


def _last_backward_on_a_child() -> dict[str, Any]:
    """set_is_last_backward on a unit that is not the root, under fullshard and FSDP2: before
    the first forward, after it with False, then True; whether each backward ended the step,
    and the gradients the three backwards accumulated."""
    out: dict[str, Any] = {}
    for name, shard in (("fullshard", fully_shard), ("torch", _TORCH_FULLY_SHARD)):
        model = _model(shard)
        finalized = []
        for step, flag in enumerate((False, False, True)):
            model[1].set_is_last_backward(flag)
            model(_data(step)).square().mean().backward()
            finalized.append(_finalized(model))
        out[name] = (finalized, [p.grad.full_tensor() for p in model.parameters()])
    return out


def test_set_is_last_backward_on_a_unit_that_is_not_the_root() -> None:
    """FSDP2's flag lives in the context every unit shares: set on a child after the first
    forward it governs the backward (whose reductions stay in flight), set before it is
    dropped by the root's lazy init."""
    for r in run_distributed(_last_backward_on_a_child, 2, timeout=120):
        (ours, our_grads), (theirs, their_grads) = r["fullshard"], r["torch"]
        assert theirs == [True, False, True], theirs
        assert ours == theirs, (ours, theirs)
        for a, b in zip(our_grads, their_grads):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


def _same_run(a: dict[str, Any], b: dict[str, Any], atol: float = 0.0) -> None:
    assert a["losses"] == pytest.approx(b["losses"], abs=atol, rel=0), (a["losses"], b["losses"])
    assert len(a["weights"]) == len(b["weights"])
    for x, y in zip(a["weights"], b["weights"]):
        torch.testing.assert_close(x, y, rtol=0, atol=atol)


def test_fsdp2_behaviour_on_two_ranks() -> None:
    results = run_distributed(_compat_cases, 2)
    # HSDP: the all-reduce hook ran after the replicas' all-reduce (same values on both ranks)
    seen = [r["hooks"]["fullshard", "hsdp"][0][0] for r in results]
    torch.testing.assert_close(seen[0], seen[1], rtol=0, atol=0)
    for r in results:
        for a, b in zip(r["set_reduce_scatter_divide_factor"], r["set_gradient_divide_factor"]):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
        for a, b in zip(r["set_gradient_divide_factor"], r["default"]):
            torch.testing.assert_close(a, 2 * b)
        if has_method("reset_iter_state"):
            assert r["reset"]["failing"] == r["reset"]["clean"], r["reset"]
        (loss_on, gathers_on, w_on), (loss_off, gathers_off, w_off) = (
            r["unshard_in_backward"][True],
            r["unshard_in_backward"][False],
        )
        assert loss_off == loss_on
        assert [g - 1 for g in gathers_on] == gathers_off  # the embedding's re-gather skipped
        for a, b in zip(w_off, w_on):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
        _check_overrides(r)


def _check_overrides(r: dict[str, Any]) -> None:
    cc = r["custom_comms"]
    _same_run(cc["fullshard"], cc["default"], atol=1e-6)
    _same_run(cc["fullshard"], cc["torch"], atol=1e-6)
    # every collective went through the custom comms: the traffic fullshard counts by default,
    # with the gathers the default run took back from its pool
    assert (cc["default_reused"] > 0) == STORAGE_SWAP  # no pool before torch 2.12
    assert cc["fullshard"]["comms"] == cc["default_traffic"], cc
    # as many calls as FSDP2 makes (2 steps x (4 + 3 all-gathers, 4 reduce-scatters))
    assert cc["fullshard"]["comms"]["all_gather"]["calls"] == 14
    for kind in ("all_gather", "reduce_scatter"):
        assert cc["fullshard"]["comms"][kind]["calls"] == cc["torch"]["comms"][kind]["calls"]
    assert cc["fullshard"]["allocs"] == (14, 16)  # gather output; reduce input and output

    # the all-gather extension: the custom comms carry its gathers too (FSDP2's semantics)
    ext = r["custom_comms_ext"]
    _same_run(ext["fullshard"], cc["default"], atol=1e-6)  # the extension gathers losslessly
    _same_run(ext["fullshard"], ext["torch"], atol=1e-6)
    assert ext["fullshard"]["pre_all_gathers"] == ext["torch"]["pre_all_gathers"] == 4
    assert ext["fullshard"]["comms"] == ext["default_traffic"], ext
    for kind in ("all_gather", "reduce_scatter"):  # FSDP2 packs them: the same bytes
        assert ext["fullshard"]["comms"][kind]["bytes"] == ext["torch"]["comms"][kind]["bytes"]
    # one call more per extension gather (2 steps x forward + backward), as many reductions
    ours, theirs = ext["fullshard"]["comms"], ext["torch"]["comms"]
    assert ours["all_gather"]["calls"] == theirs["all_gather"]["calls"] + 4 == 18
    assert ours["reduce_scatter"]["calls"] == theirs["reduce_scatter"]["calls"] == 8

    hooks = r["hooks"]
    for ours, theirs, default in zip(
        hooks["fullshard", "scaled"], hooks["torch", "scaled"], hooks["default"]
    ):
        torch.testing.assert_close(ours, 0.25 * default, rtol=0, atol=1e-7)
        torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-7)
    (seen,), grads = hooks["fullshard", "hsdp"]
    (torch_seen,), _ = hooks["torch", "hsdp"]
    torch.testing.assert_close(seen, grads, rtol=0, atol=0)  # the hook saw the final mean
    torch.testing.assert_close(seen, torch_seen, rtol=0, atol=1e-7)
    (summed,), grads, local = hooks["fullshard", "sum"]
    (torch_summed,), torch_grads, _ = hooks["torch", "sum"]
    torch.testing.assert_close(summed, torch_summed, rtol=0, atol=1e-7)
    torch.testing.assert_close(summed[: local.numel()], 2 * local)  # the sum of 2 ranks' means
    for ours, theirs, default in zip(grads, torch_grads, hooks["default"]):
        torch.testing.assert_close(ours, default, rtol=0, atol=1e-7)  # still the mean
        torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-7)

    if not has_method("reset_iter_state"):  # the rest are torch 2.13's methods
        return
    bb = r["backend_buffers"]
    _same_run(bb["process_group"], cc["default"])
    assert bb["algorithms"] == {("all_gather", "custom"), ("reduce_scatter", "custom")}
    unused = r["unused"]
    _same_run(unused["fullshard"], unused["reference"], atol=1e-6)
    _same_run(unused["fullshard"], unused["torch"], atol=1e-6)
    assert unused["fullshard"]["reduce_scatters"] == 8  # 4 units x 2 steps on both ranks

    caps = r["max_input_buffers"]
    assert [caps[c][0] for c in (0, 1, 2, 3)] == [4, 1, 2, 3]
    for c in (0, 2, 3):
        for a, b in zip(caps[c][1], caps[1][1]):
            torch.testing.assert_close(a, b, rtol=0, atol=0)

    _same_run(r["separate"]["separate"], r["separate"]["default"])
