"""One rank of one torchft replica group, for tests/test_torchft.py (run as a script).

Each rank trains the same two-layer model twice, side by side under one torchft ``Manager``:
once sharded by fullshard's ``fully_shard`` and once by torch's FSDP2 ``fully_shard`` (the
reference). Both models' units get the same all-reduce hook (an average over the replica
groups through torchft's managed process group), both optimizers sit behind torchft's
``OptimizerWrapper`` (a step is applied only when the quorum commits it), and both are in the
state that heals a restarted replica group. So both engines see the very same quorums,
failures and heals, and must end identical.

Every rank of every replica group draws its own batch at each step: the replica groups'
gradients differ, so the average across them is what the engines must agree on, whichever
groups took part in each step (which depends on when one was killed).

Environment: ``RANK``/``WORLD_SIZE``/``MASTER_ADDR``/``MASTER_PORT`` (this replica group's
own rendezvous), ``REPLICA_GROUP_ID``, ``TORCHFT_LIGHTHOUSE``. Arguments: the output folder,
in which the test writes ``stop`` (the committed step to stop at) and each rank appends its
committed steps to ``log_<replica>_<rank>`` and writes its final state to
``final_<replica>_<rank>.pt``.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP1
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.fsdp.wrap import ModuleWrapPolicy
from torch.distributed.tensor import DTensor
from torchft import Manager, ProcessGroupGloo
from torchft.optim import OptimizerWrapper
from torchft.process_group import ManagedProcessGroup

from fullshard import FSDP, fully_shard

FSDP2 = {"fullshard": fully_shard, "torch": torch_fully_shard}
FSDP1 = {"fullshard_fsdp1": FSDP, "torch_fsdp1": TorchFSDP1}


def layers() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 5))


def build(engine: str, mesh: Any, hook: Callable[[torch.Tensor], None]) -> nn.Module:
    """The model, one unit per linear layer plus the root, every unit reducing across the
    replica groups with ``hook``: FSDP2's all-reduce hook, or (FSDP1, which has none) a
    communication hook that reduce-scatters within the group and then runs ``hook``."""
    model = layers()
    if engine in FSDP1:

        def comm_hook(state: object, grad: torch.Tensor, output: torch.Tensor) -> None:
            dist.reduce_scatter_tensor(output, grad)
            output.div_(dist.get_world_size())
            hook(output)

        wrapped = FSDP1[engine](
            model,
            auto_wrap_policy=ModuleWrapPolicy({nn.Linear}),
            use_orig_params=True,
            device_id=torch.device("cpu"),
        )
        wrapped.register_comm_hook(None, comm_hook)
        return wrapped
    shard = FSDP2[engine]
    for layer in (model[0], model[2]):
        shard(layer, mesh=mesh)
    shard(model, mesh=mesh)
    for module in model.modules():
        if hasattr(module, "set_all_reduce_hook"):  # every FSDP unit
            module.set_all_reduce_hook(hook)
    return model


def snapshot(value: Any) -> Any:
    """A copy of a (nested) state dict's tensors: torchft may send it while training goes on."""
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, dict):
        return {k: snapshot(v) for k, v in value.items()}
    if isinstance(value, list):
        return [snapshot(v) for v in value]
    return value


def heal_state(models: dict[str, nn.Module], opt: torch.optim.Optimizer) -> dict:
    """The state a restarted replica group heals from (this rank's part of it).

    FSDP2 models give their sharded state dicts (DTensors: no collective, so safe on
    torchft's quorum thread); FSDP1's full state dict would all-gather, so its models give
    their parameters' local pieces (``use_orig_params`` views). The optimizer gives its state
    dict (one for every engine's parameters).
    """
    state: dict[str, Any] = {"optim": snapshot(opt.state_dict())}
    for name, model in models.items():
        if name in FSDP1:
            state[name] = [p.detach().clone() for p in model.parameters()]
        else:
            state[name] = snapshot(model.state_dict())
    return state


def load_heal_state(models: dict, opt: torch.optim.Optimizer, state: dict) -> None:
    """Load a healthy replica's state (the parameters in place: the optimizer holds them)."""
    for name, model in models.items():
        if name in FSDP1:
            with torch.no_grad():
                for p, saved in zip(model.parameters(), state[name]):
                    p.copy_(saved)
        else:
            model.load_state_dict(state[name])
    opt.load_state_dict(state["optim"])


def full_state(engine: str, model: nn.Module, opt: torch.optim.Optimizer) -> dict:
    """Every parameter and optimizer-state tensor, unsharded (collectives in the group).

    FSDP2's (and fullshard's FSDP1's) are DTensors; torch FSDP1's ``use_orig_params`` views
    are each rank's contiguous piece of the flattened tensor (maybe none), joined in rank
    order. Tensors are compared flattened.
    """
    out: dict[str, torch.Tensor] = {}
    pieces: dict[str, torch.Tensor] = {}
    for name, p in model.named_parameters():
        for k, v in opt.state[p].items():
            if isinstance(v, DTensor):
                out[f"{name}.{k}"] = v.full_tensor().flatten()
            else:  # a scalar (the step) or torch FSDP1's piece
                (out if v.dim() == 0 else pieces)[f"{name}.{k}"] = v.detach().clone()
    if engine in FSDP1:
        with FSDP1[engine].summon_full_params(model):
            out.update((n, p.detach().flatten().clone()) for n, p in model.named_parameters())
    else:
        out.update((n, p.full_tensor().detach().flatten()) for n, p in model.named_parameters())
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, (out, pieces))
    for rank_out, _ in everyone:  # state a rank without elements never made
        for key, value in rank_out.items():
            out.setdefault(key, value)
    for key in {k for _, rank_pieces in everyone for k in rank_pieces}:
        out[key] = torch.cat([rp[key] for _, rp in everyone if key in rp])
    return out


def stop_step(folder: str) -> int:
    try:
        with open(os.path.join(folder, "stop")) as f:
            return int(f.read())
    except (FileNotFoundError, ValueError):
        return 1 << 30


def train(manager: Manager, models: dict, opt: OptimizerWrapper, folder: str) -> None:
    """Train until the committed step the test asks for, logging every step."""
    replica, rank = int(os.environ["REPLICA_GROUP_ID"]), int(os.environ["RANK"])
    with open(os.path.join(folder, f"log_{replica}_{rank}"), "a") as log:
        while manager.current_step() < stop_step(folder):
            opt.zero_grad()  # starts this step's quorum
            manager.wait_quorum()  # a healing group now knows the step it heals to
            step = manager.current_step()
            gen = torch.Generator().manual_seed(1000 * step + 10 * replica + rank)
            x, y = torch.randn(4, 8, generator=gen), torch.randn(4, 5, generator=gen)
            for model in models.values():
                nn.functional.mse_loss(model(x), y).backward()
            participants = manager.num_participants()
            opt.step()  # applied only if the quorum commits the step
            committed = manager.current_step() > step
            log.write(f"{step} {participants} {int(committed)} {os.getpid()}\n")
            log.flush()
            time.sleep(float(os.environ.get("TORCHFT_TEST_STEP_SLEEP", "0.05")))


def main(folder: str) -> None:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    replica = os.environ["REPLICA_GROUP_ID"]
    dist.init_process_group("gloo", timeout=timedelta(seconds=30))  # the group's own store
    mesh = init_device_mesh("cpu", (world,))
    manager = Manager(
        pg=ProcessGroupGloo(timeout=timedelta(seconds=5)),
        load_state_dict=None,
        state_dict=None,
        min_replica_size=1,
        # Every engine builds its model from one seed, so step 0 needs no weight sync. With it,
        # torchft heals each rank of a replica group from a different group at step 0 (the
        # source is assigned round-robin by group rank) and the step's gradient is then one
        # group's on some shards and the other's on the rest: which elements come from which
        # group depends on the shard layout, so torch FSDP1's flat shards would end up with
        # another gradient than the FSDP2 layout of the other three engines (2026-12-07).
        init_sync=False,
        replica_id=f"ft_{replica}",
        timeout=timedelta(seconds=10),
        quorum_timeout=timedelta(seconds=30),
        connect_timeout=timedelta(seconds=10),
    )
    replicas = ManagedProcessGroup(manager)

    def average_over_replicas(output: torch.Tensor) -> None:
        dist.all_reduce(output, group=replicas, op=dist.ReduceOp.AVG)

    engines = os.environ.get("TORCHFT_TEST_ENGINES", "fullshard,torch").split(",")
    models = {e: build(e, mesh, average_over_replicas) for e in engines}
    # one optimizer (one commit per step), a parameter group per engine
    inner = torch.optim.AdamW(
        [{"params": list(m.parameters())} for m in models.values()], lr=0.02, foreach=False
    )
    opt = OptimizerWrapper(manager, inner)
    manager.register_state_dict_fn(
        "train",
        lambda state: load_heal_state(models, inner, state),
        lambda: heal_state(models, inner),
    )
    train(manager, models, opt, folder)
    final: dict[str, Any] = {e: full_state(e, models[e], inner) for e in engines}
    final["step"] = manager.current_step()
    torch.save(final, os.path.join(folder, f"final_{replica}_{rank}.pt"))
    manager.shutdown(wait=False)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
