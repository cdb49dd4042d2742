"""fullshard.rl: sleep / wake and one gather per rollout, against runs without them.

Sleep / wake: the same training run twice from the same seed, one of them sleeping and waking
between steps (with gradients present, and after ``zero_grad``); losses, parameters and the
optimizer's state must be bit-identical after more optimizer steps, and while asleep every
moved storage must hold 0 bytes on the device. Plain, CPU offload and mixed precision on 2
gloo ranks, HSDP on a 2x2 mesh of 4. One spawn per world size runs every case.

Rollout: N forwards under ``no_grad`` inside ``gathered_for_rollout`` issue one all-gather
per unit (N per unit without it) and return the plain path's outputs bit for bit.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from fullshard import CPUOffloadPolicy, MixedPrecisionPolicy, count_collectives
from fullshard.api import _all_states
from fullshard.engine.hooks import states_under
from fullshard.rl import asleep, gathered_for_rollout, is_asleep, sleep, wake
from fullshard.testing import run_distributed
from parity import GLOBAL_BATCH, batch, loss_fn, make_net, make_optimizer, shard_net

STEPS = 4
SLEEP_WITH_GRADS = 1  # sleep between backward and optimizer.step() at this step
SLEEP_AFTER_STEP = 2  # ... and after zero_grad() at this one


def _local(t: torch.Tensor) -> torch.Tensor:
    return t._local_tensor if isinstance(t, DTensor) else t


def _storages(tensors: list[torch.Tensor]) -> dict[int, torch.UntypedStorage]:
    out = {}
    for t in tensors:
        s = _local(t).untyped_storage()
        out[s._cdata] = s
    return out


def _opt_tensors(opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [v for st in opt.state.values() for v in st.values() if isinstance(v, torch.Tensor)]


def _forward_backward(model: nn.Module, step: int) -> float:
    rank, world = dist.get_rank(), dist.get_world_size()
    per = GLOBAL_BATCH // world
    x, y = batch(step)
    loss = loss_fn(model(x[rank * per : (rank + 1) * per]), y[rank * per : (rank + 1) * per])
    loss.backward()
    return loss.item()


def _asleep_checks(model: nn.Module, opt: torch.optim.Optimizer, offloaded: bool) -> list[str]:
    """What sleep must have done, as a list of failures (empty: all good)."""
    bad = []
    params = _storages(list(model.parameters()))
    state = _storages(_opt_tensors(opt))
    held = [s.nbytes() for s in (*params.values(), *state.values())]
    if offloaded and not all(held):
        bad.append("offloaded shards or optimizer state were freed")
    if not offloaded and any(held):
        bad.append(f"device storages still hold bytes while asleep: {held}")
    for what, call in (
        ("forward", lambda: model(batch(0)[0][:2])),
        ("optimizer.step", opt.step),
        ("state_dict", model.state_dict),
    ):
        try:
            call()
            bad.append(f"{what} ran while asleep")
        except RuntimeError as e:
            if "asleep" not in str(e) or "fullshard.rl.wake" not in str(e):
                bad.append(f"{what}: unclear error {e}")
    return bad


def _train(shard_kwargs: dict[str, Any], sleepy: bool) -> dict[str, Any]:
    model = shard_net(make_net(), **shard_kwargs)
    opt = make_optimizer(model)
    offloaded = isinstance(shard_kwargs.get("offload_policy"), CPUOffloadPolicy)
    losses, reports, problems, hosts = [], [], [], []
    root = states_under([model])[0]
    for step in range(STEPS):
        losses.append(_forward_backward(model, step))
        if sleepy and step == SLEEP_WITH_GRADS:
            reports.append(sleep(model, opt))
            problems += _asleep_checks(model, opt, offloaded)
            hosts.append(root.sleep_host)
            reports.append(wake(model))
        opt.step()
        opt.zero_grad()
        if sleepy and step == SLEEP_AFTER_STEP:
            with asleep(model, opt) as report:
                reports.append(report)
                problems += _asleep_checks(model, opt, offloaded)
                hosts.append(root.sleep_host)
    params = {n: _local(p).detach().clone() for n, p in model.named_parameters()}
    state = [t.detach().clone() for t in _opt_tensors(opt)]
    shard_bytes = sum(s.nbytes() for s in _storages(list(model.parameters())).values())
    opt_bytes = sum(s.nbytes() for s in _storages(_opt_tensors(opt)).values())
    if sleepy:  # a third cycle, then the buffer let go
        reports.append(sleep(model, opt))
        hosts.append(root.sleep_host)
        wake(model, keep_host=False)
        hosts.append(root.sleep_host)
    # each buffer referenced until here: a new one cannot take an old one's address
    return {
        "hosts": [None if h is None else h.data_ptr() for h in hosts],
        "losses": losses,
        "params": params,
        "state": state,
        "reports": reports,
        "problems": problems,
        "shard_bytes": shard_bytes,
        "opt_bytes": opt_bytes,
    }


def _same(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    bad = []
    if a["losses"] != b["losses"]:
        bad.append(f"losses differ: {a['losses']} vs {b['losses']}")
    for name, t in a["params"].items():
        if not torch.equal(t, b["params"][name]):
            bad.append(f"parameter {name} differs")
    if len(a["state"]) != len(b["state"]) or not all(
        torch.equal(x, y) for x, y in zip(a["state"], b["state"])
    ):
        bad.append("optimizer state differs")
    return bad


def _misuse(model: nn.Module) -> dict[str, str]:
    """Sleep refused mid-forward, mid-backward, on a non-root unit; sleep / wake twice."""
    errors: dict[str, str] = {}

    def attempt(name: str) -> None:
        try:
            sleep(model)
            errors[name] = "no error"
            wake(model)
        except (RuntimeError, ValueError) as e:
            errors[name] = str(e)

    hook = model.blocks[1].register_forward_hook(lambda *_: attempt("forward"))
    out = model(batch(0)[0][:2])
    hook.remove()
    out.register_hook(lambda g: attempt("backward"))
    out.float().sum().backward()
    try:
        sleep(model.blocks[0])
    except ValueError as e:
        errors["non_root"] = str(e)
    sleep(model)
    try:
        sleep(model)
    except RuntimeError as e:
        errors["twice"] = str(e)
    wake(model)
    try:
        wake(model)
    except RuntimeError as e:
        errors["wake_awake"] = str(e)
    errors["asleep_after"] = str(is_asleep(model))
    return errors


def _rollout(prefetch: bool) -> dict[str, Any]:
    """N no-grad forwards with and without gathered_for_rollout (same model, same inputs)."""
    model = shard_net(make_net())
    inputs = [batch(i)[0][:4, : 3 + i] for i in range(4)]  # a growing "sequence"
    with torch.no_grad(), count_collectives() as plain:
        plain_out = [model(x) for x in inputs]
    # units with parameters of their own (after lazy init: the embedding tied to the head
    # has moved to the root)
    units = [st for st in _all_states(model) if st.group.params]
    out: dict[str, Any] = {"units": len(units), "n": len(inputs), "plain": plain_out}
    out["plain_gathers"] = plain.calls("all_gather")
    saved = [st.reshard_after_forward for st in units]
    with torch.no_grad(), count_collectives() as held:
        with gathered_for_rollout(model, prefetch=prefetch):
            out["held"] = []
            for x in inputs:
                out["held"].append(model(x))
                gathered = [st.group.unsharded_bytes_allocated for st in units]
                out.setdefault("gathered_inside", gathered)
    out["held_gathers"] = held.calls("all_gather")
    out["after"] = [st.group.unsharded_bytes_allocated for st in units]
    out["restored"] = [st.reshard_after_forward for st in units] == saved
    # training afterwards is the training of a model that never rolled out
    opt = make_optimizer(model)
    out["loss_after"] = _forward_backward(model, 0)
    opt.step()
    ref = shard_net(make_net())
    out["loss_ref"] = _forward_backward(ref, 0)
    return out


def _two_ranks() -> dict[str, Any]:
    results: dict[str, Any] = {}
    cases = {
        "plain": {},
        "offload": {"offload_policy": CPUOffloadPolicy()},
        "mixed": {
            "mp_policy": MixedPrecisionPolicy(
                param_dtype=torch.bfloat16, reduce_dtype=torch.float32
            )
        },
    }
    for name, kwargs in cases.items():
        ref, slept = _train(kwargs, False), _train(kwargs, True)
        results[name] = {"diff": _same(ref, slept), **slept}
    results["misuse"] = _misuse(shard_net(make_net()))
    results["rollout"] = _rollout(prefetch=False)
    results["rollout_prefetch"] = _rollout(prefetch=True)
    return results


def _hsdp() -> dict[str, Any]:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    ref, slept = _train({"mesh": mesh}, False), _train({"mesh": mesh}, True)
    return {"hsdp": {"diff": _same(ref, slept), **slept}}


@pytest.fixture(scope="module")
def two() -> dict[str, Any]:
    return run_distributed(_two_ranks, 2, timeout=600)[0]


@pytest.mark.parametrize("case", ["plain", "offload", "mixed"])
def test_sleep_wake_is_bit_exact(two: dict[str, Any], case: str) -> None:
    _check_case(two[case], offloaded=case == "offload")


def test_sleep_wake_hsdp_2x2() -> None:
    (result,) = run_distributed(_hsdp, 4, timeout=600)[:1]
    _check_case(result["hsdp"], offloaded=False)


def _check_case(r: dict[str, Any], offloaded: bool) -> None:
    assert not r["diff"], r["diff"]
    assert not r["problems"], r["problems"]
    with_grads, woke, after_step = r["reports"][0], r["reports"][1], r["reports"][2]
    assert with_grads.action == "sleep" and woke.action == "wake"
    if offloaded:  # shards, gradients and optimizer state already live in host memory
        assert with_grads.moved["params"] == 0 and with_grads.moved["optimizer"] == 0
        assert with_grads.on_host["params"] == r["shard_bytes"]
        assert with_grads.on_host["optimizer"] == r["opt_bytes"]
        assert with_grads.on_host["grads"] > 0
    else:
        assert with_grads.moved["params"] == r["shard_bytes"]
        assert with_grads.moved["optimizer"] == r["opt_bytes"]
        assert with_grads.moved["grads"] > 0  # sleeping between backward and step
        assert after_step.moved["grads"] == 0  # after zero_grad: none
        assert with_grads.device_bytes_before == with_grads.moved_bytes
        assert with_grads.device_bytes_after == 0
        assert woke.device_bytes_after == with_grads.moved_bytes
    assert "moved" in str(with_grads)
    # one host buffer per model: the first sleep (with gradients, the largest) allocates it,
    # the later ones reuse it; wake(keep_host=False) lets it go
    first, second, third, released = r["hosts"]
    assert first == second == third and released is None, r["hosts"]
    assert [rep.host_reused for rep in r["reports"] if rep.action == "sleep"] == [
        False,
        True,
        True,
    ]


def test_sleep_refused_mid_step_and_misuse(two: dict[str, Any]) -> None:
    e = two["misuse"]
    assert "in the middle of a forward or backward" in e["forward"], e["forward"]
    assert "during a backward" in e["backward"], e["backward"]
    assert "inside a larger fully_shard root" in e["non_root"]
    assert "already asleep" in e["twice"]
    assert "is not asleep" in e["wake_awake"]
    assert e["asleep_after"] == "False"


@pytest.mark.parametrize("key", ["rollout", "rollout_prefetch"])
def test_one_gather_per_rollout(two: dict[str, Any], key: str) -> None:
    r = two[key]
    assert r["plain_gathers"] == r["n"] * r["units"]
    assert r["held_gathers"] == r["units"]
    for a, b in zip(r["plain"], r["held"]):
        assert torch.equal(a, b)
    assert all(r["gathered_inside"]), r["gathered_inside"]
    assert r["after"] == [0] * r["units"]
    assert r["restored"]
    assert r["loss_after"] == r["loss_ref"]
