"""The client scripts of ``test_clients.py``: each runs once under torch FSDP2, once under fullshard.

Every script is written against torch's names only (``torch.distributed.fsdp.fully_shard``, the
frameworks' own FSDP2 paths); the fullshard run is the same code with
``fullshard.patch_torch_fsdp()`` active, so it checks what a framework user gets. Each returns
its losses (and what else it checks) for the parent to compare against the torch run.

Data: a fixed global batch per step, sliced by rank, and the loss reported is the global mean
(an all-reduce of the per-rank means), so runs on different world sizes see the same numbers.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

VOCAB, SEQ, GLOBAL_BATCH = 64, 8, 6


def tiny_llama(tie: bool = False) -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=tie,
    )
    return LlamaForCausalLM(cfg)


def batch(step: int) -> torch.Tensor:
    """This rank's slice of step ``step``'s global batch of token ids."""
    g = torch.Generator().manual_seed(1000 + step)
    ids = torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ), generator=g)
    world, rank = dist.get_world_size(), dist.get_rank()
    per = GLOBAL_BATCH // world
    return ids[rank * per : (rank + 1) * per]


def global_mean(loss: torch.Tensor) -> float:
    t = loss.detach().clone()
    dist.all_reduce(t)
    return t.item() / dist.get_world_size()


@contextlib.contextmanager
def engine(name: str) -> Iterator[None]:
    """``torch``: torch's FSDP2 as installed; ``fullshard``: the same with the patch active."""
    import fullshard

    patch = fullshard.patch_torch_fsdp() if name == "fullshard" else None
    try:
        yield
    finally:
        if patch is not None:
            patch.undo()


def check_units(model: nn.Module, name: str) -> None:
    """The units are torch FSDPModules, and fullshard's exactly when fullshard runs."""
    from torch.distributed.fsdp import FSDPModule

    import fullshard

    units = [m for m in model.modules() if isinstance(m, FSDPModule)]
    assert units, f"{name}: no FSDP2 unit in the model"
    ours = [isinstance(m, fullshard.FSDPModule) for m in units]
    assert all(ours) if name == "fullshard" else not any(ours), (name, ours)


def shard_llama(model: nn.Module) -> None:
    from torch.distributed.fsdp import fully_shard

    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)


def train_llama(model: nn.Module, opt: torch.optim.Optimizer, steps: range) -> list[float]:
    losses = []
    for step in steps:
        ids = batch(step)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(global_mean(loss))
    return losses


# ------------------------------------------------------------------------------ transformers
def transformers_client(name: str, folder: str) -> dict[str, Any]:
    """LlamaForCausalLM: training, generate() with ranks stopping at different lengths (default
    arguments: transformers turns synced_gpus on because it detects an FSDP-managed module),
    and a gathered save_pretrained that from_pretrained reloads with identical logits."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from transformers import LlamaForCausalLM
    from transformers.distributed.fsdp import is_fsdp_managed_module

    rank = dist.get_rank()
    with engine(name):
        model = tiny_llama()
        shard_llama(model)
        check_units(model, name)
        assert is_fsdp_managed_module(model)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        losses = train_llama(model, opt, range(3))

        # generate: rank 0's first greedy token is the EOS, absent from rank 1's continuation.
        prompt = batch(10)[:1, :4] + rank
        model.generation_config.pad_token_id = 0
        model.generation_config.eos_token_id = None
        probe = model.generate(prompt, max_new_tokens=6, do_sample=False)[0, 4:].tolist()
        probes: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(probes, probe)
        eos = probes[0][0]
        assert all(eos not in p for p in probes[1:]), f"pick another prompt: {probes}"
        model.generation_config.eos_token_id = eos
        out = model.generate(prompt, max_new_tokens=6, do_sample=False)[0, 4:].tolist()
        assert (out[0] == eos) == (rank == 0), out

        # gathered save_pretrained, reloaded by from_pretrained on rank 0
        full = get_model_state_dict(
            model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
        )
        ids = batch(11)
        with torch.no_grad():
            logits = model(input_ids=ids).logits
        diff = 0.0
        if rank == 0:
            path = os.path.join(folder, f"hf-{name}")
            model.save_pretrained(path, state_dict=full)
            reloaded = LlamaForCausalLM.from_pretrained(path)
            with torch.no_grad():
                diff = (reloaded(input_ids=ids).logits - logits).abs().max().item()
        dist.barrier()
    return {"losses": losses, "generated": out, "reload_diff": diff}


# ---------------------------------------------------------------------------------- DCP
def dcp_save(name: str, folder: str) -> dict[str, Any]:
    """Train 2 steps, save sharded (dcp.save) and full (rank 0) model + optimizer states, then
    train 2 more steps: the losses a load on another world size must reproduce."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    with engine(name):
        model = tiny_llama()
        shard_llama(model)
        check_units(model, name)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        losses = train_llama(model, opt, range(2))
        state = {
            "model": get_model_state_dict(model),
            "optim": get_optimizer_state_dict(model, opt),
        }
        dcp.save(state, checkpoint_id=os.path.join(folder, f"dcp-{name}"))
        full_opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
        full = {
            "model": get_model_state_dict(model, options=full_opts),
            "optim": get_optimizer_state_dict(model, opt, options=full_opts),
        }
        if dist.get_rank() == 0:
            torch.save(full, os.path.join(folder, f"full-{name}.pt"))
        dist.barrier()
        after = train_llama(model, opt, range(2, 4))
    return {"losses": losses, "after": after}


def dcp_load(name: str, folder: str, saved_by: str) -> dict[str, list[float]]:
    """On a different world size: load ``saved_by``'s sharded and full checkpoints into a fresh
    model and optimizer and train the same 2 steps."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    out: dict[str, list[float]] = {}
    with engine(name):
        for kind in ("sharded", "full"):
            model = tiny_llama()
            shard_llama(model)
            check_units(model, name)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
            if kind == "sharded":
                state = {
                    "model": get_model_state_dict(model),
                    "optim": get_optimizer_state_dict(model, opt),
                }
                dcp.load(state, checkpoint_id=os.path.join(folder, f"dcp-{saved_by}"))
                set_model_state_dict(model, state["model"])
                set_optimizer_state_dict(model, opt, state["optim"])
            else:
                opts = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
                full: dict[str, Any] = {"model": {}, "optim": {}}
                if dist.get_rank() == 0:
                    full = torch.load(os.path.join(folder, f"full-{saved_by}.pt"))
                set_model_state_dict(model, full["model"], options=opts)
                set_optimizer_state_dict(model, opt, full["optim"], options=opts)
            out[kind] = train_llama(model, opt, range(2, 4))
    return out


# ---------------------------------------------------------------------------- pipelining
PP_MICRO, PP_PER_REPLICA = 4, 8  # micro-batches per step; rows per data-parallel replica


def _pp_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(12, 16), nn.Tanh(), nn.Linear(16, 16),  # stage 0
        nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 5),  # stage 1
    )  # fmt: skip


def _pp_stage(model: nn.Sequential, stage: int) -> nn.Sequential:
    return model[:3] if stage == 0 else model[3:]


def _pp_batch(step: int, replica: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(70 + step)
    x, y = (
        torch.randn(2 * PP_PER_REPLICA, 12, generator=g),
        torch.randn(2 * PP_PER_REPLICA, 5, generator=g),
    )
    rows = slice(replica * PP_PER_REPLICA, (replica + 1) * PP_PER_REPLICA)
    return x[rows], y[rows]


def pipelining_client(name: str) -> dict[str, Any]:
    """torch.distributed.pipelining on 4 ranks: 2 pipeline stages x 2 data-parallel replicas
    (mesh ``(pp, dp)``). Each stage's module is a fully_shard root over its ``dp`` sub-mesh
    with one inner unit; Schedule1F1B runs 4 micro-batches per step, so the schedule's FSDP2
    path runs (no gradient sync for the early micro-batches, the reduction at the end through
    ``fully_shard.state``). Returns the global loss per step (last stage) and the stage's
    full weights."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    import fullshard

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    stage_index, replica = mesh.get_local_rank("pp"), mesh.get_local_rank("dp")
    with engine(name):
        from torch.distributed.fsdp import fully_shard

        module = _pp_stage(_pp_model(), stage_index)
        inner = module[0] if stage_index == 0 else module[1]
        fully_shard(inner, mesh=mesh["dp"])
        fully_shard(module, mesh=mesh["dp"])
        check_units(module, name)
        stage = PipelineStage(
            module, stage_index, 2, torch.device("cpu"), group=mesh["pp"].get_group()
        )
        schedule = Schedule1F1B(stage, n_microbatches=PP_MICRO, loss_fn=nn.functional.mse_loss)
        opt = torch.optim.SGD(module.parameters(), lr=0.1)
        losses, reductions = [], []
        for step in range(3):
            x, y = _pp_batch(step, replica)
            mb_losses: list[torch.Tensor] = []
            with fullshard.count_collectives() as stats:
                if stage_index == 0:
                    schedule.step(x)
                else:
                    schedule.step(target=y, losses=mb_losses)
            reductions.append(stats.calls("reduce_scatter"))
            opt.step()
            opt.zero_grad()
            if stage_index == 1:
                loss = torch.stack(mb_losses).mean().detach()
                dist.all_reduce(loss, group=mesh["dp"].get_group())
                losses.append(loss.item() / 2)
        weights = [p.full_tensor() for p in module.parameters()]
    return {"losses": losses, "reductions": reductions, "weights": weights, "stage": stage_index}


def pipelining_reference() -> dict[str, Any]:
    """The same 3 steps on one process: the unsharded model, every replica's micro-batches,
    loss = the mean over replicas of the mean over micro-batches (what 1F1B + FSDP compute)."""
    model = _pp_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for step in range(3):
        per_replica = []
        for replica in range(2):
            x, y = _pp_batch(step, replica)
            mbs = [
                nn.functional.mse_loss(model(a), b)
                for a, b in zip(x.chunk(PP_MICRO), y.chunk(PP_MICRO))
            ]
            per_replica.append(torch.stack(mbs).mean())
        loss = torch.stack(per_replica).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    weights = {s: [p.detach() for p in _pp_stage(model, s).parameters()] for s in (0, 1)}
    return {"losses": losses, "weights": weights}


# -------------------------------------------------------------------------------- Fabric
class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList([nn.Linear(12, 12) for _ in range(2)])
        self.out = nn.Linear(12, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = torch.tanh(b(x))
        return self.out(x)


def _parallelize(model: nn.Module, mesh: Any) -> nn.Module:
    from torch.distributed.fsdp import fully_shard

    for b in model.blocks:
        fully_shard(b, mesh=mesh["data_parallel"])
    fully_shard(model, mesh=mesh["data_parallel"])
    return model


def fabric_client(name: str, folder: str) -> dict[str, Any]:
    """Lightning Fabric's ModelParallelStrategy (the FSDP2 strategy): gradient accumulation
    with ``fabric.no_backward_sync`` and ``fabric.save`` / ``fabric.load``. The parent passes
    TORCHELASTIC_RUN_ID so Fabric adopts this process group instead of launching its own."""
    from lightning.fabric import Fabric
    from lightning.fabric.strategies import ModelParallelStrategy

    import fullshard

    world = dist.get_world_size()
    with engine(name):
        strategy = ModelParallelStrategy(
            _parallelize, data_parallel_size=world, tensor_parallel_size=1
        )
        fabric = Fabric(accelerator="cpu", devices=world, strategy=strategy)
        fabric.launch()
        model = fabric.setup_module(MLP())
        check_units(model, name)
        opt = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-2))

        def step(i: int) -> tuple[float, list[int]]:
            g = torch.Generator().manual_seed(100 * i + dist.get_rank())
            reduce_scatters, total = [], 0.0
            for micro in range(2):
                x, y = torch.randn(4, 12, generator=g), torch.randn(4, 3, generator=g)
                with fullshard.count_collectives() as stats:
                    with fabric.no_backward_sync(model, enabled=micro == 0):
                        loss = nn.functional.mse_loss(model(x), y)
                        fabric.backward(loss)
                reduce_scatters.append(stats.calls("reduce_scatter"))
                total += global_mean(loss) / 2
            opt.step()
            opt.zero_grad()
            return total, reduce_scatters

        losses, counts = [], []
        for i in range(2):
            loss, c = step(i)
            losses.append(loss)
            counts.append(c)
        path = os.path.join(folder, f"fabric-{name}")
        fabric.save(path, {"model": model, "optimizer": opt})
        after = [step(i)[0] for i in range(2, 4)]
        fabric.load(path, {"model": model, "optimizer": opt})
        again = [step(i)[0] for i in range(2, 4)]
    return {"losses": losses, "reduce_scatters": counts, "after": after, "again": again}


# ---------------------------------------------------------------------------- Accelerate
def _fsdp2_accelerator(plugin: Any) -> Any:
    """An Accelerator on Accelerate's FSDP2 path. Accelerate picks FSDP only on accelerators
    (on CPU it falls back to DDP), so on a CPU machine the distributed type is set to FSDP by
    hand after construction; everything after that (prepare's fully_shard calls, save_state /
    load_state through DCP) is Accelerate's own FSDP2 code."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState, PartialState
    from accelerate.utils import DistributedType

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    acc = Accelerator(fsdp_plugin=plugin, cpu=not torch.cuda.is_available())
    if acc.distributed_type is not DistributedType.FSDP:
        acc.state.distributed_type = DistributedType.FSDP
        acc.state.fsdp_plugin = plugin
        PartialState._shared_state["distributed_type"] = DistributedType.FSDP
    return acc


def accelerate_client(name: str, folder: str) -> dict[str, Any]:
    """Accelerate's FSDP2 plugin (fsdp_version=2, torch's MixedPrecisionPolicy and
    OffloadPolicy objects built by Accelerate): prepare, train, save_state, load_state."""
    from accelerate.utils import FullyShardedDataParallelPlugin

    with engine(name):
        plugin = FullyShardedDataParallelPlugin(
            fsdp_version=2, reshard_after_forward=True, state_dict_type="SHARDED_STATE_DICT"
        )
        acc = _fsdp2_accelerator(plugin)
        model = tiny_llama(tie=True)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        model, opt = acc.prepare(model, opt)
        check_units(model, name)
        assert acc.is_fsdp2

        def train(steps: range) -> list[float]:
            out = []
            for s in steps:
                ids = batch(s)
                loss = model(input_ids=ids, labels=ids).loss
                acc.backward(loss)
                opt.step()
                opt.zero_grad()
                out.append(global_mean(loss))
            return out

        losses = train(range(3))
        path = os.path.join(folder, f"accelerate-{name}")
        acc.save_state(path)
        after = train(range(3, 5))
        acc.load_state(path)
        again = train(range(3, 5))
    return {"losses": losses, "after": after, "again": again}


# ------------------------------------------------------------------------------- spawns
def two_ranks(folder: str) -> dict[str, Any]:
    """Everything that runs on 2 ranks, each client under both engines (one spawn)."""
    out: dict[str, Any] = {}
    for name in ("torch", "fullshard"):
        out[name] = {
            "transformers": transformers_client(name, folder),
            "dcp": dcp_save(name, folder),
            "fabric": fabric_client(name, folder),
            "accelerate": accelerate_client(name, folder),
        }
    return out


def four_ranks() -> dict[str, Any]:
    """Pipelining: 2 stages x 2 data-parallel ranks, under both engines, and the reference."""
    out: dict[str, Any] = {name: pipelining_client(name) for name in ("torch", "fullshard")}
    out["reference"] = pipelining_reference()
    return out


def three_ranks(folder: str) -> dict[str, Any]:
    """DCP: the 2-rank checkpoints loaded on 3 ranks, by each engine (and across engines)."""
    return {
        "torch": dcp_load("torch", folder, "torch"),
        "fullshard": dcp_load("fullshard", folder, "fullshard"),
        "fullshard_from_torch": dcp_load("fullshard", folder, "torch"),
    }
