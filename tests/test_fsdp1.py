"""fullshard's ``FullyShardedDataParallel`` (FSDP1's API) against torch's FSDP1 doing the same.

Each distributed test runs torch's FSDP1 and fullshard's wrapper on the same model, data and
arguments in one spawn (gloo, CPU) and compares losses, gradients, state dicts and optimizer
state. torch's FSDP1 runs on CPU/gloo with ``device_id=torch.device("cpu")``; where one of its
paths does not (noted per test), the reference is a single process instead.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.fsdp as tfsdp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecision, ShardingStrategy

import fullshard
from fsdp1_cases import (
    ENGINES,
    full_grads,
    full_state,
    max_diff,
    train,
    wrap,
)
from fullshard.fsdp1 import FullyShardedDataParallel as OurFSDP
from fullshard.testing import run_distributed

S = ShardingStrategy
BF16 = MixedPrecision(param_dtype=torch.bfloat16, buffer_dtype=torch.bfloat16)
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
        for mp_label, mp in (("fp32", None), ("bf16", BF16), ("fp16-reduce", FP16_REDUCE)):
            if mp is FP16_REDUCE and strategy is not S.FULL_SHARD:
                continue
            results[f"{label}/{mp_label}"] = _run_both(strategy, extra, mixed_precision=mp)
    return results


def _check_parity(results: dict[str, Any]) -> None:
    for case, both in results.items():
        (l_t, g_t, sd_t, n_t), (l_o, g_o, sd_o, n_o) = both["torch"], both["fullshard"]
        exact = case.endswith("fp32")
        tol = 1e-5 if exact else 2e-2
        assert n_t == n_o, case  # _fsdp_wrapped_module. prefixes where FSDP1 has them
        assert list(sd_t) == list(sd_o), case  # FSDP1's state-dict keys, in its order
        for a, b in zip(l_t, l_o):
            assert abs(a - b) <= tol * abs(a), (case, l_t, l_o)
        assert max_diff(g_t, g_o) <= (1e-5 if exact else 5e-2), case
        assert max_diff(sd_t, sd_o) <= (1e-5 if exact else 5e-2), case
        dtypes = {k: (sd_t[k].dtype, sd_o[k].dtype) for k in sd_t}
        assert all(a == b for a, b in dtypes.values()), (case, dtypes)


def test_training_parity_every_strategy_2_ranks() -> None:
    """Every sharding strategy, in fp32, bf16 (params, buffers) and with an fp16 reduction:
    the same losses, first-step gradients, final weights, parameter names and state-dict
    keys as torch's FSDP1."""
    _check_parity(run_distributed(_strategy_cases, 2, 2, STRATEGIES_2)[0])
