"""The shipped benchmark configurations (``speed``, ``comm``, ``memory``, ``tiny``) and modes."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

# Modes of ``fullshard bench --config overhead`` (fullshard.bench.overhead).
OVERHEAD_MODES: tuple[str, ...] = ("fullshard", "fsdp2", "bare")

__all__ = [
    "ALL_MODES",
    "CONFIGS",
    "DEFAULT_MODES",
    "ENGINE_MODES",
    "FSDP1_MODES",
    "PEER_MODES",
    "SHARDED_MODES",
    "BenchConfig",
    "get_config",
]

#: Every mode ``fullshard bench`` knows, in the order tables list them.
#: ``nocomm`` trains an unsynchronised replica per rank on the rank's slice of the batch: the same
#: per-rank compute with no communication at all, the floor the other modes are measured against
#: (exposed communication = step time - nocomm step time).
#: ``deepspeed`` is DeepSpeed ZeRO stage 3 with its defaults (``fullshard.peers``), from the
#: optional ``peers`` extra: where it is not installed, runs skip it and say how to install it.
#: The FSDP1 modes wrap the model in ``FullyShardedDataParallel`` (blocks auto-wrapped, the
#: root holding the rest, as the other sharded modes' units): ``fsdp1-fullshard`` is fullshard's
#: (``fullshard.fsdp1``), ``fsdp1`` torch's (a peer); no config runs them unless asked to.
ALL_MODES: tuple[str, ...] = (
    "fullshard",
    "fsdp1-fullshard",
    "fsdp2",
    "fsdp1",
    "deepspeed",
    "ddp",
    "single",
    "nocomm",
)
#: The modes that ``FullyShardedDataParallel`` wraps (fullshard's, torch's).
FSDP1_MODES: tuple[str, ...] = ("fsdp1-fullshard", "fsdp1")
#: What the configs run unless ``--modes`` says otherwise.
DEFAULT_MODES: tuple[str, ...] = tuple(m for m in ALL_MODES if m not in FSDP1_MODES)
#: Modes whose engine comes from an optional extra (``fullshard.peers.peer_missing`` says).
PEER_MODES: tuple[str, ...] = ("deepspeed",)
#: ZeRO-3 modes: 3 x parameter bytes on the wire per step in theory.
SHARDED_MODES: tuple[str, ...] = ("fullshard", "fsdp2", "deepspeed", *FSDP1_MODES)
#: Modes on fullshard's engine (its collective recorder meters them; its AdamW local step).
ENGINE_MODES: tuple[str, ...] = ("fullshard", "fsdp1-fullshard")


@dataclass(kw_only=True, frozen=True)
class BenchConfig:
    """One benchmark: model shape, batch, schedule and the modes compared."""

    name: str
    n_layer: int
    """Transformer blocks (each block is one sharding unit; the root holds the rest)."""
    d_model: int
    n_head: int
    seq_len: int = 256
    vocab_size: int = 256
    batch: int
    """Global batch (sequences per step), split evenly across ranks; per rank if ``batch_per_rank``."""
    batch_per_rank: bool = False
    steps: int
    """Steps per run; the first ``warmup`` are not timed."""
    warmup: int
    repeats: int
    """Runs per mode; modes alternate (A B C, C B A, ...) so drift hits every mode alike."""
    nprocs: tuple[int, ...] = (2,)
    """World sizes to run (``memory`` runs 1, 2 and 4 to show per-rank memory falling as 1/N)."""
    modes: tuple[str, ...] = DEFAULT_MODES
    reshard_after_forward: bool = True
    transport: str = "auto"
    """fullshard's ``CommPolicy(transport=...)``: ``auto``, ``packed`` or ``p2p``."""
    local_step: bool = True
    """fullshard's AdamW steps on the local shards (:func:`fullshard.optim.local_step`, as
    ``fullshard train`` does); ``False`` steps on the DTensors, as FSDP2's must."""
    lr: float = 1e-3
    seed: int = 0

    def __post_init__(self) -> None:
        bad = [m for m in self.modes if m not in ALL_MODES]
        if bad:
            raise ValueError(f"unknown modes {bad}; choose from {list(ALL_MODES)}")
        if not 0 <= self.warmup < self.steps:
            raise ValueError(
                f"--warmup ({self.warmup}) must be at least 0 and less than --steps "
                f"({self.steps}); lower --warmup or raise --steps"
            )
        if self.repeats < 1:
            raise ValueError(f"repeats must be >= 1, got {self.repeats}")
        for n in self.nprocs:
            if n < 1 or (not self.batch_per_rank and self.batch % n):
                raise ValueError(
                    f"global batch {self.batch} does not split evenly over {n} ranks; "
                    "pick a batch divisible by every --nproc"
                )

    def global_batch(self, nproc: int) -> int:
        return self.batch * nproc if self.batch_per_rank else self.batch

    def replace(self, **changes: object) -> BenchConfig:
        return dataclasses.replace(self, **changes)  # type: ignore[arg-type]


CONFIGS: dict[str, BenchConfig] = {
    # Compute-heavy: BASELINES.md's model and batch.
    "speed": BenchConfig(
        name="speed", n_layer=6, d_model=512, n_head=8, batch=8, steps=30, warmup=5, repeats=2
    ),
    # Same model, a quarter of the compute: communication-bound.
    "comm": BenchConfig(
        name="comm", n_layer=6, d_model=512, n_head=8, batch=2, steps=30, warmup=5, repeats=2
    ),
    # Model states dominate: ~152M parameters (2.4 GB of fp32 params + grads + AdamW states for
    # one process), one sequence per rank. Per-rank memory should fall as 1/N.
    "memory": BenchConfig(
        name="memory",
        n_layer=12,
        d_model=1024,
        n_head=16,
        batch=1,
        batch_per_rank=True,
        steps=2,  # the peak needs step 1 (AdamW states appear) and one steady step
        warmup=1,
        repeats=1,
        nprocs=(1, 2, 4),
        modes=("fullshard", "fsdp2", "deepspeed", "ddp"),
    ),
    # Seconds, for tests and smoke runs (DeepSpeed's start-up alone takes longer: ask for it).
    "tiny": BenchConfig(
        name="tiny",
        n_layer=2,
        d_model=64,
        n_head=4,
        seq_len=32,
        batch=4,
        steps=3,
        warmup=1,
        repeats=1,
        modes=tuple(m for m in DEFAULT_MODES if m not in PEER_MODES),
    ),
}


def get_config(name: str) -> BenchConfig:
    if name not in CONFIGS:
        raise ValueError(f"unknown bench config {name!r}; choose from {sorted(CONFIGS)}")
    return CONFIGS[name]
