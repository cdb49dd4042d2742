"""FSDPModule knobs and edge inputs: ignored params, non-contiguous params, explicit prefetch,
register_fsdp_forward_method, reshard_after_backward, and bad input with clear errors."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from fullshard import (
    MixedPrecisionPolicy,
    count_collectives,
    fully_shard,
    register_fsdp_forward_method,
)
from fullshard.engine.compat import STORAGE_SWAP
from fullshard.engine.events import record_events
from fullshard.testing import run_distributed
from parity import (
    batch,
    full_state,
    make_net,
    make_optimizer,
    reference_run,
    reused_gathers,
    shard_net,
    sharded_step,
)


class _TwoLinear(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(6, 5)
        self.b = nn.Linear(5, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(x))

    def score(self, x: torch.Tensor) -> torch.Tensor:
        return self.forward(x).sum(-1)


def _knobs() -> dict:
    out: dict = {}
    world = dist.get_world_size()

    # explicit prefetch + reshard_after_backward=False during accumulation: same training
    model = shard_net(make_net())
    blocks = list(model.blocks)
    for i, b in enumerate(blocks[:-1]):
        b.set_modules_to_forward_prefetch([blocks[i + 1]])
    for i, b in enumerate(blocks[1:], start=1):
        b.set_modules_to_backward_prefetch([blocks[i - 1]])
    opt = make_optimizer(model)
    out["prefetch_losses"] = [sharded_step(model, opt, s) for s in range(3)]

    model = shard_net(make_net())
    model.set_reshard_after_backward(False)
    opt = make_optimizer(model)
    losses = []
    for s in range(3):
        with count_collectives() as stats, record_events() as log:
            losses.append(sharded_step(model, opt, s, micro_batches=2))
        model.reshard()
        for b in model.blocks:
            b.reshard()
        model.embed.reshard()
        gathers = (stats.calls("all_gather"), reused_gathers(log))
        out.setdefault("rab_gathers", []).append(gathers)
    out["rab_losses"] = losses
    out["rab_state"] = full_state(model)

    # implicit prefetch: while block i computes (forward) the all-gather of block i+1 is in
    # flight, and while block i computes its backward, block i-1's is
    from fullshard.module import unit_state as _state

    model = shard_net(make_net())
    opt = make_optimizer(model)
    in_flight: list[tuple[str, bool]] = []

    def probe(i: int, phase: str):
        def hook(*_args):
            nxt = i + 1 if phase == "fwd" else i - 1
            group = _state(model.blocks[nxt]).group
            in_flight.append((f"{phase}{i}", group._gather is not None))

        return hook

    model.blocks[0].up.register_forward_hook(probe(0, "fwd"))
    model.blocks[1].up.register_forward_hook(probe(1, "fwd"))
    model.blocks[2].up.register_full_backward_hook(probe(2, "bwd"))
    model.blocks[1].up.register_full_backward_hook(probe(1, "bwd"))
    for step in range(2):
        in_flight.clear()
        sharded_step(model, opt, step)
    out["prefetch_in_flight"] = sorted(in_flight)

    # ignored parameters stay plain, local and uncommunicated
    net = _TwoLinear()
    fully_shard(net, ignored_params={net.b.weight})
    assert isinstance(net.a.weight, DTensor) and not isinstance(net.b.weight, DTensor)
    with count_collectives() as stats:
        net(torch.randn(3, 6)).sum().backward()
    out["ignored_grad"] = net.b.weight.grad is not None
    sharded_numel = net.a.weight.numel() + net.a.bias.numel() + net.b.bias.numel()
    out["ignored_bytes"] = (stats.bytes("all_gather"), sharded_numel)

    # a non-contiguous parameter (a transposed view) shards and gathers correctly
    torch.manual_seed(0)
    lin = nn.Linear(6, 4)
    base = torch.randn(6, 4)
    lin.weight = nn.Parameter(base.t())  # [4, 6], non-contiguous
    expected = lin(torch.ones(2, 6)).detach()
    fully_shard(lin)
    got = lin(torch.ones(2, 6)).detach()
    out["noncontig"] = torch.allclose(got, expected)

    # register_fsdp_forward_method: a method other than forward gathers parameters
    net = _TwoLinear()
    torch.manual_seed(1)
    x = torch.randn(3, 6)
    want = net.score(x).detach()
    fully_shard(net)
    register_fsdp_forward_method(net, "score")
    out["method"] = torch.allclose(net.score(x).detach(), want)

    # bad input
    errors = {}
    with pytest.raises(TypeError, match=r"nn\.Module") as e:
        fully_shard("not a module")  # type: ignore[arg-type]
    errors["non_module"] = str(e.value)
    mixed = _TwoLinear()
    mixed.b.to(torch.float64)
    fully_shard(mixed)
    with pytest.raises(ValueError, match="trainable parameters of several dtypes") as e:
        mixed(torch.randn(2, 6))
    errors["dtypes"] = str(e.value)
    with pytest.raises(ValueError, match="reshard_after_forward") as e:
        fully_shard(_TwoLinear(), reshard_after_forward=world + 1 if world > 1 else 0)
    errors["raf"] = str(e.value)
    with pytest.raises(TypeError, match="mp_policy") as e:
        fully_shard(_TwoLinear(), mp_policy=torch.bfloat16)  # type: ignore[arg-type]
    errors["mp"] = str(e.value)
    half = _TwoLinear()
    half.b.to_empty(device="meta")  # one part materialised, the other not: two devices
    with pytest.raises(ValueError, match="different devices") as e:
        fully_shard(half)
    errors["devices"] = str(e.value)
    # a unit whose dtypes differ is fine once a param_dtype unifies the gathered buffer
    ok = _TwoLinear()
    ok.b.to(torch.float64)
    fully_shard(ok, mp_policy=MixedPrecisionPolicy(param_dtype=torch.float32))
    ok(torch.randn(2, 6)).sum().backward()
    out["errors"] = errors
    return out


def test_knobs_and_bad_input() -> None:
    ref_losses, ref_state = reference_run(3)
    r = run_distributed(_knobs, 2, timeout=300)[0]
    for a, b in zip(r["prefetch_losses"], ref_losses):
        assert abs(a - b) / b < 1e-5
    for a, b in zip(r["rab_losses"], ref_losses):
        assert abs(a - b) / b < 1e-5
    for k in ref_state:
        torch.testing.assert_close(r["rab_state"][k], ref_state[k], atol=1e-4, rtol=0)
    # kept unsharded after the first micro-batch's backward, so the second micro-batch's
    # forward gathers nothing; its backward regathers the 3 blocks (resharded after forward):
    # (4 + 3) + (0 + 3) instead of 2 x (4 + 3)
    # (all-gathers + gathers that took back their unit's pooled memory instead)
    # (no pool before torch 2.12: every gather is an all-gather)
    assert all(sum(g) == 10 and (g[1] > 0) == STORAGE_SWAP for g in r["rab_gathers"])
    # second step (the first records the order): every probe saw the neighbour's gather live
    assert r["prefetch_in_flight"] == [
        ("bwd1", True),
        ("bwd2", True),
        ("fwd0", True),
        ("fwd1", True),
    ], r["prefetch_in_flight"]
    assert r["ignored_grad"]
    ag_bytes, sharded_numel = r["ignored_bytes"]
    # one forward gather of a.weight [5->6 rows padded, 6], a.bias [5->6], b.bias [4] in fp32:
    # (36 + 6 + 4) * 4 bytes; b.weight (ignored) never travels; root keeps params for backward
    assert sharded_numel == 39 and ag_bytes == (36 + 6 + 4) * 4, ag_bytes
    assert r["noncontig"] and r["method"]
    e = r["errors"]
    assert "str" in e["non_module"]
    assert "b.weight: torch.float64" in e["dtypes"] and "param_dtype" in e["dtypes"]
    assert "reshard_after_forward" in e["raf"]
    assert "MixedPrecisionPolicy" in e["mp"]
    assert "a.weight: cpu" in e["devices"] and "b.weight: meta" in e["devices"]


def test_batch_helper_is_deterministic() -> None:
    a, b = batch(3), batch(3)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert isinstance(make_net().blocks[0], nn.Module)
