"""FSDP2's private names, as verl and torchtitan call them, answer for fullshard's units under
``patch_torch_fsdp()`` (and ``module._get_fsdp_state()`` without it) ([Note: FSDP2's private names] in ``fullshard.torch_state``).

The helpers below reproduce the callers' code (imports inside the function, as they write
them): verl's veomni offload helper (``_get_module_fsdp_state``, ``TrainingState``,
``state._fsdp_param_group._training_state``), verl's ``set_reshard_after_forward`` fallback
(``_auto_reshard_after_forward``, ``post_forward_mesh_info = _get_post_forward_mesh_info(...,
.mesh_info)``), trainers reading ``fsdp_params``, and torchtitan's ``FSDPMeshInfo`` /
``_get_mesh_info``. Each effect is checked on fullshard's own unit (its gathered memory, its
policy, its training state), and the answer for modules that are no fullshard unit is torch's.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

import fullshard
from fullshard.api import _all_states
from fullshard.engine.state import TrainingState as OurTrainingState
from fullshard.testing import run_distributed
from parity import batch, make_net


def offload_veomni_model_like(model: nn.Module) -> int:
    """verl's ``offload_veomni_model_to_cpu`` up to its ``model.cpu()``: every unit IDLE, then
    the root resharded. Returns how many unit states it found."""
    from torch.distributed.fsdp._fully_shard._fsdp_common import TrainingState
    from torch.distributed.fsdp._fully_shard._fsdp_state import _get_module_fsdp_state

    found = 0
    for module in model.modules():
        state = _get_module_fsdp_state(module)
        if state is None:
            continue
        found += 1
        fsdp_param_group = state._fsdp_param_group
        if fsdp_param_group is None:
            continue
        fsdp_param_group._training_state = TrainingState.IDLE
    model.reshard()  # type: ignore[operator]
    return found


def set_reshard_after_forward_like(module: nn.Module, value: bool | int) -> None:
    """verl's ``set_reshard_after_forward`` (fsdp_utils), with the state from
    ``_get_module_fsdp_state`` (verl reads it through ``module._get_fsdp_state()``)."""
    from torch.distributed.fsdp._fully_shard._fsdp_init import _get_post_forward_mesh_info
    from torch.distributed.fsdp._fully_shard._fsdp_state import _get_module_fsdp_state

    state = _get_module_fsdp_state(module)
    state._auto_reshard_after_forward = False
    if fsdp_param_group := state._fsdp_param_group:
        fsdp_param_group.post_forward_mesh_info = _get_post_forward_mesh_info(
            value, fsdp_param_group.mesh_info
        )


def _shard(model: nn.Module, mesh: Any = None) -> nn.Module:
    from torch.distributed.fsdp import fully_shard  # fullshard's, under the patch

    for block in model.blocks:  # type: ignore[union-attr]
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _verl_calls() -> dict[str, Any]:
    from torch.distributed.fsdp._fully_shard import _fsdp_init, _fsdp_state
    from torch.distributed.fsdp._fully_shard._fsdp_common import FSDPMeshInfo, TrainingState

    originals = (_fsdp_state._get_module_fsdp_state, _fsdp_init._get_post_forward_mesh_info)
    patch = fullshard.patch_torch_fsdp()
    out: dict[str, Any] = {}
    model = _shard(make_net())
    x = batch(0)[0][:4]
    model(x).sum().backward()  # lazy init, one step
    states = _all_states(model)
    out["units"] = len(states)
    out["plain"] = _fsdp_state._get_module_fsdp_state(nn.Linear(2, 2)) is None

    # a forward that raised half-way leaves units busy; verl's helper makes them IDLE
    hook = model.blocks[1].register_forward_hook(lambda *_: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        model(x)
    hook.remove()
    out["busy_before"] = [st.training_state.value for st in states]
    out["found"] = offload_veomni_model_like(model)
    out["idle_after"] = all(st.training_state is OurTrainingState.IDLE for st in states)
    view = _fsdp_state._get_module_fsdp_state(model.blocks[0])
    out["reads_idle"] = view._fsdp_param_group._training_state is TrainingState.IDLE
    out["same_view"] = view == _fsdp_state._get_module_fsdp_state(model.blocks[0])

    # the policy through post_forward_mesh_info: block 0 keeps, the others free
    block = model.blocks[0]
    group = view._fsdp_param_group
    out["mesh_info"] = (type(group.mesh_info) is FSDPMeshInfo, group.mesh_info.shard_mesh_size)
    set_reshard_after_forward_like(block, False)
    out["keep_info"] = group.post_forward_mesh_info is None
    with torch.no_grad():
        model(x)
        model(x)
    out["kept"] = [st.group.unsharded_bytes_allocated > 0 for st in states[1:]]
    set_reshard_after_forward_like(block, True)
    out["free_info"] = group.post_forward_mesh_info is group.mesh_info
    block.reshard()  # type: ignore[operator]
    with torch.no_grad():
        model(x)
    out["freed"] = [st.group.unsharded_bytes_allocated for st in states[1:]]
    set_reshard_after_forward_like(block, dist.get_world_size())  # an int of the group's size
    out["int_full"] = states[1].reshard_after_forward
    try:
        set_reshard_after_forward_like(block, 3)
    except ValueError as e:
        out["int_bad"] = str(e)

    # fsdp_params as trainers read them
    out["params"] = [
        (fp.sharded_param is p, tuple(fp._orig_size), tuple(fp.sharded_size))
        for fp, p in zip(group.fsdp_params, [sp.sharded_param for sp in states[1].group.params])
    ]
    out["shapes"] = [
        (tuple(sp.orig_shape), math.ceil(sp.orig_shape[0] / dist.get_world_size()))
        for sp in states[1].group.params
    ]
    patch.undo()
    out["restored"] = (
        _fsdp_state._get_module_fsdp_state,
        _fsdp_init._get_post_forward_mesh_info,
    ) == originals
    # no patch: code reaching the state through module._get_fsdp_state() (verl's fallback)
    fallback = model.blocks[1]._get_fsdp_state()  # type: ignore[operator]
    fallback._auto_reshard_after_forward = False
    fallback._fsdp_param_group.post_forward_mesh_info = None  # keep after forward
    with torch.no_grad():
        model(x)
    out["fallback_kept"] = [st.group.unsharded_bytes_allocated > 0 for st in states[1:]]
    return out


def _torchtitan_hsdp() -> dict[str, Any]:
    patch = fullshard.patch_torch_fsdp()
    from torch.distributed.fsdp._fully_shard._fsdp_common import FSDPMeshInfo
    from torch.distributed.fsdp._fully_shard._fsdp_init import _get_mesh_info
    from torch.distributed.fsdp._fully_shard._fsdp_state import _get_module_fsdp_state

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    model = _shard(make_net(), mesh)
    group = _get_module_fsdp_state(model.blocks[0])._fsdp_param_group
    theirs = _get_mesh_info(mesh)  # torchtitan's call, torch's own function
    info = group.mesh_info
    out = {
        "same_type": type(info) is type(theirs),
        "is_fsdp_info": isinstance(info, FSDPMeshInfo),
        "sizes": (info.shard_mesh_size, info.replicate_mesh_size),
    }
    patch.undo()
    return out


@pytest.fixture(scope="module")
def verl() -> dict[str, Any]:
    return run_distributed(_verl_calls, 2, timeout=600)[0]


def test_get_module_fsdp_state_and_training_state(verl: dict[str, Any]) -> None:
    assert verl["plain"]  # not a unit: torch's answer
    assert "forward" in verl["busy_before"]  # the aborted forward left units busy
    assert verl["found"] == verl["units"]
    assert verl["idle_after"] and verl["reads_idle"] and verl["same_view"]


def test_post_forward_mesh_info_sets_the_policy(verl: dict[str, Any]) -> None:
    assert verl["mesh_info"] == (True, 2)
    assert verl["keep_info"] and verl["free_info"]
    assert verl["kept"] == [True, False, False]  # block 0 kept after no-grad forwards
    assert verl["freed"] == [0, 0, 0]
    assert verl["int_full"] is True  # k == the shard group's size means True
    assert "factor of 2, not 3" in verl["int_bad"]


def test_fsdp_params_and_undo(verl: dict[str, Any]) -> None:
    assert verl["params"] and all(same for same, _, _ in verl["params"])
    for (_, orig, sharded), (shape, rows) in zip(verl["params"], verl["shapes"]):
        assert orig == shape and sharded[0] == rows
    assert verl["restored"]
    assert verl["fallback_kept"] == [False, True, False]  # block 1 keeps, through the view


def _has_get_mesh_info() -> bool:
    from torch.distributed.fsdp._fully_shard import _fsdp_init

    return hasattr(_fsdp_init, "_get_mesh_info")


@pytest.mark.skipif(
    not _has_get_mesh_info(),
    reason=f"torchtitan's _fsdp_init._get_mesh_info is not in torch {torch.__version__} "
    "(it came after 2.9; torchtitan needs a newer torch)",
)
def test_torchtitan_mesh_info_hsdp() -> None:
    out = run_distributed(_torchtitan_hsdp, 4, timeout=600)[0]
    assert out == {"same_type": True, "is_fsdp_info": True, "sizes": (2, 2)}
