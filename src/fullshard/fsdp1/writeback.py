"""FSDP1's ``use_orig_params=True`` writeback: parameters and gradients changed by hand.

[Note: use_orig_params writeback]
FSDP1 with ``use_orig_params=True`` lets code change the original parameters outside its
runtime and copies the change into its flat parameter before the next unshard (forward,
backward, ``summon_full_params``): a parameter replaced on its module
(``m.weight = nn.Parameter(t)``), one whose ``.data`` or whose gradient (``.grad``, set, set to
``None`` or its ``.data`` set) was changed. It refuses a replacement of another shape
(``RuntimeError: Cannot writeback ...``) and any change while a no-reshard strategy
(``SHARD_GRAD_OP``) keeps the unsharded parameters between forward and backward
(``AssertionError``: the backward would run on other values than the forward's).

fullshard's wrapper parameters are ``DTensor`` shards, the engine's own storage, so most of this
is a matter of not losing what users write:

- ``.data`` set by hand: torch's setter on a ``DTensor`` swaps the wrapper's metadata but keeps
  its old local tensor, dropping the new values without a word. The wrapper's sharded
  parameters and their gradients are therefore of the class :class:`WritableShard`, a
  ``DTensor`` whose ``data`` setter copies the new values into its local tensor at once (this
  rank's part of a ``DTensor`` of the same spec, or its slice of a plain tensor of the full
  shape); another shape raises FSDP1's ``RuntimeError``.
- ``.grad`` set by hand is the sharded gradient itself (optimizers and the next reduction read
  it), as is ``None``; a plain tensor of the full shape is cut to this rank's slice.
- a replaced parameter: before every unshard of a wrapper (``ParamGroup.pre_unshard``, and
  ``summon_full_params``) :func:`write_back` compares, per parameter, the object its module
  registers with the engine's (an identity test: the common path's whole cost). A
  replacement's values are copied into the shard; a ``Parameter`` holding a ``DTensor`` of
  the same spec then becomes the shard itself (its local tensor is the engine's, as FSDP1's
  new parameter becomes a view into its flat parameter), and optimizers holding the old one
  step the new one (``orig_params.note_replaced``); a plain one of the full shape leaves the
  engine's parameter registered. Another shape, mesh or placement raises ``RuntimeError``.
- while the unit keeps its unsharded parameters after forward (``SHARD_GRAD_OP``, the root),
  the registered unsharded parameter must be the engine's and keep the memory it had when
  gathered (its data pointer, recorded by ``ParamGroup.post_unshard``); otherwise FSDP1's
  ``AssertionError``.

Tied parameters are checked through their first module. fullshard does this whatever
``use_orig_params`` says, since its parameters are always the originals. Two differences from
FSDP1: an optimizer built before a replacement steps the new parameter (FSDP1's keeps the old
one, which no longer gets gradients), and the root, which fullshard keeps unsharded after a
forward under ``FULL_SHARD`` too (as FSDP2), refuses a change there as ``SHARD_GRAD_OP``
does. On torch before 2.11, whose ``DTensor`` view ops refuse a subclass, there is no
:class:`WritableShard`: a ``.data`` set on a sharded parameter is refused at the next unshard
(``RuntimeError``, telling to copy in place), and one on a gradient is lost as with a plain
``DTensor``.
"""

from __future__ import annotations

import copy
from typing import Any, cast

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils._foreach_utils import _foreach_supported_types

from ..checkpoint.shards import local_box, slices
from ..engine import (
    DTENSOR_SUBCLASS_VIEWS,
    FSDPState,
    ParamGroup,
    ShardedParam,
    ShardedState,
    dtensor_like,
)
from .orig_params import note_replaced
from .state_dict import clean_fqn

__all__ = ["WritableShard", "install", "unmark", "write_back"]

_DATA: Any = torch._C.TensorBase.data  # torch's own ``data`` descriptor
# Marks on a wrapper's sharded parameter, as attributes (a weak reference to it would make
# ``module.to(...)`` fail: ``swap_tensors`` refuses a tensor something holds weakly); the
# wrapper marks its parameters again after ``_apply`` (``_mark_flattened``).
_FQN = "_fullshard_fqn"  # its clean FQN
_WRAPPER = "_fullshard_wrapper_storage"  # torch < 2.11: its wrapper's storage


class WritableShard(DTensor):
    """A ``DTensor`` whose ``.data = t`` writes ``t``'s values into its local tensor (see the
    Note); everything else is ``DTensor``'s."""

    __slots__ = ()

    @property  # type: ignore[override]
    def data(self) -> torch.Tensor:
        return _DATA.__get__(self)

    @data.setter
    def data(self, new: torch.Tensor) -> None:
        fqn = getattr(self, _FQN, None)
        name = f"{fqn!r}'s .data" if fqn else "a sharded gradient's .data"
        local = _local_part(self, new, name + " was set to")
        with torch.no_grad():
            self._local_tensor.copy_(local)

    def __deepcopy__(self, memo: dict[int, Any]) -> DTensor:
        """A copy is a plain ``DTensor`` (``Parameter``), which no wrapper manages."""
        if id(self) in memo:
            return cast(DTensor, memo[id(self)])
        out = self.detach().clone()
        if isinstance(self, nn.Parameter):
            out = nn.Parameter(out, requires_grad=self.requires_grad)
        if self.grad is not None:
            out.grad = copy.deepcopy(self.grad, memo)
        memo[id(self)] = out
        return cast(DTensor, out)


if WritableShard not in _foreach_supported_types:  # optimizers' foreach paths take it as DTensor
    _foreach_supported_types.append(WritableShard)


def _local_part(like: DTensor, new: Any, what: str) -> torch.Tensor:
    """This rank's part of ``new`` for ``like``: the local tensor of a ``DTensor`` of ``like``'s
    spec, or this rank's slice of a plain tensor of ``like``'s full shape (``what``: the
    change, for messages: "'lin.weight' was replaced by")."""
    shape = tuple(like.shape)
    if not isinstance(new, torch.Tensor) or tuple(new.shape) != shape:
        got = repr(new)
        if isinstance(new, torch.Tensor):
            got = f"a {type(new).__name__} of shape {tuple(new.shape)}"
        raise RuntimeError(
            f"Cannot writeback: {what} {got}, but the wrapper shards shape {shape}. Give it a "
            f"tensor of shape {shape} (e.g. torch.ones_like(param)), or change the module "
            f"before wrapping it"
        )
    if not isinstance(new, DTensor):
        return new.detach()[slices(local_box(like, what))]
    if new.device_mesh != like.device_mesh or tuple(new.placements) != tuple(like.placements):
        raise RuntimeError(
            f"Cannot writeback: {what} a DTensor placed {new.placements} on "
            f"{new.device_mesh}, but the wrapper shards it as {like.placements} on "
            f"{like.device_mesh}. Give it a DTensor of the same placements (e.g. "
            f"torch.ones_like(param)) or a plain tensor of the full shape"
        )
    return new._local_tensor.detach()


def _mark(param: torch.Tensor, fqn: str) -> None:
    if DTENSOR_SUBCLASS_VIEWS and type(param) is DTensor:
        param.__class__ = WritableShard
    elif not DTENSOR_SUBCLASS_VIEWS:  # see _check_data_kept
        setattr(param, _WRAPPER, param.untyped_storage()._cdata)
    setattr(param, _FQN, fqn)


def unmark(state: FSDPState) -> None:
    """Before ``module._apply`` converts the unit's parameters: plain ``DTensor``s again, as
    torch re-wraps each one in ``nn.Parameter``, which takes a tensor subclass only if its
    ``detach()`` keeps the type (a ``WritableShard``'s gives a ``DTensor``: what state dicts
    hold). The wrapper marks them again afterwards (:func:`install`)."""
    for sp in state.group.params:
        if type(sp.sharded_param) is WritableShard:
            sp.sharded_param.__class__ = DTensor


def _check_data_kept(sp: ShardedParam) -> None:
    """torch < 2.11 (no :class:`WritableShard`): refuse a ``.data`` set on the sharded
    parameter, whose values torch's ``DTensor`` dropped (its wrapper's storage changed)."""
    param = sp.sharded_param
    if getattr(param, _WRAPPER, None) in (None, param.untyped_storage()._cdata):
        return
    raise RuntimeError(
        f"Cannot writeback: {clean_fqn(sp.fqn)!r}'s .data was set, and on torch "
        f"{torch.__version__} DTensor keeps its old values when .data is set. Copy the new "
        f"values in instead (with torch.no_grad(): param.copy_(new)), or use torch 2.11 or newer"
    )


def install(state: FSDPState, strategy: Any) -> None:
    """Give a wrapper's unit (``state``; ``strategy`` its FSDP1 sharding strategy, for
    messages) the writeback of the Note. Called again after the unit adopts new parameters."""
    group = state.group
    for sp in group.params:
        _mark(sp.sharded_param, clean_fqn(sp.fqn))
    watch = _Watch(strategy)
    group.pre_unshard = watch.before
    group.post_unshard = watch.after


class _Watch:
    """One unit's hooks: :func:`write_back` before each unshard; once gathered, the data
    pointer of each unsharded parameter (by ``id``), which a ``.data`` set would change."""

    def __init__(self, strategy: Any) -> None:
        self.strategy = strategy
        self.gathered: dict[int, int] = {}

    def before(self, group: ParamGroup) -> None:
        write_back(group, self.strategy, self.gathered)

    def after(self, group: ParamGroup) -> None:
        self.gathered = {
            id(up): up.data_ptr() for sp in group.params if (up := sp.unsharded_param) is not None
        }


def write_back(
    group: ParamGroup, strategy: Any = None, gathered: dict[int, int] | None = None
) -> None:
    """Write back, or refuse, what was changed by hand on ``group``'s parameters (the Note;
    ``gathered``: :class:`_Watch`'s data pointers)."""
    if group.state is ShardedState.UNSHARDING:  # checked when the gather was issued
        return
    kept = group.state is ShardedState.UNSHARDED
    for sp in group.params:
        module, name = sp.refs[0]
        current = module._parameters.get(name)
        if current is sp.sharded_param:
            if not DTENSOR_SUBCLASS_VIEWS:
                _check_data_kept(sp)
            _check_grad(sp)
            continue
        up = sp.unsharded_param
        if current is not None and current is up:
            if gathered is None or gathered.get(id(up), up.data_ptr()) == up.data_ptr():
                continue
            raise AssertionError(_changed_while_kept(sp, strategy, "had its .data set"))
        if kept:
            raise AssertionError(_changed_while_kept(sp, strategy, "was replaced"))
        _adopt(sp, current)


def _changed_while_kept(sp: ShardedParam, strategy: Any, how: str) -> str:
    return (
        f"FSDP does not support changing the parameters between forward and backward for "
        f"{strategy}: {clean_fqn(sp.fqn)!r} {how} while its unit kept the unsharded parameters "
        f"after forward (the backward would use other values than the forward). Change it "
        f"after the backward (before the next forward), or use FULL_SHARD"
    )


def _adopt(sp: ShardedParam, current: Any) -> None:
    """Copy the parameter registered in place of ``sp``'s shard into the shard (the Note)."""
    old = sp.sharded_param
    assert isinstance(old, DTensor)
    fqn = clean_fqn(sp.fqn)
    local = _local_part(old, current, f"{fqn!r} was replaced by")
    with torch.no_grad():
        sp.local.copy_(local)
    if isinstance(current, DTensor):  # the new Parameter becomes the shard, on its memory
        _DATA.__set__(current, dtensor_like(sp.local, old, DTensor))
        current._local_tensor = sp.local
        current._spec = old._spec
        _mark(current, fqn)
        sp.sharded_param = cast(nn.Parameter, current)
        note_replaced(cast(nn.Parameter, old), sp.sharded_param)
    elif isinstance(current, nn.Parameter):  # a plain one of the full shape: its rows only
        note_replaced(current, old)
    sp.to_sharded()
    _check_grad(sp)


def _check_grad(sp: ShardedParam) -> None:
    """A gradient set by hand as a plain tensor of the full shape: cut to this rank's part."""
    param = sp.sharded_param
    grad = param.grad
    if (
        grad is None
        or type(grad) is WritableShard
        or getattr(grad, "_spec", None) is cast(DTensor, param)._spec
    ):
        return  # none, or the engine's (it shares the parameter's spec)
    assert isinstance(param, DTensor)
    local = _local_part(param, grad, f"{clean_fqn(sp.fqn)!r}'s .grad was set to")
    if isinstance(grad, DTensor):  # already this rank's part: keep it, .data set included
        if DTENSOR_SUBCLASS_VIEWS:
            grad.__class__ = WritableShard
        return
    param.grad = dtensor_like(local.to(param.dtype).contiguous(), param)
