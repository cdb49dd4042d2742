"""Core engine: parity with single-process training, collective counts, memory, clear errors."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Shard

from fullshard import CommPolicy, FSDPModule, MixedPrecisionPolicy, count_collectives, fully_shard
from fullshard.api import _all_states
from fullshard.engine.backend import CPU_CHOICES
from fullshard.engine.compat import STORAGE_SWAP
from fullshard.engine.events import record_events
from fullshard.testing import run_distributed
from parity import (
    Net,
    batch,
    freeze_mixed,
    full_state,
    loss_fn,
    make_net,
    make_optimizer,
    reference_run,
    reused_gathers,
    shard_net,
    sharded_step,
)

STEPS = 5

# (name, model kwargs, fully_shard kwargs, micro-batches, world sizes it runs on)
CASES = [
    ("default", {}, {}, 1, (1, 2, 3, 4)),
    ("raf_false", {}, {"reshard_after_forward": False}, 1, (2, 3)),
    ("raf_true_accum2", {}, {"reshard_after_forward": True}, 2, (1, 2, 3)),
    ("raf_2", {}, {"reshard_after_forward": 2}, 1, (4,)),
    ("raf_2_accum2", {}, {"reshard_after_forward": 2}, 2, (4,)),
    ("ckpt_reuse", {"ckpt": True, "reuse": True}, {}, 1, (1, 2, 4)),
    # requires_grad mixed within and across units, set after fully_shard
    ("mixed_frozen", {"mixed": True}, {}, 1, (2, 4)),
    ("mixed_frozen_accum2", {"mixed": True}, {}, 2, (2, 3)),
]


TRANSPORTS = ("auto", "packed", "p2p", "core")


def _transports(world: int) -> tuple[str, ...]:
    """World 1 communicates nothing (one transport, and the core); for this model's tiny
    units ``auto`` picks ``packed`` (checked on 2 ranks), so 3 and 4 ranks run the two real
    ones. ``core``: packed with every CPU special case off, so the root has no host strategy
    and runs the core alone, FSDP2's path ([Note: the host strategy] in fullshard.engine.host)."""
    return {1: ("auto", "core"), 2: TRANSPORTS}.get(world, ("packed", "p2p", "core"))


def _policy(transport: str) -> CommPolicy:
    if transport == "core":
        return CommPolicy(transport="packed", cpu_fast_paths_off=CPU_CHOICES)
    return CommPolicy(transport=transport)


def _run_cases() -> dict[tuple[str, str], tuple[list[float], dict[str, torch.Tensor], list]]:
    """Every case x every transport (one spawn per world size)."""
    world = dist.get_world_size()
    results = {}
    for transport in _transports(world):
        policy = _policy(transport)
        for name, model_kwargs, shard_kwargs, micro, worlds in CASES:
            if world not in worlds:
                continue
            kwargs = dict(model_kwargs)
            mixed = kwargs.pop("mixed", False)
            model = shard_net(make_net(**kwargs), comm_policy=policy, **shard_kwargs)
            if mixed:  # frozen through the sharded parameters, after fully_shard
                freeze_mixed(model)
            opt = make_optimizer(model)
            losses, counts, leftover, algos, paths = [], [], [], set(), set()
            reuses = []
            for step in range(STEPS):
                with count_collectives() as stats, record_events() as log:
                    losses.append(sharded_step(model, opt, step, micro_batches=micro))
                # A gather that took back its unit's pooled memory ([Note: taking back a
                # unit's own gathered memory]) stands for the all-gather theory counts.
                reused = reused_gathers(log)
                reuses.append(reused)
                counts.append(
                    [(r.kind, r.group_size) for r in stats.records if r.group_size > 0]
                    + [("all_gather", world)] * reused
                )
                algos |= {(r.kind, r.group_size, r.algorithm) for r in stats.records}
                paths |= {
                    (e.kind, e.detail)
                    for e in log
                    if e.kind.endswith("_issue") and e.detail != "reused"
                }
                leftover.append(
                    sum(st.group.unsharded_bytes_allocated for st in _all_states(model))
                )
            results[(name, transport)] = (
                losses,
                full_state(model),
                [
                    counts,
                    leftover,
                    algos,
                    paths,
                    reuses,
                    _all_states(model)[0].ctx.host is not None,
                ],
            )
    return results


def _expected_paths(name: str, transport: str, world: int) -> set[tuple[str, str]]:
    """Which way each unit gathered/reduced (fullshard.engine.transport), as the event log shows.

    The parity model's units are far below ``P2P_MIN_BYTES``, so ``auto`` packs them; on one
    rank every unit is ``local`` (its unsharded parameters alias the shards)."""
    if world == 1:
        return {("gather_issue", "local"), ("reduce_issue", "local")}
    if transport in ("packed", "auto", "core"):
        return {("gather_issue", "packed"), ("reduce_issue", "packed")}
    paths = {("gather_issue", "pieces"), ("reduce_issue", "pieces")}
    if name.startswith("raf_2"):  # backward regathers the kept copy: always packed
        paths.add(("gather_issue", "packed"))
    return paths


@pytest.fixture(scope="module")
def references() -> dict[str, tuple[list[float], dict[str, torch.Tensor]]]:
    out = {}
    for name, model_kwargs, _, _, _ in CASES:
        out[name] = reference_run(STEPS, **model_kwargs)
    return out


def _expected_counts(name: str, world: int, micro: int) -> list[tuple[str, int]]:
    """ZeRO-3 theory for the parity model (per optimizer step, in issue order)."""
    # Units with parameters: root (owns the tied embedding/head, norm), 3 blocks. The embed
    # unit lost its only parameter to the root (tied across units) and communicates nothing.
    units = 4
    raf = {"raf_false": False, "raf_2": 2, "raf_2_accum2": 2}.get(name, True)
    if name in ("default", "ckpt_reuse") or name.startswith("mixed_frozen"):
        raf = None
    if world == 1:
        return []
    reuse = name == "ckpt_reuse"
    per_micro_fwd = units + (1 if reuse else 0)  # the reused block is gathered again
    if raf is None:
        bwd = [("all_gather", world)] * (units - 1)  # blocks regather, root keeps its params
    elif raf is True:
        bwd = [("all_gather", world)] * units
    elif raf is False:
        bwd = []
    else:
        bwd = [("all_gather", raf)] * units
    # reduce-scatters: units with gradients = root + 3 blocks (frozen params inside a block
    # are simply not in the packed gradient buffer).
    rs = [("reduce_scatter", world)] * units
    calls = []
    for i in range(micro):
        calls += [("all_gather", world)] * per_micro_fwd + bwd
        if i == micro - 1:
            calls += rs
    return calls


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_parity_and_counts(world: int, references) -> None:
    results = run_distributed(_run_cases, world, timeout=900)
    ours = results[0]
    expected_keys = {(c[0], t) for c in CASES if world in c[4] for t in _transports(world)}
    assert set(ours) == expected_keys
    for (name, transport), (losses, state, extra) in ours.items():
        counts, leftover, algos, paths, reuses, has_host = extra
        case = f"{name} transport={transport} world={world}"
        ref_losses, ref_state = references[name]
        for step, (a, b) in enumerate(zip(losses, ref_losses)):
            assert abs(a - b) / abs(b) < 1e-5, f"{case} step {step}: {a} vs {b}"
        assert state.keys() == ref_state.keys()
        for k in ref_state:
            torch.testing.assert_close(state[k], ref_state[k], atol=1e-4, rtol=0, msg=f"{case} {k}")
        micro = next(c[3] for c in CASES if c[0] == name)
        expected = _expected_counts(name, world, micro)
        for step_counts in counts:
            assert sorted(step_counts) == sorted(expected), case
        # the last block (and, resharded after forward, the root) regather in backward from
        # their own pooled memory; an int reshard_after_forward keeps a copy instead
        assert has_host == (transport != "core"), f"{case}: host strategy {has_host}"
        core = transport == "core"
        if STORAGE_SWAP and world > 1 and not core and not name.startswith(("raf_false", "raf_2")):
            assert all(r >= micro for r in reuses), f"{case}: reused gathers {reuses}"
        else:
            assert reuses == [0] * STEPS, f"{case}: reused gathers {reuses}"
        assert leftover == [0] * STEPS, f"{case}: gathered storage left after a step {leftover}"
        assert paths == _expected_paths(name, transport, world), f"{case}: {sorted(paths)}"
        # gloo: pieces are p2p exchanges; packed buffers this small are one p2p message per
        # peer on 2-rank groups (backend.P2P_SMALL_BYTES), and on larger groups gloo's
        # all-gather and the in-place all-reduce (backend.P2P_MIN_BYTES)
        for kind, size, algo in algos:
            small = "p2p" if size == 2 else "all_gather" if kind == "all_gather" else "all_reduce"
            pieces = transport == "p2p" and not (name.startswith("raf_2") and size == 2)
            want = {"p2p"} if pieces else {small}
            if core:  # no p2p collectives: gloo's own, as FSDP2 issues them
                want = {kind}
            if transport == "p2p" and name.startswith("raf_2") and kind == "all_gather":
                want = {"p2p", small}  # forward in pieces, backward from the packed kept copy
            assert algo in want, f"{case}: {kind}/{size} ran {algo}"
    # every rank computed the same global losses
    for other in results[1:]:
        for key in ours:
            assert other[key][0] == ours[key][0]


def _api_and_errors() -> dict[str, str]:
    rank, world = dist.get_rank(), dist.get_world_size()
    out: dict[str, str] = {}
    model = shard_net(make_net())
    assert isinstance(model, FSDPModule) and isinstance(model.blocks[0], FSDPModule)
    params = dict(model.named_parameters())
    assert all(isinstance(p, DTensor) and p.placements == (Shard(0),) for p in params.values())
    assert params["embed.weight"].shape == (13, 10)
    assert "head.weight" not in params  # tied: one parameter
    assert model.head.weight is model.embed.weight

    # fully_shard applied twice
    with pytest.raises(ValueError, match="already applied") as e:
        fully_shard(model.blocks[0])
    out["twice"] = str(e.value)

    # top-down: root first, then a block
    top = make_net()
    fully_shard(top)
    with pytest.raises(ValueError, match="bottom-up") as e:
        fully_shard(top.blocks[0])
    out["top_down"] = str(e.value)

    # a mesh this rank is not part of (a smaller mesh is a sub-mesh: see test_composition)
    if world > 1:
        from torch.distributed.device_mesh import DeviceMesh

        bad = DeviceMesh("cpu", list(range(world - 1)))  # every rank builds it
        if rank == world - 1:
            with pytest.raises(ValueError, match="not in the mesh") as e:
                fully_shard(make_net().blocks[0], mesh=bad)
            out["mesh"] = str(e.value)

    # meta init: forward before materialising names the parameters; after, it trains
    with torch.device("meta"):
        meta = Net()
    shard_net(meta)
    x, y = batch(0)
    with pytest.raises(RuntimeError, match="meta device") as e:
        meta(x)
    out["meta"] = str(e.value)
    meta.to_empty(device="cpu")
    for m in meta.modules():
        if hasattr(m, "reset_parameters") and m is not meta:
            m.reset_parameters()
    for (
        b
    ) in meta.blocks:  # a bare Parameter no reset_parameters covers (else: whatever memory held)
        nn.init.zeros_(b.small)
    local = meta.blocks[0].up.weight.to_local()
    rows = -(-7 // world)  # torch.chunk: ceil(7 / world) rows per rank, the tail gets the rest
    assert local.shape == (max(0, min(rows, 7 - rank * rows)), 10)  # only its shard exists
    loss = loss_fn(meta(x), y)
    loss.backward()
    assert torch.isfinite(loss)

    # state_dict holds DTensors and round-trips through load_state_dict and DCP
    sd = model.state_dict()
    assert isinstance(sd["blocks.0.up.weight"], DTensor)
    fresh = shard_net(make_net(seed=1))
    fresh.load_state_dict(sd)
    torch.testing.assert_close(full_state(fresh), full_state(model))

    # explicit unshard / reshard
    model.blocks[1].unshard()
    assert not isinstance(model.blocks[1].up.weight, DTensor)
    assert model.blocks[1].up.weight.shape == (7, 10)
    model.blocks[1].reshard()
    assert isinstance(model.blocks[1].up.weight, DTensor)
    handle = model.blocks[1].unshard(async_op=True)
    handle.wait()
    model.blocks[1].reshard()
    return out


def test_api_and_errors() -> None:
    results = run_distributed(_api_and_errors, 2, timeout=300)
    msgs = results[0]
    assert "Block" in msgs["twice"]
    assert "bottom-up" in msgs["top_down"] and "'small' of Block" in msgs["top_down"]
    assert "rank 1 is not in the mesh [0]" in results[1]["mesh"]
    # FSDP2's message, naming the first unit's (the root's) parameters still on meta
    assert "['norm.weight', 'norm.bias']" in msgs["meta"] and "to_empty" in msgs["meta"]


def _local_transport() -> dict[str, object]:
    """One rank: the ``local`` transport ([Note: a shard group of one rank] in group.py)."""
    out: dict[str, object] = {}
    x, y = batch(0)
    model = shard_net(make_net())
    model.set_gradient_divide_factor(4.0)
    for _ in range(2):  # the second backward accumulates into the sharded gradients
        loss_fn(model(x), y).backward()
    ref = make_net()
    loss_fn(ref(x), y).backward()
    ref_grads = {k: 2 * p.grad / 4.0 for k, p in ref.named_parameters() if p.grad is not None}
    grads = {k: p.grad.full_tensor() for k, p in model.named_parameters() if p.grad is not None}
    out["grads_match"] = grads.keys() == ref_grads.keys() and all(
        torch.allclose(grads[k], ref_grads[k], atol=1e-6) for k in grads
    )
    units = [st.group for st in _all_states(model) if st.group.layout]
    out["transports"] = sorted({g.transport.name for g in units})
    out["aliased"] = all(
        sp.unsharded_param is not None and sp.unsharded_param.data_ptr() == sp.local.data_ptr()
        for g in units
        for sp in g.layout
    )
    out["dtensors"] = all(isinstance(p, DTensor) for p in model.parameters())
    # Shards replaced after lazy init (to_empty) are re-aliased: the model computes with the
    # loaded values, not the old storage.
    model.zero_grad()
    model.to_empty(device="cpu")
    model.load_state_dict(shard_net(make_net(seed=1)).state_dict())
    with torch.no_grad():
        out["realiased"] = torch.allclose(loss_fn(model(x), y), loss_fn(make_net(seed=1)(x), y))
    # A compute dtype other than the shards' needs a copy: the packed transport again.
    bf16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    mp = shard_net(make_net(), mp_policy=bf16)
    loss_fn(mp(x), y).backward()
    out["mp_transports"] = sorted({st.group.transport.name for st in _all_states(mp)})
    return out


def test_local_transport_on_one_rank() -> None:
    (out,) = run_distributed(_local_transport, 1, timeout=300)
    assert out["transports"] == ["local"] and out["aliased"] and out["dtensors"], out
    assert out["grads_match"], "gradients on one rank: the local tensors, accumulated, divided"
    assert out["realiased"], "a shard replaced after lazy init was not re-aliased"
    assert out["mp_transports"] == ["packed"], out


def _dcp_roundtrip(path: str) -> bool:
    import torch.distributed.checkpoint as dcp

    model = shard_net(make_net())
    opt = make_optimizer(model)
    sharded_step(model, opt, 0)
    dcp.save(model.state_dict(), checkpoint_id=path)
    fresh = shard_net(make_net(seed=3))
    sd = fresh.state_dict()
    dcp.load(sd, checkpoint_id=path)
    fresh.load_state_dict(sd)
    a, b = full_state(model), full_state(fresh)
    return all(torch.equal(a[k], b[k]) for k in a)


def test_torch_distributed_checkpoint_works(tmp_path) -> None:
    assert all(run_distributed(_dcp_roundtrip, 2, str(tmp_path / "dcp"), timeout=300))


def test_zero_dim_parameter_is_a_clear_error() -> None:
    import fullshard.engine.param as P
    from fullshard.engine.mesh import MeshInfo

    with pytest.raises(ValueError, match="0-dimensional") as e:
        P.ShardedParam(
            torch.nn.Parameter(torch.tensor(1.0)),
            "scale",
            MeshInfo.__new__(MeshInfo),
            torch.device("cpu"),
        )
    assert "scale" in str(e.value)
