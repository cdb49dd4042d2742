"""TP x FSDP with ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``: the gradient of
a TP-replicated parameter (a sequence-parallel norm weight, ``Replicate()`` on tp, its
gradient ``Partial()`` there) is all-reduced over tp in the reduce dtype, as torch 2.15's FSDP2
does (pytorch/pytorch#190626), not in bf16.

The inputs make every bf16 computation but that reduction exact: each tp rank's partial sum
is exactly representable in bf16 (multiples of 64 on the first half of the sequence, small
integers on the second), their sum is not. So the gradients match an fp32 single-process
reference to fp32 rounding (here: exactly) when the tp all-reduce runs in fp32, and are off
by bf16's rounding (about 1e-3 relative) when it runs in bf16. torch's FSDP2 runs the same
steps and must match too from torch 2.15 on (in bf16 before). One spawn of 4 gloo ranks on a
(dp=2, tp=2) mesh: one step with gradient sync, and two micro-steps (the first without sync:
its unsharded gradient is accumulated in the reduce dtype, the tp reduction included).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import SequenceParallel, parallelize_module

from fullshard import MixedPrecisionPolicy, fully_shard
from fullshard.engine.compat import TORCH_VERSION
from fullshard.testing import run_distributed

BATCH, SEQ, DIM = 4, 4, 6  # global batch (dp=2: 2 rows each), sequence (tp=2: 2 each)
TOL = 1e-6  # fp32 rounding; the bf16 tp reduction is off by about 1e-3


class Scale(nn.Module):
    """A norm's learnable scale, ``x * weight`` (what sequence parallelism replicates)."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(DIM))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.weight


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = Scale()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.norm(x)
        if isinstance(y, DTensor):  # sequence parallel: this tp rank's tokens
            y = y.to_local()
        return y


def _data(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Global ``(x, c)``; the loss is ``sum(net(x) * c)``. The first half of the sequence
    (tp rank 0's tokens) holds multiples of 64, the second small integers, so every partial
    sum is exact in bf16 and their sum (over tp) is not."""
    g = torch.Generator().manual_seed(step)
    big = torch.randint(4, 17, (BATCH, SEQ // 2, DIM), generator=g) * 64.0
    small = torch.randint(-15, 16, (BATCH, SEQ // 2, DIM), generator=g).float()
    c = torch.randint(1, 3, (BATCH, SEQ, DIM), generator=g).float()
    return torch.cat([big, small], dim=1), c


def _reference(steps: list[int]) -> torch.Tensor:
    """One process, fp32: the gradients of the mean over dp ranks of their summed losses."""
    net = Net()
    for step in steps:
        x, c = _data(step)
        ((net(x) * c).sum() / 2).backward()
    return net.norm.weight.grad.clone()


def _sharded(mesh, steps: list[int], shard=fully_shard) -> torch.Tensor:
    dp, tp = mesh["dp"].get_local_rank(), mesh["tp"].get_local_rank()
    net = Net()
    parallelize_module(net.norm, mesh["tp"], SequenceParallel())
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    model = shard(net, mesh=mesh["dp"], mp_policy=mp)
    rows, cols = slice(2 * dp, 2 * dp + 2), slice(tp * SEQ // 2, (tp + 1) * SEQ // 2)
    for i, step in enumerate(steps):
        model.set_requires_gradient_sync(i == len(steps) - 1)
        x, c = _data(step)
        (model(x[rows, cols]).float() * c[rows, cols]).sum().backward()
    return net.norm.weight.grad.full_tensor()


def _four_ranks() -> dict[tuple[str, str], float]:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    out = {}
    for name, steps in (("one_step", [0]), ("accumulated", [1, 2])):
        want = _reference(steps)
        for who, shard in (("fullshard", fully_shard), ("FSDP2", torch_fully_shard)):
            got = _sharded(mesh, steps, shard)
            out[who, name] = ((got - want).abs().max() / want.abs().max()).item()
    dist.barrier()
    return out


def test_tp_partial_grads_reduce_in_reduce_dtype() -> None:
    """The norm weight's tp reduction (and so its gradient) is fp32-exact, for one step and
    for a step accumulated over a micro-step without sync."""
    for rank, errors in enumerate(run_distributed(_four_ranks, 4)):
        # torch's FSDP2 reduces over tp in reduce_dtype from 2.15 on (in bf16 before)
        judged = ("fullshard", "FSDP2") if TORCH_VERSION >= (2, 15) else ("fullshard",)
        bad = {k: e for k, e in errors.items() if k[0] in judged and not e < TOL}
        assert not bad, f"rank {rank}: relative gradient errors above {TOL}: {bad}"
