"""``WholeTensor``: run any per-tensor optimizer on whole tensors of a fully sharded model.

[Note: whole-tensor step] Optimizers such as Muon (Newton-Schulz orthogonalisation of the whole
matrix) or Shampoo (whole-matrix preconditioners) compute a different update from a row shard
than from the matrix, so running them on FSDP2 / fullshard parameters directly is silently
wrong. ``WholeTensor`` gives every tensor one *owner* rank in its shard group (balanced by
bytes, the same on every rank: :func:`layout.assign_owners`). Per step:

1. one exchange out (:func:`exchange.gather`): every rank sends its gradient rows of each
   tensor to the tensor's owner, which assembles the whole gradient;
2. each owner runs the inner optimizer (built once, over its owned tensors only) on whole
   tensors: its state lives only there, ~1/N of the optimizer memory per rank;
3. one exchange back (:func:`exchange.scatter`): the owner sends the updated rows to the ranks
   that hold them, which copy them into their local shards.

Each exchange is issued asynchronously for every shard group before any is waited on, and the
work that needs no exchange runs while they travel: whole tensors are prepared during the
exchange out, gradients dropped and whole tensors fingerprinted during the exchange back. An
owner's inner step needs its whole gradients, so it waits for the exchange out: that wait is
the exposed communication (``fullshard bench --config optim`` reports the step time).

The exchange out is not started during backward, as each unit's reduce-scatter finishes,
although the rows are final then, for three reasons. Gradients may change between backward and
``step()``, and ``torch.optim`` reads them at ``step()``: clipping scales them all by a factor
known only after the last reduction, the fp16 loss scaler unscales them, a training loop may
zero or skip them; rows sent early would be stale, and the owner cannot redo those edits. The
engine's only per-unit signal after a reduction is ``set_all_reduce_hook``, the user's hook,
which an optimizer must not take. And it would make one exchange per unit instead of one per
step. What it could save is small: on 2 gloo ranks with the ``small`` preset's 16 block
matrices (6 MiB sent per rank and step), float32 Muon, the step blocked 2-10 ms in the exchange
out and 5-9 ms in the exchange back, of a 0.85 s optimizer step and a ~2 s training step (load
average ~10 on 2 cores; ``fullshard bench --config optim`` at its default 4 x d_model 128:
WholeTensor 0.134 s a step, AdamW 0.035 s, naive 0.222 s). Under 1% of the step, and within its
noise.

The owner keeps a whole copy of each tensor it owns (its *master*, as many bytes as the tensors
it owns: ~1/N of the parameters), so parameters never travel at a step: bytes per step are the
owned gradients out and the owned parameters back, 2 x (N-1)/N of the owned bytes. A master is
refreshed from the shards whenever any rank's shard of it changed outside the optimizer (a
checkpoint load, a manual edit: detected from the local tensor's identity and a hash of its
contents, see [Note: why shards are hashed], and signalled in the exchange's header, so it
costs no extra collective). Whole tensors (plain
tensors, replicated DTensors, world size 1) are optimized in place on every rank, with no
communication. HSDP replicas run identical exchanges in their own shard groups.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from . import exchange
from .closure import run_closure
from .exchange import Traffic
from .layout import ShardLayout, assign_owners, layout_of, local_of

__all__ = ["WholeTensor"]

_Fingerprint = tuple[int, int, int]  # id, data_ptr and content hash of a local shard
_HASH_CHUNK = 1 << 20  # elements hashed per kernel; the weights vector is this long
_hash_weights: dict[torch.device, torch.Tensor] = {}


def content_hash(t: torch.Tensor) -> int:
    """A position-weighted sum (mod 2**64) of ``t``'s bits: changes when any element does.

    [Note: why shards are hashed] The version counter is not enough: loads that copy through
    ``.data`` (``load_state_dict`` on DTensor parameters does) leave it unchanged. Hashing
    reads each local shard once per step, about what an element-wise optimizer reads.
    """
    flat = t.detach().reshape(-1)
    if flat.numel() == 0:
        return 0
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[flat.element_size()]
    bits = flat.contiguous().view(ints)
    w = _hash_weights.get(t.device)
    if w is None:
        w = torch.arange(_HASH_CHUNK, dtype=torch.int64, device=t.device) * 0x9E3779B1 + 0x7F4A7C15
        _hash_weights[t.device] = w
    total = torch.zeros((), dtype=torch.int64, device=t.device)
    for start in range(0, bits.numel(), _HASH_CHUNK):
        chunk = bits[start : start + _HASH_CHUNK].to(torch.int64)
        total += (chunk * w[: chunk.numel()]).sum()
    return int(total.item())


class _Item:
    """One parameter: its layout, owner, and (on the owner) the whole tensor the inner
    optimizer steps."""

    __slots__ = ("fingerprint", "group_index", "layout", "owner", "param", "proxy")

    def __init__(self, param: torch.Tensor, layout: ShardLayout, owner: int, group_index: int):
        self.param = param
        self.layout = layout
        self.owner = owner  # group rank
        self.group_index = group_index  # its param group
        self.proxy: nn.Parameter | None = None  # on the owner: the whole tensor (master)
        self.fingerprint: _Fingerprint | None = None  # of the local shard at the last sync

    @property
    def whole(self) -> bool:
        """Optimized in place on this rank (no shard group to exchange with)."""
        return self.layout.size == 1

    @property
    def mine(self) -> bool:
        return self.whole or self.owner == self.layout.rank

    def local(self) -> torch.Tensor:
        return local_of(self.param).detach()

    def current_fingerprint(self) -> _Fingerprint:
        t = local_of(self.param)
        return (id(t), t.data_ptr(), 0 if self.whole else content_hash(t))


class WholeTensor(torch.optim.Optimizer):
    """A ``torch.optim.Optimizer`` running ``optimizer_cls`` on whole tensors of sharded params.

    >>> matrices = [p for n, p in model.named_parameters() if p.dim() == 2 and "blocks" in n]
    >>> muon = WholeTensor(torch.optim.Muon, matrices, lr=0.02, adjust_lr_fn="match_rms_adamw")

    ``params`` and ``optimizer_kwargs`` are what ``optimizer_cls`` takes (param groups
    included); the parameters are fullshard / FSDP2 ``DTensor`` parameters (one ``Shard(d)``
    mesh dim, ``Replicate()`` on others), plain tensors, or a mix. The inner optimizer must be
    per-tensor (its update of a tensor depends on that tensor alone: Muon, Shampoo, AdamW,
    SGD, ...); it sees ordinary whole tensors and runs unchanged. Param-group options set on
    this optimizer (``lr`` by a scheduler) reach it before every step.

    :meth:`step`, :meth:`state_dict` and :meth:`load_state_dict` are collective: every rank
    calls them. A parameter's gradient must be present on every rank or on none.
    ``last_step_traffic`` holds the bytes the last step moved; :meth:`state_bytes` the optimizer
    memory this rank holds. See [Note: whole-tensor step].
    """

    def __init__(
        self,
        optimizer_cls: Callable[..., torch.optim.Optimizer],
        params: Iterable[Any],
        **optimizer_kwargs: Any,
    ) -> None:
        super().__init__(params, optimizer_kwargs)
        self.optimizer_cls = optimizer_cls
        self._validate()
        flat = [(gi, p) for gi, g in enumerate(self.param_groups) for p in g["params"]]
        layouts = [
            layout_of(p, f"param_groups[{gi}] parameter of shape {list(p.shape)}") for gi, p in flat
        ]
        owners = assign_owners(layouts, [p.numel() * p.element_size() for _, p in flat])
        self._items = [_Item(p, lay, o, gi) for (gi, p), lay, o in zip(flat, layouts, owners)]
        # Exchanges run per shard group (usually one); whole items need none.
        self._groups: dict[tuple[int, ...], list[_Item]] = {}
        for item in self._items:
            if not item.whole:
                self._groups.setdefault(item.layout.ranks, []).append(item)
        for item in self._items:
            if item.mine:
                item.proxy = self._new_proxy(item)
        inner_groups = [
            {
                **_options(g),
                "params": [i.proxy for i in self._items if i.group_index == gi and i.mine],
            }
            for gi, g in enumerate(self.param_groups)
        ]
        self.inner: torch.optim.Optimizer | None = None
        if any(g["params"] for g in inner_groups):
            self.inner = optimizer_cls(inner_groups)
        self.last_step_traffic = Traffic()
        """Bytes this rank sent and received in the last :meth:`step` (both exchanges)."""

    # ---- construction helpers

    def _validate(self) -> None:
        """Build the inner optimizer on meta tensors of every parameter, so a parameter it
        refuses fails on every rank (not only on its owner), with this optimizer's name."""
        groups = [
            {
                **_options(g),
                "params": [torch.empty(p.shape, dtype=p.dtype, device="meta") for p in g["params"]],
            }
            for g in self.param_groups
        ]
        try:
            self.optimizer_cls(groups)
        except Exception as e:
            shapes = [[list(p.shape) for p in g["params"]] for g in self.param_groups]
            raise type(e)(
                f"WholeTensor({getattr(self.optimizer_cls, '__name__', self.optimizer_cls)}) "
                f"refused its parameters (shapes per group: {shapes}): {e}"
            ) from e

    def _new_proxy(self, item: _Item) -> nn.Parameter:
        local = item.local()
        if local.device.type == "meta":
            raise ValueError(
                f"WholeTensor: a parameter of shape {list(item.param.shape)} is still on the "
                "meta device; build the optimizer after model.to_empty(...) and "
                "reset_parameters()"
            )
        if item.whole:  # optimized in place: the proxy shares the parameter's storage
            proxy = nn.Parameter(local, requires_grad=True)
            item.fingerprint = item.current_fingerprint()
            return proxy
        # The master: filled from the shards at the first step (fingerprint None = stale).
        return nn.Parameter(torch.empty(item.layout.shape, dtype=local.dtype, device=local.device))

    # ---- the step

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """Gather owned gradients, step the inner optimizer on whole tensors, send rows back."""
        loss = run_closure(closure)
        traffic = Traffic()
        # 1. Every shard group's gradients go out before any exchange is waited on.
        pending = []
        for items in self._groups.values():
            with_grad = [i for i in items if i.param.grad is not None]
            group, lays, owners = _plan(with_grad)
            dirty = any(i.fingerprint != i.current_fingerprint() for i in items)
            grads = [local_of(i.param.grad).detach() for i in with_grad]  # type: ignore[arg-type]
            if group is None:
                # No gradients this step: the exchange still runs, for the stale flag.
                group, lays, owners, grads = items[0].layout.group, [], [], []
            assert group is not None
            gathering = exchange.start_gather(group, lays, owners, grads, flag=dirty)
            pending.append((items, with_grad, gathering))
        # While they travel: whole tensors need no exchange.
        for item in self._items:
            if item.whole:
                if item.fingerprint != item.current_fingerprint():
                    assert item.proxy is not None
                    item.proxy.data = item.local()  # the shard was replaced: re-alias it
                    item.fingerprint = item.current_fingerprint()
                assert item.proxy is not None
                g = item.param.grad
                item.proxy.grad = None if g is None else local_of(g).detach()
        for items, with_grad, gathering in pending:
            fulls, stale, t = gathering.wait()
            traffic.add(t)
            if stale:
                self._refresh_masters(items, traffic)
            for item, full in zip(with_grad, fulls):
                if full is not None:
                    assert item.proxy is not None
                    item.proxy.grad = full
        # 2. The inner optimizer, on whole tensors.
        if self.inner is not None:
            for inner_group, outer in zip(self.inner.param_groups, self.param_groups):
                inner_group.update(_options(outer))
            self.inner.step()
        # 3. Every group's updated rows go back before any exchange is waited on; meanwhile
        # the gradients are dropped and the whole tensors fingerprinted.
        scattering = []
        for _, with_grad, _ in pending:
            group, lays, owners = _plan(with_grad)
            if group is not None:
                fulls_ = [i.proxy if i.mine else None for i in with_grad]
                outs = [i.local() for i in with_grad]
                scattering.append(exchange.start_scatter(group, lays, owners, fulls_, outs))
        for item in self._items:
            if item.proxy is not None:
                item.proxy.grad = None
            if item.whole:
                item.fingerprint = item.current_fingerprint()
        for pending_scatter in scattering:
            traffic.add(pending_scatter.wait())
        for item in self._items:
            if not item.whole:
                item.fingerprint = item.current_fingerprint()
        self.last_step_traffic = traffic
        return loss

    def _refresh_masters(self, items: list[_Item], traffic: Traffic) -> None:
        """Rebuild every owner's master from the current shards (first step, after a load)."""
        group, lays, owners = _plan(items)
        assert group is not None
        fulls, _, t = exchange.gather(group, lays, owners, [i.local() for i in items])
        traffic.add(t)
        for item, full in zip(items, fulls):
            if full is not None:
                assert item.proxy is not None
                item.proxy.data.copy_(full)

    # ---- introspection

    def owned_parameters(self) -> list[torch.Tensor]:
        """The parameters whose whole tensor this rank optimizes (whole tensors included)."""
        return [i.param for i in self._items if i.mine]

    def owner_of(self, param: torch.Tensor) -> int:
        """The owning rank (index in the parameter's shard group) of ``param``."""
        for item in self._items:
            if item.param is param:
                return item.owner
        raise KeyError(f"a parameter of shape {list(param.shape)} is not in this optimizer")

    def state_bytes(self) -> dict[str, int]:
        """Bytes of optimizer memory on this rank: ``"state"`` (the inner optimizer's state
        tensors) and ``"master"`` (whole copies of owned sharded tensors)."""
        state = 0
        if self.inner is not None:
            for entries in self.inner.state.values():
                state += sum(
                    v.numel() * v.element_size()
                    for v in entries.values()
                    if isinstance(v, torch.Tensor)
                )
        master = sum(
            i.proxy.numel() * i.proxy.element_size()
            for i in self._items
            if i.proxy is not None and not i.whole
        )
        return {"state": state, "master": master}

    # ---- state dicts (see state_dict.py for the format)

    def state_dict(self) -> dict[str, Any]:
        """Collective. The state in the usual sharded form, the same on every rank in layout.

        Keys are positions, as for any ``torch.optim.Optimizer``. A state tensor of its
        parameter's shape is a DTensor sharded like the parameter, another tensor is a
        ``Shard(0)`` DTensor on the same shard group, a 0-d tensor is a plain tensor on every
        rank — so ``fullshard.checkpoint`` and ``torch.distributed.checkpoint`` save it as they
        save a plain sharded AdamW's, and load it at any world size.
        """
        from .state_dict import sharded_state

        state = sharded_state(self)
        groups = []
        index = 0
        for g in self.param_groups:
            groups.append({**_options(g), "params": list(range(index, index + len(g["params"])))})
            index += len(g["params"])
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Collective. Load :meth:`state_dict`'s form (or a plain optimizer's, sharded like
        its parameters or whole): every state tensor is gathered onto its new owner."""
        from .state_dict import load_sharded_state

        load_sharded_state(self, state_dict)


def _options(group: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in group.items() if k != "params"}


def _plan(items: list[_Item]) -> tuple[dist.ProcessGroup | None, list[ShardLayout], list[int]]:
    if not items:
        return None, [], []
    return items[0].layout.group, [i.layout for i in items], [i.owner for i in items]
