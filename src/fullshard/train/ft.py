"""One replica group of a fault-tolerant ``fullshard train`` job under torchft
(``--ft-lighthouse``): :class:`FTTrainingRun`.

Each replica group is one ``fullshard train`` launch (its ranks shard the model, ``--dp-shard``);
the groups meet at a torchft lighthouse. Per step, a torchft ``Manager`` forms a quorum of the
live groups; every unit's all-reduce hook averages its reduced gradient shard over the quorum;
the step is applied only when the quorum commits it. A group that dies drops out (the others
train on, never restarting); started again, it heals live from a healthy group's model,
optimizer and trainer state (step, data position, counters).

[Note: data under torchft] The global batch of committed step ``s`` is the same on every group
(the deterministic sampler, at the position after ``s - 1`` committed steps). It splits into
``--ft-replicas`` x data-parallel parts: rank ``k`` of group ``r`` reads part
``r x group size + k`` (:class:`ReplicaEnv`). A step that does not commit (a group died within
it) is retried with the same batch. A committed step trains on the rows of the groups in its
quorum; the rows of the others are skipped, never read again: rank 0 writes a ``ft`` record per
step to metrics.jsonl (the quorum, the groups in it, the skipped rows and their window starts,
the running count of skipped samples) and a ``heal`` record when the group heals. Which
groups a step averaged is measured, not assumed: one small all-reduce over the quorum, in
which a group torchft does not count contributes zeros. A restarted group heals at the start
of a step (before its forward), so it trains on its rows of that very step.

[Note: non-finite gradients under torchft] The gradients are averaged across the quorum before
the norm is taken, so every group sees the same non-finite norm. Every group still asks the
quorum to commit (the others wait on it), and a committed step with non-finite gradients is a
skipped step exactly as without torchft (no optimizer update, counted, its batch consumed).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, fields
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from fullshard import FSDPModule
from fullshard.train import data as data_mod
from fullshard.train.config import ConfigError, TrainConfig
from fullshard.train.lighthouse import lighthouse_url
from fullshard.train.optim import set_ns_dtype
from fullshard.train.session import DistEnv, TrainingRun, _grad_norm_and_clip

__all__ = ["FTTrainingRun", "ReplicaEnv"]


@dataclass(frozen=True)
class ReplicaEnv(DistEnv):
    """A rank of replica group ``replica`` of ``replicas``: its data-parallel position spans
    every group (see [Note: data under torchft])."""

    replica: int = 0
    replicas: int = 1

    @property
    def dp_rank(self) -> int:
        """Which part of the global batch this rank reads: replica x group size + rank."""
        return self.replica * self.degrees.dp + self.degrees.dp_rank(self.rank)

    @property
    def dp_size(self) -> int:
        """The parts of the global batch: every rank of every replica group."""
        return self.replicas * self.degrees.dp


def _snapshot(value: Any) -> Any:
    """A copy of a nested state dict's tensors (torchft may send it while training goes on)."""
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, dict):
        return {k: _snapshot(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_snapshot(v) for v in value]
    return value


def _manager(cfg: TrainConfig, env: DistEnv, load: Any, save: Any) -> Any:
    """This rank's torchft manager (after the group's own process group is up)."""
    try:
        from torchft import Manager, ProcessGroupGloo, ProcessGroupNCCL
    except ImportError:
        raise ConfigError(
            "--ft-lighthouse needs torchft: pip install 'fullshard[ft]' (Linux)"
        ) from None
    timeout = timedelta(seconds=min(cfg.collective_timeout, 60))
    cuda = env.device.type == "cuda"
    pg = ProcessGroupNCCL(timeout=timeout) if cuda else ProcessGroupGloo(timeout=timeout)
    return Manager(
        pg=pg,
        load_state_dict=load,
        state_dict=save,
        min_replica_size=1,
        use_async_quorum=False,  # a restarted group heals before its first forward
        replica_id=f"fullshard_{cfg.ft_replica_id}",
        lighthouse_addr=lighthouse_url(cfg.ft_lighthouse),  # HOST:PORT works too
        rank=env.rank,
        world_size=env.world_size,
        timeout=timeout,
        quorum_timeout=timedelta(seconds=cfg.collective_timeout),
        connect_timeout=timeout,
    )


class FTTrainingRun(TrainingRun):
    """:class:`~fullshard.train.session.TrainingRun` as one torchft replica group: the same
    data, model, checkpoints and metrics, with steps committed by the quorum."""

    def __init__(self, cfg: TrainConfig, env: DistEnv) -> None:
        self.group_env = env  # the evaluation reads within the group
        values = {f.name: getattr(env, f.name) for f in fields(env)}
        replica_env = ReplicaEnv(**values, replica=cfg.ft_replica_id, replicas=cfg.ft_replicas)
        self.skipped_samples, self.quorum = 0, 0
        self.healed_from: int | None = None
        self._before: dict[str, int] = {}  # the sampler's position at the step's start
        super().__init__(cfg, replica_env)

    # ------------------------------------------------------------------------- setup
    def _build_model(self) -> None:
        super()._build_model()
        self.manager = _manager(self.cfg, self.env, self._load_heal_state, self._heal_state)
        from torchft.process_group import ManagedProcessGroup

        replicas = ManagedProcessGroup(self.manager)

        def average_over_replicas(reduced: torch.Tensor) -> None:
            dist.all_reduce(reduced, group=replicas, op=dist.ReduceOp.AVG)

        for unit in self.model.modules():
            if isinstance(unit, FSDPModule):
                unit.set_all_reduce_hook(average_over_replicas)

    def _resume(self) -> Any:
        resumed = super()._resume()
        if self.start_step:  # the quorum heals whichever group is behind
            self.manager.load_state_dict({"step": self.start_step, "batches_committed": 0})
        return resumed

    def _heal_state(self) -> dict[str, Any]:
        """What a restarted group heals from (torchft's quorum thread calls it while this
        group's main thread waits for the quorum: no step is in flight)."""
        trainer = {
            "step": self.step,
            "tokens": self.tokens_seen,
            "skipped_steps": self.skipped_total,
            "skipped_samples": self.skipped_samples,
            "sampler": self.sampler.state_dict(),
            "scaler": self.scaler.state_dict(),
        }
        model, optim = self.model.state_dict(), self.optimizer.state_dict()
        return {"model": _snapshot(model), "optim": _snapshot(optim), "trainer": trainer}

    def _load_heal_state(self, state: dict[str, Any]) -> None:
        self.model.load_state_dict(state["model"])  # in place: the optimizer keeps them
        self.optimizer.load_state_dict(state["optim"])
        set_ns_dtype(self.optimizer, self.ns_dtype)
        trainer = state["trainer"]
        self.step, self.tokens_seen = int(trainer["step"]), int(trainer["tokens"])
        self.skipped_total = int(trainer["skipped_steps"])
        self.skipped_samples = int(trainer["skipped_samples"])
        self.sampler.load_state_dict(trainer["sampler"])
        self.scaler.load_state_dict(trainer["scaler"])
        self.healed_from = self.step

    # -------------------------------------------------------------------------- run
    def run(self) -> int:
        """Train as one replica group; leave the quorum at the end."""
        try:
            return super().run()
        finally:
            self.manager.shutdown(wait=False)

    def _loop(self, t_start: float) -> str:
        """Steps until ``max_steps`` or a stop; a step not committed is retried."""
        cfg = self.cfg
        while self.step < cfg.max_steps:
            t0 = time.perf_counter()
            lr, loss_sum, grad_norm, members, committed = self._attempt()
            stats = self._exchange(loss_sum, t_start)
            self._report(members, committed)
            if committed:
                self._log_step(stats, lr, grad_norm, time.perf_counter() - t0)
            if self.skipped_in_a_row > cfg.max_skipped_steps:
                return "nonfinite"
            stop_code, step = int(stats[:, 2].max()), self.step
            if committed and cfg.eval_every and step % cfg.eval_every == 0:
                if len(self.data.eval):
                    self._evaluate()
            if stop_code:
                self.last_saved = self.save(step)
                return "signal" if stop_code == 2 else "time_budget"
            due = cfg.ckpt_every and step % cfg.ckpt_every == 0
            if committed and (due or step == cfg.max_steps):
                self.last_saved = self.save(step)
            self.probe.after_step(step)
        return "done"

    def _attempt(self) -> tuple[float, torch.Tensor, float, list[int], bool]:
        """One try at the next step: quorum (a restarted group heals here), forward and
        backward on this rank's rows, the commit, the update when committed and finite.
        Returns the learning rate, the loss, the gradient norm, the groups whose gradients
        the step averaged, and whether it committed."""
        cfg = self.cfg
        self.healed_from = None
        self.manager.start_quorum()
        if self.healed_from is not None:
            self._report_heal()
        before = self.sampler.state_dict()
        step = self.step + 1
        self.faults.step_begin(step)
        lr = self._set_lr(step)
        loss_sum = self._forward_backward()
        self.faults.after_backward(step, self.model)
        members = self._members()
        grad_norm = _grad_norm_and_clip(self.model, cfg.grad_clip, 1.0 / self.scaler.scale)
        finite = math.isfinite(grad_norm)
        committed = bool(self.manager.should_commit())  # every group asks, finite or not
        if committed:
            if finite:
                self.optimizer.step()
            self.scaler.update(finite)
            self.skipped_in_a_row = 0 if finite else self.skipped_in_a_row + 1
            self.skipped_total += not finite
            rows = cfg.global_batch // cfg.ft_replicas * len(members)
            self.tokens_seen += rows * cfg.seq_len
            self.step = step
        else:  # retried with the same batch
            self.sampler.load_state_dict(before)
        self._before = before
        self.optimizer.zero_grad(set_to_none=True)
        return lr, loss_sum, grad_norm, members, committed

    def _members(self) -> list[int]:
        """The replica groups whose gradients this step averages (a healing group's count
        for nothing: torchft zeroes what it sends)."""
        mine = torch.zeros(self.cfg.ft_replicas, dtype=torch.float32, device=self.env.device)
        mine[self.cfg.ft_replica_id] = 1.0
        self.manager.allreduce(mine, reduce_op=dist.ReduceOp.SUM).wait()
        return [r for r, v in enumerate(mine.cpu().tolist()) if v > 0.5]

    # ------------------------------------------------------------------- reporting
    def _report(self, members: list[int], committed: bool) -> None:
        """Rank 0: the ``ft`` record of this try and the quorum on the progress line."""
        cfg = self.cfg
        quorum = len(members)
        missing = [r for r in range(cfg.ft_replicas) if r not in members]
        per = cfg.global_batch // cfg.ft_replicas
        if committed:
            self.skipped_samples += per * len(missing)
        if not self.log:
            return
        self.progress.note = f"quorum {quorum}/{cfg.ft_replicas}"
        if not committed:
            self.log.write("ft", step=self.step + 1, committed=False, quorum=quorum)
            self.progress.line(
                f"step {self.step + 1}: not committed (a replica group failed within it); "
                "retrying its batch"
            )
            return
        rows = [[r * per, (r + 1) * per] for r in missing]
        starts: list[int] = []
        if missing:  # this step's global batch, from the position it started at
            sampler = data_mod.Sampler(
                len(self.data.train),
                seq_len=cfg.seq_len,
                global_batch=cfg.global_batch,
                seed=cfg.seed,
            )
            sampler.load_state_dict(self._before)
            batch = sampler.next_batch()
            starts = [int(s) for a, b in rows for s in batch[a:b]]
        self.log.write(
            "ft",
            step=self.step,
            committed=True,
            quorum=quorum,
            replicas=members,
            skipped_rows=rows,
            skipped_starts=starts,
            skipped_samples=self.skipped_samples,
        )
        if quorum != self.quorum:
            gone = f"; rows of replica group(s) {missing} skipped" if missing else ""
            self.progress.line(f"step {self.step}: quorum {quorum}/{cfg.ft_replicas}{gone}")
        self.quorum = quorum

    def _report_heal(self) -> None:
        if self.log:
            self.log.write(
                "heal",
                step=self.healed_from,
                tokens=self.tokens_seen,
                skipped_samples=self.skipped_samples,  # counted by the group healed from
            )
            self.progress.line(
                f"healed from a live replica group at step {self.healed_from}: model, "
                "optimizer and data position received"
            )

    def _evaluate(self) -> None:
        """Evaluate within this group (its own ranks share the eval batches)."""
        env, self.env = self.env, self.group_env
        try:
            super()._evaluate()
        finally:
            self.env = env
