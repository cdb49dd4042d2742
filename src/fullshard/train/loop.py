"""The training job's entry on each rank: join the process group torchrun set up, then run
the training (``fullshard.train.session``: build, shard, resume, step, evaluate, save, sample).
"""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from fullshard.train.config import TrainConfig
from fullshard.train.degrees import resolve
from fullshard.train.failures import ATTEMPT_ENV, attempt_number
from fullshard.train.session import DistEnv, TrainingRun

__all__ = ["DistEnv", "train"]


def _rendezvous_store(rank: int, world: int, launches: int) -> tuple[dist.Store | None, int]:
    """The store the process group meets in, namespaced by the elastic attempt, and that
    attempt's number (``launches``, the launcher's own restarts, outside torchelastic).

    [Note: stale keys after an elastic restart] torchrun's agent shares one TCPStore with its
    workers across restarts, and the default process group writes the same keys every
    attempt, so a restarted rank can read a dead peer's address and fail to connect. A
    per-attempt prefix keeps each attempt's keys apart. The attempt is counted in the store
    itself (how many times this rank has joined it), not taken from the agent's
    ``TORCHELASTIC_RESTART_COUNT``: on several machines that count is per agent, and an agent
    that restarts its ranks because another node's did (a membership change, which torchrun
    does not count as a restart) would otherwise pick another prefix than the failed node's
    and never meet it. ``launches`` adds ``fullshard train``'s own relaunches (each a fresh
    store). ``(None, launches)`` outside torchelastic.
    """
    env = os.environ
    if "TORCHELASTIC_RUN_ID" not in env or "MASTER_ADDR" not in env:
        return None, launches
    agent_hosts = env.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = dist.TCPStore(
        env["MASTER_ADDR"],
        int(env["MASTER_PORT"]),
        world,
        is_master=not agent_hosts and rank == 0,
        timeout=timedelta(minutes=10),
        multi_tenant=True,
    )
    joins = int(store.add(f"fullshard/joins/rank_{rank}", 1))
    # A store that rank 0 hosts itself is new every attempt (joins == 1): the agent's count.
    attempt = launches + max(joins - 1, int(env.get("TORCHELASTIC_RESTART_COUNT", "0")))
    return dist.PrefixStore(f"fullshard/attempt_{attempt}", store), attempt


def init_distributed(cfg: TrainConfig) -> DistEnv:
    """Join the process group torchrun set up (NCCL on GPUs, gloo on CPUs)."""
    env = os.environ
    rank, world = int(env.get("RANK", "0")), int(env.get("WORLD_SIZE", "1"))
    local_rank = int(env.get("LOCAL_RANK", "0"))
    launches = int(env.get(ATTEMPT_ENV, "0") or 0)
    store, restarts = _rendezvous_store(rank, world, launches)
    if store is None:
        restarts = attempt_number()
    node = int(env["LOCAL_WORLD_SIZE"]) if "LOCAL_WORLD_SIZE" in env else None
    degrees = resolve(cfg, world, node_size=node)
    kwargs: dict[str, Any] = {"timeout": timedelta(seconds=cfg.collective_timeout)}
    if store is not None:
        kwargs |= {"store": store, "rank": rank, "world_size": world}
    use_cuda = cfg.device == "cuda" or (cfg.device == "auto" and torch.cuda.is_available())
    if use_cuda:
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device, **kwargs)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo", **kwargs)
    return DistEnv(rank, world, local_rank, restarts, device, degrees)


def train(cfg: TrainConfig, env: DistEnv) -> int:
    """Run training on this rank; returns the process exit code (0 also after Ctrl-C)."""
    if cfg.ft_lighthouse:  # one replica group of a torchft job (fullshard.train.ft)
        from fullshard.train.ft import FTTrainingRun

        return FTTrainingRun(cfg, env).run()
    return TrainingRun(cfg, env).run()
