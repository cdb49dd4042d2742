"""FSDP1's ``LOCAL_STATE_DICT`` entry: each wrapper's flat parameter shard, ``_flat_param``.

torch's FSDP1 keeps a wrapper's own parameters in one ``FlatParameter``: the parameters
flattened and concatenated in module order (a tied parameter once), padded to a
multiple of the shard group's size and cut into equal contiguous pieces, one per rank. Its
``LOCAL_STATE_DICT`` holds, per wrapper with parameters, ``<prefix>_flat_param``: a 1-D
``ShardedTensor`` whose piece on each rank is that rank's part without the end padding.
With ``use_orig_params=True`` FSDP1 also pads before each parameter so that it starts on a
16-byte boundary (in the dtype it computes in), and pads the end to a multiple of the group's
size before cutting, with the value 42; that padding is part of the entry's size.

fullshard shards each parameter by rows, which are not a rank's flat piece: saving gathers
the wrapper's parameters (one wrapper's full parameters at a time, as ``FULL_STATE_DICT``
does; FSDP1's costs no communication) and keeps this rank's flat piece; loading gathers the
pieces and cuts each parameter's rows out of them. The
entry has FSDP1's key, size, offsets and values, so a ``LOCAL_STATE_DICT`` saved by torch's
FSDP1 (``use_orig_params=False``; torch's FSDP1 loads none with ``True``) loads into fullshard
on the same shard groups and the other way round. It is a copy: FSDP1's is a view of the flat
parameter. With ``use_orig_params=True`` FSDP1 also keeps each parameter's name, holding this
rank's 1-D piece of it in that layout; so does fullshard (loading reads ``_flat_param``
only). FSDP1 needs one dtype per flat parameter: a wrapper with several dtypes is refused in
one line. (Under ``NO_SHARD`` FSDP1's ``LOCAL_STATE_DICT`` is a full one, and so is
fullshard's: ``fullshard.fsdp1.state_dict``.)
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._shard.sharded_tensor import Shard, init_from_local_shards
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import _CHECKPOINT_PREFIX
from torch.distributed.tensor import DTensor

__all__ = ["FLAT_PARAM", "load_flat_param", "save_flat_param"]

FLAT_PARAM = "_flat_param"
_ALIGNMENT_BYTES = 16  # FSDP1's address alignment with use_orig_params=True
_PADDING_VALUE = 42  # what FSDP1 fills that padding with


@dataclass
class _Layout:
    """Where a wrapper's own parameters lie in FSDP1's flat parameter."""

    params: list[DTensor]  # in FSDP1's order, each once
    names: list[list[str]]  # each parameter's names below the wrapper (tied: several)
    offsets: list[int]  # where each parameter starts in the flat parameter
    total: int  # the flat parameter's size, its padding for alignment included
    rank: int
    world: int
    group: Any

    @property
    def chunk(self) -> int:
        """Each rank's piece with padding (``torch.chunk``'s first chunk)."""
        return -(-self.total // self.world)

    @property
    def valid(self) -> int:
        """This rank's piece without the end padding."""
        return max(0, min(self.chunk, self.total - self.rank * self.chunk))


def _own_named(wrapper: Any) -> Iterator[tuple[str, nn.Parameter]]:
    """The wrapper's own parameters by name, in FSDP1's order (module by module, each
    module's own parameters; tied ones under each name), names as state dicts spell them."""
    own = {id(sp.sharded_param) for sp in wrapper._unit.group.params}
    wrapped: nn.Module = wrapper._fsdp_wrapped_module
    for mod_name, module in wrapped.named_modules(remove_duplicate=False):
        for name, p in module.named_parameters(recurse=False, remove_duplicate=False):
            if id(p) in own:
                full = f"{mod_name}.{name}" if mod_name else name
                yield full.replace(_CHECKPOINT_PREFIX, ""), p


def _layout(wrapper: Any, prefix: str) -> _Layout | None:
    """The wrapper's flat layout (``None`` without parameters); several dtypes are refused."""
    params: list[DTensor] = []
    names: dict[int, list[str]] = {}
    for name, p in _own_named(wrapper):
        if id(p) not in names:
            params.append(cast(DTensor, p))
            names[id(p)] = []
        names[id(p)].append(name)
    if not params:
        return None
    where = f"the FSDP module at {prefix[:-1]!r}" if prefix else "the root FSDP module"
    dtypes = sorted({str(p.dtype) for p in params})
    if len(dtypes) > 1:
        raise ValueError(
            f"LOCAL_STATE_DICT holds one flat parameter of one dtype per FSDP module (as "
            f"FSDP1), and {where} has parameters in {', '.join(dtypes)}: use "
            f"SHARDED_STATE_DICT, or wrap the parameters of each dtype in their own FSDP module"
        )
    align = 0
    if wrapper._use_orig_params:
        compute = wrapper.mixed_precision.param_dtype or params[0].dtype
        align = _ALIGNMENT_BYTES // torch.empty((), dtype=compute).element_size()
    offsets, total = [], 0
    for param in params:
        if align and total % align:
            total += align - total % align
        offsets.append(total)
        total += param.numel()
    world = wrapper.world_size
    if align and total % world:
        total += world - total % world
    order = [names[id(p)] for p in params]
    return _Layout(params, order, offsets, total, wrapper.rank, world, wrapper.process_group)


def save_flat_param(
    wrapper: nn.Module, state_dict: dict[str, Any], prefix: str, offload_to_cpu: bool
) -> None:
    """Put the wrapper's ``_flat_param`` entry in ``state_dict`` (keys already without
    ``_fsdp_wrapped_module.``) where FSDP1 puts it. Collective over the shard group.

    Without ``use_orig_params`` the entry replaces the wrapper's parameters, before the
    wrapper's other entries (FSDP1 registers the flat parameter on the wrapped module). With
    it, FSDP1 keeps the parameters' names, each holding this rank's piece of it in the flat
    layout (1-D, maybe empty), and adds the entry after the wrapper's other entries."""
    layout = _layout(wrapper, prefix)
    if layout is None:
        return
    lead = layout.params[0]
    flat = torch.full((layout.total,), _PADDING_VALUE, dtype=lead.dtype, device=lead.device)
    for p, offset in zip(layout.params, layout.offsets):
        full = cast(DTensor, p.detach()).full_tensor().reshape(-1)
        flat[offset : offset + full.numel()] = full
    start, end = layout.rank * layout.chunk, layout.rank * layout.chunk + layout.valid
    piece = flat[start:end].clone()
    if offload_to_cpu:
        piece = piece.cpu()
    shards = [Shard.from_tensor_and_offsets(piece, [start], layout.rank)] if layout.valid else []
    entry = init_from_local_shards(shards, layout.total, process_group=layout.group)
    if wrapper._use_orig_params:  # type: ignore[union-attr]
        for p, offset, names in zip(layout.params, layout.offsets, layout.names):
            lo = min(max(offset, start), end)  # the parameter's part of this rank's piece
            hi = min(max(offset + p.numel(), lo), end)
            for name in names:
                state_dict[prefix + name] = piece[lo - start : hi - start]
        state_dict[prefix + FLAT_PARAM] = entry
        return
    drop = {prefix + n for names in layout.names for n in names}
    items = [(k, v) for k, v in state_dict.items() if k not in drop]
    first = next((i for i, (k, _) in enumerate(items) if k.startswith(prefix)), len(items))
    items.insert(first, (prefix + FLAT_PARAM, entry))
    state_dict.clear()
    state_dict.update(items)


def load_flat_param(wrapper: nn.Module, state_dict: dict[str, Any], prefix: str) -> set[str]:
    """Replace ``prefix + "_flat_param"`` in ``state_dict`` (``prefix``: the wrapper's,
    ``_fsdp_wrapped_module.`` included) with the wrapper's full parameters; return their keys
    (none without the entry). Collective over the shard group."""
    key = prefix + FLAT_PARAM
    if key not in state_dict:
        return set()
    layout = _layout(wrapper, prefix)
    if layout is None:
        return set()  # the entry is reported as unexpected
    local = _local_piece(state_dict.pop(key))
    if local.numel() != layout.valid:
        raise ValueError(
            f"the LOCAL_STATE_DICT entry {key!r} holds {local.numel()} elements on rank "
            f"{layout.rank}, and this FSDP module's flat parameter shard has {layout.valid}: "
            f"load it into the same model, wrapping, use_orig_params and shard group size it "
            f"was saved from"
        )
    device = layout.params[0].device
    piece = torch.zeros(layout.chunk, dtype=layout.params[0].dtype, device=device)
    piece[: layout.valid] = local.reshape(-1)
    pieces = [torch.empty_like(piece) for _ in range(layout.world)]
    dist.all_gather(pieces, piece, group=layout.group)
    flat = torch.cat(pieces)
    filled = set()
    for p, offset, names in zip(layout.params, layout.offsets, layout.names):
        for name in names:
            state_dict[prefix + name] = flat[offset : offset + p.numel()].view(p.shape)
            filled.add(prefix + name)
    return filled


def _local_piece(value: Any) -> torch.Tensor:
    """This rank's piece of a ``_flat_param`` entry: FSDP1's ``ShardedTensor`` (its one local
    shard, or none), or the piece itself as a tensor."""
    if callable(getattr(value, "local_shards", None)):
        shards = value.local_shards()
        return shards[0].tensor.detach() if shards else torch.empty(0)
    if isinstance(value, torch.Tensor):
        return value.detach()
    raise TypeError(
        f"a LOCAL_STATE_DICT _flat_param entry must be a ShardedTensor (as FSDP1 saves it) or "
        f"a tensor, got {type(value).__name__}"
    )
