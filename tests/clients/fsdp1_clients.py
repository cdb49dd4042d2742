"""FSDP1 client scripts of ``test_clients.py``: each runs once under torch's FSDP1, once under
fullshard (the same code with ``fullshard.patch_torch_fsdp()`` active, which rebinds torch's
``FullyShardedDataParallel``), in one spawn, and returns its global losses.

- Accelerate's FSDP plugin with ``fsdp_version=1``: ``prepare`` wraps the model in
  ``FullyShardedDataParallel`` with Accelerate's transformer auto-wrap policy;
  ``save_state`` / ``load_state`` with a sharded (DCP) and a full state dict.
- transformers' ``Trainer`` with ``fsdp="full_shard auto_wrap"`` and an FSDP1 ``fsdp_config``.
- Lightning's ``FSDPStrategy`` (FSDP1): Fabric's (``setup_module`` / ``setup_optimizers`` /
  ``backward`` / ``clip_gradients``, ``save`` / ``load`` sharded and full) with
  ``use_orig_params`` ``True`` (Lightning's default) and ``False``, and the Trainer's (``fit``,
  a checkpoint each epoch, a resume from one). Both run inside this process group (the parent
  sets ``TORCHELASTIC_RUN_ID``: Lightning then launches no processes).

Accelerate selects FSDP only on accelerators (on a CPU it falls back to DDP), and the Trainer
enables FSDP only when its Accelerator did, so on a CPU machine the Accelerator's distributed
type is set to FSDP by hand after construction (:func:`to_fsdp`; the Trainer through a subclass
that does it in ``create_accelerator_and_postprocess``). Everything after that is Accelerate's
and the Trainer's own FSDP1 code. torch's FSDP1 cannot run ``sync_module_states`` on a CPU
(it wants accelerator tensors), so both engines run with it off (every rank builds the model
from the same seed instead). Lightning refuses ``FSDPStrategy`` off GPUs, and hands FSDP1 a
``device_id`` torch's FSDP1 refuses on a CPU: see :func:`cpu_fsdp_strategy`.
"""

from __future__ import annotations

import os
import types
from typing import Any

import torch
import torch.distributed as dist

from clients import GLOBAL_BATCH, SEQ, batch, engine, global_mean, tiny_llama

UNITS = 3  # two decoder layers and the root


def to_fsdp(acc: Any, plugin: Any) -> None:
    """Put ``acc`` on Accelerate's FSDP path (it chose DDP: no accelerator here), on device
    ``cpu``: Accelerate's ``cpu:0``, which it passes as ``device_id``, is refused by torch's
    FSDP1 (it compares it with ``cpu``)."""
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType

    if acc.distributed_type is not DistributedType.FSDP:
        acc.state.distributed_type = DistributedType.FSDP
        acc.state.fsdp_plugin = plugin
        PartialState._shared_state["distributed_type"] = DistributedType.FSDP
        acc.state.device = PartialState._shared_state["device"] = torch.device("cpu")


def reset_accelerate() -> None:
    """Forget the previous run's Accelerator (Accelerate keeps its state per process)."""
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()


def check_wrappers(model: torch.nn.Module, name: str) -> None:
    """The FSDP1 wrappers are fullshard's exactly when fullshard runs."""
    import fullshard

    wrappers = [m for m in model.modules() if type(m).__name__ == "FullyShardedDataParallel"]
    assert len(wrappers) == UNITS, (name, len(wrappers))
    ours = [isinstance(m, fullshard.FullyShardedDataParallel) for m in wrappers]
    assert all(ours) if name == "fullshard" else not any(ours), (name, ours)


# ---------------------------------------------------------------------------- Accelerate
def _state_dict_type(plugin: Any, kind: str) -> None:
    """Switch the plugin's state-dict type, with that type's default configs."""
    plugin.state_dict_config = plugin.optim_state_dict_config = None
    plugin.set_state_dict_type(kind)


def _prepared(name: str, mixed_precision: str) -> tuple[Any, Any, Any, Any]:
    """Accelerate's FSDP1 plugin preparing the tiny Llama and an AdamW built on the unwrapped
    model (``use_orig_params=True`` allows it): (accelerator, plugin, model, optimizer)."""
    from accelerate import Accelerator
    from accelerate.utils import FullyShardedDataParallelPlugin

    reset_accelerate()
    plugin = FullyShardedDataParallelPlugin(
        fsdp_version=1,
        reshard_after_forward="FULL_SHARD",
        auto_wrap_policy="transformer_based_wrap",
        use_orig_params=True,
        sync_module_states=False,
        state_dict_type="SHARDED_STATE_DICT",
    )
    acc = Accelerator(
        fsdp_plugin=plugin, cpu=not torch.cuda.is_available(), mixed_precision=mixed_precision
    )
    to_fsdp(acc, plugin)
    model = tiny_llama(tie=True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, opt = acc.prepare(model, opt)
    check_wrappers(model, name)
    assert not acc.is_fsdp2
    return acc, plugin, model, opt


def _train(acc: Any, model: Any, opt: Any, steps: range) -> list[float]:
    out = []
    for s in steps:
        ids = batch(s)
        loss = model(input_ids=ids, labels=ids).loss
        acc.backward(loss)
        opt.step()
        opt.zero_grad()
        out.append(global_mean(loss))
    return out


def accelerate_client(name: str, folder: str) -> dict[str, Any]:
    """fp32: 3 steps, ``save_state`` under SHARDED_STATE_DICT (DCP) and FULL_STATE_DICT
    (fullshard only, see below), 2 more steps, then each state loaded and the same 2 steps
    again. bf16 (Accelerate's ``mixed_precision="bf16"``: autocast and FSDP1's
    ``MixedPrecision``): 3 steps."""
    with engine(name):
        acc, plugin, model, opt = _prepared(name, "no")
        losses = _train(acc, model, opt, range(3))
        # Accelerate saves full state dicts with offload_to_cpu, which crashes torch's FSDP1 on
        # a CPU (a segfault in its state_dict()): torch runs the sharded round trip only
        kinds = ("SHARDED_STATE_DICT",) + (("FULL_STATE_DICT",) if name == "fullshard" else ())
        paths = {kind: os.path.join(folder, f"accelerate1-{name}-{kind}") for kind in kinds}
        for kind, path in paths.items():
            _state_dict_type(plugin, kind)
            acc.save_state(path)
        after = _train(acc, model, opt, range(3, 5))
        again = {}
        for kind, path in paths.items():
            _state_dict_type(plugin, kind)
            acc.load_state(path)
            again[kind] = _train(acc, model, opt, range(3, 5))
        acc, _, model, opt = _prepared(name, "bf16")
        bf16 = _train(acc, model, opt, range(3))
    return {"losses": losses, "after": after, "again": again, "bf16": bf16}


# ------------------------------------------------------------------------------ Trainer
class _Rows(torch.utils.data.Dataset):  # type: ignore[type-arg]
    """The clients' global batches, one sequence a row (the Trainer's sampler splits them)."""

    def __init__(self, steps: int) -> None:
        g = torch.Generator().manual_seed(7)
        from clients import VOCAB

        self.ids = torch.randint(0, VOCAB, (steps * GLOBAL_BATCH, SEQ), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def _cpu_fsdp_trainer() -> type:
    """A ``Trainer`` on Accelerate's FSDP path on a CPU machine (see the module docstring)."""
    from transformers import Trainer

    class CPUFSDPTrainer(Trainer):  # type: ignore[misc]
        def create_accelerator_and_postprocess(self) -> None:
            super().create_accelerator_and_postprocess()
            from accelerate.utils import FullyShardedDataParallelPlugin

            if not self.is_fsdp_enabled:
                plugin = FullyShardedDataParallelPlugin(**self.args.fsdp_plugin_args)
                to_fsdp(self.accelerator, plugin)
                self.is_fsdp_enabled = True

    return CPUFSDPTrainer


def _trainer(name: str, out: str, steps: int) -> Any:
    """A Trainer with ``fsdp="full_shard auto_wrap"`` and an FSDP1 ``fsdp_config`` wrapping each
    ``LlamaDecoderLayer``; AdamW at a constant learning rate, a checkpoint every 2 steps
    (SHARDED_STATE_DICT: its default FULL_STATE_DICT offloads to the CPU, which crashes torch's
    FSDP1 there, see ``accelerate_client``)."""
    from transformers import TrainingArguments

    reset_accelerate()
    args = TrainingArguments(
        output_dir=out,
        fsdp="full_shard auto_wrap",
        fsdp_config={
            "version": 1,
            "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"],
            "sync_module_states": False,
            "use_orig_params": True,
            "state_dict_type": "SHARDED_STATE_DICT",
        },
        per_device_train_batch_size=GLOBAL_BATCH // dist.get_world_size(),
        max_steps=steps,
        learning_rate=1e-2,
        lr_scheduler_type="constant",
        logging_steps=1,
        save_strategy="steps",
        save_steps=2,
        report_to=[],
        use_cpu=True,
        seed=0,
        disable_tqdm=True,
    )
    return _cpu_fsdp_trainer()(model=tiny_llama(), args=args, train_dataset=_Rows(steps))


def trainer_client(name: str, folder: str) -> dict[str, Any]:
    """transformers' Trainer on FSDP1: 4 steps (the logged global losses and gradient norms:
    it clips to 1.0 by default), then a fresh Trainer resuming from the step-2 checkpoint."""
    out = os.path.join(folder, f"trainer1-{name}")
    with engine(name):
        trainer = _trainer(name, out, 4)
        trainer.train()
        check_wrappers(trainer.model, name)
        logged = [e for e in trainer.state.log_history if "loss" in e]
        resumed = _trainer(name, out, 4)
        resumed.train(resume_from_checkpoint=os.path.join(out, "checkpoint-2"))
        check_wrappers(resumed.model, name)
        again = [e["loss"] for e in resumed.state.log_history if "loss" in e]
    return {
        "losses": [e["loss"] for e in logged],
        "grad_norms": [float(e["grad_norm"]) for e in logged],
        "resumed": again[-2:],
    }


# ---------------------------------------------------------------------------- Lightning
def cpu_fsdp_strategy(base: type, wraps: str) -> type:
    """Lightning's ``FSDPStrategy`` (``base``: Fabric's or the Trainer's) on a CPU machine.
    Lightning refuses it off a GPU by an exact type check (a subclass passes), and builds FSDP1
    with ``device_id=root_device.index``, ``None`` on a CPU, which torch's FSDP1 refuses ("FSDP
    needs a non-CPU accelerator device"); so while ``wraps`` (the method that builds the
    wrapper) runs, the root device's ``index`` is the CPU device. The rest is Lightning's."""

    class CPUFSDPStrategy(base):  # type: ignore[misc,valid-type]
        _wrapping = False

        @property
        def root_device(self) -> Any:
            if self._wrapping:
                return types.SimpleNamespace(index=torch.device("cpu"), type="cpu")
            return super().root_device

    def wrap(self: Any, module: torch.nn.Module) -> torch.nn.Module:
        self._wrapping = True
        try:
            return getattr(base, wraps)(self, module)  # type: ignore[no-any-return]
        finally:
            self._wrapping = False

    setattr(CPUFSDPStrategy, wraps, wrap)
    return CPUFSDPStrategy


def _full_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's full state dict, on every rank (FSDP1's FULL_STATE_DICT, no offload)."""
    from torch.distributed.fsdp import FullStateDictConfig, StateDictType
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    root = FSDP.fsdp_modules(model, root_only=True)[0]
    config = FullStateDictConfig(offload_to_cpu=False, rank0_only=False)
    with FSDP.state_dict_type(root, StateDictType.FULL_STATE_DICT, config):
        return {k: v.detach().clone() for k, v in root.state_dict().items()}


def _fabric_run(name: str, folder: str, orig: bool, kind: str) -> dict[str, Any]:
    """Fabric with ``FSDPStrategy(use_orig_params=orig, state_dict_type=kind)``, wrapping each
    decoder layer: 3 steps (clipped to 1.0), ``fabric.save``, 2 more steps, ``fabric.load`` and
    the same 2 steps again; then, under fullshard, torch's sharded checkpoint of the same run
    loaded and the 2 steps again."""
    from lightning.fabric import Fabric
    from lightning.fabric.strategies import FSDPStrategy
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    strategy = cpu_fsdp_strategy(FSDPStrategy, "setup_module")(
        auto_wrap_policy={LlamaDecoderLayer}, use_orig_params=orig, state_dict_type=kind
    )
    fabric = Fabric(accelerator="cpu", devices=dist.get_world_size(), strategy=strategy)
    fabric.launch()
    model = fabric.setup_module(tiny_llama())
    check_wrappers(model, name)
    opt = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-2))

    def train(steps: range) -> list[float]:
        out = []
        for s in steps:
            ids = batch(s)
            loss = model(input_ids=ids, labels=ids).loss
            fabric.backward(loss)
            fabric.clip_gradients(model, opt, max_norm=1.0)
            opt.step()
            opt.zero_grad()
            out.append(global_mean(loss))
        return out

    def load(path: str) -> list[float]:
        state = {"model": model, "optimizer": opt, "step": 0}
        fabric.load(path, state)
        assert state["step"] == 3, state["step"]
        return train(range(3, 5))

    out: dict[str, Any] = {"losses": train(range(3))}
    path = os.path.join(folder, f"fabric1-{name}-{orig}-{kind}")
    fabric.save(path, {"model": model, "optimizer": opt, "step": 3})
    out["after"] = train(range(3, 5))
    out["again"] = load(path)
    out["weights"] = _full_weights(model)
    if name == "fullshard" and kind == "sharded":
        out["from_torch"] = load(path.replace("-fullshard-", "-torch-"))
    return out


def fabric_client(name: str, folder: str) -> dict[str, Any]:
    """Lightning Fabric's FSDPStrategy: sharded checkpoints with ``use_orig_params`` True and
    False; full ones under fullshard only (Lightning's full save offloads to the CPU, which
    crashes torch's FSDP1 there, as Accelerate's)."""
    runs = [(True, "sharded"), (False, "sharded")]
    runs += [(True, "full"), (False, "full")] if name == "fullshard" else []
    with engine(name):
        return {f"{orig}-{kind}": _fabric_run(name, folder, orig, kind) for orig, kind in runs}


def _lightning_trainer(name: str, folder: str, kind: str) -> tuple[Any, Any, Any]:
    """The Trainer's FSDPStrategy (``use_orig_params=False``: the optimizer is built on
    ``trainer.model``'s parameters, each decoder layer wrapped), 4 steps over epochs of 2
    batches, a ``kind`` checkpoint at each epoch's end: (trainer, module, loader)."""
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.strategies import FSDPStrategy
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    class Llama(pl.LightningModule):  # type: ignore[misc]
        """Step ``global_step`` trains on ``batch(global_step)`` (the loader's items are
        placeholders), so a resumed run sees the batches of the steps it resumes (resumed from
        a checkpoint saved at an epoch's end, Lightning's loop draws the loader's first batch
        again, under either engine)."""

        def __init__(self) -> None:
            super().__init__()
            self.model = tiny_llama()
            self.losses: list[float] = []

        def training_step(self, _rows: Any, _i: int) -> torch.Tensor:
            ids = batch(self.global_step)
            loss = self.model(input_ids=ids, labels=ids).loss
            self.losses.append(global_mean(loss))
            return loss  # type: ignore[no-any-return]

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.trainer.model.parameters(), lr=1e-2)

    strategy = cpu_fsdp_strategy(FSDPStrategy, "_setup_model")(
        auto_wrap_policy={LlamaDecoderLayer}, use_orig_params=False, state_dict_type=kind
    )
    out = os.path.join(folder, f"lightning1-{name}")
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=dist.get_world_size(),
        strategy=strategy,
        max_steps=4,
        callbacks=[ModelCheckpoint(dirpath=out, filename="{step}", save_top_k=-1)],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=out,
    )
    placeholders = torch.utils.data.TensorDataset(torch.zeros(2 * dist.get_world_size()))
    return trainer, Llama(), torch.utils.data.DataLoader(placeholders)


def lightning_trainer_client(name: str, folder: str) -> dict[str, Any]:
    """Lightning's Trainer on FSDP1: 4 steps (2 epochs), then a fresh Trainer resuming from the
    step-2 checkpoint. Full checkpoints (the Trainer's default) under fullshard, sharded under
    torch (its full save crashes on a CPU, see ``fabric_client``)."""
    kind = "full" if name == "fullshard" else "sharded"
    with engine(name):
        trainer, module, loader = _lightning_trainer(name, folder, kind)
        trainer.fit(module, loader)
        check_wrappers(trainer.model, name)
        ckpt = os.path.join(folder, f"lightning1-{name}", "step=2.ckpt")
        resumed, again, loader = _lightning_trainer(name, folder, kind)
        resumed.fit(again, loader, ckpt_path=ckpt)
        check_wrappers(resumed.model, name)
    return {"losses": module.losses, "resumed": again.losses, "full": os.path.isfile(ckpt)}


def two_ranks(folder: str) -> dict[str, Any]:
    """Every FSDP1 client on 2 ranks, each under both engines (one spawn)."""
    return {
        name: {
            "accelerate": accelerate_client(name, folder),
            "trainer": trainer_client(name, folder),
            "fabric": fabric_client(name, folder),
            "lightning": lightning_trainer_client(name, folder),
        }
        for name in ("torch", "fullshard")
    }
