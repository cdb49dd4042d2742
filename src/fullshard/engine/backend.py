"""BackendPlan: every speed decision that depends on the device and the process group's
backend, made once per root.

[Note: the backend plan]
The engine's results never depend on the backend; its speed does. On CUDA/NCCL the plan is
the plain path: packed collectives on side streams, FSDP2's ordering. On the CPU (gloo) five
measured special cases are plan choices, each of which can be switched off on its own
(``CommPolicy(cpu_fast_paths_off=(...))`` on the root) and keeps its parity tests:

- ``pieces``: units of at least ``P2P_MIN_BYTES`` gather (up to ``P2P_MAX_RANKS`` ranks) and
  reduce (2 ranks) in pieces, point to point straight into / out of each parameter
  ([Note: transports] in ``fullshard.engine.transport``);
- ``p2p_collectives``: a packed buffer's all-gather / reduce-scatter runs as p2p exchanges or
  an in-place all-reduce where that measured faster than gloo's own (:meth:`algorithm`;
  [Note: p2p on gloo] in ``fullshard.engine.p2p``);
- ``small_unit_window``: the implicit prefetch and the reductions in flight run further ahead
  for small units ([Note: a window for small units] in ``fullshard.engine.window``);
- ``buffer_pool``: freed unsharded buffers are recycled for the next gather and a unit may
  take back its own gathered memory ([Note: recycling unsharded buffers] in
  ``fullshard.engine.pool``);
- ``grad_slabs``: gradient memory is lent to the next forward's gathers ([Note: gradient
  memory lent for the next forward]; needs ``buffer_pool``).

The first two are transports, chosen once per unit at lazy init; the last three are the root's
host strategy ([Note: the host strategy] in ``fullshard.engine.host``), which is absent (the
core alone, FSDP2's path) on CUDA and where all three are off.

Lazy init chooses the root's plan (:meth:`BackendPlan.for_group`); every unit below it, the
step context, the pool and the collectives ask it, and no other module tests the device type
or the backend to make a speed decision. The memory planner models the same plan.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .compat import STORAGE_SWAP, STORAGE_USE_COUNT

__all__ = [
    "CPU_CHOICES",
    "P2P_MAX_RANKS",
    "P2P_MIN_BYTES",
    "P2P_SMALL_BYTES",
    "SMALL_UNIT_WINDOW_BYTES",
    "BackendPlan",
    "serving_backend",
]

#: The CPU special cases a root may switch off (see the Note).
CPU_CHOICES: tuple[str, ...] = (
    "pieces",
    "p2p_collectives",
    "small_unit_window",
    "buffer_pool",
    "grad_slabs",
)

# Up to this many ranks a gloo all-gather is N - 1 sends and receives per rank; measured on 2
# and 4 ranks. Past it, gloo's own all-gather (a ring) is used.
P2P_MAX_RANKS = 8
# Between these two sizes (the full buffer) gloo's own collectives are kept; outside it, on 2
# ranks, one message per peer wins. Small buffers are latency: gloo's all-gather and its ring
# all-reduce (two round trips) against one send and one receive. Large ones are bandwidth: see
# [Note: p2p on gloo] in fullshard.engine.p2p. Quiet machine, ``python
# benchmarks/collectives.py --nproc 2 --sizes 0.004 0.016 0.064 0.128 0.25 0.5 --iters 200``,
# two runs, ms: all-gather 0.40-0.57 (gloo) vs 0.33-0.51 (p2p) up to 0.128 MiB; reduce-scatter
# 0.61-1.06 (as all-reduce) vs 0.34-0.61 (p2p) up to 0.128 MiB, while at 0.25-0.5 MiB a p2p
# exchange sometimes took 2-3.6 ms. Both bands matter to small units (``fullshard bench
# --config overhead``: 64 units of 4.5 KiB).
P2P_MIN_BYTES = 512 * 1024
P2P_SMALL_BYTES = 64 * 1024
#: Unsharded bytes that may be gathered ahead beyond the next unit, and reduced in flight beyond
#: ``max_pending`` units, on the CPU ([Note: a window for small units] in fullshard.engine.window).
SMALL_UNIT_WINDOW_BYTES = 256 * 1024


@dataclass(frozen=True)
class BackendPlan:
    """The backend-dependent choices of one root's units (see [Note: the backend plan])."""

    device_type: str
    backend: str
    pieces: bool = False
    p2p_collectives: bool = False
    window_bytes: int = 0
    buffer_pool: bool = False
    grad_slabs: bool = False

    @staticmethod
    def choose(device_type: str, backend: str, off: Iterable[str] = ()) -> BackendPlan:
        """The plan for units computing on ``device_type`` over a ``backend`` group, with the
        CPU choices in ``off`` switched off (names from :data:`CPU_CHOICES`)."""
        return _choose(device_type, backend, frozenset(off))

    @staticmethod
    def for_group(
        group: dist.ProcessGroup | None, device: torch.device, off: Iterable[str] = ()
    ) -> BackendPlan:
        """:meth:`choose` for a live process group (``None``: no communication)."""
        backend = str(dist.get_backend(group)) if group is not None else ""
        return _choose(device.type, backend, frozenset(off))

    def algorithm(self, kind: str, size: int, nbytes: int) -> str:
        """The call implementing a packed ``kind`` (``all_gather`` / ``reduce_scatter``) of
        ``nbytes`` over ``size`` ranks: the collective itself, unless ``p2p_collectives``.

        On gloo, for buffers of at least ``P2P_MIN_BYTES``: the all-gather is a p2p exchange
        up to ``P2P_MAX_RANKS`` ranks; the reduce-scatter is a p2p exchange on 2 ranks, where
        the one received chunk lands in the output and needs no scratch, and an in-place
        all-reduce on more (a p2p reduce-scatter holds N - 2 received chunks in scratch at
        once: 24 MiB per rank on ``fullshard bench --config memory --nproc 4``, +30 MiB peak
        RSS, above FSDP2's). On 2 ranks buffers of at most ``P2P_SMALL_BYTES`` are p2p
        exchanges too. The rest use gloo's all-gather and the in-place all-reduce.
        """
        if not self.p2p_collectives:
            return kind
        large = nbytes >= P2P_MIN_BYTES
        small = size == 2 and nbytes <= P2P_SMALL_BYTES
        if kind == "reduce_scatter":
            return "p2p" if size == 2 and (large or small) else "all_reduce"
        return "p2p" if (size <= P2P_MAX_RANKS and large) or small else kind

    def gathers_in_pieces(self, shard_size: int, unit_bytes: int) -> bool:
        """Whether an ``auto`` unit of ``unit_bytes`` (unsharded) gathers in pieces."""
        return self.pieces and unit_bytes >= P2P_MIN_BYTES and shard_size <= P2P_MAX_RANKS

    def reduces_in_pieces(self, shard_size: int, unit_bytes: int) -> bool:
        """Whether an ``auto`` unit reduces in pieces (2 ranks: no scratch needed)."""
        return self.pieces and unit_bytes >= P2P_MIN_BYTES and shard_size == 2


def serving_backend(backend: str, device_type: str) -> str:
    """The backend that runs ``device_type``'s collectives in a group whose backend string is
    ``backend``: ``"gloo"`` as it is; one device's part of ``"cpu:gloo,cuda:nccl"``; and for
    ``"undefined"`` (``init_process_group()`` without a backend, where torch makes each
    device's default backend on first use) that default: gloo for CPU tensors, NCCL for CUDA.
    """
    if backend == "undefined":
        return str(dist.Backend.default_device_backend_map.get(device_type, backend))
    if ":" in backend:
        for part in backend.split(","):
            dev, _, name = part.partition(":")
            if dev.strip() == device_type:
                return name.strip()
    return backend


@functools.cache
def _choose(device_type: str, backend: str, off: frozenset[str]) -> BackendPlan:
    unknown = sorted(off - set(CPU_CHOICES))
    if unknown:
        raise ValueError(
            f"CommPolicy.cpu_fast_paths_off names {unknown}, which are not CPU choices; "
            f"choose from {CPU_CHOICES}"
        )
    cpu = device_type == "cpu"
    backend = serving_backend(backend, device_type)
    gloo = cpu and backend == "gloo"
    # recycling swaps storages' memory (a private torch API, checked once); lending a slab
    # needs storage use counts too
    swap = cpu and STORAGE_SWAP
    pool = swap and "buffer_pool" not in off
    return BackendPlan(
        device_type,
        backend,
        pieces=gloo and "pieces" not in off,
        p2p_collectives=gloo and "p2p_collectives" not in off,
        window_bytes=SMALL_UNIT_WINDOW_BYTES if cpu and "small_unit_window" not in off else 0,
        buffer_pool=pool,
        grad_slabs=pool and STORAGE_USE_COUNT and "grad_slabs" not in off,
    )
