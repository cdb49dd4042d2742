"""GPU checks (NCCL, CUDA, bf16, offload). Skipped without CUDA; run on a GPU machine with
``python -m pytest -q tests/test_gpu.py``. One GPU suffices: NCCL at world size 1."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from fullshard import CPUOffloadPolicy, MixedPrecisionPolicy
from fullshard.testing import free_port
from parity import batch, full_state, loss_fn, make_net, make_optimizer, shard_net

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def nccl():
    import os

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _train(model, steps=3):
    opt = make_optimizer(model)
    losses = []
    for step in range(steps):
        x, y = (t.cuda() for t in batch(step))
        loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def test_nccl_parity_bf16_and_offload(nccl) -> None:
    ref = make_net().cuda()
    ref_losses = _train(ref)
    ours = shard_net(make_net().cuda())
    assert next(ours.parameters()).device.type == "cuda"
    assert _train(ours) == pytest.approx(ref_losses, rel=1e-5)
    a, b = full_state(ours), {k: v for k, v in ref.state_dict().items()}
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=1e-4, rtol=0)

    bf16 = shard_net(make_net().cuda(), mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16))
    assert _train(bf16) == pytest.approx(ref_losses, rel=3e-2)

    off = shard_net(make_net(), offload_policy=CPUOffloadPolicy(pin_memory=True))
    assert {p.to_local().device.type for p in off.parameters()} == {"cpu"}
    assert _train(off) == pytest.approx(ref_losses, rel=1e-5)
