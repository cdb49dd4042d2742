"""Misuse, to the letter of FSDP2: each case runs under torch FSDP2 and under fullshard on one
gloo rank (one spawn for the whole file) and fullshard must raise FSDP2's exception type with a
message that starts with FSDP2's, so ``pytest.raises(X, match=<FSDP2's message>)`` written
against FSDP2 passes against fullshard. Also FSDP2's ``fully_shard.state(module)`` (without
``patch_torch_fsdp``) and the calls FSDP2 accepts on the CPU."""

from __future__ import annotations

import copy
import functools
import sys
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed.fsdp as tfsdp
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

from fullshard import fully_shard
from fullshard.testing import run_distributed

Shard_ = Callable[..., Any]  # torch's fully_shard or fullshard's
ENGINES: dict[str, Shard_] = {"fsdp2": tfsdp.fully_shard, "fullshard": fully_shard}
#: ``dp_mesh_dims`` exists in FSDP2 from torch 2.12 on
DataParallelMeshDims = getattr(tfsdp, "DataParallelMeshDims", None)


def _pair() -> nn.Sequential:
    return nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))


class _Scaled(nn.Module):
    """A Linear times a 0-dim (scalar) parameter."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.scale = nn.Parameter(torch.tensor(1.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * self.scale


# ------------------------------------------------------------------------------ the misuses
def _unnamed_2d_mesh(shard: Shard_) -> None:
    shard(nn.Linear(4, 4), mesh=init_device_mesh("cpu", (1, 1)))


def _mesh_3d(shard: Shard_) -> None:
    shard(nn.Linear(4, 4), mesh=init_device_mesh("cpu", (1, 1, 1)))


def _named_mesh_3d(shard: Shard_) -> None:
    mesh = init_device_mesh("cpu", (1, 1, 1), mesh_dim_names=("pp", "dp", "tp"))
    shard(nn.Linear(4, 4), mesh=mesh)


def _scalar_param(shard: Shard_) -> None:
    shard(nn.Sequential(_Scaled()))  # FSDP2 names the attribute ('scale'), not '0.scale'


def _forward_on_meta(shard: Shard_) -> None:
    """FSDP2's own test's shape: the root owns nothing, the first child unit is named."""
    with torch.device("meta"):
        model = nn.Sequential(_pair(), _pair())
    for m in (model[0], model[1], model):
        shard(m)
    model(torch.randn(2, 4))


def _forward_on_meta_root_params(shard: Shard_) -> None:
    with torch.device("meta"):
        model = _pair()
    shard(model[0])
    shard(model)  # owns model[1]: the root's unit is checked first
    model(torch.randn(2, 4))


def _hsdp_hook_stream(shard: Shard_) -> None:
    mesh = init_device_mesh("cpu", (1, 1), mesh_dim_names=("replicate", "shard"))
    model = shard(nn.Linear(4, 4), mesh=mesh)
    model.set_all_reduce_hook(lambda t: None, stream=torch.cpu.Stream())


def _deepcopy(shard: Shard_) -> None:
    copy.deepcopy(shard(_pair()))


def _twice(shard: Shard_) -> None:
    lin = nn.Linear(4, 4)
    shard(lin)
    shard(lin)


def _child_again(shard: Shard_) -> None:
    model = _pair()
    shard(model[0])
    shard(model)
    shard(model[0])


def _module_list(shard: Shard_) -> None:
    shard(nn.ModuleList([nn.Linear(4, 4)]))


def _module_dict(shard: Shard_) -> None:
    shard(nn.ModuleDict({"a": nn.Linear(4, 4)}))


def _shard_dim_too_large(shard: Shard_) -> None:
    shard(nn.Linear(4, 4), shard_placement_fn=lambda p: Shard(2))


def _shard_dim_bias(shard: Shard_) -> None:
    shard(nn.Linear(4, 4), shard_placement_fn=lambda p: Shard(1))  # the weight has it


@functools.cache
def _dp_tp_mesh() -> DeviceMesh:
    """One (dp, tp) mesh per process: FSDP2 wants the parameters' DTensor mesh to *be* the mesh
    passed (``is``), and DTensor may hand back an equal mesh made earlier in the process."""
    return init_device_mesh("cpu", (1, 1), mesh_dim_names=("dp", "tp"))


def _dp_dims_placement(shard_name: str, replicate_name: str | None) -> Callable[[Shard_], None]:
    """Parameters Shard(0) on the mesh's 'dp' dim, which ``dp_mesh_dims`` names."""

    def case(shard: Shard_) -> None:
        mesh = _dp_tp_mesh()
        model = nn.Linear(4, 4)
        for name, p in list(model.named_parameters()):
            dt = distribute_tensor(p.detach(), mesh, [Shard(0), Replicate()])
            setattr(model, name, nn.Parameter(dt))
        assert DataParallelMeshDims is not None
        dims = DataParallelMeshDims(shard=shard_name, replicate=replicate_name)
        shard(model, mesh=mesh, dp_mesh_dims=dims)

    return case


MISUSES: dict[str, Callable[[Shard_], None]] = {
    "unnamed_2d_mesh": _unnamed_2d_mesh,
    "mesh_3d": _mesh_3d,
    "named_mesh_3d": _named_mesh_3d,
    "scalar_param": _scalar_param,
    "forward_on_meta": _forward_on_meta,
    "forward_on_meta_root_params": _forward_on_meta_root_params,
    "hsdp_hook_stream": _hsdp_hook_stream,
    "deepcopy": _deepcopy,
    "twice": _twice,
    "child_again": _child_again,
    "module_list": _module_list,
    "module_dict": _module_dict,
    "shard_dim_too_large": _shard_dim_too_large,
    "shard_dim_bias": _shard_dim_bias,
    "dp_shard_dim_not_replicate": _dp_dims_placement("dp", None),
    "dp_replicate_dim_not_replicate": _dp_dims_placement("tp", "dp"),
}
NEEDS_DP_MESH_DIMS = {"dp_shard_dim_not_replicate", "dp_replicate_dim_not_replicate"}
#: torch's own test compares this message whole (``assertEqual(str(e), ...)``)
EXACT = {"hsdp_hook_stream"}


def _outcome(case: Callable[[Shard_], Any], shard: Shard_) -> tuple[Any, ...]:
    """("returned", the value) or ("raised", the type's name, its MRO's names, the message)."""
    try:
        return "returned", case(shard)
    except Exception as e:  # the type and the message are what is compared
        return "raised", type(e).__name__, [c.__name__ for c in type(e).__mro__], str(e)


# ------------------------------------------------------------------- what FSDP2 accepts
def _state(shard: Shard_) -> dict[str, Any]:
    """``fully_shard.state(module)`` as FSDP2's own lazy-init test reads it."""
    model = nn.Sequential(_pair(), _pair())
    for m in (model[0][0], model[0][1], model):
        shard(m)
    root, a, b = (shard.state(m) for m in (model, model[0][0], model[0][1]))
    out: dict[str, Any] = {
        "plain_module": shard.state(model[1]),  # None: no unit
        "same_each_call": shard.state(model) == root,
        "is_root_before": [s._is_root for s in (root, a, b)],
    }
    root._lazy_init()
    out["is_root_after"] = [s._is_root for s in (root, a, b)]
    out["all_states"] = root._state_ctx.all_states == [root, a, b]
    return out


def _post_optim_event(shard: Shard_) -> list[float]:
    """``set_post_optim_event`` on a CPU unit, with the events device-agnostic code makes."""
    torch.manual_seed(0)
    model = _pair()
    shard(model[0])
    shard(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for event in (torch.cpu.Event(), torch.Event("cpu"), None):
        model.set_post_optim_event(event)
        loss = model(torch.ones(2, 4)).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _run_all() -> dict[str, dict[str, Any]]:
    assert "fullshard.patch" not in sys.modules  # fully_shard.state is fully_shard's own
    cases: dict[str, Callable[[Shard_], Any]] = {
        n: c for n, c in MISUSES.items() if DataParallelMeshDims or n not in NEEDS_DP_MESH_DIMS
    }
    cases.update(state=_state, post_optim_event=_post_optim_event)
    return {n: {e: _outcome(c, shard) for e, shard in ENGINES.items()} for n, c in cases.items()}


@pytest.fixture(scope="module")
def one_rank() -> dict[str, dict[str, Any]]:
    return run_distributed(_run_all, 1, timeout=300)[0]


_NO_DP_MESH_DIMS = pytest.mark.skipif(
    DataParallelMeshDims is None,
    reason="torch.distributed.fsdp.DataParallelMeshDims (dp_mesh_dims) needs torch >= 2.12",
)


@pytest.mark.parametrize(
    "case",
    [pytest.param(n, marks=_NO_DP_MESH_DIMS) if n in NEEDS_DP_MESH_DIMS else n for n in MISUSES],
)
def test_misuse_raises_fsdp2s_type_and_message(case: str, one_rank) -> None:
    theirs, ours = one_rank[case]["fsdp2"], one_rank[case]["fullshard"]
    assert theirs[0] == "raised", f"{case}: FSDP2 accepted it"
    assert ours[0] == "raised", f"{case}: fullshard accepted it"
    (_, their_type, _, their_msg), (_, our_type, our_mro, our_msg) = theirs, ours
    assert their_type in our_mro, f"{case}: fullshard raised {our_type}, FSDP2 {their_type}"
    assert our_msg.startswith(their_msg), f"{case}:\n{our_msg!r}\nvs FSDP2's\n{their_msg!r}"
    if case in EXACT:
        assert our_msg == their_msg


def test_fully_shard_state_without_the_patch(one_rank) -> None:
    ours, theirs = one_rank["state"]["fullshard"], one_rank["state"]["fsdp2"]
    assert ours == theirs
    assert theirs[1]["is_root_after"] == [True, False, False] and theirs[1]["all_states"]


def test_post_optim_event_accepted_on_cpu(one_rank) -> None:
    ours, theirs = one_rank["post_optim_event"]["fullshard"], one_rank["post_optim_event"]["fsdp2"]
    assert theirs[0] == "returned" and ours[0] == "returned", ours
    assert ours[1] == pytest.approx(theirs[1], rel=1e-6)
