"""fullshard.optim.WholeTensor: whole-matrix optimizers under full sharding, exactly.

The oracle is one process with the same optimizers on the unsharded model. Each spawn runs
many sub-cases: 2 ranks (Muon + AdamW, float32 Muon and Shampoo + WholeTensor(AdamW) with
clipping and the batch split over the ranks, plain Muon
on shards drifting, traffic and state bounds, state_dict round trip, a save), 3 ranks
(parity under CPUOffloadPolicy, resume of the 2-rank save), 4 ranks (parity on a 1-D mesh and
on a 2x2 HSDP mesh) and 1 rank.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor

import fullshard.checkpoint as ckpt
from fullshard import CPUOffloadPolicy, clip_grad_norm_, fully_shard
from fullshard.bench import optim as bench_optim
from fullshard.optim import MultiOptimizer, Muon, Shampoo, WholeTensor
from fullshard.testing import run_distributed

VOCAB, DIM, SEQ, BATCH, STEPS, SAVE_AT = 11, 12, 4, 12, 6, 3


class Net(nn.Module):
    """Blocks of awkward matrices, a frozen matrix, 1-D norms and an embedding tied to the
    head."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(
            nn.Sequential(
                nn.Linear(DIM, 20, bias=False),
                nn.Tanh(),
                nn.Linear(20, 5, bias=False),
                nn.Tanh(),
                nn.Linear(5, 3),
                nn.Tanh(),
                nn.Linear(3, DIM, bias=False),
                nn.LayerNorm(DIM),
            )
            for _ in range(2)
        )
        self.blocks.append(nn.Linear(DIM, DIM, bias=False))  # 9 matrices: uneven per owner
        self.frozen = nn.Linear(DIM, DIM, bias=False)
        self.frozen.weight.requires_grad_(False)
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        h = self.emb(idx)
        for b in self.blocks:
            h = h + b(h)
        return self.head(self.frozen(h))


def make_model(mesh: DeviceMesh | None = None, **policies: Any) -> Net:
    torch.manual_seed(0)
    model = Net()
    if dist.is_initialized():
        for b in model.blocks:
            fully_shard(b, mesh=mesh, **policies)
        fully_shard(model, mesh=mesh, **policies)
    return model


def split(model: nn.Module) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """The usual Muon split: 2-D block weights, and the rest (embedding/head, 1-D, frozen)."""
    matrices = [p for n, p in model.named_parameters() if n.startswith("blocks") and p.dim() == 2]
    rest = [p for n, p in model.named_parameters() if not any(p is m for m in matrices)]
    return matrices, rest


def make_optimizer(model: nn.Module, kind: str, sharded: bool) -> torch.optim.Optimizer:
    matrices, rest = split(model)
    if kind == "muon":
        muon: torch.optim.Optimizer
        kw: dict[str, Any] = {"lr": 0.05, "weight_decay": 0.1, "adjust_lr_fn": "match_rms_adamw"}
        if sharded:
            muon = WholeTensor(torch.optim.Muon, matrices, **kw)
        else:
            muon = torch.optim.Muon(matrices, **kw)
        return MultiOptimizer(muon, torch.optim.AdamW(rest, lr=1e-2, foreach=False))
    if kind == "muon32":  # ours, Newton-Schulz in float32 (what the trainer runs on CPU)
        kw = {"lr": 0.05, "weight_decay": 0.1, "adjust_lr_fn": "match_rms_adamw"}
        muon = (
            WholeTensor(Muon, matrices, ns_dtype="float32", **kw)
            if sharded
            else Muon(matrices, ns_dtype="float32", **kw)
        )
        return MultiOptimizer(muon, torch.optim.AdamW(rest, lr=1e-2, foreach=False))
    if kind == "plain_muon":  # torch.optim.Muon straight on the shards: the wrong update
        return MultiOptimizer(
            torch.optim.Muon(matrices, lr=0.05, weight_decay=0.1, adjust_lr_fn="match_rms_adamw"),
            torch.optim.AdamW(rest, lr=1e-2, foreach=False),
        )
    assert kind == "shampoo"  # Shampoo on the matrices, AdamW whole-tensor on the rest
    groups = [{"params": rest[:1], "lr": 2e-2}, {"params": rest[1:]}]
    if sharded:
        return MultiOptimizer(
            WholeTensor(Shampoo, matrices, lr=3e-2, eps=1e-3, weight_decay=0.01),
            WholeTensor(torch.optim.AdamW, groups, lr=1e-2, foreach=False),
        )
    return MultiOptimizer(
        Shampoo(matrices, lr=3e-2, eps=1e-3, weight_decay=0.01),
        torch.optim.AdamW(groups, lr=1e-2, foreach=False),
    )


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=g), torch.randint(
        0, VOCAB, (BATCH, SEQ), generator=g
    )


def train_step(
    model: nn.Module,
    opt: torch.optim.Optimizer,
    step: int,
    dp: tuple[int, int] = (0, 1),
    clip: float = 1e3,
) -> float:
    """One step on this data-parallel rank's slice ``dp = (index, count)`` of the batch, with
    gradient clipping to ``clip``; returns the gradient norm before clipping."""
    x, y = batch(step)
    per = BATCH // dp[1]
    x, y = x[dp[0] * per : (dp[0] + 1) * per], y[dp[0] * per : (dp[0] + 1) * per]
    loss = F.cross_entropy(model(x).reshape(-1, VOCAB), y.reshape(-1))
    loss.backward()
    norm = clip_grad_norm_([p for p in model.parameters() if p.grad is not None], clip)
    opt.step()
    opt.zero_grad()
    return float(norm)


# [Note: why Muon's oracle runs on one batch] torch.optim.Muon orthogonalises in bfloat16, so
# its update jumps where a gradient entry crosses a bf16 rounding boundary: gradients that
# differ by 1e-8 (another summation order of the ranks' contributions, or of a clipping norm)
# once made a weight differ by 2.6e-4 at step 6, for WholeTensor and the single process alike.
# Muon's parity cases therefore give every rank the whole batch (the gradient average of equal
# contributions is exact) and clip above the norm; the fp32 cases (Shampoo + AdamW, and
# fullshard.optim.Muon with ns_dtype="float32") split the batch over the ranks and clip for real.
def _dp(kind: str, dp: tuple[int, int]) -> tuple[int, int]:
    return dp if kind in ("shampoo", "muon32") else (0, 1)


def _clip(kind: str) -> float:
    return 0.5 if kind in ("shampoo", "muon32") else 1e3


def full_weights(model: nn.Module) -> dict[str, torch.Tensor]:
    return {
        n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
        for n, p in model.named_parameters()
    }


def reference(kind: str) -> dict[str, dict[str, torch.Tensor]]:
    """One process, same optimizers, unsharded (the oracle): weights after SAVE_AT + 1 steps
    (``next``) and at the end (``final``)."""
    model = make_model()
    opt = make_optimizer(model, kind, sharded=False)
    out = {}
    for step in range(STEPS):
        norm = train_step(model, opt, step, clip=_clip(kind))
        assert _clip(kind) > 1e2 or norm > _clip(kind)  # the clipping is real
        if step == SAVE_AT:
            out["next"] = full_weights(model)
    out["final"] = full_weights(model)
    return out


def train(
    kind: str, mesh: DeviceMesh | None = None, save: str | None = None, **policies: Any
) -> dict[str, Any]:
    """Train STEPS steps sharded. Before step SAVE_AT: save to ``save`` (if given) and, for
    Muon on a 1-D mesh, step a twin loaded through ``state_dict()``. Returns the weights after
    SAVE_AT + 1 steps (``next``), at the end (``final``), the twin's, each step's traffic and
    what this rank owns."""
    model = make_model(mesh, **policies)
    opt = make_optimizer(model, kind, sharded=kind != "plain_muon")
    out: dict[str, Any] = {"traffic": []}
    dp = _dp(kind, (dist.get_rank(), dist.get_world_size()))
    for step in range(STEPS):
        if step == SAVE_AT and save is not None:
            ckpt.save(save, model=model, optimizer=opt)
        if step == SAVE_AT and kind == "muon" and mesh is None:
            sd = copy.deepcopy(opt.state_dict())  # AdamW's state dict holds its live tensors
            twin = make_model(mesh, **policies)
            twin.load_state_dict(model.state_dict())
            twin_opt = make_optimizer(twin, kind, sharded=True)
            twin_opt.load_state_dict(sd)
            train_step(twin, twin_opt, step, dp, _clip(kind))
            out["twin"] = full_weights(twin)
        train_step(model, opt, step, dp, _clip(kind))
        if kind == "muon":
            t = opt.optimizers[0].last_step_traffic  # type: ignore[attr-defined]
            out["traffic"].append((t.sent_bytes, t.received_bytes, t.exchanges))
        if step == SAVE_AT:
            out["next"] = full_weights(model)
    out["final"] = full_weights(model)
    if kind == "muon":
        out["owns"] = owns(model, opt.optimizers[0])  # type: ignore[attr-defined]
    return out


def owns(model: nn.Module, opt: WholeTensor) -> dict[str, Any]:
    """What this rank owns and holds, to check traffic and optimizer memory against."""
    matrices, _ = split(model)
    mesh = matrices[0].device_mesh  # type: ignore[attr-defined]
    me = mesh.get_local_rank(mesh.ndim - 1)
    owned = [p for p in matrices if opt.owner_of(p) == me]
    local = {id(p): p._local_tensor.numel() * 4 for p in matrices}  # type: ignore[attr-defined]
    return {
        "owned_bytes": sum(p.numel() * 4 for p in owned),
        "own_slice_bytes": sum(local[id(p)] for p in owned),
        "others_local_bytes": sum(local[id(p)] for p in matrices if opt.owner_of(p) != me),
        "n_owned": len(owned),
        "state": opt.state_bytes(),
        "total_bytes": sum(p.numel() * 4 for p in matrices),
    }


def _two_ranks(root: str) -> dict[str, Any]:
    out: dict[str, Any] = {
        kind: train(kind, save=None if kind == "plain_muon" else f"{root}/{kind}")
        for kind in ("muon", "shampoo", "plain_muon")
    }
    out["muon32"] = train("muon32")
    cfg = bench_optim.OptimBenchConfig(n_layer=1, d_model=8, steps=2, warmup=1)
    out["bench"] = {m: bench_optim._worker(cfg, m) for m in bench_optim.MODES}
    return out


def _three_ranks(root: str) -> dict[str, Any]:
    out: dict[str, Any] = {"muon_offload": train("muon", offload_policy=CPUOffloadPolicy())}
    for kind in ("muon", "shampoo"):
        model = make_model()
        opt = make_optimizer(model, kind, sharded=True)
        if kind == "muon":  # a step first: the owners' masters go stale at the load
            train_step(model, opt, 0, _dp(kind, (dist.get_rank(), 3)), _clip(kind))
        ckpt.load(f"{root}/{kind}", model=model, optimizer=opt)
        train_step(model, opt, SAVE_AT, _dp(kind, (dist.get_rank(), 3)), _clip(kind))
        out[f"resumed_{kind}"] = full_weights(model)
    return out


def _four_ranks() -> dict[str, Any]:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    return {"muon": train("muon"), "hsdp": train("muon", mesh)}


def _one_rank() -> dict[str, Any]:
    return {"muon": train("muon")}


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


@pytest.fixture(scope="module")
def refs() -> dict[str, Any]:
    return {kind: reference(kind) for kind in ("muon", "shampoo", "muon32")}


@pytest.fixture(scope="module")
def two(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[dict[str, Any]], Path]:
    root = tmp_path_factory.mktemp("optim_ckpt")
    return run_distributed(_two_ranks, 2, str(root), timeout=240), root


def test_two_ranks_match_one_process(two: Any, refs: dict[str, Any]) -> None:
    (r0, r1), _ = two
    for kind in ("muon", "shampoo", "muon32"):
        assert _max_diff(r0[kind]["final"], refs[kind]["final"]) < 1e-5, kind
        assert _max_diff(r0[kind]["final"], r1[kind]["final"]) == 0.0
    assert torch.equal(r0["muon"]["final"]["frozen.weight"], make_model().frozen.weight)


def test_plain_muon_on_shards_drifts(two: Any, refs: dict[str, Any]) -> None:
    (r0, _), _ = two
    drift = _max_diff(r0["plain_muon"]["final"], refs["muon"]["final"])
    assert drift > 1e-3, drift  # the update of a row shard is not the matrix's


def test_traffic_and_state_bounds(two: Any) -> None:
    (r0, r1), _ = two
    t0, t1 = r0["muon"]["owns"], r1["muon"]["owns"]
    steps0, steps1 = r0["muon"]["traffic"], r1["muon"]["traffic"]
    for t, steps in ((t0, steps0), (t1, steps1)):
        assert steps[0][2] == 3  # first step: masters filled from the shards, then out and back
        assert all(exchanges == 2 for _, _, exchanges in steps[1:])  # one out, one back
        assert t["state"]["state"] == t["owned_bytes"]  # Muon: one momentum per owned matrix
        assert t["state"]["master"] == t["owned_bytes"]
    payload = 2 * sum(t["owned_bytes"] - t["own_slice_bytes"] for t in (t0, t1))
    pieces = t0["n_owned"] + t1["n_owned"]
    for (s0, g0, _), (s1, g1, _) in zip(steps0[1:], steps1[1:]):
        assert s0 + s1 == g0 + g1  # what one rank sends the other receives
        # Each tensor's gradient rows go to its owner once and its rows come back once: the
        # payload is 2 x (bytes - the owner's own rows), plus a 16-byte header per peer and
        # 16-byte alignment of each piece; at most 2 x the owned tensors' bytes.
        assert payload <= s0 + s1 <= payload + 2 * 16 + 2 * 16 * pieces
        assert s0 + s1 <= 2 * t0["total_bytes"]
        for t, sent in ((t0, s0), (t1, s1)):  # its rows of others' tensors, its owned rows back
            assert sent <= t["others_local_bytes"] + t["owned_bytes"] + 16 * (pieces + 1)
    # Owned bytes partition the matrices, balanced within the largest matrix; counts uneven.
    assert t0["owned_bytes"] + t1["owned_bytes"] == t0["total_bytes"]
    assert abs(t0["owned_bytes"] - t1["owned_bytes"]) <= 20 * 12 * 4
    assert t0["n_owned"] != t1["n_owned"]


def test_bench_optim_memory_and_bytes(two: Any) -> None:
    (r0, r1), _ = two
    b0, b1 = r0["bench"], r1["bench"]
    params = b0["naive"]["param_bytes"]
    for b in (b0, b1):
        assert b["naive"]["state_bytes"] == 2 * params  # whole masters + momentum everywhere
        assert b["naive"]["sent_bytes"] == params // 2  # its half of every matrix, to the peer
        assert b["adamw"]["state_bytes"] == params + 4 * 4  # two half moments + 4 fp32 steps
    # WholeTensor: masters + momentum of the owned matrices only, the two ranks together once.
    assert b0["wholetensor"]["state_bytes"] + b1["wholetensor"]["state_bytes"] == 2 * params
    rows = [
        {
            "mode": m,
            "step_s": 0.1,
            "state_bytes_per_rank": 1,
            "sent_bytes_per_rank": 1,
            "param_bytes": params,
        }
        for m in bench_optim.MODES
    ]
    text = bench_optim.table(
        {"config": {"n_layer": 1, "d_model": 8, "nproc": 2, "steps": 2, "warmup": 1}, "rows": rows}
    )
    assert all(f"| {m} |" in text for m in bench_optim.MODES)


def test_state_dict_round_trip(two: Any, refs: dict[str, Any]) -> None:
    (r0, _), _ = two
    assert _max_diff(r0["muon"]["twin"], r0["muon"]["next"]) == 0.0
    for kind in ("muon", "shampoo"):
        assert _max_diff(r0[kind]["next"], refs[kind]["next"]) < 1e-5


def test_three_ranks_offload_and_resume_from_two(two: Any, refs: dict[str, Any]) -> None:
    (r0, _), root = two
    three = run_distributed(_three_ranks, 3, str(root), timeout=240)
    assert _max_diff(three[0]["muon_offload"]["final"], refs["muon"]["final"]) < 1e-5
    for kind in ("muon", "shampoo"):
        # Resumed on 3 ranks from the 2-rank save: the uninterrupted run's next step.
        assert _max_diff(three[0][f"resumed_{kind}"], r0[kind]["next"]) < 1e-6, kind


def test_four_ranks_and_hsdp(refs: dict[str, Any]) -> None:
    out = run_distributed(_four_ranks, 4, timeout=240)
    for case in ("muon", "hsdp"):
        assert _max_diff(out[0][case]["final"], refs["muon"]["final"]) < 1e-5, case
        assert all(_max_diff(o[case]["final"], out[0][case]["final"]) == 0.0 for o in out)


def test_one_rank(refs: dict[str, Any]) -> None:
    (out,) = run_distributed(_one_rank, 1, timeout=120)
    assert _max_diff(out["muon"]["final"], refs["muon"]["final"]) < 1e-5
    assert out["muon"]["traffic"][-1][:2] == (0, 0)  # nothing to exchange on one rank


def test_multi_optimizer_groups_stay_live_after_load() -> None:
    a, b = nn.Parameter(torch.randn(3)), nn.Parameter(torch.randn(3))
    opt = MultiOptimizer(torch.optim.AdamW([a]), torch.optim.SGD([b], lr=0.1))
    a.grad, b.grad = torch.ones(3), torch.ones(3)
    opt.step()
    opt.load_state_dict(opt.state_dict())  # the children replace their group dicts
    for group in opt.param_groups:
        group["lr"] = 0.5  # what the trainer's schedule does
    assert [g["lr"] for o in opt.optimizers for g in o.param_groups] == [0.5, 0.5]
    with pytest.raises(ValueError, match="more than one parameter group"):
        MultiOptimizer(torch.optim.SGD([a], lr=1.0), torch.optim.SGD([a], lr=1.0))


# ---- fullshard.optim.Muon: torch.optim.Muon with a Newton-Schulz dtype (one process)


def _muon_run(make: Any, steps: int = 4) -> tuple[list[torch.Tensor], torch.optim.Optimizer]:
    """Tall, wide and square matrices in two groups (Nesterov and not, both lr rules)."""
    torch.manual_seed(0)
    params = [nn.Parameter(torch.randn(shape)) for shape in ((30, 12), (12, 30), (16, 16))]
    opt = make(
        [{"params": params[:2]}, {"params": params[2:], "nesterov": False, "adjust_lr_fn": None}]
    )
    for step in range(steps):
        g = torch.Generator().manual_seed(step)
        for p in params:
            p.grad = torch.randn(p.shape, generator=g)
        opt.step()
    return [p.detach().clone() for p in params], opt


def test_muon_is_torch_muon_bit_for_bit_in_bfloat16() -> None:
    kw: dict[str, Any] = {"lr": 0.05, "weight_decay": 0.1, "adjust_lr_fn": "match_rms_adamw"}
    theirs, t_opt = _muon_run(lambda g: torch.optim.Muon(g, **kw))
    ours, o_opt = _muon_run(lambda g: Muon(g, **kw))  # ns_dtype="bfloat16", the default
    assert all(torch.equal(a, b) for a, b in zip(theirs, ours))
    assert isinstance(o_opt, torch.optim.Muon)
    # torch.optim.Muon's state dict (no ns_dtype) loads and steps on as torch's does.
    sd = copy.deepcopy(t_opt.state_dict())
    for opt in (t_opt, o_opt):
        opt.load_state_dict(copy.deepcopy(sd))
        for p in (p for g in opt.param_groups for p in g["params"]):
            p.grad = torch.ones_like(p)
        opt.step()
    t_params = [p for g in t_opt.param_groups for p in g["params"]]
    o_params = [p for g in o_opt.param_groups for p in g["params"]]
    assert all(torch.equal(a, b) for a, b in zip(t_params, o_params))


def test_muon_float32_is_closer_to_exact_than_bfloat16() -> None:
    kw: dict[str, Any] = {"lr": 0.05, "weight_decay": 0.1, "adjust_lr_fn": "match_rms_adamw"}
    runs = {
        dtype: _muon_run(lambda g, d=dtype: Muon(g, ns_dtype=d, **kw))[0]
        for dtype in ("bfloat16", "float32", "float64")
    }

    def diff(a: str, b: str) -> float:
        return max((x - y).abs().max().item() for x, y in zip(runs[a], runs[b]))

    assert diff("float32", "float64") < 1e-5  # also: the momentum buffer is not scaled in place
    assert diff("bfloat16", "float64") > 1e-4  # the dtype is the one asked for
    with pytest.raises(ValueError, match="a string, so that checkpoints can store it"):
        Muon([nn.Parameter(torch.zeros(2, 2))], ns_dtype=torch.float32)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"floating dtype.*'int32'"):
        Muon([{"params": [nn.Parameter(torch.zeros(2, 2))], "ns_dtype": "int32"}])
