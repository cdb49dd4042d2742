"""One training run on this rank: data, model, resume, the step loop, evaluation, saving and
the sample at the end (:class:`TrainingRun`; ``fullshard.train.loop.train`` runs it).

[Note: one decision per step] After every optimizer step each rank contributes
``[loss, peak memory, stop requested, resident memory]`` to one all-gather. Rank 0 logs from it, and every rank
reads the same stop decision from it (a Ctrl-C/SIGTERM that reached any rank, or the time
budget on rank 0), so all ranks stop after the same step, save the same checkpoint together
and exit 0. A signal never interrupts a step or a collective: the handler only sets a flag.

[Note: falling back from a damaged checkpoint] Each rank reads only its own rows of a
checkpoint, so one rank may find a bad block that the others never read. After trying a
checkpoint the ranks exchange how it went (one all_gather_object): all intact, and they go
on; damaged somewhere (a checksum, a truncated or missing file), and all of them try the next
older checkpoint of the run (a load replaces every tensor, so a half-done one leaves nothing
behind), saying so; any other error (a checkpoint of another model) is final everywhere. A
checkpoint named by ``--resume PATH`` is never replaced by another one.
"""

from __future__ import annotations

import math
import os
import resource
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from fullshard import checkpoint as ckpt
from fullshard import clip_grad_norm_
from fullshard.train import data as data_mod
from fullshard.train.config import TrainConfig, to_toml
from fullshard.train.degrees import Degrees
from fullshard.train.failures import SecondaryFailure
from fullshard.train.guard import FaultInjector, ResourceProbe, nonfinite_stop
from fullshard.train.metrics import MetricsLog, Progress, plot
from fullshard.train.models import (
    META_INIT_THRESHOLD,
    build_model,
    describe,
    generate,
    logits_of,
    materialize,
    units_of,
)
from fullshard.train.optim import LossScaler, build_optimizer, lr_at, muon_ns_dtype, set_ns_dtype
from fullshard.train.parallelize import ParallelPlan, build_mesh, parallelize

__all__ = ["DistEnv", "TrainingRun", "resume_candidates"]


@dataclass(frozen=True)
class DistEnv:
    """Where this process sits in the job (from torchrun's environment)."""

    rank: int
    world_size: int
    local_rank: int
    restart_count: int  # > 0 after the group was restarted (see _rendezvous_store)
    device: torch.device
    degrees: Degrees  # dp_replicate x dp_shard x tp

    @property
    def is_main(self) -> bool:
        """Rank 0 does the reporting."""
        return self.rank == 0

    @property
    def dp_rank(self) -> int:
        """Which rows of the global batch this rank reads (its TP peers read the same)."""
        return self.degrees.dp_rank(self.rank)

    @property
    def dp_size(self) -> int:
        """Data-parallel ranks: the global batch splits into this many parts."""
        return self.degrees.dp


class StopRequest:
    """SIGINT/SIGTERM set a flag the loop reads between steps; see [Note: one decision per step]."""

    def __init__(self) -> None:
        self.signal: int | None = None
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self._handle)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self.signal = signum


def _rss_mib() -> float:
    """This process's resident memory now (Linux /proc; 0 elsewhere)."""
    try:
        pages = int(Path("/proc/self/statm").read_text().split()[1])
    except (OSError, ValueError, IndexError):
        return 0.0
    return pages * os.sysconf("SC_PAGE_SIZE") / 2**20


def _peak_mem_mib(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def resume_candidates(cfg: TrainConfig, root: Path, restart_count: int) -> list[Path]:
    """The checkpoints to resume from, in order: this run's own, newest first (an older one
    is the fallback when a newer one is damaged), or the one ``--resume PATH`` names."""
    own = ckpt.list_checkpoints(root)[::-1]
    if cfg.resume == "auto":
        return own
    if cfg.resume == "never":  # after an elastic restart, continue what this launch saved
        return own if restart_count > 0 else []
    if restart_count > 0 and own:
        return own
    return [Path(cfg.resume)]


def _load_resume(
    candidates: list[Path],
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    env: DistEnv,
) -> tuple[Path | None, dict[str, Any]]:
    """Load the first of ``candidates`` that every rank reads intact (see [Note: falling back
    from a damaged checkpoint]); ``(None, {})`` when there are none."""
    say = print if env.is_main else (lambda *a, **k: None)
    for i, path in enumerate(candidates):
        extra: dict[str, Any] = {}
        mine: tuple[str, str] = ("ok", "")
        error: Exception | None = None
        try:
            extra = ckpt.load(path, model=model, optimizer=optimizer)
        except ckpt.CheckpointCorruptedError as e:
            mine, error = ("damaged", str(e)), e
        except Exception as e:  # a mismatch, an OS error: the same after any fallback
            mine, error = ("failed", str(e)), e
        statuses: list[Any] = [None] * env.world_size
        dist.all_gather_object(statuses, mine)
        if all(kind == "ok" for kind, _ in statuses):
            return path, extra
        if error is not None and mine[0] == "failed":
            raise error
        if any(kind == "failed" for kind, _ in statuses):
            raise SecondaryFailure(f"loading {path} failed on another rank")
        damage = next(message for kind, message in statuses if kind == "damaged")
        if i + 1 == len(candidates):
            if not env.is_main:
                raise SecondaryFailure(f"{path} is damaged: {damage}")
            newer = "; so is every newer checkpoint of this run" if i else ""
            raise ckpt.CheckpointCorruptedError(f"{damage}{newer}")
        say(
            f"fullshard train: checkpoint {path} is damaged ({damage}); falling back to the "
            f"newest intact one, trying {candidates[i + 1]}",
            flush=True,
        )
    return None, {}


def _eval_loss(model: nn.Module, data: data_mod.TokenData, cfg: TrainConfig, env: DistEnv) -> float:
    starts = data_mod.eval_starts(
        len(data.eval), seq_len=cfg.seq_len, count=cfg.eval_batches * cfg.global_batch
    )
    mine = starts.reshape(cfg.eval_batches, cfg.global_batch)[
        :, data_mod.rank_slice(cfg.global_batch, env.dp_rank, env.dp_size)
    ].reshape(-1)
    total = torch.zeros(2, dtype=torch.float64, device=env.device)  # [sum of losses, targets]
    model.eval()
    with torch.no_grad():
        for i in range(0, len(mine), cfg.micro_batch):
            inputs, targets = data_mod.gather_batch(
                data.eval, data.eval_mask, mine[i : i + cfg.micro_batch], cfg.seq_len
            )
            logits = logits_of(model, inputs.to(env.device))
            targets = targets.to(env.device).flatten()
            loss = F.cross_entropy(logits.float().flatten(0, 1), targets, reduction="sum")
            total[0] += loss.double()
            total[1] += int((targets != data_mod.IGNORE_INDEX).sum())
    model.train()
    dist.all_reduce(total)
    return float(total[0] / total[1].clamp(min=1))


def _grad_norm_and_clip(model: nn.Module, max_norm: float, unscale: float) -> float:
    params = [p for p in model.parameters() if p.grad is not None]
    if unscale != 1.0:
        for p in params:
            p.grad.mul_(unscale)  # type: ignore[union-attr]
    return float(clip_grad_norm_(params, max_norm if max_norm > 0 else math.inf))


def _print_sample(
    model: nn.Module, cfg: TrainConfig, data: data_mod.TokenData, env: DistEnv, tokenizer: Any
) -> None:
    if tokenizer is not None:
        prompt = list(tokenizer(cfg.sample_prompt)["input_ids"])
    else:
        prompt = list(cfg.sample_prompt.encode()) if data.byte_level else []
    model.eval()
    out = generate(
        model,
        prompt,
        n_tokens=cfg.sample_tokens,
        context=cfg.seq_len,
        temperature=cfg.temperature,
        vocab_limit=256 if data.byte_level else 2**31,
        seed=cfg.seed,
        device=env.device,
    )
    model.train()
    if env.is_main:
        if tokenizer is not None:
            text = str(tokenizer.decode(prompt + out))
        elif data.byte_level:
            text = bytes(prompt + out).decode("utf-8", errors="replace")
        else:
            text = " ".join(map(str, out))
        print(f"--- sample ({cfg.sample_tokens} tokens) ---\n{text}\n---", flush=True)


class TrainingRun:
    """This rank's part of one training run: set up on construction (run directory, data,
    model, optimizer, resume, metrics), then :meth:`run`."""

    def __init__(self, cfg: TrainConfig, env: DistEnv) -> None:
        self.cfg, self.env = cfg, env
        self.run_dir = Path(cfg.resolved_run_dir())
        self.ckpt_root = self.run_dir / "checkpoints"
        self.say: Callable[..., None] = print if env.is_main else (lambda *a, **k: None)
        if env.is_main:
            self.ckpt_root.mkdir(parents=True, exist_ok=True)
            (self.run_dir / "config.toml").write_text(to_toml(cfg))
        self.stop = StopRequest()
        self.faults = FaultInjector.from_env(
            rank=env.rank, attempt=env.restart_count, run_dir=self.run_dir
        )
        self.probe = ResourceProbe(rank=env.rank, run_dir=self.run_dir)
        self._load_data()
        self._build_model()
        self.tokens_seen = self.skipped_total = self.skipped_in_a_row = 0
        self.resume_from = self._resume()
        self.step = self.start_step
        self._announce()
        self.log = self._open_log()
        self.progress = Progress(
            total=cfg.max_steps,
            start=self.start_step,
            mode=cfg.progress,
            log_every=cfg.log_every,
            time_budget=cfg.time_budget,
        )
        resumed = self.resume_from
        self.last_saved = resumed if resumed and resumed.parent == self.ckpt_root else None
        self.last_eval = -1

    # ------------------------------------------------------------------------- setup
    def _load_data(self) -> None:
        cfg, env = self.cfg, self.env
        self.tokens, mask = data_mod.load_data(
            cfg.data,
            data_dtype=cfg.data_dtype,
            vocab_size=cfg.vocab_size,
            tokenizer=cfg.tokenizer_source,
            cache_dir=self.run_dir / "data_cache",
        )
        self.data = data_mod.TokenData.split(
            self.tokens, cfg.eval_fraction, byte_level=self.tokens.dtype.itemsize == 1, mask=mask
        )
        self.tokenizer = None
        if cfg.tokenizer_source:
            from fullshard.train.tokenized import load_tokenizer

            self.tokenizer = load_tokenizer(cfg.tokenizer_source)
            if env.is_main:  # beside the checkpoints, for fullshard ckpt export --hf
                self.tokenizer.save_pretrained(str(self.run_dir / "tokenizer"))
        self.sampler = data_mod.Sampler(
            len(self.data.train), seq_len=cfg.seq_len, global_batch=cfg.global_batch, seed=cfg.seed
        )
        self.accum = cfg.global_batch // env.dp_size // cfg.micro_batch

    def _build_model(self) -> None:
        """Build (on meta when large), shard, materialise and make the optimizer."""
        cfg, env = self.cfg, self.env
        torch.manual_seed(cfg.seed)
        meta_model = build_model(cfg, meta=True)
        self.n_params = sum(p.numel() for p in meta_model.parameters())
        meta = cfg.init == "meta" or (cfg.init == "auto" and self.n_params > META_INIT_THRESHOLD)
        model = meta_model if meta else build_model(cfg)
        del meta_model
        self.kind = f"HF {type(model).__name__}" if cfg.uses_hf else "GPT"
        meshes = build_mesh(env.degrees, env.device.type)
        plan = ParallelPlan(
            mixed_precision=cfg.mixed_precision,
            reshard_after_forward=cfg.reshard_after_forward,
            cpu_offload=cfg.cpu_offload,
            activation_checkpointing=cfg.activation_checkpointing,
            compile=cfg.compile,
        )
        units = units_of(model)
        parallelize(model, units, plan, mesh=meshes.dp, tp_mesh=meshes.tp)
        if meta:
            torch.manual_seed(cfg.seed)
            materialize(model, env.device)
            if cfg.hf_weights_source:  # built on meta, so not loaded yet: each rank reads its rows
                ckpt.load_full_state_dict_from_file(model, cfg.hf_weights_source)
        self.model = model
        self.model_description = describe(model)
        self.ns_dtype = muon_ns_dtype(cfg.muon_ns_dtype, env.device)
        self.optimizer = build_optimizer(
            model,
            lr=cfg.lr,
            weight_decay=cfg.weight_decay,
            betas=(cfg.beta1, cfg.beta2),
            kind=cfg.optimizer,
            layers=units.layers,
            ns_dtype=self.ns_dtype,
        )
        self.scaler = LossScaler(cfg.mixed_precision == "fp16")

    def _resume(self) -> Path | None:
        """Load the checkpoint to resume from, if any; sets the counters it holds."""
        self.start_step = 0
        candidates = resume_candidates(self.cfg, self.ckpt_root, self.env.restart_count)
        resume_from, extra = _load_resume(candidates, self.model, self.optimizer, self.env)
        if resume_from is not None:
            self.start_step = int(extra["step"])
            self.tokens_seen = int(extra.get("tokens", 0))
            self.skipped_total = int(extra.get("skipped_steps", 0))
            self.sampler.load_state_dict(extra["sampler"])
            self.scaler.load_state_dict(extra.get("scaler", {}))
            set_ns_dtype(self.optimizer, self.ns_dtype)
        return resume_from

    def _announce(self) -> None:
        cfg, env = self.cfg, self.env
        self.say(
            f"fullshard train: {cfg.resolved_name()} | {self.kind}, "
            f"{self.n_params / 1e6:.2f}M parameters | "
            f"{env.world_size} rank(s) on {env.device.type}, mesh {env.degrees.describe()} | "
            f"global batch {cfg.global_batch} x "
            f"{cfg.seq_len} tokens (micro {cfg.micro_batch}, accumulation {self.accum}) | "
            f"{data_mod.describe_source(cfg.data)}: {len(self.tokens):,} tokens | "
            f"run dir {self.run_dir}",
            flush=True,
        )
        if self.resume_from is not None:
            self.say(f"resumed from {self.resume_from} at step {self.start_step}", flush=True)
        if self.start_step >= cfg.max_steps:
            self.say(
                f"already trained to step {self.start_step}; raise --max-steps to train further"
            )

    def _open_log(self) -> MetricsLog | None:
        env = self.env
        if not env.is_main:
            return None
        log = MetricsLog(
            self.run_dir / "metrics.jsonl",
            resume_step=self.start_step,
            tensorboard=self.cfg.tensorboard,
        )
        log.write(
            "start",
            step=self.start_step,
            world_size=env.world_size,
            degrees=list(env.degrees.shape),
            attempt=env.restart_count,
            resumed_from=str(self.resume_from) if self.resume_from else None,
            parameters=self.n_params,
        )
        return log

    # -------------------------------------------------------------------------- run
    def run(self) -> int:
        """Train to ``max_steps`` (or a stop); returns the process exit code (0 also after
        Ctrl-C)."""
        reason = self._loop(time.monotonic())
        self.progress.close()
        if reason == "nonfinite":
            return nonfinite_stop(
                self.log,
                self.step,
                self.skipped_in_a_row,
                self.cfg.max_skipped_steps,
                self.last_saved,
                self.skipped_total,
            )
        self._finish(reason)
        return 0

    def _set_lr(self, step: int) -> float:
        """Give every parameter group ``step``'s learning rate (warmup, then cosine)."""
        cfg = self.cfg
        lr = lr_at(
            step,
            lr=cfg.lr,
            warmup=cfg.warmup_steps,
            total=cfg.max_steps,
            min_ratio=cfg.min_lr_ratio,
        )
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        return lr

    def _loop(self, t_start: float) -> str:
        """The steps; returns why they ended: done, nonfinite, signal or time_budget."""
        cfg = self.cfg
        while self.step < cfg.max_steps:
            t0 = time.perf_counter()
            self.step += 1
            step = self.step
            self.faults.step_begin(step)
            lr = self._set_lr(step)
            loss_sum = self._forward_backward()
            self.faults.after_backward(step, self.model)
            grad_norm = self._optimizer_step()
            stats = self._exchange(loss_sum, t_start)
            self._log_step(stats, lr, grad_norm, time.perf_counter() - t0)
            if self.skipped_in_a_row > cfg.max_skipped_steps:  # the same on every rank:
                return "nonfinite"  # grad_norm is global; stop without saving (guard)
            stop_code = int(stats[:, 2].max())  # the same on every rank
            eval_due = cfg.eval_every and (step % cfg.eval_every == 0 or step == cfg.max_steps)
            if eval_due and len(self.data.eval):
                self._evaluate()
            if stop_code:
                self.last_saved = self.save(step)
                return "signal" if stop_code == 2 else "time_budget"
            if (cfg.ckpt_every and step % cfg.ckpt_every == 0) or step == cfg.max_steps:
                self.last_saved = self.save(step)
            self.probe.after_step(step)
        return "done"

    def _forward_backward(self) -> torch.Tensor:
        """This rank's rows of the step's global batch, in micro-batches; the loss summed."""
        cfg, env, data = self.cfg, self.env, self.data
        mine_rows = data_mod.rank_slice(cfg.global_batch, env.dp_rank, env.dp_size)
        global_starts = self.sampler.next_batch()
        # [Note: loss over the global batch] the mean over every learned target of the global
        # batch (each rank can count them: it knows every start), so masked targets and the
        # number of ranks do not change the math; x the data-parallel size undoes the gradient
        # averaging (over dp_replicate x dp_shard; TP ranks of one group hold one batch part).
        n_targets = data_mod.count_targets(data.train_mask, global_starts, cfg.seq_len)
        weight = env.dp_size / max(n_targets, 1)
        inputs, targets = data_mod.gather_batch(
            data.train, data.train_mask, global_starts[mine_rows], cfg.seq_len
        )
        inputs, targets = inputs.to(env.device), targets.to(env.device)
        loss_sum = torch.zeros((), device=env.device)
        for i in range(self.accum):
            rows = slice(i * cfg.micro_batch, (i + 1) * cfg.micro_batch)
            self.model.set_requires_gradient_sync(i == self.accum - 1)  # type: ignore[operator]
            logits = logits_of(self.model, inputs[rows])
            loss = weight * F.cross_entropy(
                logits.float().flatten(0, 1), targets[rows].flatten(), reduction="sum"
            )
            (loss * self.scaler.scale).backward()
            loss_sum += loss.detach()
        return loss_sum

    def _optimizer_step(self) -> float:
        """Clip, step when the gradients are finite (else skip), zero; the gradient norm."""
        grad_norm = _grad_norm_and_clip(self.model, self.cfg.grad_clip, 1.0 / self.scaler.scale)
        finite = math.isfinite(grad_norm)
        if finite:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.scaler.update(finite)
        self.skipped_in_a_row = 0 if finite else self.skipped_in_a_row + 1
        self.skipped_total += not finite
        self.tokens_seen += self.cfg.global_batch * self.cfg.seq_len
        return grad_norm

    def _exchange(self, loss_sum: torch.Tensor, t_start: float) -> torch.Tensor:
        """[Note: one decision per step]: every rank's loss, memory and stop request."""
        env, cfg = self.env, self.cfg
        # 2: a signal reached this rank; 1: rank 0's time budget ran out; 0: carry on.
        over_budget = env.is_main and 0 < cfg.time_budget < time.monotonic() - t_start
        wants_stop = 2.0 if self.stop.signal is not None else 1.0 if over_budget else 0.0
        mine = torch.tensor(
            [float(loss_sum), _peak_mem_mib(env.device), wants_stop, _rss_mib()],
            dtype=torch.float64,
            device=env.device,
        )
        gathered = [torch.empty_like(mine) for _ in range(env.world_size)]
        dist.all_gather(gathered, mine)
        return torch.stack(gathered).cpu()  # [world, 4]

    def _log_step(self, stats: torch.Tensor, lr: float, grad_norm: float, step_time: float) -> None:
        if not self.log:
            return
        cfg, finite = self.cfg, math.isfinite(grad_norm)
        rec = {
            "step": self.step,
            "loss": float(stats[:, 0].mean()),
            "lr": lr,
            "grad_norm": grad_norm if finite else None,
            "skipped": not finite,
            "skipped_steps": self.skipped_total,
            "tokens": self.tokens_seen,
            "tokens_per_s": cfg.global_batch * cfg.seq_len / step_time,
            "step_time_s": step_time,
            "peak_mem_mib": [round(float(m), 1) for m in stats[:, 1]],
            "rss_mib": [round(float(m), 1) for m in stats[:, 3]],
        }
        self.log.write("train", **rec)
        self.progress.step(rec)

    def _evaluate(self) -> None:
        eval_loss = _eval_loss(self.model, self.data, self.cfg, self.env)
        self.last_eval = self.step
        if self.log:
            self.log.write("eval", step=self.step, loss=eval_loss)
            self.progress.line(f"step {self.step}: eval loss {eval_loss:.4f}")

    def save(self, at: int) -> Path:
        """Checkpoint step ``at`` (model, optimizer, data position and counters)."""
        path = self.ckpt_root / f"step_{at:08d}"
        extra: dict[str, Any] = {
            "step": at,
            "tokens": self.tokens_seen,
            "sampler": self.sampler.state_dict(),
            "scaler": self.scaler.state_dict(),
            "world_size": self.env.world_size,
            "degrees": list(self.env.degrees.shape),  # dp_replicate, dp_shard, tp
            "skipped_steps": self.skipped_total,
            "model": self.model_description,  # what fullshard ckpt export --hf writes as config.json
        }
        # overwrite: after an elastic restart the group may redo (and re-save) a step.
        with self.faults.saving(at):
            ckpt.save(
                path,
                model=self.model,
                optimizer=self.optimizer,
                extra=extra,
                overwrite=True,
                keep_last=self.cfg.keep_last or None,
            )
        return path

    # ----------------------------------------------------------------------- the end
    def _finish(self, reason: str) -> None:
        """Save the last step, evaluate and sample after a full run, close the metrics, and
        leave together."""
        cfg, step = self.cfg, self.step
        last = self.last_saved
        if step > self.start_step and (last is None or last.name != f"step_{step:08d}"):
            self.last_saved = self.save(step)
        done = reason == "done"
        if done and cfg.eval_every and step not in (self.last_eval, self.start_step):
            if len(self.data.eval):
                self._evaluate()
        if done and cfg.sample_tokens:
            _print_sample(self.model, cfg, self.data, self.env, self.tokenizer)
        if self.log:
            self._close_log(reason)
        sys.stdout.flush()
        dist.barrier()  # leave together: no rank tears down while rank 0 still writes the plot

    def _close_log(self, reason: str) -> None:
        assert self.log is not None
        step, last_saved = self.step, self.last_saved
        self.log.write(
            "stop",
            step=step,
            reason=reason,
            checkpoint=str(last_saved) if last_saved else None,
            skipped_steps=self.skipped_total,
        )
        self.log.close()
        try:
            plot(self.run_dir / "metrics.jsonl", self.run_dir / "loss.png")
        except ImportError:  # matplotlib is an optional extra
            self.say(
                "loss.png skipped: matplotlib is not installed (pip install 'fullshard[plot]')"
            )
        if reason == "done":
            self.say(
                f"done: step {step}, checkpoint {last_saved}, metrics and loss.png in "
                f"{self.run_dir}"
            )
        else:
            what = "time budget reached" if reason == "time_budget" else "interrupted"
            self.say(
                f"{what} after step {step}: saved {last_saved}; run the same command again to "
                "resume",
                flush=True,
            )
