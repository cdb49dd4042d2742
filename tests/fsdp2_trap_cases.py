"""The models, runs and one-process oracles of ``tests/test_fsdp2_traps.py``: per trap, what
runs under an engine (fullshard's or torch FSDP2's ``fully_shard``) on each of 4 gloo ranks and
what one process computes for it. See that file for the traps and their reports."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from fullshard import fully_shard
from fullshard.optim import Muon, WholeTensor
from torch_versions import has_method

WORLD, D, V, BATCH, STEPS = 4, 8, 5, 16, 3
ENGINES: dict[str, Callable[..., Any]] = {"fullshard": fully_shard, "fsdp2": torch_fully_shard}
MP = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


def _full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def _data(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(BATCH, D, generator=g), torch.randint(0, V, (BATCH,), generator=g)


def _mine(t: torch.Tensor) -> torch.Tensor:
    """This rank's slice of the global batch."""
    per = BATCH // dist.get_world_size()
    return t[dist.get_rank() * per : (dist.get_rank() + 1) * per]


def _attempt(fn: Callable[..., Any], *args: Any) -> dict[str, Any]:
    """``{"ok": fn(*args)}``, or ``{"error": "Type: first line"}`` where it raised (every rank
    raises alike in these cases: the reported failures are not rank-dependent)."""
    try:
        return {"ok": fn(*args)}
    except Exception as e:  # what the engine did is the result
        return {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:150]}"}


class _ReduceDtypes(TorchDispatchMode):
    """The dtypes of the floating tensors that gradient reductions (c10d reduce-scatters and
    all-reduces, either engine) communicate."""

    def __init__(self) -> None:
        super().__init__()
        self.dtypes: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        name = str(func)
        if name.startswith("c10d.") and "reduce" in name:
            for t in tree_flatten((args, kwargs))[0]:
                if isinstance(t, torch.Tensor) and t.is_floating_point():
                    self.dtypes.add(str(t.dtype).removeprefix("torch."))
        return func(*args, **(kwargs or {}))


# ---------------------------------------------------------------- 1. a head called twice
class _MTP(nn.Module):
    """A multi-token-prediction module: a projection, then the shared output head (passed in);
    it keeps its logits for the loss to read after the forward and returns its input."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(D, D)
        self.logits: torch.Tensor | None = None

    def forward(self, h: torch.Tensor, head: nn.Module) -> torch.Tensor:
        self.logits = head(torch.tanh(self.proj(h)))
        return h


class _HeadReuse(nn.Module):
    def __init__(self, mtp_first: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Linear(D, D)
        self.norm = nn.LayerNorm(D)
        self.mtp = _MTP()
        self.head = nn.Linear(D, V, bias=False)
        self.mtp_first = mtp_first

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.body(x))
        if self.mtp_first:
            self.mtp(h, self.head)
        logits = self.head(self.norm(h))
        if not self.mtp_first:
            self.mtp(h, self.head)
        return logits

    def loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        logits = self(x)
        assert self.mtp.logits is not None
        return F.cross_entropy(logits, y) + 0.5 * F.cross_entropy(self.mtp.logits, y)

    def shard(self, shard: Callable[..., Any]) -> None:
        shard(self.body)
        shard([self.norm, self.mtp, self.head])
        shard(self)


class _Passthrough(nn.Module):
    """Returns its input beside its output: that output's gradient arrives last."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(D, D)

    def forward(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return h, self.lin(h)


class _PassNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body, self.mid, self.head = nn.Linear(D, D), _Passthrough(), nn.Linear(D, V)

    def loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h, g = self.mid(torch.tanh(self.body(x)))
        return F.cross_entropy(self.head(h * torch.tanh(g)), y)

    def shard(self, shard: Callable[..., Any]) -> None:
        for m in (self.body, self.mid, self.head):
            shard(m)
        shard(self)


HEAD_REUSE: dict[str, Callable[[], Any]] = {
    "mtp_first": lambda: _HeadReuse(mtp_first=True),
    "head_first": lambda: _HeadReuse(mtp_first=False),
    "passthrough": _PassNet,
}


def _train_head_reuse(case: str, shard: Callable[..., Any] | None) -> dict[str, Any]:
    """SGD steps; sharded: each rank its slice, the loss averaged over ranks."""
    model = HEAD_REUSE[case]()
    if shard is not None:
        model.shard(shard)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    losses = []
    for step in range(STEPS):
        x, y = _data(step)
        if shard is not None:
            x, y = _mine(x), _mine(y)
        loss = model.loss(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        total = loss.detach().clone()
        if shard is not None:
            dist.all_reduce(total)
            total /= dist.get_world_size()
        losses.append(total.item())
    return {"losses": losses, "weights": {n: _full(p) for n, p in model.named_parameters()}}


# ---------------------------------------------------------------- 2. Muon, empty shards
class _Thin(nn.Module):
    """Matrices whose dim 0 is below 4 ranks: (2, 8) and (1, 16), between wider ones."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        dims = [(16, 8), (8, 2), (2, 16), (16, 1)]  # weights (8, 16) (2, 8) (16, 2) (1, 16)
        self.lins = nn.ModuleList(nn.Linear(i, o, bias=False) for i, o in dims)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for lin in self.lins:
            x = torch.tanh(lin(x))
        return x


def _thin_data(step: int) -> torch.Tensor:
    return torch.randn(BATCH, 16, generator=torch.Generator().manual_seed(200 + step))


def _train_muon(shard: Callable[..., Any] | None) -> dict[str, torch.Tensor]:
    """Muon (float32 Newton-Schulz) steps: one process, fullshard's ``WholeTensor``, or Muon
    stepping FSDP2's shards directly (its users' setup)."""
    model = _Thin()
    opt: torch.optim.Optimizer
    if shard is None:
        opt = Muon(model.parameters(), lr=0.05, ns_dtype="float32")
    else:
        for lin in model.lins:
            shard(lin)
        shard(model)
        if shard is fully_shard:
            opt = WholeTensor(Muon, list(model.parameters()), lr=0.05, ns_dtype="float32")
        else:  # torch.optim.Muon's step (float32 Newton-Schulz, as the oracle) on the shards
            opt = Muon(model.parameters(), lr=0.05, ns_dtype="float32")
    for step in range(STEPS):
        x = _thin_data(step)
        model(x if shard is None else _mine(x)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    return {n: _full(p) for n, p in model.named_parameters()}


# ---------------------------------------------- 3-4. mixed precision: accumulation, unfreezing
class _Block(nn.Module):
    """fp32 linears ``a``, ``c`` (optional in forward) and ``u`` (never used), and a frozen
    bf16 linear ``f``: one unit of parameters of two dtypes."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.c, self.u = nn.Linear(D, D), nn.Linear(D, D), nn.Linear(D, D)
        self.f = nn.Linear(D, D).to(torch.bfloat16).requires_grad_(False)
        self.use_c = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.a(x)) + self.f(x.to(torch.bfloat16)).to(x.dtype)
        return h + self.c(h) if self.use_c else h


class _MixedNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blk, self.head = _Block(), nn.Linear(D, V)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blk(x))

    def shard(self, shard: Callable[..., Any]) -> None:
        shard(self.blk, mp_policy=MP)
        shard(self, mp_policy=MP)


def _loss(out: torch.Tensor) -> torch.Tensor:
    return out.float().pow(2).mean()


def _grads(model: nn.Module) -> dict[str, tuple[str, torch.Tensor]]:
    return {
        n: (str(p.grad.dtype).removeprefix("torch."), _full(p.grad).float())
        for n, p in model.named_parameters()
        if p.grad is not None
    }


def _accumulate(case: str, shard: Callable[..., Any]) -> dict[str, Any]:
    """2 micro-steps on this rank's slice, gradient sync off then on (``fresh``: ``c`` first
    used on the synced one; ``unused``: ``u`` never used, zeros reduced for it)."""
    model = _MixedNet()
    model.shard(shard)
    if case == "unused":
        model.set_reduce_scatter_unused_params(True)  # type: ignore[operator]
    x = _mine(_data(0)[0])
    with _ReduceDtypes() as seen:
        for i, xs in enumerate(x.chunk(2)):
            model.set_requires_gradient_sync(i == 1)  # type: ignore[operator]
            model.blk.use_c = case == "unused" or i == 1
            (_loss(model(xs)) / 2).backward()
    return {"grads": _grads(model), "reduced_in": sorted(seen.dtypes)}


def _unfreeze(bf16_params: bool, shard: Callable[..., Any]) -> dict[str, Any]:
    """The block frozen (after fully_shard) for step 0's forward, unfrozen (but ``f``) from
    step 1; each step's gradients and the dtype its reduction communicated."""
    model = _MixedNet()
    if bf16_params:
        model.to(torch.bfloat16)
    model.shard(shard)
    model.blk.requires_grad_(False)
    out = []
    for step in range(STEPS):
        if step == 1:
            for n, p in model.blk.named_parameters():
                p.requires_grad_(not n.startswith("f."))
        with _ReduceDtypes() as seen:
            _loss(model(_mine(_data(step)[0]))).backward()
        out.append({"grads": _grads(model), "reduced_in": sorted(seen.dtypes)})
        model.zero_grad(set_to_none=True)
    return {"steps": out}


def _rank_sum(model: nn.Module, micro: list[tuple[torch.Tensor, float]]) -> dict[str, Any]:
    """One process as the ranks compute: each micro-batch's bf16 forward and backward (loss
    scaled), the gradients summed in fp32."""
    acc: dict[str, torch.Tensor] = {}
    for xs, scale in micro:
        model.zero_grad(set_to_none=True)
        (_loss(model(xs.to(torch.bfloat16))) * scale).backward()
        for n, p in model.named_parameters():
            if p.grad is not None:
                acc[n] = acc[n] + p.grad.float() if n in acc else p.grad.float()
    return acc


def _accumulate_oracle(case: str) -> dict[str, Any]:
    model = _MixedNet().to(torch.bfloat16)
    per, x = BATCH // WORLD, _data(0)[0]
    acc: dict[str, torch.Tensor] = {}
    for rank in range(WORLD):
        for i, xs in enumerate(x[rank * per : (rank + 1) * per].chunk(2)):
            model.blk.use_c = case == "unused" or i == 1
            for n, g in _rank_sum(model, [(xs, 0.5)]).items():
                acc[n] = acc[n] + g if n in acc else g
    grads = {n: ("float32", g / WORLD) for n, g in acc.items()}
    if case == "unused":  # zeros reduced for the parameters no rank used
        grads.update(
            {
                f"blk.u.{k}": ("float32", torch.zeros_like(v, dtype=torch.float32))
                for k, v in model.blk.u.named_parameters()
            }
        )
    return {"grads": grads, "reduced_in": ["float32"]}


def _unfreeze_oracle(bf16_params: bool) -> dict[str, Any]:
    dtype = torch.bfloat16 if bf16_params else torch.float32
    model = _MixedNet().to(torch.bfloat16)
    model.blk.requires_grad_(False)
    per, steps = BATCH // WORLD, []
    for step in range(STEPS):
        if step == 1:
            for n, p in model.blk.named_parameters():
                p.requires_grad_(not n.startswith("f."))
        x = _data(step)[0]
        acc = _rank_sum(model, [(x[r * per : (r + 1) * per], 1.0) for r in range(WORLD)])
        name = str(dtype).removeprefix("torch.")
        grads = {n: (name, (g / WORLD).to(dtype).float()) for n, g in acc.items()}
        steps.append({"grads": grads, "reduced_in": ["float32"]})
    return {"steps": steps}


# ------------------------------------------------------- 5. parameter and buffer order
class _Rope(nn.Module):
    """Buffers of a size of its own per layer, one of them not persistent (Gemma-style)."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.dim = dim
        self.register_buffer("inv_freq", torch.empty(dim // 2), persistent=False)
        self.register_buffer("scale", torch.empty(dim))

    def init_buffers(self) -> None:
        self.inv_freq.copy_(1.0 / 10000 ** (torch.arange(0, self.dim, 2).float() / self.dim))
        self.scale.copy_(torch.linspace(0.5, 1.5, self.dim))


class _Layer(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.rope, self.lin, self.bn = _Rope(dim), nn.Linear(D, D), nn.BatchNorm1d(D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.bn(self.lin(x)) * self.rope.scale.mean()


class _Ordered(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(V, D)
        self.layers = nn.ModuleList(_Layer(d) for d in (4, 8, 6))
        self.norm, self.head = nn.LayerNorm(D), nn.Linear(D, V, bias=False)
        self.head.weight = self.emb.weight  # tied

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx)
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x))


def _build_ordered(meta: bool, shard: Callable[..., Any] | None) -> _Ordered:
    """Built plainly or on the meta device (then ``to_empty``, its buffers initialised on rank
    0 only and broadcast by ``named_buffers`` order, as verl loads them)."""
    torch.manual_seed(0)
    with torch.device("meta" if meta else "cpu"):
        model = _Ordered()
    if shard is not None:
        for layer in model.layers:
            shard(layer)
        shard([model.emb, model.norm, model.head])  # a unit of several modules, the tie in it
        shard(model)
    if meta:
        model.to_empty(device="cpu")
        if shard is None:
            model.head.weight = model.emb.weight  # to_empty unties a plain module
    if shard is None or not meta or dist.get_rank() == 0:
        for layer in model.layers:
            layer.rope.init_buffers()
            layer.bn.reset_running_stats()
    return model


def _describe(model: nn.Module) -> dict[str, list[tuple[str, Any]]]:
    return {
        "parameters": [(n, tuple(p.shape)) for n, p in model.named_parameters()],
        "buffers": [(n, tuple(b.shape)) for n, b in model.named_buffers()],
        "state_dict": [(k, tuple(v.shape)) for k, v in model.state_dict().items()],
    }


def _order(meta: bool, shard: Callable[..., Any]) -> dict[str, Any]:
    """The order on every rank after building (and, where every rank agrees, broadcasting the
    buffers from rank 0 by it), the full values, and the order after a training step."""
    model = _build_ordered(meta, shard)
    orders: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(orders, _describe(model))
    if meta and all(o == orders[0] for o in orders):  # else it would mismatch, or hang
        for _, buf in model.named_buffers():
            dist.broadcast(buf, src=0)
    values = {k: _full(v) for k, v in model.state_dict().items()}
    buffers = {n: b.clone() for n, b in model.named_buffers()}
    torch.manual_seed(0)
    model(torch.randint(0, V, (6,))).float().pow(2).mean().backward()
    after: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(after, _describe(model))
    return {"orders": orders, "after_step": after, "values": values, "buffers": buffers}


def _order_oracle(meta: bool) -> dict[str, Any]:
    """The unwrapped model's order and values (parameters: unless built on the meta device,
    where they are not initialised)."""
    model = _build_ordered(meta, None)
    values = None if meta else {k: v.detach().clone() for k, v in model.state_dict().items()}
    return {
        "order": _describe(model),
        "values": values,
        "buffers": {n: b.clone() for n, b in model.named_buffers()},
    }


# ------------------------------------------------------------------------- the spawn
# (trap, case) -> (what runs under an engine, the oracle, (atol, rtol))
Runner = Callable[[Callable[..., Any]], Any]
FP32_TOL, BF16_TOL = (1e-6, 1e-5), (1e-3, 1e-2)  # bf16 gradients: one rounding apart
CASES: dict[tuple[str, str], tuple[Runner, Callable[[], Any], tuple[float, float]]] = {
    **{
        ("head_reuse", c): (
            partial(_train_head_reuse, c),
            partial(_train_head_reuse, c, None),
            (1e-5, 1e-5),
        )
        for c in HEAD_REUSE
    },
    ("muon_empty_shards", "(2, 8) and (1, 16) on 4 ranks"): (
        _train_muon,
        partial(_train_muon, None),
        (1e-5, 1e-5),
    ),
    **{
        ("mixed_grad_dtypes", c): (
            partial(_accumulate, c),
            partial(_accumulate_oracle, c),
            FP32_TOL,
        )
        for c in ("fresh", "unused")
    },
    **{
        ("unfreeze_mixed_precision", f"{'bf16' if b else 'fp32'} params"): (
            partial(_unfreeze, b),
            partial(_unfreeze_oracle, b),
            BF16_TOL if b else FP32_TOL,
        )
        for b in (False, True)
    },
    **{
        ("order", "meta init" if m else "plain init"): (
            partial(_order, m),
            partial(_order_oracle, m),
            (0.0, 0.0),
        )
        for m in (False, True)
    },
}


# the FSDPModule method a case calls, where older torch releases lack it
NEEDS = {("mixed_grad_dtypes", "unused"): "set_reduce_scatter_unused_params"}


def runnable(trap: str, case: str) -> bool:
    return (trap, case) not in NEEDS or has_method(NEEDS[(trap, case)])


def run_all() -> dict[tuple[str, str, str], dict[str, Any]]:
    out = {}
    for (trap, case), (run, _, _) in CASES.items():
        for engine, shard in ENGINES.items():
            if not runnable(trap, case):
                continue
            out[(trap, case, engine)] = _attempt(run, shard)
            dist.barrier()
    return out
