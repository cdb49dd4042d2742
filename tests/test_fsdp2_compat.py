"""fullshard looks like FSDP2 to code that checks: classes, markers, policies, validation,
every public FSDPModule method of torch 2.13, and ``patch_torch_fsdp``."""

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

import fullshard
from fullshard import fully_shard
from fullshard.hooks import FSDPState
from fullshard.state import TrainingState
from fullshard.testing import run_distributed

_TORCH_FULLY_SHARD = tfsdp.fully_shard


def test_every_public_fsdp2_method_is_overridden() -> None:
    torch_names = {
        n
        for n, v in vars(tfsdp.FSDPModule).items()
        if callable(v) and (not n.startswith("__") or n == "__new__")
    }
    assert {"reset_iter_state", "set_symm_mem_for_comm", "_set_unshard_async_op"} <= torch_names
    missing = sorted(n for n in torch_names if n not in vars(fullshard.FSDPModule))
    assert not missing, f"torch's FSDPModule methods would run torch's engine: {missing}"
    assert issubclass(fullshard.FSDPModule, tfsdp.FSDPModule)
    assert issubclass(fullshard.UnshardHandle, tfsdp.UnshardHandle)


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
            assert sys.modules["torch.distributed.pipelining.stage"].fully_shard is fully_shard
            assert tfsdp.register_fsdp_forward_method is fullshard.register_fsdp_forward_method
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


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    model = nn.Sequential(Block(), Block(), Block(), nn.Linear(8, 2))
    for b in model[:3]:
        fully_shard(b)
    fully_shard(model)
    return model


def _data(step: int) -> torch.Tensor:
    return torch.randn(4, 8, generator=torch.Generator().manual_seed(step * 10 + dist.get_rank()))


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
    assert isinstance(model._get_fsdp_state(), FSDPState)
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

    # knobs fullshard has fixed: the fixed value is accepted, others refused clearly
    model.set_reduce_scatter_unused_params(False)
    model.set_separate_reduce_scatter_group(False)
    model.set_reduce_scatter_max_input_buffers(1)
    model.set_allocate_memory_from_process_group_for_comm(False)
    model._set_unshard_async_op(True)
    model._set_unshard_async_op(False)
    for call in (
        lambda: model.set_reduce_scatter_unused_params(True),
        lambda: model.set_separate_reduce_scatter_group(),
        lambda: model.set_reduce_scatter_max_input_buffers(2),
        lambda: model.set_all_reduce_hook(lambda t: None),
        lambda: model.set_custom_all_gather(object()),
        lambda: model.set_custom_reduce_scatter(object()),
    ):
        with pytest.raises(NotImplementedError, match="not implemented by fullshard"):
            call()
    with pytest.raises(TypeError, match="int"):
        model.set_reduce_scatter_max_input_buffers(True)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="positive"):
        model.set_reduce_scatter_max_input_buffers(0)
    with pytest.raises(TypeError, match="bool"):
        model._set_unshard_async_op("yes")  # type: ignore[arg-type]
    # CUDA-only knobs on a CPU unit
    with pytest.raises(RuntimeError, match="NCCL"):
        model.set_allocate_memory_from_process_group_for_comm(True)
    with pytest.raises(RuntimeError, match="CUDA"):
        model.set_symm_mem_for_comm()
    with pytest.raises(ValueError, match="NCCL"):
        model.set_symm_mem_for_comm("NVSHMEM")  # type: ignore[arg-type]
    with pytest.raises(RuntimeError, match="no streams or events"):
        model.set_post_optim_event(torch.Event("cpu"))
    # prefetch lists and share_comm_ctx take units only
    with pytest.raises(ValueError, match="FSDPModule"):
        model.set_modules_to_forward_prefetch([nn.Linear(2, 2)])  # type: ignore[list-item]
    with pytest.raises(ValueError, match="FSDPModule"):
        fullshard.share_comm_ctx([nn.Linear(2, 2)])  # type: ignore[list-item]
    # share_comm_ctx: the roots use one set of streams (before their first forward)
    a, b, c = _model(), _model(), _model()
    fullshard.share_comm_ctx([a, b])
    for m in (a, b, c):
        m(x)
    streams = [m._get_fsdp_state().ctx.streams for m in (a, b, c)]
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
            with fullshard.count_collectives() as stats:
                loss.backward()
            gathers.append(stats.calls("all_gather"))
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        out[unshard] = (losses, gathers, [p.full_tensor() for p in net.parameters()])
    return out


def _compat_cases() -> dict[str, Any]:
    _identity_and_validation()
    out = _methods()
    out["reset"] = _reset_cases()
    out["unshard_in_backward"] = _unshard_in_backward()
    return out


def test_fsdp2_behaviour_on_two_ranks() -> None:
    for r in run_distributed(_compat_cases, 2):
        for a, b in zip(r["set_reduce_scatter_divide_factor"], r["set_gradient_divide_factor"]):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
        for a, b in zip(r["set_gradient_divide_factor"], r["default"]):
            torch.testing.assert_close(a, 2 * b)
        assert r["reset"]["failing"] == r["reset"]["clean"], r["reset"]
        (loss_on, gathers_on, w_on), (loss_off, gathers_off, w_off) = (
            r["unshard_in_backward"][True],
            r["unshard_in_backward"][False],
        )
        assert loss_off == loss_on
        assert [g - 1 for g in gathers_on] == gathers_off  # the embedding's re-gather skipped
        for a, b in zip(w_off, w_on):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
