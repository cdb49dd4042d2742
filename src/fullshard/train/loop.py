"""The training loop every rank runs: build, shard, resume, step, evaluate, save, sample.

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
from dataclasses import dataclass
from datetime import timedelta
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
from fullshard.train.degrees import Degrees, resolve
from fullshard.train.failures import ATTEMPT_ENV, SecondaryFailure, attempt_number
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

__all__ = ["DistEnv", "train"]


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


def train(cfg: TrainConfig, env: DistEnv) -> int:
    """Run training on this rank; returns the process exit code (0 also after Ctrl-C)."""
    run_dir = Path(cfg.resolved_run_dir())
    ckpt_root = run_dir / "checkpoints"
    say = print if env.is_main else (lambda *a, **k: None)
    if env.is_main:
        ckpt_root.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.toml").write_text(to_toml(cfg))
    stop = StopRequest()
    faults = FaultInjector.from_env(rank=env.rank, attempt=env.restart_count, run_dir=run_dir)
    probe = ResourceProbe(rank=env.rank, run_dir=run_dir)

    # ---- data
    tokens, mask = data_mod.load_data(
        cfg.data,
        data_dtype=cfg.data_dtype,
        vocab_size=cfg.vocab_size,
        tokenizer=cfg.tokenizer_source,
        cache_dir=run_dir / "data_cache",
    )
    data = data_mod.TokenData.split(
        tokens, cfg.eval_fraction, byte_level=tokens.dtype.itemsize == 1, mask=mask
    )
    tokenizer = None
    if cfg.tokenizer_source:
        from fullshard.train.tokenized import load_tokenizer

        tokenizer = load_tokenizer(cfg.tokenizer_source)
        if env.is_main:  # beside the checkpoints, for fullshard ckpt export --hf
            tokenizer.save_pretrained(str(run_dir / "tokenizer"))
    sampler = data_mod.Sampler(
        len(data.train), seq_len=cfg.seq_len, global_batch=cfg.global_batch, seed=cfg.seed
    )
    per_rank = cfg.global_batch // env.dp_size
    accum = per_rank // cfg.micro_batch

    # ---- model
    torch.manual_seed(cfg.seed)
    meta_model = build_model(cfg, meta=True)
    n_params = sum(p.numel() for p in meta_model.parameters())
    meta = cfg.init == "meta" or (cfg.init == "auto" and n_params > META_INIT_THRESHOLD)
    model = meta_model if meta else build_model(cfg)
    del meta_model
    kind = f"HF {type(model).__name__}" if cfg.uses_hf else "GPT"
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
    model_description = describe(model)
    ns_dtype = muon_ns_dtype(cfg.muon_ns_dtype, env.device)
    optimizer = build_optimizer(
        model,
        lr=cfg.lr,
        weight_decay=cfg.weight_decay,
        betas=(cfg.beta1, cfg.beta2),
        kind=cfg.optimizer,
        layers=units.layers,
        ns_dtype=ns_dtype,
    )
    scaler = LossScaler(cfg.mixed_precision == "fp16")

    # ---- resume
    start_step, tokens_seen, skipped_total = 0, 0, 0
    candidates = resume_candidates(cfg, ckpt_root, env.restart_count)
    resume_from, extra = _load_resume(candidates, model, optimizer, env)
    if resume_from is not None:
        start_step = int(extra["step"])
        tokens_seen = int(extra.get("tokens", 0))
        skipped_total = int(extra.get("skipped_steps", 0))
        sampler.load_state_dict(extra["sampler"])
        scaler.load_state_dict(extra.get("scaler", {}))
        set_ns_dtype(optimizer, ns_dtype)
    say(
        f"fullshard train: {cfg.resolved_name()} | {kind}, {n_params / 1e6:.2f}M parameters | "
        f"{env.world_size} rank(s) on {env.device.type}, mesh {env.degrees.describe()} | "
        f"global batch {cfg.global_batch} x "
        f"{cfg.seq_len} tokens (micro {cfg.micro_batch}, accumulation {accum}) | "
        f"{data_mod.describe_source(cfg.data)}: {len(tokens):,} tokens | run dir {run_dir}",
        flush=True,
    )
    if resume_from is not None:
        say(f"resumed from {resume_from} at step {start_step}", flush=True)
    if start_step >= cfg.max_steps:
        say(f"already trained to step {start_step}; raise --max-steps to train further")

    log = (
        MetricsLog(run_dir / "metrics.jsonl", resume_step=start_step, tensorboard=cfg.tensorboard)
        if env.is_main
        else None
    )
    if log:
        log.write(
            "start",
            step=start_step,
            world_size=env.world_size,
            degrees=list(env.degrees.shape),
            attempt=env.restart_count,
            resumed_from=str(resume_from) if resume_from else None,
            parameters=n_params,
        )
    progress = Progress(
        total=cfg.max_steps,
        start=start_step,
        mode=cfg.progress,
        log_every=cfg.log_every,
        time_budget=cfg.time_budget,
    )

    # ---- loop
    t_start = time.monotonic()
    step, reason, skipped_in_a_row = start_step, "done", 0
    last_saved: Path | None = (
        resume_from if resume_from and resume_from.parent == ckpt_root else None
    )
    last_eval = -1

    def save(at: int) -> Path:
        path = ckpt_root / f"step_{at:08d}"
        extra: dict[str, Any] = {
            "step": at,
            "tokens": tokens_seen,
            "sampler": sampler.state_dict(),
            "scaler": scaler.state_dict(),
            "world_size": env.world_size,
            "degrees": list(env.degrees.shape),  # dp_replicate, dp_shard, tp
            "skipped_steps": skipped_total,
            "model": model_description,  # what fullshard ckpt export --hf writes as config.json
        }
        # overwrite: after an elastic restart the group may redo (and re-save) a step.
        with faults.saving(at):
            ckpt.save(
                path,
                model=model,
                optimizer=optimizer,
                extra=extra,
                overwrite=True,
                keep_last=cfg.keep_last or None,
            )
        return path

    while step < cfg.max_steps:
        t0 = time.perf_counter()
        step += 1
        faults.step_begin(step)
        lr = lr_at(
            step,
            lr=cfg.lr,
            warmup=cfg.warmup_steps,
            total=cfg.max_steps,
            min_ratio=cfg.min_lr_ratio,
        )
        for group in optimizer.param_groups:
            group["lr"] = lr
        mine_rows = data_mod.rank_slice(cfg.global_batch, env.dp_rank, env.dp_size)
        global_starts = sampler.next_batch()
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
        for i in range(accum):
            rows = slice(i * cfg.micro_batch, (i + 1) * cfg.micro_batch)
            model.set_requires_gradient_sync(i == accum - 1)  # type: ignore[operator]
            logits = logits_of(model, inputs[rows])
            loss = weight * F.cross_entropy(
                logits.float().flatten(0, 1), targets[rows].flatten(), reduction="sum"
            )
            (loss * scaler.scale).backward()
            loss_sum += loss.detach()
        faults.after_backward(step, model)
        grad_norm = _grad_norm_and_clip(model, cfg.grad_clip, 1.0 / scaler.scale)
        finite = math.isfinite(grad_norm)
        if finite:
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        scaler.update(finite)
        skipped_in_a_row = 0 if finite else skipped_in_a_row + 1
        skipped_total += not finite
        tokens_seen += cfg.global_batch * cfg.seq_len

        # 2: a signal reached this rank; 1: rank 0's time budget ran out; 0: carry on.
        over_budget = env.is_main and 0 < cfg.time_budget < time.monotonic() - t_start
        wants_stop = 2.0 if stop.signal is not None else 1.0 if over_budget else 0.0
        mine = torch.tensor(
            [float(loss_sum), _peak_mem_mib(env.device), wants_stop, _rss_mib()],
            dtype=torch.float64,
            device=env.device,
        )
        gathered = [torch.empty_like(mine) for _ in range(env.world_size)]
        dist.all_gather(gathered, mine)
        stats = torch.stack(gathered).cpu()  # [world, 4]
        step_time = time.perf_counter() - t0
        if log:
            rec = {
                "step": step,
                "loss": float(stats[:, 0].mean()),
                "lr": lr,
                "grad_norm": grad_norm if finite else None,
                "skipped": not finite,
                "skipped_steps": skipped_total,
                "tokens": tokens_seen,
                "tokens_per_s": cfg.global_batch * cfg.seq_len / step_time,
                "step_time_s": step_time,
                "peak_mem_mib": [round(float(m), 1) for m in stats[:, 1]],
                "rss_mib": [round(float(m), 1) for m in stats[:, 3]],
            }
            log.write("train", **rec)
            progress.step(rec)
        if skipped_in_a_row > cfg.max_skipped_steps:  # the same on every rank: grad_norm is
            reason = "nonfinite"  # global; stop here without saving (see guard.nonfinite_stop)
            break
        stop_code = int(stats[:, 2].max())  # the same on every rank
        if stop_code:
            reason = "signal" if stop_code == 2 else "time_budget"
        eval_due = cfg.eval_every and (step % cfg.eval_every == 0 or step == cfg.max_steps)
        if eval_due and len(data.eval):
            eval_loss = _eval_loss(model, data, cfg, env)
            last_eval = step
            if log:
                log.write("eval", step=step, loss=eval_loss)
                progress.line(f"step {step}: eval loss {eval_loss:.4f}")
        if stop_code:
            last_saved = save(step)
            break
        if (cfg.ckpt_every and step % cfg.ckpt_every == 0) or step == cfg.max_steps:
            last_saved = save(step)
        probe.after_step(step)
    progress.close()

    if reason == "nonfinite":
        return nonfinite_stop(
            log, step, skipped_in_a_row, cfg.max_skipped_steps, last_saved, skipped_total
        )
    if step > start_step and (last_saved is None or last_saved.name != f"step_{step:08d}"):
        last_saved = save(step)
    if (
        reason == "done"
        and cfg.eval_every
        and step not in (last_eval, start_step)
        and len(data.eval)
    ):
        eval_loss = _eval_loss(model, data, cfg, env)
        if log:
            log.write("eval", step=step, loss=eval_loss)
            progress.line(f"step {step}: eval loss {eval_loss:.4f}")
    if reason == "done" and cfg.sample_tokens:
        _print_sample(model, cfg, data, env, tokenizer)
    if log:
        log.write(
            "stop",
            step=step,
            reason=reason,
            checkpoint=str(last_saved) if last_saved else None,
            skipped_steps=skipped_total,
        )
        log.close()
        try:
            plot(run_dir / "metrics.jsonl", run_dir / "loss.png")
        except ImportError:  # matplotlib is an optional extra
            say("loss.png skipped: matplotlib is not installed (pip install 'fullshard[plot]')")
        if reason == "done":
            say(f"done: step {step}, checkpoint {last_saved}, metrics and loss.png in {run_dir}")
        else:
            what = "time budget reached" if reason == "time_budget" else "interrupted"
            say(
                f"{what} after step {step}: saved {last_saved}; run the same command again to "
                "resume",
                flush=True,
            )
    sys.stdout.flush()
    dist.barrier()  # leave together: no rank tears down while rank 0 still writes the plot
    return 0


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
