"""FSDP2's API of torch 2.15, on every supported torch: manual backward finalization
(``set_manual_backward_finalization`` / ``finalize_backward`` / ``GradientReductionHandle``),
``set_keep_unsharded_storage`` and ``MixedPrecisionPolicy.param_dtype_override_fn``.

Each is checked against one process training on the whole batch (the parity oracle)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.distributed.fsdp as tfsdp

from fullshard import GradientReductionHandle, MixedPrecisionPolicy
from fullshard.engine.compat import MP_HAS_PARAM_DTYPE_OVERRIDE
from fullshard.module import unit_state
from fullshard.testing import run_distributed
from parity import (
    GLOBAL_BATCH,
    batch,
    full_state,
    loss_fn,
    make_net,
    make_optimizer,
    reference_run,
    shard_net,
    sharded_step,
)
from torch_versions import needs_method

STEPS, MICRO = 3, 2


def _manual_step(model, opt, step: int, async_op: bool) -> float:
    """What torch 2.15's pipelining does: backward passes with sync and reshard off, then one
    finalization with both on."""
    rank, world = dist.get_rank(), dist.get_world_size()
    x, y = batch(step)
    per = GLOBAL_BATCH // world
    x, y = x[rank * per : (rank + 1) * per], y[rank * per : (rank + 1) * per]
    model.set_manual_backward_finalization(True)
    total = torch.zeros(())
    m = per // MICRO
    for i in range(MICRO):
        model.set_requires_gradient_sync(False)
        model.set_reshard_after_backward(False)
        loss = loss_fn(model(x[i * m : (i + 1) * m]), y[i * m : (i + 1) * m]) / MICRO
        loss.backward()
        total += loss.detach()
    for p in model.parameters():  # nothing reduced yet: no sharded gradient
        assert p.grad is None
    model.set_requires_gradient_sync(True)
    model.set_reshard_after_backward(True)
    if async_op:
        handle = model.finalize_backward(async_op=True)
        assert isinstance(handle, GradientReductionHandle)
        handle.wait()
    else:
        assert model.finalize_backward() is None
    model.set_manual_backward_finalization(False)
    opt.step()
    opt.zero_grad()
    dist.all_reduce(total)
    return (total / world).item()


def _worker() -> dict:
    out: dict = {}
    for async_op in (False, True):
        model = shard_net(make_net())
        model.finalize_backward()  # before the first forward: nothing to do
        opt = make_optimizer(model)
        out[f"manual_{async_op}"] = [_manual_step(model, opt, s, async_op) for s in range(STEPS)]
        out[f"manual_state_{async_op}"] = full_state(model)

    # misuse: FSDP2's errors
    model = shard_net(make_net())
    opt = make_optimizer(model)
    sharded_step(model, opt, 0)
    errors = []
    for call in (
        lambda: model.finalize_backward(),  # manual finalization is off
        lambda: model.blocks[0].finalize_backward(),  # not the root
        lambda: model.blocks[0].set_manual_backward_finalization(True),
    ):
        try:
            call()
            errors.append("")
        except RuntimeError as e:
            errors.append(str(e))
    model.set_manual_backward_finalization(True)
    x, y = batch(0)
    loss_fn(model(x), y).backward()
    try:  # the iteration is open: the mode cannot change
        model.set_manual_backward_finalization(False)
        errors.append("")
    except RuntimeError as e:
        errors.append(str(e))
    handle = model.finalize_backward(async_op=True)
    try:
        model.finalize_backward()
        errors.append("")
    except RuntimeError as e:
        errors.append(str(e))
    model.reset_iter_state()  # invalidates the handle
    try:
        handle.wait()
        errors.append("")
    except RuntimeError as e:
        errors.append(str(e))
    out["errors"] = errors

    # keep the unsharded storage: same addresses after reshard, same training
    model = shard_net(make_net())
    model.set_keep_unsharded_storage(True)
    opt = make_optimizer(model)
    ptrs = []
    losses = []
    for s in range(STEPS):
        losses.append(sharded_step(model, opt, s))
        block = model.blocks[1]
        block.unshard()
        ptrs.append(block.up.weight.data_ptr())
        block.reshard()
        ptrs.append(unit_state(block).group.unsharded_buf.untyped_storage().nbytes() > 0)
    out["keep_losses"], out["keep_ptrs"] = losses, ptrs
    return out


@needs_method("finalize_backward", "set_keep_unsharded_storage", "reset_iter_state")
def test_manual_finalization_and_keep_storage() -> None:
    ref_losses, ref_state = reference_run(STEPS)
    r = run_distributed(_worker, 2, timeout=300)[0]
    for async_op in (False, True):
        for a, b in zip(r[f"manual_{async_op}"], ref_losses):
            assert abs(a - b) / b < 1e-5, (async_op, a, b)
        for k, v in ref_state.items():
            torch.testing.assert_close(r[f"manual_state_{async_op}"][k], v, atol=1e-4, rtol=0)
    e = r["errors"]
    assert "set_manual_backward_finalization(True)" in e[0]
    assert "root" in e[1] and "root" in e[2]
    assert "cannot change" in e[3] or "after a backward started" in e[3]
    assert "waited on" in e[4]
    assert "invalidated" in e[5]
    for a, b in zip(r["keep_losses"], ref_losses):
        assert abs(a - b) / b < 1e-5
    addrs = r["keep_ptrs"][0::2]
    assert len(set(addrs)) == 1, addrs  # the same memory every time
    assert all(r["keep_ptrs"][1::2])  # kept while resharded


def test_gradient_reduction_handle_is_torchs_where_torch_has_it() -> None:
    if hasattr(tfsdp, "GradientReductionHandle"):
        assert issubclass(GradientReductionHandle, tfsdp.GradientReductionHandle)
    GradientReductionHandle(None, None).wait()  # a no-op handle


def _override_worker() -> dict:
    torch.manual_seed(0)
    from torch import nn

    from fullshard import fully_shard

    class Norm(nn.LayerNorm):  # computes in fp32 on a bf16 input, as fp32-norm recipes do
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return super().forward(x.float()).to(x.dtype)

    model = nn.Sequential(nn.Linear(8, 8), Norm(8), nn.Linear(8, 4))
    ref = [p.detach().clone() for p in model.parameters()]
    keep = {id(p) for p in model[1].parameters()}  # evaluated on the parameters as built
    mp = MixedPrecisionPolicy(
        param_dtype=torch.bfloat16,
        param_dtype_override_fn=lambda p: p.dtype if id(p) in keep else None,
    )
    fully_shard(model, mp_policy=mp)
    dtypes = {}
    handles = [
        m.register_forward_pre_hook(
            lambda mod, _a, name=name: dtypes.update({name: mod.weight.dtype})
        )
        for name, m in model.named_children()
    ]
    x = torch.randn(4, 8)
    model(x).sum().backward()
    for h in handles:
        h.remove()
    grads = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
    bad = None
    try:
        fully_shard(
            nn.Linear(2, 2),
            mp_policy=MixedPrecisionPolicy(
                param_dtype=torch.bfloat16, param_dtype_override_fn=lambda p: torch.float16
            ),
        )
    except ValueError as e:
        bad = str(e)
    return {"dtypes": dtypes, "grads": grads, "ref": ref, "bad": bad}


@pytest.mark.skipif(not MP_HAS_PARAM_DTYPE_OVERRIDE, reason="param_dtype_override_fn: torch 2.15+")
def test_param_dtype_override_fn() -> None:
    r = run_distributed(_override_worker, 2, timeout=300)[0]
    assert r["dtypes"] == {"0": torch.bfloat16, "1": torch.float32, "2": torch.bfloat16}
    assert all(g.dtype == torch.float32 for g in r["grads"].values())
    assert "param_dtype_override_fn must return None" in r["bad"]


def test_supported_range_matches_pyproject(monkeypatch: pytest.MonkeyPatch) -> None:
    import re
    from pathlib import Path

    from fullshard.engine import compat

    text = (Path(__file__).parents[1] / "pyproject.toml").read_text()
    lo, hi = compat.SUPPORTED_TORCH
    assert f'"torch>={lo[0]}.{lo[1]},<{hi[0]}.{hi[1]}"' in text
    assert compat.check_supported() is None  # the torch under test is supported
    monkeypatch.setattr(compat, "TORCH_VERSION", (hi[0], hi[1]))
    msg = compat.check_supported()
    assert msg is not None and re.search(r"torch \d+\.\d+ to \d+\.\d+", msg)
