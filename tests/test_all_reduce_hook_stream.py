"""``set_all_reduce_hook(hook, stream=s)`` runs the hook on ``s``, as FSDP2 does: ordered after
the unit's reduce-scatter, with the gradients handed out after it ([Note: the all-reduce hook]
in fullshard.engine.reduce). On the CPU ``s`` — a ``torch.Stream(device="cpu")``, a
``torch.cpu.Stream`` or one of fullshard's logical streams — stands for a logical stream the
stream checker checks ([Note: a user's stream] in fullshard.engine.streams).

One spawn of 4 gloo ranks, torchft's layout: 2 replicas of 2 shards, each replica a 1-D
``fully_shard`` over its shard pair, every unit's hook averaging its reduced shards over the
replica group. For each kind of stream, under ``check_streams()``: the hook sees itself on that
stream, nothing is unordered, and the gradients equal FSDP2's (the same hook and a stream) and
one process's on the whole batch. Deleting either of the hook's wait lines is caught by
``tests/test_stream_mutations.py`` (its ``hook`` case). A stream that cannot serve the unit is
refused with one line; HSDP's refusal (FSDP2's message) is in ``tests/test_fsdp2_misuse.py``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard as torch_fully_shard

from fullshard import fully_shard
from fullshard.engine.streamcheck import COMPUTE, check_streams
from fullshard.engine.streams import current_stream, new_stream
from fullshard.testing import run_distributed

CPU = torch.device("cpu")
BATCH, DIM = 8, 6  # global batch: 2 rows per rank


def _net() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(DIM, 10), nn.GELU(), nn.Linear(10, 7), nn.Tanh(), nn.Linear(7, 3)
    )


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(BATCH, DIM, generator=g), torch.randn(BATCH, 3, generator=g)


def _grads(model: nn.Module) -> list[torch.Tensor]:
    return [p.grad.full_tensor() for p in model.parameters()]


def _train(shard: Any, mesh: Any, replicas: dist.ProcessGroup, stream: Any) -> tuple[Any, list]:
    """One backward on this rank's rows; every unit's hook averages over the replicas (and
    notes the stream it runs on). Returns the gradients and the streams the hooks saw."""
    seen: list[Any] = []

    def replica_mean(t: torch.Tensor) -> None:
        seen.append(current_stream(CPU))
        dist.all_reduce(t, group=replicas)
        t.div_(replicas.size())

    model = _net()
    units = [shard(model[i], mesh=mesh) for i in (0, 2, 4)] + [shard(model, mesh=mesh)]
    for unit in units:
        unit.set_all_reduce_hook(replica_mean, stream=stream)
    x, y = _data()
    rows = slice(2 * dist.get_rank(), 2 * dist.get_rank() + 2)
    F.mse_loss(model(x[rows]), y[rows]).backward()
    return _grads(model), seen


def _four_ranks() -> dict[str, Any]:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replica", "shard"))
    replicas = mesh.get_group("replica")
    ref = _net()
    x, y = _data()
    F.mse_loss(ref(x), y).backward()
    want = [p.grad for p in ref.parameters()]
    torch_grads, _ = _train(torch_fully_shard, mesh["shard"], replicas, torch.cpu.Stream())
    out: dict[str, Any] = {}
    streams = {
        "torch.Stream": torch.Stream(device="cpu"),
        "torch.cpu.Stream": torch.cpu.Stream(),
        "logical": new_stream(CPU, "replicas"),
    }
    for name, stream in streams.items():
        with check_streams() as checker:
            grads, seen = _train(fully_shard, mesh["shard"], replicas, stream)
        ran_on = {s.name for s in seen}
        # the user's logical stream itself, or one logical stream standing for a torch stream
        expected = {stream.name} if name == "logical" else ran_on if len(ran_on) == 1 else None
        out[name] = {
            "hooks": len(seen),
            "on its stream": ran_on == expected and COMPUTE not in ran_on,
            "violations": checker.violations[:3],
            "vs FSDP2": max((g - t).abs().max().item() for g, t in zip(grads, torch_grads)),
            "vs one process": max((g - w).abs().max().item() for g, w in zip(grads, want)),
        }
    model = fully_shard(_net(), mesh=mesh["shard"])
    try:
        model.set_all_reduce_hook(lambda t: None, stream=object())  # type: ignore[arg-type]
        out["refused"] = "accepted"
    except ValueError as e:
        out["refused"] = str(e)
    return out


def test_hook_runs_on_its_stream_with_replica_all_reduce() -> None:
    for rank, out in enumerate(run_distributed(_four_ranks, 4)):
        for name in ("torch.Stream", "torch.cpu.Stream", "logical"):
            case = out[name]
            assert case["hooks"] == 3, (rank, name, case)  # one per unit with parameters
            assert case["on its stream"], (rank, name, case)
            assert case["violations"] == [], (rank, name, case)
            assert case["vs FSDP2"] < 1e-6, (rank, name, case)
            assert case["vs one process"] < 1e-5, (rank, name, case)
        assert out["refused"].startswith("set_all_reduce_hook: stream=<object object at "), out
        assert out["refused"].endswith('pass a torch.Stream(device="cpu")'), out
