"""Parallelism degrees: ``--dp-replicate R --dp-shard S --tp T``, checked before any launch.

The job's ranks form one ``(dp_replicate, dp_shard, tp)`` mesh, row-major, so TP ranks are
neighbours (one node), each shard group is ``S x T`` consecutive ranks, and replicas are the
slowest dim (across nodes on several machines: HSDP shards within a node and all-reduces
across). ``S = 0`` (the default) means "the rest": ``world / (R x T)``, so with no flags every
rank shards (plain ZeRO-3). Data parallelism is ``R x S``: ranks of one TP group read the same
rows (``dp_rank = rank // T``).

Every refusal is one :class:`ConfigError` line naming the flag, the numbers and the fix. This
module imports no torch: ``fullshard train`` checks the degrees before importing it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from fullshard.train.config import ConfigError, TrainConfig

__all__ = ["MESH_DIM_NAMES", "Degrees", "check_reshard", "check_tp_shapes", "resolve"]

MESH_DIM_NAMES = ("dp_replicate", "dp_shard", "tp")


@dataclass(frozen=True)
class Degrees:
    """How the world splits: ``replicate x shard x tp`` ranks."""

    replicate: int
    shard: int
    tp: int

    @property
    def world(self) -> int:
        return self.replicate * self.shard * self.tp

    @property
    def dp(self) -> int:
        """Data-parallel ranks (different rows of the batch): ``replicate x shard``."""
        return self.replicate * self.shard

    @property
    def shape(self) -> tuple[int, int, int]:
        """The mesh shape, in :data:`MESH_DIM_NAMES` order."""
        return (self.replicate, self.shard, self.tp)

    def dp_rank(self, rank: int) -> int:
        """The data-parallel index of global ``rank`` (its TP peers share it)."""
        return rank // self.tp

    def describe(self) -> str:
        """``2 x 2 x 1 (dp_replicate x dp_shard x tp)``, for logs."""
        return f"{self.replicate} x {self.shard} x {self.tp} (dp_replicate x dp_shard x tp)"


def resolve(cfg: TrainConfig, world: int, *, node_size: int | None = None) -> Degrees:
    """The degrees ``cfg`` asks for on ``world`` ranks; ``node_size``: ranks per machine, when
    known (torchrun's ``LOCAL_WORLD_SIZE``; one machine for ``fullshard train``).

    Refused: a product that is not the world size, and TP (or, when degrees were given, a
    shard group) that would cross a machine boundary."""
    r, t = cfg.dp_replicate, cfg.tp
    if cfg.dp_shard == 0:
        if world % (r * t):
            raise ConfigError(
                f"--dp-replicate {r} x --tp {t} = {r * t} does not divide the {world} ranks; "
                f"pick degrees whose product divides {world} (e.g. --dp-replicate "
                f"{math.gcd(world, r)} --tp {math.gcd(world // math.gcd(world, r), t)})"
            )
        s = world // (r * t)
    else:
        s = cfg.dp_shard
        if r * s * t != world:
            raise ConfigError(
                f"--dp-replicate {r} x --dp-shard {s} x --tp {t} = {r * s * t}, but the job has "
                f"{world} ranks; make the product {world} (or --dp-shard 0: the rest, "
                f"{world // (r * t) if world % (r * t) == 0 else '?'})"
            )
    degrees = Degrees(r, s, t)
    if node_size is not None and node_size < world:
        _check_node(cfg, degrees, node_size)
    return degrees


def _check_node(cfg: TrainConfig, d: Degrees, node: int) -> None:
    """TP never crosses a machine; nor does a shard group when the degrees were chosen."""
    if node % d.tp:
        raise ConfigError(
            f"--tp {d.tp} does not divide the {node} ranks of a node (LOCAL_WORLD_SIZE): a TP "
            f"group would span two machines; pick --tp dividing {node}"
        )
    group = d.shard * d.tp
    explicit = cfg.dp_shard != 0 or cfg.dp_replicate != 1
    if explicit and (group > node or node % group):
        fit = max(k for k in range(1, node // d.tp + 1) if (node // d.tp) % k == 0)
        raise ConfigError(
            f"--dp-shard {d.shard} x --tp {d.tp} = {group} ranks per shard group does not fit "
            f"the {node} ranks of a node (LOCAL_WORLD_SIZE); replicate across nodes instead: "
            f"--dp-shard {fit} --dp-replicate {d.world // (fit * d.tp)}"
        )


def check_reshard(cfg: TrainConfig, d: Degrees) -> None:
    """An int ``--reshard-after-forward K`` must divide the shard group (``--dp-shard``)."""
    k = cfg.reshard_group
    if k is not None and d.shard % k:
        fits = [n for n in range(1, d.shard + 1) if d.shard % n == 0]
        raise ConfigError(
            f"--reshard-after-forward {k} must divide --dp-shard {d.shard} (each group of {k} "
            f"ranks keeps one copy after forward); use one of {', '.join(map(str, fits))}"
        )


def check_tp_shapes(d: Degrees, sizes: dict[str, int]) -> None:
    """``--tp`` divides every dimension TP splits (``sizes``: flag or config key -> size)."""
    if d.tp == 1:
        return
    for name, size in sizes.items():
        if size % d.tp:
            fits = [k for k in range(1, size + 1) if size % k == 0 and d.world % k == 0]
            raise ConfigError(
                f"--tp {d.tp} does not divide {name} {size}: each TP rank holds whole heads "
                f"and equal slices; use --tp {max(k for k in fits if k <= d.tp)} (or another "
                f"divisor of {size})"
            )
