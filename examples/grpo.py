"""GRPO on the CPU: a fully sharded policy on N training ranks, rollouts on one inference rank,
the new weights sent to it by delta after every step.

Run (2 training ranks + 1 inference rank on gloo; about 35 s on 2 CPU cores, the mean reward
rising from chance, 0.06, to about 0.55)::

    OMP_NUM_THREADS=1 python examples/grpo.py
    OMP_NUM_THREADS=1 python examples/grpo.py --steps 60 --train-ranks 3 --group 8 --seed 1
    OMP_NUM_THREADS=1 python examples/grpo.py --sync colocated

or under torchrun (the world is the training ranks and then the inference rank; the world
size sets ``--train-ranks``)::

    torchrun --nproc-per-node 3 examples/grpo.py

The toy task: a prompt is three terms of an arithmetic sequence modulo the vocabulary
(``a, a+d, a+2d``, ``d`` from 1 to ``--max-stride``) and a completion's reward is the fraction
of its tokens that continue the sequence (``a+3d, a+4d, ...``; chance: one in 16). Each step:

1. the inference rank (a :class:`fullshard.rl.WeightReceiver` over a bf16 copy of the policy)
   samples ``--group`` completions per prompt at temperature 1, scores them and broadcasts the
   sequences and rewards to every rank;
2. each training rank takes its share of the prompts, computes group-normalised advantages
   ``(reward - group mean) / (group std + eps)`` and the policy-gradient loss
   ``-advantage * sum of the completion tokens' log-probabilities``, and AdamW steps the
   policy (a :class:`fullshard.models.GPT`, fully sharded over the training ranks' subgroup);
3. the training ranks send what changed in their own rows (:class:`fullshard.rl.ShardDeltas`,
   :func:`fullshard.rl.send_deltas`, XOR masks of the bf16 bits) and the inference rank applies
   it (:func:`fullshard.rl.receive`). The first sync is full (:func:`fullshard.rl.send_full`).
   With ``--sync colocated`` every sync instead hands the inference process the full weights as
   shared-memory buckets (:func:`fullshard.rl.publish_colocated` from rank 0,
   :func:`fullshard.rl.receive_colocated`): what a trainer and an engine on one host do.

One line per step: the mean reward of its rollouts, the bytes of the delta the training ranks
sent (after the full weights once, at step 0) and the step's seconds.
At the end the receiver's weights are compared with the trainers' ``full_tensor()`` cast to
bf16, bit for bit; the command exits 1 if they differ.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from functools import partial
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from fullshard import fully_shard
from fullshard.models import GPT, GPTConfig
from fullshard.rl import (
    DistLink,
    Receivers,
    ShardDeltas,
    SyncReport,
    WeightReceiver,
    named_weights,
    publish_colocated,
    receive,
    receive_colocated,
    send_deltas,
    send_full,
)
from fullshard.testing import run_distributed

__all__ = ["Config", "advantages", "main", "policy_loss", "rewards", "run", "sample"]

PROMPT_LEN = 3


@dataclass(frozen=True)
class Config:
    """The run: ranks, task, policy and optimizer."""

    steps: int = 300
    train_ranks: int = 2
    group: int = 8  # completions per prompt
    prompts: int = 16  # prompts per training rank per step
    new_tokens: int = 4  # tokens sampled per completion
    vocab: int = 16
    max_stride: int = 2
    temperature: float = 1.0
    lr: float = 3e-3
    dtype: str = "bfloat16"  # the inference copy's (and the wire's)
    seed: int = 0
    sync: str = "delta"  # "delta": send_full, then send_deltas; "colocated": publish_colocated

    def gpt(self) -> GPTConfig:
        return GPTConfig(
            vocab_size=self.vocab, seq_len=PROMPT_LEN + self.new_tokens,
            n_layer=2, d_model=64, n_head=4,
        )  # fmt: skip

    @property
    def batch(self) -> int:
        """Sequences per step, all training ranks together."""
        return self.train_ranks * self.prompts * self.group


def make_prompts(cfg: Config, step: int) -> torch.Tensor:
    """``train_ranks * prompts`` prompts ``a, a+d, a+2d`` (mod vocab), the same every run."""
    g = torch.Generator().manual_seed(cfg.seed * 1_000_003 + step)
    n = cfg.train_ranks * cfg.prompts
    start = torch.randint(0, cfg.vocab, (n, 1), generator=g)
    stride = torch.randint(1, cfg.max_stride + 1, (n, 1), generator=g)
    return (start + stride * torch.arange(PROMPT_LEN)) % cfg.vocab


@torch.no_grad()
def sample(
    model: nn.Module, prompts: torch.Tensor, cfg: Config, gen: torch.Generator
) -> torch.Tensor:
    """``group`` completions of ``new_tokens`` per prompt, at ``temperature``: the whole
    sequences, each prompt's group in consecutive rows."""
    seqs = prompts.repeat_interleave(cfg.group, dim=0)
    for _ in range(cfg.new_tokens):
        logits = model(seqs)[:, -1].float() / cfg.temperature
        nxt = torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=gen)
        seqs = torch.cat([seqs, nxt], dim=1)
    return seqs


def rewards(seqs: torch.Tensor, cfg: Config) -> torch.Tensor:
    """Per sequence, the fraction of completion tokens that continue the prompt's sequence."""
    start, stride = seqs[:, :1], seqs[:, 1:2] - seqs[:, :1]
    at = torch.arange(PROMPT_LEN, PROMPT_LEN + cfg.new_tokens)
    want = (start + stride * at) % cfg.vocab
    return (seqs[:, PROMPT_LEN:] == want).float().mean(dim=1)


def advantages(reward: torch.Tensor, group: int, eps: float = 1e-4) -> torch.Tensor:
    """GRPO's: each reward minus its group's mean, over the group's std plus ``eps``."""
    r = reward.view(-1, group)
    return ((r - r.mean(dim=1, keepdim=True)) / (r.std(dim=1, keepdim=True) + eps)).view(-1)


def policy_loss(model: nn.Module, seqs: torch.Tensor, adv: torch.Tensor) -> torch.Tensor:
    """``-advantage * sum of the completion tokens' log-probabilities``, mean over sequences."""
    logp = torch.log_softmax(model(seqs[:, :-1]).float(), dim=-1)
    taken = logp.gather(-1, seqs[:, 1:, None]).squeeze(-1)[:, PROMPT_LEN - 1 :]
    return -(adv * taken.sum(dim=1)).mean()


def _digests(weights: list[tuple[str, torch.Tensor]]) -> dict[str, str]:
    return {
        name: hashlib.sha256(
            t.detach().contiguous().view(torch.uint8).numpy().tobytes()
        ).hexdigest()
        for name, t in weights
    }


def _exchange(cfg: Config, seqs: torch.Tensor, reward: torch.Tensor) -> None:
    """The inference rank's rollouts to every rank (a broadcast over the world)."""
    dist.broadcast(seqs, src=cfg.train_ranks)
    dist.broadcast(reward, src=cfg.train_ranks)


def _trainer(cfg: Config, group: dist.ProcessGroup) -> dict[str, Any]:
    dtype, to = getattr(torch, cfg.dtype), Receivers((cfg.train_ranks,))
    torch.manual_seed(cfg.seed)
    model = GPT(cfg.gpt())
    mesh = DeviceMesh.from_group(group, "cpu")
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.0)
    sync: Callable[[], SyncReport]
    if cfg.sync == "colocated":  # rank 0 lends the inference process the buckets
        link = DistLink(cfg.train_ranks) if dist.get_rank() == 0 else None
        sync = partial(publish_colocated, model, link, dtype=dtype)
        sync()  # the receiver starts from the trainers' weights
    else:
        send_full(model, to, dtype=dtype)  # the receiver starts from the trainers' weights
        deltas = ShardDeltas(model, dtype=dtype)  # the base: what the receiver holds now
        sync = partial(send_deltas, deltas, to)
    length = PROMPT_LEN + cfg.new_tokens
    per_rank = cfg.prompts * cfg.group  # this rank's prompts' groups: its share of the batch
    mine = slice(dist.get_rank() * per_rank, (dist.get_rank() + 1) * per_rank)
    for _ in range(cfg.steps):
        seqs = torch.empty(cfg.batch, length, dtype=torch.int64)
        reward = torch.empty(cfg.batch)
        _exchange(cfg, seqs, reward)
        adv = advantages(reward[mine], cfg.group)
        policy_loss(model, seqs[mine], adv).backward()
        opt.step()
        opt.zero_grad()
        sync()
    oracle = [(n, cast(DTensor, p).full_tensor().to(dtype)) for n, p in named_weights(model)]
    digests = [_digests(oracle) if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(digests, src=0)
    return {}


def _inference(cfg: Config) -> dict[str, Any]:
    dtype = getattr(torch, cfg.dtype)
    torch.manual_seed(cfg.seed + 1)  # any weights: the first sync overwrites them all
    policy = GPT(cfg.gpt()).to(dtype).eval()
    receiver = WeightReceiver(policy)
    trainers = tuple(range(cfg.train_ranks))
    if cfg.sync == "colocated":
        link = DistLink(0)
        receive_sync: Callable[[], SyncReport] = partial(receive_colocated, link, receiver)
        full = receive_sync()
    else:
        receive_sync = partial(receive, receiver, srcs=trainers)
        full = receive(receiver, srcs=(0,))  # send_full: rank 0 sends
    print(f"step   0  full weights {full.bytes_received / 1024:.1f} KiB", flush=True)
    gen = torch.Generator().manual_seed(cfg.seed)
    history: list[dict[str, float]] = []
    for step in range(1, cfg.steps + 1):
        t0 = time.perf_counter()
        seqs = sample(policy, make_prompts(cfg, step), cfg, gen)
        reward = rewards(seqs, cfg)
        _exchange(cfg, seqs, reward)
        sync = receive_sync()  # the trainers' deltas (or buckets), applied bit for bit
        row = {"step": step, "reward": reward.mean().item(), "sync_bytes": sync.bytes_received}
        row["seconds"] = time.perf_counter() - t0
        history.append(row)
        print(
            f"step {step:3d}  reward {row['reward']:.3f}  {cfg.sync} "
            f"{sync.bytes_received / 1024:7.1f} KiB  {row['seconds']:.2f} s",
            flush=True,
        )
    digests: list[Any] = [None]
    dist.broadcast_object_list(digests, src=0)  # rank 0's digests of full_tensor() in dtype
    theirs, mine = digests[0], _digests(list(receiver.weights.items()))
    differ = sorted(n for n in theirs.keys() | mine.keys() if theirs.get(n) != mine.get(n))
    return {
        "history": history,
        "full_bytes": full.bytes_received,
        "path": sync.path,
        "weights_equal": not differ,
        "differ": differ,
    }


def _worker(cfg: Config) -> dict[str, Any]:
    group = dist.new_group(list(range(cfg.train_ranks)))  # every rank creates it
    if dist.get_rank() == cfg.train_ranks:
        return _inference(cfg)
    return _trainer(cfg, group)


def summary(result: dict[str, Any], cfg: Config) -> str:
    """The first and last steps' mean reward and the weight check, in two lines."""
    h = result["history"]
    k = min(5, len(h))
    first, last = (sum(r["reward"] for r in rows) / k for rows in (h[:k], h[-k:]))
    seconds = sum(r["seconds"] for r in h)
    check = "bit for bit" if result["weights_equal"] else f"DIFFER: {result['differ'][:4]}"
    return (
        f"mean reward {h[0]['reward']:.3f} (step 1) -> {h[-1]['reward']:.3f} (step {len(h)}); "
        f"first {k} steps {first:.3f}, last {k} {last:.3f}; chance {1 / cfg.vocab:.3f}; "
        f"{seconds:.1f} s\nreceiver == trainers' full_tensor() in {cfg.dtype}: {check}"
    )


def run(cfg: Config, *, timeout: float = 1800.0) -> dict[str, Any]:
    """The whole run on ``train_ranks + 1`` gloo ranks spawned here; the inference rank's
    result: per-step history and the weight check.

    The ranks get ``_worker`` by name: run as a script, this file is ``__main__``, which the
    forkserver imports before it forks the ranks (``run_distributed``'s default)."""
    return run_distributed(_worker, cfg.train_ranks + 1, cfg, timeout=timeout)[-1]


def _parse(argv: list[str] | None) -> tuple[Config, str | None]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    d = Config()
    p.add_argument("--steps", type=int, default=d.steps)
    p.add_argument("--train-ranks", type=int, default=d.train_ranks)
    p.add_argument("--group", type=int, default=d.group, help="completions per prompt")
    p.add_argument("--prompts", type=int, default=d.prompts, help="prompts per training rank")
    p.add_argument("--lr", type=float, default=d.lr)
    p.add_argument("--dtype", choices=("bfloat16", "float32"), default=d.dtype)
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--max-stride", type=int, default=d.max_stride)
    p.add_argument("--sync", choices=("delta", "colocated"), default=d.sync)
    p.add_argument("--out", help="write the result (history, weight check) as JSON here")
    a = p.parse_args(argv)
    if "TORCHELASTIC_RUN_ID" in os.environ:  # torchrun: the world is given
        a.train_ranks = int(os.environ["WORLD_SIZE"]) - 1
    if min(a.train_ranks, a.steps, a.prompts, a.max_stride) < 1 or a.group < 2:
        p.error("--train-ranks, --steps, --prompts, --max-stride >= 1 and --group >= 2")
    if a.max_stride >= Config.vocab:
        p.error(f"--max-stride must be below the vocabulary ({Config.vocab})")
    fields = (
        "steps",
        "train_ranks",
        "group",
        "prompts",
        "lr",
        "dtype",
        "seed",
        "max_stride",
        "sync",
    )
    return Config(**{f: getattr(a, f) for f in fields}), a.out


def main(argv: list[str] | None = None) -> int:
    cfg, out = _parse(argv)
    if "TORCHELASTIC_RUN_ID" in os.environ:
        dist.init_process_group("gloo")
        try:
            result = _worker(cfg)
        finally:
            dist.destroy_process_group()
        if not result:  # a training rank
            return 0
    else:
        result = run(cfg)
    result["config"] = asdict(cfg)
    print(summary(result, cfg), flush=True)
    if out:
        with open(out, "w") as f:
            json.dump(result, f, indent=1)
    return 0 if result["weights_equal"] else 1


if __name__ == "__main__":
    sys.exit(main())
