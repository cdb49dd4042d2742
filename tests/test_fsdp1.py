"""fullshard's ``FullyShardedDataParallel`` (FSDP1's API) against torch's FSDP1 doing the same:
training under every strategy and precision, gradient accumulation, offload, clipping, state
dicts and optimizer state dicts (the wrapper's other API: ``tests/test_fsdp1_api.py``).

Each distributed test runs torch's FSDP1 and fullshard's wrapper on the same model, data and
arguments in one spawn (gloo, CPU) and compares losses, gradients, state dicts and optimizer
state. torch's FSDP1 runs on CPU/gloo with ``device_id=torch.device("cpu")``; where one of its
paths does not (noted per test), the reference is a single process instead.
"""

from __future__ import annotations

import inspect
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.fsdp as tfsdp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import (
    CPUOffload,
    FullOptimStateDictConfig,
    FullStateDictConfig,
    MixedPrecision,
    OptimStateKeyType,
    ShardingStrategy,
    StateDictType,
)

import fullshard
from fsdp1_cases import (
    BF16,
    ENGINES,
    full_grads,
    full_state,
    local_shard,
    make_net,
    max_diff,
    train,
    wrap,
)
from fullshard.api import _all_states
from fullshard.fsdp1 import FullyShardedDataParallel as OurFSDP
from fullshard.testing import run_distributed

S = ShardingStrategy
# the buffer stays fp32, so the root's activations are fp32 and each block casts its inputs
BF16_CAST = MixedPrecision(param_dtype=torch.bfloat16, cast_forward_inputs=True)
FP16_REDUCE = MixedPrecision(reduce_dtype=torch.float16)


# ------------------------------------------------------------------------------ identity
def test_every_fsdp1_method_and_property_is_overridden() -> None:
    """None of torch's FSDP1 methods is inherited (each would run torch's FSDP1 code), and the
    public ones are called as FSDP1's are (same parameter names, kinds and defaults)."""
    torch_cls = tfsdp.FullyShardedDataParallel
    assert issubclass(OurFSDP, torch_cls)
    assert fullshard.FSDP is fullshard.FullyShardedDataParallel is OurFSDP
    names = {n for n, v in vars(torch_cls).items() if n not in ("__module__", "__doc__")}
    assert {"__init__", "forward", "state_dict_type", "module", "_flat_param"} <= names
    inherited = sorted(
        n for n in names if next(c for c in OurFSDP.__mro__ if n in vars(c)) is torch_cls
    )
    assert not inherited, f"torch's FSDP1 code would run for {inherited}"
    for name in sorted(n for n in names if not n.startswith("_") or n == "__init__"):
        theirs = getattr(torch_cls, name)
        if isinstance(theirs, property):
            continue
        shape = [
            [(p.name, p.kind, p.default) for p in inspect.signature(f).parameters.values()]
            for f in (getattr(OurFSDP, name), theirs)
        ]
        assert shape[0] == shape[1], (name, *shape)


# ------------------------------------------------------------------------------ training
# (label, strategy, extra): ``mesh`` a device_mesh shape; ``reference``: the strategy torch's
# FSDP1 runs instead. A hybrid strategy whose shard groups have one rank is NO_SHARD's layout,
# but torch's FSDP1 then switches to NO_SHARD over the one-rank group and never averages
# gradients across the replicas (the replicas drift apart); fullshard averages them, so
# those cases are compared with torch's NO_SHARD.
STRATEGIES_2 = [
    ("FULL_SHARD", S.FULL_SHARD, {}),
    ("SHARD_GRAD_OP", S.SHARD_GRAD_OP, {}),
    ("NO_SHARD", S.NO_SHARD, {}),
    ("HYBRID_SHARD(1x2)", S.HYBRID_SHARD, {"mesh": (1, 2)}),
    ("_HYBRID_SHARD_ZERO2(1x2)", S._HYBRID_SHARD_ZERO2, {"mesh": (1, 2)}),
    ("HYBRID_SHARD(default: 2x1 on CPU)", S.HYBRID_SHARD, {"reference": S.NO_SHARD}),
    ("_HYBRID_SHARD_ZERO2(2x1)", S._HYBRID_SHARD_ZERO2, {"mesh": (2, 1), "reference": S.NO_SHARD}),
]


def _kwargs(strategy: ShardingStrategy, extra: dict[str, Any], engine: str) -> dict[str, Any]:
    if engine == "torch" and "reference" in extra:
        return {"sharding_strategy": extra["reference"]}
    kw: dict[str, Any] = {"sharding_strategy": strategy}
    if "mesh" in extra:
        kw["device_mesh"] = init_device_mesh("cpu", extra["mesh"])
    elif "groups" in extra:
        kw["process_group"] = _hybrid_groups(*extra["groups"])
    return kw


def _hybrid_groups(replicas: int, shard: int) -> tuple[dist.ProcessGroup, dist.ProcessGroup]:
    """FSDP1's ``(intra_node_group, inter_node_group)`` of this rank (rows of ``shard``)."""
    rank = dist.get_rank()
    intra = inter = None
    for r in range(replicas):
        g = dist.new_group(list(range(r * shard, (r + 1) * shard)))
        intra = g if rank // shard == r else intra
    for s in range(shard):
        g = dist.new_group(list(range(s, replicas * shard, shard)))
        inter = g if rank % shard == s else inter
    assert intra is not None and inter is not None
    return intra, inter


def _run_both(
    strategy: ShardingStrategy, extra: dict[str, Any], steps: int = 3, **kwargs: Any
) -> dict[str, Any]:
    """Train under both engines; per engine: losses, gradients after the first backward,
    the final full state dict and the parameter names."""
    out: dict[str, Any] = {}
    for engine in ENGINES:
        model = wrap(engine, **_kwargs(strategy, extra, engine), **kwargs)
        grads: dict[str, torch.Tensor] = {}

        def keep(m: torch.nn.Module, grads: dict[str, torch.Tensor] = grads) -> None:
            if not grads:
                grads.update(full_grads(m))

        losses, _ = train(model, steps, after_backward=keep)
        names = [n for n, _ in model.named_parameters()]
        out[engine] = (losses, grads, full_state(model), names)
    return out


def _strategy_cases(
    world: int, cases: list[tuple[str, ShardingStrategy, dict[str, Any]]]
) -> dict[str, Any]:
    assert dist.get_world_size() == world
    results: dict[str, Any] = {}
    for label, strategy, extra in cases:
        precisions = (
            ("fp32", None),
            ("bf16", BF16),
            ("fp16-reduce", FP16_REDUCE),
            ("bf16-cast-inputs", BF16_CAST),
        )
        for mp_label, mp in precisions:
            if mp in (FP16_REDUCE, BF16_CAST) and strategy is not S.FULL_SHARD:
                continue
            results[f"{label}/{mp_label}"] = _run_both(strategy, extra, mixed_precision=mp)
    return results


def _check_parity(results: dict[str, Any], weight_tol: float = 1e-3) -> None:
    """The two agree to the bit on 2 ranks. Low precision leaves room for other orders of
    summation, not for computing in another dtype (~1e-2 here); on 4 ranks torch's FSDP1
    divides low-precision gradients by 2 before the reduction and by 2 after, fullshard by 4
    after, and Adam turns that rounding in tiny gradients into ``weight_tol`` of weight."""
    for case, both in results.items():
        (l_t, g_t, sd_t, n_t), (l_o, g_o, sd_o, n_o) = both["torch"], both["fullshard"]
        exact = case.endswith("fp32")
        tol = 1e-5 if exact else 1e-3
        assert n_t == n_o, case  # _fsdp_wrapped_module. prefixes where FSDP1 has them
        assert list(sd_t) == list(sd_o), case  # FSDP1's state-dict keys, in its order
        for a, b in zip(l_t, l_o):
            assert abs(a - b) <= tol * abs(a), (case, l_t, l_o)
        assert max_diff(g_t, g_o) <= tol, case
        assert max_diff(sd_t, sd_o) <= (tol if exact else weight_tol), case
        dtypes = {k: (sd_t[k].dtype, sd_o[k].dtype) for k in sd_t}
        assert all(a == b for a, b in dtypes.values()), (case, dtypes)


def test_training_parity_every_strategy_2_ranks() -> None:
    """Every sharding strategy, in fp32, bf16 (params, buffers), with an fp16 reduction and
    with every unit casting its inputs (``cast_forward_inputs``):
    the same losses, first-step gradients, final weights, parameter names and state-dict
    keys as torch's FSDP1."""
    _check_parity(run_distributed(_strategy_cases, 2, 2, STRATEGIES_2)[0])


def test_training_parity_hybrid_4_ranks() -> None:
    """HYBRID_SHARD / _HYBRID_SHARD_ZERO2 on 2 replicas x 2 shards, from a 2-D device_mesh and
    from FSDP1's (intra, inter) process groups, and FULL_SHARD over 4: as torch's FSDP1."""
    cases = [
        ("FULL_SHARD(4)", S.FULL_SHARD, {}),
        ("HYBRID_SHARD(mesh 2x2)", S.HYBRID_SHARD, {"mesh": (2, 2)}),
        ("HYBRID_SHARD(groups 2x2)", S.HYBRID_SHARD, {"groups": (2, 2)}),
        ("_HYBRID_SHARD_ZERO2(mesh 2x2)", S._HYBRID_SHARD_ZERO2, {"mesh": (2, 2)}),
    ]
    _check_parity(run_distributed(_strategy_cases, 4, 4, cases)[0], weight_tol=3e-2)


def _variant_cases() -> dict[str, Any]:
    """Gradient accumulation under no_sync(), CPU offload and clipping, each under both."""
    variants: list[tuple[str, dict[str, Any], dict[str, Any]]] = []
    for label, strategy, extra in STRATEGIES_2[:4]:
        variants.append((f"no_sync/{label}", {**_kwargs(strategy, extra, "")}, {"micro": 2}))
    variants += [
        ("no_sync/bf16", {"mixed_precision": BF16}, {"micro": 2}),
        ("clip/FULL_SHARD", {}, {"clip": 0.5}),
        ("clip/NO_SHARD", {"sharding_strategy": S.NO_SHARD}, {"clip": 0.5}),
        ("clip/bf16", {"mixed_precision": BF16}, {"clip": 0.5}),
    ]
    for strategy in (S.FULL_SHARD, S.SHARD_GRAD_OP, S.NO_SHARD):
        offload = {"sharding_strategy": strategy, "cpu_offload": CPUOffload(offload_params=True)}
        variants.append((f"cpu_offload/{strategy.name}", offload, {"micro": 2}))
    out: dict[str, Any] = {}
    for label, kwargs, how in variants:
        runs = {}
        for engine in ENGINES:
            mine = dict(kwargs)
            if engine == "torch":  # torch's CPUOffload pins memory: it needs an accelerator
                mine.pop("cpu_offload", None)
            model = wrap(engine, **mine)
            norms: list[torch.Tensor] = []
            losses, _ = train(model, 3, norms=norms, **how)
            offloaded = any(st.group.offloaded for st in _all_states(model))
            runs[engine] = (losses, norms, full_state(model), offloaded)
        out[label] = runs
    # a weight tied across the root's modules (embedding and head)
    runs = {}
    for engine in ENGINES:
        net = make_net()
        net.head.weight = net.embed.weight
        model = wrap(engine, model=net)
        losses, _ = train(model, 3)
        state = full_state(model)
        runs[engine] = (losses, [], dict(sorted(state.items())), False)
    out["tied embedding/head"] = runs
    return out


def test_no_sync_cpu_offload_and_clipping_match_fsdp1() -> None:
    """Gradient accumulation under ``no_sync()`` (each strategy, and bf16), ``CPUOffload``
    and ``clip_grad_norm_`` (the norms it returns, their dtype, and the weights after).
    torch's FSDP1 cannot offload on a machine without an accelerator (it pins host memory),
    so fullshard's offloaded runs are compared with torch's FSDP1 without offload. And a
    weight tied across two modules of one wrapper (torch's FSDP1 lists it after the wrapper's
    other parameters, fullshard in module order: compared by name)."""
    for label, runs in run_distributed(_variant_cases, 2)[0].items():
        (l_t, n_t, sd_t, _), (l_o, n_o, sd_o, offloaded) = runs["torch"], runs["fullshard"]
        assert offloaded == label.startswith("cpu_offload"), label
        tol = 2e-2 if "bf16" in label else 1e-5
        for a, b in zip(l_t, l_o):
            assert abs(a - b) <= tol * abs(a), (label, l_t, l_o)
        assert len(n_t) == len(n_o), label
        for a, b in zip(n_t, n_o):
            assert a.dtype == b.dtype and a.shape == b.shape == (), (label, a, b)
            assert abs(a.item() - b.item()) <= tol * a.item(), (label, n_t, n_o)
        assert max_diff(sd_t, sd_o) <= (5e-2 if "bf16" in label else 1e-5), label


# ---------------------------------------------------------------------------- state dicts
def _trained(engine: str, steps: int = 2, **kwargs: Any) -> tuple[Any, Any, list[float]]:
    model = wrap(engine, **kwargs)
    losses, opt = train(model, steps)
    return model, opt, losses


def _state_dict_cases() -> dict[str, Any]:
    """Every state-dict type under both engines after the same training, and loads across
    engines, types and strategies."""
    out: dict[str, Any] = {}
    raw: dict[str, Any] = {}  # each engine's SHARDED_STATE_DICT as it is
    models = {e: _trained(e, mixed_precision=BF16)[0] for e in ENGINES}
    for e, model in models.items():
        cls = ENGINES[e]
        rank0 = FullStateDictConfig(rank0_only=True)
        with cls.state_dict_type(model, StateDictType.FULL_STATE_DICT, rank0):
            out[f"full_rank0/{e}"] = dict(model.state_dict())
        with cls.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
            raw[e] = model.state_dict()
            out[f"sharded/{e}"] = {k: local_shard(v).clone() for k, v in raw[e].items()}
            out[f"sharded_types/{e}"] = {k: type(v).__name__ for k, v in raw[e].items()}
        out[f"full/{e}"] = full_state(model)
    ours = models["fullshard"]
    with OurFSDP.state_dict_type(
        ours, StateDictType.FULL_STATE_DICT, FullStateDictConfig(offload_to_cpu=True)
    ):
        out["full_offload"] = {k: v.device.type for k, v in ours.state_dict().items()}
    with OurFSDP.state_dict_type(ours, StateDictType.LOCAL_STATE_DICT):
        local = ours.state_dict()
        out["local"] = {k: type(v).__name__ for k, v in local.items()}
    with OurFSDP.state_dict_type(ours, StateDictType.SHARDED_STATE_DICT):
        sharded = ours.state_dict()
    # loads: into fresh models (another seed), then compared through their full state dicts
    full_t, full_o = out["full/torch"], out["full/fullshard"]
    loads = {
        "ours<-ours(full)": ("fullshard", {}, StateDictType.FULL_STATE_DICT, full_o),
        "ours<-torch(full)": ("fullshard", {}, StateDictType.FULL_STATE_DICT, full_t),
        "torch<-ours(full)": ("torch", {}, StateDictType.FULL_STATE_DICT, full_o),
        "ours<-ours(sharded)": ("fullshard", {}, StateDictType.SHARDED_STATE_DICT, sharded),
        "ours<-torch(sharded: ShardedTensor)": (
            "fullshard",
            {},
            StateDictType.SHARDED_STATE_DICT,
            raw["torch"],
        ),
        "NO_SHARD<-FULL_SHARD(sharded)": (
            "fullshard",
            {"sharding_strategy": S.NO_SHARD},
            StateDictType.SHARDED_STATE_DICT,
            sharded,
        ),
        "ours<-ours(local)": (
            "fullshard",
            {},
            StateDictType.LOCAL_STATE_DICT,
            local,
        ),
    }
    for label, (engine, kwargs, kind, sd) in loads.items():
        target = wrap(engine, model=make_net(seed=7), mixed_precision=BF16, **kwargs)
        with ENGINES[engine].state_dict_type(target, kind):
            result = target.load_state_dict(sd)
        out[f"load/{label}"] = (result.missing_keys, result.unexpected_keys, full_state(target))
    return out


def test_state_dicts_match_fsdp1_and_load_across_types() -> None:
    """FULL_STATE_DICT (keys, values, buffer dtypes; rank0_only: nothing elsewhere, as FSDP1;
    offload_to_cpu), SHARDED_STATE_DICT (keys; each rank's piece equals FSDP1's ShardedTensor
    shard; DTensor values), LOCAL_STATE_DICT (FSDP1's ``_flat_param`` entries); loading full
    state dicts across the two engines both ways, sharded (also into NO_SHARD, and torch's
    ShardedTensor form) and local."""
    per_rank = run_distributed(_state_dict_cases, 2)
    for rank, out in enumerate(per_rank):
        full_t, full_o = out["full/torch"], out["full/fullshard"]
        assert max_diff(full_t, full_o) <= 5e-2
        assert full_o["scale"].dtype == torch.float32  # built in fp32, computed in bf16
        r0_t, r0_o = out["full_rank0/torch"], out["full_rank0/fullshard"]
        assert list(r0_t) == list(r0_o), rank
        assert (rank == 0) == bool(r0_o), rank
        sh_t, sh_o = out["sharded/torch"], out["sharded/fullshard"]
        assert list(sh_t) == list(sh_o) == list(full_o)
        assert max_diff(sh_t, sh_o) <= 5e-2
        assert out["sharded_types/fullshard"]["head.weight"] == "DTensor"
        assert out["sharded_types/fullshard"]["scale"] == "Tensor"
        assert set(out["full_offload"].values()) == {"cpu"}
        local = out["local"]  # FSDP1's entries (tests/test_fsdp1_state_dict_conformance.py)
        assert [k for k in local if not k.endswith("_flat_param")] == list(full_o)
        assert local["_flat_param"] == local["blocks.0._flat_param"] == "ShardedTensor"
        for label in (k for k in out if k.startswith("load/")):
            missing, unexpected, loaded = out[label]
            assert not missing and not unexpected, (label, missing, unexpected)
            source = full_t if "<-torch" in label else full_o
            assert max_diff(loaded, source) == 0.0, label


def _optim_cases() -> dict[str, Any]:
    out: dict[str, Any] = {}
    raw: dict[str, Any] = {}  # each engine's sharded optimizer state dict as it is
    for e in ENGINES:  # the order of the entries with use_orig_params=True (FSDP1: by name)
        model, opt, _ = _trained(e, steps=1)
        osd = ENGINES[e].optim_state_dict(model, opt)
        out[f"order/{e}"] = (list(osd["state"]), osd["param_groups"])
        out[f"rekeyed/{e}"] = ENGINES[e].rekey_optim_state_dict(
            osd, OptimStateKeyType.PARAM_ID, model, optim=opt
        )
    # torch's FSDP1 gives wrong values with use_orig_params=True on CPU/gloo (checked against
    # one process): the values are compared with use_orig_params=False, which it gets right
    trained = {e: _trained(e, steps=2, use_orig_params=False) for e in ENGINES}
    for e, (model, opt, losses) in trained.items():
        cls = ENGINES[e]
        out[f"losses/{e}"] = losses
        out[f"full/{e}"] = _map_tensors(cls.optim_state_dict(model, opt), torch.clone)
        with cls.state_dict_type(
            model,
            StateDictType.FULL_STATE_DICT,
            FullStateDictConfig(),
            FullOptimStateDictConfig(rank0_only=True),
        ):
            out[f"full_rank0/{e}"] = _map_tensors(cls.optim_state_dict(model, opt), torch.clone)
        with cls.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
            osd = cls.optim_state_dict(model, opt)
            raw[e] = _map_tensors(osd, lambda t: t if hasattr(t, "local_shards") else t.clone())
            out[f"sharded/{e}"] = _map_tensors(osd, lambda t: local_shard(t).clone())
        out[f"legacy_full/{e}"] = _map_tensors(cls.full_optim_state_dict(model, opt), torch.clone)
    # the uninterrupted run's third step, and the same step after reloading
    model, opt, _ = trained["fullshard"]
    model_sd = full_state(model)
    out["continued"] = train(model, 1, optim=opt, first_step=2)[0]
    sources = {
        "optim_state_dict_to_load(ours)": out["full/fullshard"],
        "optim_state_dict_to_load(torch)": out["full/torch"],
        "shard_full_optim_state_dict": out["full/fullshard"],
        "scatter_full_optim_state_dict": out["legacy_full/fullshard"],
        "optim_state_dict_to_load(torch, ShardedTensor)": raw["torch"],
    }
    for how, osd in sources.items():
        fresh = wrap("fullshard", model=make_net(seed=7), use_orig_params=False)
        with OurFSDP.state_dict_type(fresh, StateDictType.FULL_STATE_DICT):
            fresh.load_state_dict(model_sd)
        new_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-2, weight_decay=0.1)
        if how.startswith("optim_state_dict_to_load"):
            kind = StateDictType.SHARDED_STATE_DICT if "Sharded" in how else None
            with OurFSDP.state_dict_type(fresh, kind or StateDictType.FULL_STATE_DICT):
                OurFSDP.optim_state_dict_to_load(fresh, new_opt, osd, load_directly=True)
        elif how == "shard_full_optim_state_dict":
            new_opt.load_state_dict(OurFSDP.shard_full_optim_state_dict(osd, fresh, optim=new_opt))
        else:
            given = osd if dist.get_rank() == 0 else None
            new_opt.load_state_dict(
                OurFSDP.scatter_full_optim_state_dict(given, fresh, optim=new_opt)
            )
        out[f"resumed/{how}"] = train(fresh, 1, optim=new_opt, first_step=2)[0]
    return out


def _map_tensors(tree: Any, fn: Any) -> Any:
    if isinstance(tree, dict):
        return {k: _map_tensors(v, fn) for k, v in tree.items()}
    if isinstance(tree, list):
        return [_map_tensors(v, fn) for v in tree]
    return fn(tree) if isinstance(tree, torch.Tensor) else tree


def _assert_osd_equal(a: dict[str, Any], b: dict[str, Any], atol: float, what: str) -> None:
    """Equal optimizer state dicts, in any order (torch's FSDP1 orders its entries by flat
    parameter with use_orig_params=False; the order is checked apart)."""
    assert a.keys() == b.keys()
    if not a:
        return
    by_name = [[{**g, "params": sorted(g["params"])} for g in d["param_groups"]] for d in (a, b)]
    assert by_name[0] == by_name[1]
    assert sorted(a["state"]) == sorted(b["state"])
    for fqn, entries in a["state"].items():
        assert entries.keys() == b["state"][fqn].keys(), fqn
        for k, v in entries.items():
            w = b["state"][fqn][k]
            assert v.shape == w.shape and v.dtype == w.dtype, (what, fqn, k)
            assert torch.allclose(v.float(), w.float(), atol=atol), (what, fqn, k)


def test_optimizer_state_dicts_match_fsdp1_and_resume() -> None:
    """optim_state_dict under FULL (keys, param_groups, values, on the CPU; rank0_only: {}
    elsewhere) and SHARDED (each rank's piece equals FSDP1's), full_optim_state_dict and
    rekey_optim_state_dict as torch's FSDP1 returns them; and training resumes exactly from
    optim_state_dict_to_load (of fullshard's and of torch's full state, and of torch's
    sharded state: ShardedTensor),
    shard_full_optim_state_dict and scatter_full_optim_state_dict."""
    for rank, out in enumerate(run_distributed(_optim_cases, 2)):
        assert out["order/torch"] == out["order/fullshard"]
        assert out["order/torch"][0] == sorted(out["order/torch"][0])
        assert out["losses/torch"] == pytest.approx(out["losses/fullshard"], rel=1e-5)
        for form in ("full", "full_rank0", "sharded", "legacy_full"):
            _assert_osd_equal(
                out[f"{form}/torch"], out[f"{form}/fullshard"], 1e-5, f"{form} {rank}"
            )
        assert bool(out["full_rank0/fullshard"]) == (rank == 0)
        assert bool(out["legacy_full/fullshard"]) == (rank == 0)
        state = out["full/fullshard"]["state"]["head.weight"]
        assert state["exp_avg"].device.type == "cpu" and state["exp_avg"].shape == (13, 10)
        rekeyed_t, rekeyed_o = out["rekeyed/torch"], out["rekeyed/fullshard"]
        assert list(rekeyed_o["state"]) == list(rekeyed_t["state"])
        assert sorted(rekeyed_o["state"]) == list(range(15))
        assert rekeyed_o["param_groups"] == rekeyed_t["param_groups"]
        for how in (k for k in out if k.startswith("resumed/")):
            assert out[how] == pytest.approx(out["continued"], rel=1e-6), how
