"""Mixed ``requires_grad`` across and within units, set after ``fully_shard`` (torch FSDP2's
``test_fully_shard_frozen`` style): parity with one process and with torch FSDP2.

The model is FSDP2's test model, six ``Linear(32, 32)`` + ``ReLU``, one unit per linear, with
and without a root unit (without one every linear is its own root, as in FSDP2's test).
Parameters are frozen through the sharded parameters after ``fully_shard``, some before the
first forward and some after training started (unfreezing and freezing later). Every sub-case
runs in one spawn: each pattern x gradient accumulation x root x engine (fullshard on both
transports, torch FSDP2). Compared per step: the loss, every parameter's gradient (``None``
where frozen) and the reduce-scatter bytes (trainable parameters only); at the end the weights.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils.checkpoint import checkpoint

from fullshard import CommPolicy, count_collectives
from fullshard.testing import run_distributed

WORLD, LINEARS, DIM, PER_RANK = 2, 6, 32, 8
STEPS = 5
EVAL_STEP = 1  # a forward under no_grad, no backward (as FSDP2's test)
CHANGE_STEP = 2  # where "unfreeze" / "refreeze" change requires_grad (after lazy init)

# Per linear: which of (weight, bias) are trainable.
ALL = [(True, True)] * LINEARS
# frozen across units (interleaved, the first included: its input needs no gradient)
ACROSS = [(i % 2 == 1, i % 2 == 1) for i in range(LINEARS)]
WITHIN = [(False, True)] * LINEARS  # BitFit: biases only, every unit mixed
MIXED = [(False, False), (False, True), (True, True), (True, False), (False, False), (False, True)]

# name -> (requires_grad before CHANGE_STEP, from CHANGE_STEP on, activation checkpointing)
PATTERNS: dict[str, tuple[list[tuple[bool, bool]], list[tuple[bool, bool]], bool]] = {
    "across": (ACROSS, ACROSS, False),
    "within": (WITHIN, WITHIN, False),
    "mixed": (MIXED, MIXED, False),
    "mixed_ckpt": (MIXED, MIXED, True),
    "unfreeze": (MIXED, ALL, False),
    "refreeze": (ALL, MIXED, False),
}
ENGINES = ("packed", "p2p", "torch")  # fullshard's two transports, torch FSDP2


class Net(nn.Module):
    def __init__(self, ckpt: bool = False) -> None:
        super().__init__()
        torch.manual_seed(42)
        mods: list[nn.Module] = []
        for _ in range(LINEARS):
            mods += [nn.Linear(DIM, DIM), nn.ReLU()]
        self.seq = nn.Sequential(*mods)
        self.ckpt = ckpt

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for m in self.seq:
            # checkpoint around the unit: its hooks run again in the recomputation
            use = self.ckpt and isinstance(m, nn.Linear) and torch.is_grad_enabled()
            x = checkpoint(m, x, use_reentrant=False) if use else m(x)
        return x


def linears(model: Net) -> list[nn.Module]:
    return [m for m in model.seq if isinstance(m, nn.Linear)]


def set_trainable(model: Net, spec: list[tuple[bool, bool]]) -> None:
    for lin, (w, b) in zip(linears(model), spec):
        lin.weight.requires_grad_(w)
        lin.bias.requires_grad_(b)


def spec_at(pattern: str, step: int) -> list[tuple[bool, bool]]:
    before, after, _ = PATTERNS[pattern]
    return after if step >= CHANGE_STEP else before


def global_batch(step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(WORLD * PER_RANK, DIM, generator=g)


def loss_of(out: torch.Tensor) -> torch.Tensor:
    return out.pow(2).mean()


def _full(t: torch.Tensor | None) -> torch.Tensor | None:
    if t is None:
        return None
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


Result = tuple[list[float], list[dict[str, torch.Tensor | None]], dict[str, torch.Tensor]]


def train(
    model: Net,
    pattern: str,
    opt: torch.optim.Optimizer,
    forward_backward: Callable[[int, bool], float],
) -> Result:
    """The pattern's schedule with Adam: train, evaluate once under no_grad, change
    requires_grad at CHANGE_STEP; gradients are read before each optimizer step."""
    losses: list[float] = []
    grads: list[dict[str, torch.Tensor | None]] = []
    for step in range(STEPS):
        if step == CHANGE_STEP:
            set_trainable(model, spec_at(pattern, step))
        training = step != EVAL_STEP
        losses.append(forward_backward(step, training))
        if training:
            grads.append({n: _full(p.grad) for n, p in model.named_parameters()})
            opt.step()
            opt.zero_grad(set_to_none=step % 2 == 0)  # both forms, as FSDP2's test
    weights = {n: _full(p) for n, p in model.named_parameters()}
    return losses, grads, weights  # type: ignore[return-value]


def reference(pattern: str) -> Result:
    """One process, the whole global batch."""
    model = Net(ckpt=PATTERNS[pattern][2])
    set_trainable(model, spec_at(pattern, 0))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)

    def forward_backward(step: int, training: bool) -> float:
        with torch.set_grad_enabled(training):
            loss = loss_of(model(global_batch(step)))
        if training:
            loss.backward()
        return loss.item()

    return train(model, pattern, opt, forward_backward)


def shard(model: Net, engine: str, root: bool) -> None:
    if engine == "torch":
        from torch.distributed.fsdp import fully_shard as torch_fully_shard

        for lin in linears(model):
            torch_fully_shard(lin)
        if root:
            torch_fully_shard(model)
        return
    from fullshard import fully_shard

    policy = CommPolicy(transport=engine)
    for lin in linears(model):
        fully_shard(lin, comm_policy=policy)
    if root:
        fully_shard(model, comm_policy=policy)


def sharded(pattern: str, engine: str, root: bool, micro: int) -> tuple[Result, list[int]]:
    """2 ranks, each its slice of the global batch in ``micro`` micro-steps (gradient sync
    off but on the last); frozen after ``fully_shard``. Also returns the reduce-scatter
    bytes per training step (fullshard only)."""
    rank = dist.get_rank()
    model = Net(ckpt=PATTERNS[pattern][2])
    shard(model, engine, root)
    set_trainable(model, spec_at(pattern, 0))  # after fully_shard (and before lazy init)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    units = linears(model) + ([model] if root else [])
    rs_bytes: list[int] = []

    def forward_backward(step: int, training: bool) -> float:
        x = global_batch(step)[rank * PER_RANK : (rank + 1) * PER_RANK]
        total = torch.zeros(())
        if not training:
            with torch.no_grad():
                total += loss_of(model(x))
        else:
            with count_collectives() as stats:
                for i, xs in enumerate(x.chunk(micro)):
                    for u in units:  # every unit: without a root each linear is one
                        u.set_requires_gradient_sync(i == micro - 1)  # type: ignore[operator]
                    loss = loss_of(model(xs)) / micro
                    loss.backward()
                    total += loss.detach()
            rs_bytes.append(stats.bytes("reduce_scatter"))
        dist.all_reduce(total)
        return (total / WORLD).item()

    return train(model, pattern, opt, forward_backward), rs_bytes


def _fsdp2_follows(pattern: str, engine: str, root: bool) -> bool:
    """torch FSDP2 copies ``requires_grad`` to a unit's unsharded parameters when it unshards
    them; without a root unit every linear is a root that keeps its parameters unsharded from
    one step to the next, so a change after the first forward never reaches them (there it
    trains what was trainable at the first forward). fullshard copies it before every
    forward, so it follows the change in every form."""
    return engine != "torch" or root or PATTERNS[pattern][0] == PATTERNS[pattern][1]


CASES = [
    (pattern, engine, root, micro)
    for pattern in PATTERNS
    for micro in (1, 2)
    for root in (False, True)
    for engine in ENGINES
    if _fsdp2_follows(pattern, engine, root)
]


def _run_all() -> dict[tuple[str, str, bool, int], tuple[Result, list[int]]]:
    return {case: sharded(*case) for case in CASES}


def expected_rs_bytes(pattern: str, step: int) -> int:
    """What a training step reduce-scatters: the trainable parameters only, each padded to
    its per-rank shard (weight 32 x 32: 512 elements a rank, bias 32: 16), fp32."""
    numel = sum(DIM * DIM * w + DIM * b for w, b in spec_at(pattern, step))
    return numel * 4  # 2 ranks x (numel / 2) elements, 4 bytes each


@pytest.fixture(scope="module")
def results() -> dict[tuple[str, str, bool, int], tuple[Result, list[int]]]:
    return run_distributed(_run_all, WORLD, timeout=600)[0]


@pytest.mark.parametrize("pattern", list(PATTERNS))
def test_mixed_requires_grad_parity(pattern: str, results) -> None:
    ref_losses, ref_grads, ref_weights = reference(pattern)
    train_steps = [s for s in range(STEPS) if s != EVAL_STEP]
    for case, ((losses, grads, weights), rs_bytes) in results.items():
        if case[0] != pattern:
            continue
        name = "pattern={} engine={} root={} micro={}".format(*case)
        for step, (a, b) in enumerate(zip(losses, ref_losses)):
            assert abs(a - b) <= 1e-5 * abs(b), f"{name} step {step}: loss {a} vs {b}"
        for step, got, want in zip(train_steps, grads, ref_grads):
            assert got.keys() == want.keys(), name
            for k in want:
                where = f"{name} step {step} {k}.grad"
                if want[k] is None:
                    assert got[k] is None, f"{where}: a frozen parameter got a gradient"
                    continue
                assert got[k] is not None, f"{where}: missing"
                torch.testing.assert_close(got[k], want[k], atol=1e-5, rtol=1e-4, msg=where)
        for k in ref_weights:
            torch.testing.assert_close(
                weights[k], ref_weights[k], atol=1e-4, rtol=0, msg=f"{name} weight {k}"
            )
        if case[1] != "torch":  # fullshard reduces exactly the trainable parameters
            want_bytes = [expected_rs_bytes(pattern, s) for s in train_steps]
            assert rs_bytes == want_bytes, f"{name}: reduce-scatter bytes {rs_bytes}"
        # and against torch FSDP2 doing the same, directly
        peer = results.get((pattern, "torch", *case[2:]))
        if case[1] == "torch" or peer is None:
            continue
        (peer_losses, peer_grads, peer_weights), _ = peer
        for step, (a, b) in enumerate(zip(losses, peer_losses)):
            assert abs(a - b) <= 1e-5 * abs(b), f"{name} step {step}: loss {a}, FSDP2 {b}"
        for step, got, want in zip(train_steps, grads, peer_grads):
            for k in want:
                where = f"{name} step {step} {k}.grad vs FSDP2"
                if want[k] is None or got[k] is None:
                    assert got[k] is None and want[k] is None, where
                else:
                    torch.testing.assert_close(got[k], want[k], atol=1e-5, rtol=1e-4, msg=where)
        for k in peer_weights:
            torch.testing.assert_close(
                weights[k], peer_weights[k], atol=1e-4, rtol=0, msg=f"{name} weight {k} vs FSDP2"
            )
