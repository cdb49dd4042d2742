"""What FSDP1 does to a module before sharding it: materialise it, move it, synchronise it.

- A module with parameters or buffers on the meta device is materialised: with
  ``param_init_fn``, that function is called on each of the unit's modules; without, each
  module holding tensors of its own is ``to_empty``'d onto the compute device and its
  ``reset_parameters()`` called (FSDP1's contract: it initialises only its own tensors).
- ``device_id`` moves the unit's own parameters and buffers to that device.
- ``sync_module_states`` broadcasts them from the mesh's first rank, across the replicas first
  and then within the shard group (FSDP1's order for the hybrid strategies), so every rank
  shards the same values. FSDP1 requires GPU tensors for it; fullshard broadcasts on whatever
  backend the mesh runs (gloo on the CPU too). The tensors travel in buckets, as FSDP1's do:
  per dtype and device, flattened into buffers of at most ``BROADCAST_BUCKET_BYTES`` (a larger
  tensor alone), one broadcast per bucket and mesh dimension.

"The unit's modules" are those reached from the wrapped module without entering a unit
applied before (a nested wrapper) or an ignored module.
"""

from __future__ import annotations

import collections
import itertools
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from ..engine import STATE_ATTR

__all__ = [
    "BROADCAST_BUCKET_BYTES",
    "local_modules",
    "materialize",
    "move_to_device",
    "sync_module_states",
]

#: The most bytes ``sync_module_states`` packs into one broadcast (FSDP1's bucket size).
BROADCAST_BUCKET_BYTES = 250 * 1024 * 1024


def local_modules(root: nn.Module, ignored: set[nn.Module]) -> list[nn.Module]:
    """``root`` and its submodules down to (not into) nested units and ignored modules,
    breadth first, each once."""
    out: list[nn.Module] = []
    queue = collections.deque([root])
    seen = {root}
    while queue:
        module = queue.popleft()
        out.append(module)
        for child in module.children():
            if child in seen or child in ignored or STATE_ATTR in child.__dict__:
                continue
            seen.add(child)
            queue.append(child)
    return out


def _own_tensors(module: nn.Module) -> list[torch.Tensor]:
    return [
        t
        for t in itertools.chain(module.parameters(recurse=False), module.buffers(recurse=False))
        if not isinstance(t, DTensor)
    ]


def materialize(
    modules: list[nn.Module],
    param_init_fn: Callable[[nn.Module], None] | None,
    device: torch.device,
) -> None:
    """Materialise ``modules`` if any of their own tensors is on meta (see the docstring)."""
    if not any(t.is_meta for m in modules for t in _own_tensors(m)):
        return
    if param_init_fn is not None:
        if not callable(param_init_fn):
            raise ValueError(
                f"Expected {param_init_fn} to be callable but got {type(param_init_fn)}"
            )
        for m in modules:
            param_init_fn(m)
        return
    with torch.no_grad():
        for m in modules:
            if not _own_tensors(m):
                continue
            reset = getattr(m, "reset_parameters", None)
            if not callable(reset):
                raise ValueError(
                    f"{type(m).__name__} has parameters or buffers on the meta device and no "
                    f"reset_parameters() to initialise them: give it one, or pass "
                    f"param_init_fn=... to FullyShardedDataParallel"
                )
            m.to_empty(device=device, recurse=False)
            reset()


def move_to_device(modules: list[nn.Module], device: torch.device) -> None:
    """Move the own parameters and buffers of ``modules`` to ``device`` (``device_id``)."""
    for m in modules:
        m._apply(lambda t: t.to(device), recurse=False)


def _buckets(tensors: list[torch.Tensor], max_bytes: int) -> list[list[torch.Tensor]]:
    """``tensors`` grouped by dtype and device (in order of first appearance, the same on every
    rank), each group cut into runs of at most ``max_bytes`` (a larger tensor alone)."""
    groups: dict[tuple[torch.dtype, torch.device], list[list[torch.Tensor]]] = {}
    filled: dict[tuple[torch.dtype, torch.device], int] = {}  # bytes in each group's last run
    for t in tensors:
        key, nbytes = (t.dtype, t.device), t.numel() * t.element_size()
        runs = groups.setdefault(key, [[]])
        if runs[-1] and filled[key] + nbytes > max_bytes:
            runs.append([])
            filled[key] = 0
        runs[-1].append(t)
        filled[key] = filled.get(key, 0) + nbytes
    return [run for runs in groups.values() for run in runs]


def _broadcast(bucket: list[torch.Tensor], src: int, group: dist.ProcessGroup) -> None:
    """One broadcast of ``bucket``: the tensor itself if alone, else a flat copy, copied back."""
    if len(bucket) == 1 and bucket[0].is_contiguous():
        dist.broadcast(bucket[0], src=src, group=group)
        return
    flat = torch.cat([t.reshape(-1) for t in bucket])
    dist.broadcast(flat, src=src, group=group)
    for t, part in zip(bucket, flat.split([t.numel() for t in bucket])):
        t.copy_(part.view(t.shape))


def sync_module_states(
    modules: list[nn.Module], mesh: DeviceMesh, bucket_bytes: int = BROADCAST_BUCKET_BYTES
) -> None:
    """Broadcast the own parameters and buffers of ``modules`` from the mesh's first rank,
    one broadcast per bucket of at most ``bucket_bytes`` (see the module's docstring)."""
    own = {id(t): t for m in modules for t in _own_tensors(m)}  # a tied tensor once
    tensors = [t.detach() for t in own.values()]
    if any(t.is_meta for t in tensors):
        raise ValueError(
            "sync_module_states=True with parameters or buffers still on the meta device: "
            "materialise them first (param_init_fn=... or reset_parameters())"
        )
    buckets = _buckets([t for t in tensors if t.numel()], bucket_bytes)
    for dim in range(mesh.ndim):  # replicas first (dim 0 of a 2-D mesh), then the shard group
        group = mesh.get_group(dim)
        if dist.get_world_size(group) == 1:
            continue
        src = dist.get_global_rank(group, 0)
        with torch.no_grad():
            for bucket in buckets:
                _broadcast(bucket, src, group)
