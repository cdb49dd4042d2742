"""One benchmark run on one rank: build, wrap per mode, train, time, meter memory and traffic.

Runs inside :func:`fullshard.testing.run_distributed` children (gloo on loopback). Peers are
imported lazily here, never at ``import fullshard`` time.
"""

from __future__ import annotations

import gc
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from fullshard.bench.comm import KINDS, CommMeter, ddp_comm_per_step
from fullshard.bench.configs import ENGINE_MODES, FSDP1_MODES, PEER_MODES, BenchConfig
from fullshard.memory.tracker import current_rss_bytes, peak_rss_bytes, reset_peak_rss
from fullshard.models import GPT, GPTConfig
from fullshard.optim import local_step
from fullshard.peers import load_fully_shard, load_peer, load_torch_fsdp1

__all__ = [
    "Trainee",
    "corpus",
    "make_batches",
    "make_optimizer",
    "model_config",
    "run_rank",
    "train_with",
    "wrap",
]


def model_config(cfg: BenchConfig) -> GPTConfig:
    # Untied: torch FSDP2 refuses a parameter shared across units (the peers must run as-is).
    return GPTConfig(
        vocab_size=cfg.vocab_size,
        seq_len=cfg.seq_len,
        n_layer=cfg.n_layer,
        d_model=cfg.d_model,
        n_head=cfg.n_head,
        tie_embeddings=False,
    )


def corpus() -> torch.Tensor:
    """The training bytes: torch's own ``nn/modules/*.py``, in sorted order (same everywhere)."""
    root = Path(nn.__file__).parent / "modules"
    data = b"".join(p.read_bytes() for p in sorted(root.glob("*.py")))
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).long()


def make_batches(
    cfg: BenchConfig, global_batch: int, rank: int, world: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """This rank's (inputs, targets) for every step: its contiguous slice of a fixed global batch."""
    data = corpus()
    gen = torch.Generator().manual_seed(cfg.seed)
    per_rank = global_batch // world
    lo, hi = rank * per_rank, (rank + 1) * per_rank
    out = []
    for _ in range(cfg.steps):
        starts = torch.randint(0, data.numel() - cfg.seq_len - 1, (global_batch,), generator=gen)
        rows = torch.stack([data[s : s + cfg.seq_len + 1] for s in starts.tolist()])[lo:hi]
        out.append((rows[:, :-1].contiguous(), rows[:, 1:].contiguous()))
    return out


def wrap(model: GPT, mode: str, reshard_after_forward: bool, transport: str = "auto") -> nn.Module:
    """Apply ``mode``'s parallelism from outside the model: blocks first, then the root.

    ``transport`` selects fullshard's ``CommPolicy(transport=...)`` (ignored by other modes).
    """
    if mode in ("fsdp2", "fullshard"):
        fully_shard = load_fully_shard(mode)
        kw: dict[str, Any] = {"reshard_after_forward": reshard_after_forward}
        if mode == "fullshard":
            from fullshard.engine import CommPolicy

            kw["comm_policy"] = CommPolicy(transport=transport)
        for block in model.blocks:
            fully_shard(block, **kw)
        fully_shard(model, **kw)
        return model
    if mode in FSDP1_MODES:
        return _wrap_fsdp1(model, mode, reshard_after_forward)
    if mode == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel(model)
    if mode in ("single", "nocomm"):
        return model
    raise ValueError(f"unknown mode {mode!r}")


def _wrap_fsdp1(model: GPT, mode: str, reshard_after_forward: bool) -> nn.Module:
    """``FullyShardedDataParallel`` (fullshard's or torch's) with FSDP1's defaults, each block
    auto-wrapped: ``FULL_SHARD``, or ``SHARD_GRAD_OP`` without resharding after forward."""
    import torch.distributed.fsdp.wrap as policies
    from torch.distributed.fsdp import ShardingStrategy

    if mode == "fsdp1-fullshard":
        from fullshard.fsdp1 import FullyShardedDataParallel

        cls: type = FullyShardedDataParallel
    else:
        cls = load_torch_fsdp1()
    strategy = (
        ShardingStrategy.FULL_SHARD if reshard_after_forward else ShardingStrategy.SHARD_GRAD_OP
    )
    return cls(  # type: ignore[no-any-return]
        model,
        sharding_strategy=strategy,
        auto_wrap_policy=policies.ModuleWrapPolicy({type(model.blocks[0])}),
        device_id=torch.device("cpu"),  # gloo ranks (torch's FSDP1 wants it said on a CPU)
    )


def make_optimizer(net: nn.Module, cfg: BenchConfig, mode: str) -> torch.optim.Optimizer:
    """Every mode's AdamW; fullshard's steps on the local shards unless ``cfg.local_step`` is
    off (bitwise the DTensor step, tests/test_optim_local.py, without DTensor's dispatch)."""
    opt = torch.optim.AdamW(net.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=0.1)
    if mode in ENGINE_MODES and cfg.local_step:
        local_step(opt)
    return opt


@dataclass(frozen=True)
class Trainee:
    """What the training loop calls, whoever owns forward, backward and the optimizer step."""

    forward: Callable[[torch.Tensor], torch.Tensor]
    backward: Callable[[torch.Tensor], None]
    step: Callable[[], None]
    """The optimizer step, then the gradients zeroed (set to ``None``)."""
    peer: Any = None
    """A whole-engine peer (``fullshard.peers.load_peer``), for its meter hooks and config."""


def train_with(model: GPT, cfg: BenchConfig, mode: str, micro_batch: int) -> Trainee:
    """``mode``'s parallelism and optimizer around ``model``: ``fully_shard`` / DDP applied from
    outside and the AdamW stepped by the loop, or a peer engine that takes both and owns its
    backward and step (DeepSpeed, with the same AdamW)."""
    if mode in PEER_MODES:
        engine = load_peer(mode).ZeRO3(model, make_optimizer(model, cfg, mode), micro_batch)
        return Trainee(engine, engine.backward, engine.step, engine)
    net = wrap(model, mode, cfg.reshard_after_forward, cfg.transport)
    opt = make_optimizer(net, cfg, mode)

    def step() -> None:
        opt.step()
        opt.zero_grad(set_to_none=True)

    return Trainee(net, torch.Tensor.backward, step)


class _EngineMeter:
    """fullshard's own recorder (``fullshard.count_collectives``) behind :class:`CommMeter`'s API.

    The engine records every collective it issues (kind, bytes on the wire by the same
    convention) and the time spent waiting on its handles.
    """

    def __init__(self) -> None:
        from fullshard import count_collectives  # type: ignore[attr-defined]

        self._cm = count_collectives()
        self._stats = self._cm.__enter__()

    def reset(self) -> None:
        self._stats.reset()

    def uninstall(self) -> None:
        self._cm.__exit__(None, None, None)

    def snapshot(self) -> dict[str, Any]:
        by_kind = self._stats.by_kind()
        return {
            "calls": {k: by_kind.get(k, {}).get("calls", 0) for k in KINDS},
            "bytes": {k: by_kind.get(k, {}).get("bytes", 0) for k in KINDS},
            "blocked_s": float(self._stats.wait_seconds),
        }


def _meter(mode: str, trainee: Trainee) -> Any:
    if mode in ENGINE_MODES:
        try:
            return _EngineMeter()
        except ImportError:  # an engine without the recorder: meter it like the peers
            return CommMeter().install()
    if mode in ("fsdp2", "fsdp1"):
        return CommMeter().install()
    if trainee.peer is not None:
        return CommMeter().install(also=trainee.peer.cached_collectives())
    return None


def _comm_per_step(meter: Any, trainee: Any, mode: str, timed: int) -> dict[str, Any] | None:
    """The metered traffic per timed step and where it was read from (``None``: unmetered)."""
    if meter is not None:
        meter.uninstall()
        comm: dict[str, Any] = meter.snapshot()
        comm["calls"] = {k: v / timed for k, v in comm["calls"].items()}
        comm["bytes"] = {k: v / timed for k, v in comm["bytes"].items()}
        comm["blocked_s"] = comm["blocked_s"] / timed
        comm["source"] = (
            "fullshard.count_collectives"
            if isinstance(meter, _EngineMeter)
            else "torch.distributed wrappers"
            + (" and the engine's bound collectives" if trainee.peer is not None else "")
        )
        return comm
    if mode == "ddp":
        comm = ddp_comm_per_step(trainee.forward)
        comm["source"] = "DDP reducer buckets"
        return comm
    return None


def run_rank(cfg_dict: dict[str, Any], mode: str, ref_world: int = 1) -> dict[str, Any]:
    """Train ``cfg.steps`` steps under ``mode`` on this rank; return timings, losses, memory, comm.

    ``single`` (one process) trains the global batch of a ``ref_world``-rank run as
    ``ref_world`` micro-batches — exactly the ranks' slices — with gradient accumulation, so it
    sums gradients in the same grouping as data parallelism: the single-process reference the
    loss check compares against. (One big batch sums in another order; Adam's first steps
    amplify that rounding difference to ~1e-5 relative, which is not a training difference.)
    """
    fields: dict[str, Any] = {
        k: tuple(v) if isinstance(v, list) else v for k, v in cfg_dict.items()
    }
    cfg = BenchConfig(**fields)
    rank, world = dist.get_rank(), dist.get_world_size()
    if mode in PEER_MODES:  # the engine's libraries are runtime, not model memory
        load_peer(mode).load()
    gc.collect()
    rss_runtime = current_rss_bytes()  # interpreter + torch + gloo, before any model memory
    micro = ref_world if mode == "single" else 1
    global_batch = cfg.global_batch(world * micro)
    # [micro-batch][step] -> (inputs, targets); one micro-batch except for `single`
    slices = [
        make_batches(cfg, global_batch, rank * micro + i, world * micro) for i in range(micro)
    ]
    torch.manual_seed(cfg.seed)
    model = GPT(model_config(cfg))
    n_params = model.num_parameters()
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    trainee = train_with(model, cfg, mode, global_batch // world // micro)
    meter = _meter(mode, trainee)
    gc.collect()
    dist.barrier()
    rss_setup = current_rss_bytes()
    hwm_reset = reset_peak_rss()

    times: list[float] = []
    losses: list[float] = []
    for step in range(cfg.steps):
        if step == cfg.warmup and meter is not None:
            meter.reset()
        t0 = time.perf_counter()
        step_loss = 0.0
        for mb in slices:
            x, y = mb[step]
            logits = trainee.forward(x)
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), y.view(-1))
            trainee.backward(loss / micro if micro > 1 else loss)
            step_loss += float(loss.detach()) / micro
        trainee.step()
        times.append(time.perf_counter() - t0)
        losses.append(step_loss)
    timed = cfg.steps - cfg.warmup
    peak_rss = peak_rss_bytes()
    comm = _comm_per_step(meter, trainee, mode, timed)
    return {
        "rank": rank,
        "world_size": world,
        "mode": mode,
        "threads": torch.get_num_threads(),
        "step_s": times[cfg.warmup :],
        "losses": losses,
        "peak_rss_bytes": peak_rss,
        "rss_after_setup_bytes": rss_setup,
        "rss_runtime_bytes": rss_runtime,
        "hwm_reset": hwm_reset,
        "malloc_mmap_threshold": os.environ.get("MALLOC_MMAP_THRESHOLD_"),
        "n_params": n_params,
        "param_bytes": param_bytes,
        "comm": comm,
        "config": asdict(cfg),
        "engine": trainee.peer.describe() if trainee.peer is not None else None,
    }
