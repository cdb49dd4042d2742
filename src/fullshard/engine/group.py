"""ParamGroup: one communication unit — its layout, its knobs and its sharded-state machine.

The verbs of the machine (see [Note: sharded state] in ``fullshard.engine.state``) are methods:
:meth:`unshard` (issue the all-gather), :meth:`wait_for_unshard` (finish it and register the
unsharded parameters), :meth:`reshard` (free them), :meth:`reshard_partial` (keep a copy
sharded over ``k`` ranks) and :meth:`reduce_grads` (collect and reduce-scatter gradients).
How bytes move is the unit's :class:`~fullshard.engine.transport.Transport`, chosen once at lazy init;
the code that moves them lives in ``fullshard.engine.gather`` and ``fullshard.engine.reduce``; what depends
on the placement lives in :class:`~fullshard.engine.param.ShardedParam`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from .comm import CommContext
from .compat import REDUCE_DTYPE_FOLLOWS_GRAD_DTYPE
from .events import emit
from .extension import ExtensionGather, has_extension
from .gather import PendingGather, finish_gather, start_gather
from .host import AfterBackward, BufferContent, Release
from .kept import KeptBuffers
from .labels import labelled
from .mesh import MeshInfo
from .overrides import CommOverrides
from .param import ShardedParam
from .partition import mesh_name, ranks_of, split_by_dtype, split_by_mesh
from .policies import CommPolicy, MixedPrecisionPolicy, own_dtype_policy
from .reduce import (
    PartialReduce,
    PendingReduce,
    collect_grads,
    hand_out_local,
    start_reduce,
)
from .state import ShardedState, transition
from .streamcheck import freed
from .transport import Transport, aliasable, decide

__all__ = ["ParamGroup"]


class ParamGroup:
    """The parameters of one ``fully_shard`` unit, communicated together."""

    def __init__(
        self,
        params: list[ShardedParam],
        info: MeshInfo,
        device: torch.device,
        mp_policy: MixedPrecisionPolicy,
        name: str,
        comm_policy: CommPolicy | None = None,
        *,
        offloaded: bool = False,
        pin_memory: bool = False,
    ) -> None:
        self.params = params  # every parameter of the unit (what init, api and checkpoints see)
        # The parameters in this group's own buffer; parameters of other dtypes (frozen) live
        # in ``subgroups``, one per dtype ([Note: one buffer per dtype] in
        # fullshard.engine.partition). Set by init_layout.
        self.layout: list[ShardedParam] = params
        self.subgroups: list[ParamGroup] = []
        # Parameters whose shards define FSDP2's all-gather extension (fullshard.engine.extension).
        self.extended: ExtensionGather | None = None
        self.info = info
        self.device = device  # where unsharded parameters live and compute happens
        self.mp_policy = mp_policy
        self.comm_policy = comm_policy or CommPolicy()
        self.offloaded = offloaded  # shards, gradients and optimizer state in host memory
        self.pin_memory = pin_memory
        self.name = name  # the unit's module FQN, for messages
        self.state = ShardedState.SHARDED
        # Chosen at lazy init (init_layout, see fullshard.engine.transport).
        self.transport = Transport(self.comm_policy.transport, False, False)
        # The root's plan, streams and host strategy, shared by reference (fullshard.engine.comm); bound
        # at lazy init.
        self.comm = CommContext.unbound(device)
        # Knobs (set_* methods of FSDPModule); the gradient ones live in ``overrides``, which
        # child groups share.
        self.reshard_after_backward = True
        self.unshard_in_backward = True  # False: backward needs no parameter (e.g. embedding)
        # set_keep_unsharded_storage: resharding keeps the buffer's memory (and so its address)
        # and the comm buffers in ``kept`` ([Note: a capturable step] in fullshard.engine.kept)
        self.keep_unsharded_storage = False
        self.kept = KeptBuffers()
        # custom comms, hook and gradient knobs (fullshard.engine.overrides), shared by children
        self.overrides = CommOverrides()
        self.partial = PartialReduce()  # HSDP accumulation without the all-reduce
        # Post-forward partial reshard (reshard_after_forward=int): kept chunk and its group.
        self.post_forward_group: dist.ProcessGroup | None = None
        self.post_forward_index = 0  # this rank's index within post_forward_group
        self.post_forward_chunk: torch.Tensor | None = None  # 1D [world/k * total]
        self._gather: PendingGather | None = None  # in flight: UNSHARDING's own (see _to)
        self.unsharded_buf: torch.Tensor | None = None  # 1D, see [Note: packed layouts]
        # the unsharded parameters' version counters when the gather finished
        self._gathered_versions: tuple[int, ...] = ()
        # ids of the parameters whose gradient arrived in this backward, and how many are
        # trainable (set by init_layout): post-backward fires when all of them have
        self._grads_arrived: set[int] = set()
        self._grads_expected = 0
        # the unit's post-accumulate-grad callback (set by init_layout)
        self._on_grad_accumulated: Callable[[ShardedParam], None] | None = None
        # (id, dtype) of the params the layout was built for
        self._layout_key: list[tuple[int, torch.dtype]] = []
        self.offsets: list[int] = []
        self.total = 0
        self._regions: list[torch.Tensor] = []
        # Local transport: the shard tensors the unsharded parameters alias (one per layout).
        self._aliased: list[torch.Tensor] = []
        # The FSDP1 wrapper's writeback check, before every unshard and once gathered ([Note:
        # use_orig_params writeback] in fullshard.fsdp1.writeback); None under fully_shard.
        self.pre_unshard: Callable[[ParamGroup], None] | None = None
        self.post_unshard: Callable[[ParamGroup], None] | None = None

    # ----------------------------------------------------------------------------- layout
    @property
    def world(self) -> int:
        return self.info.shard_size

    def compute_dtype(self) -> torch.dtype:
        """Dtype of the unsharded parameters (``param_dtype`` or the parameters' own)."""
        return self.mp_policy.param_dtype or (self.layout or self.params)[0].orig_dtype

    def accum_dtype(self) -> torch.dtype:
        """Dtype of unsharded gradients accumulated without sync (the reduce dtype).

        With ``reduce_dtype=None`` FSDP2 reduces in ``param_dtype`` up to torch 2.14 and in the
        parameters' own dtype from 2.15 on; fullshard follows the installed torch's."""
        mp = self.mp_policy
        own = (self.layout or self.params)[0].orig_dtype
        if REDUCE_DTYPE_FOLLOWS_GRAD_DTYPE:
            return mp.reduce_dtype or own
        return mp.reduce_dtype or mp.param_dtype or own

    def wire_reduce_dtype(self) -> torch.dtype:
        return self.comm_policy.reduce_dtype or self.accum_dtype()

    def wire_gather_dtype(self) -> torch.dtype:
        return self.comm_policy.all_gather_dtype or self.compute_dtype()

    @property
    def reduce_group(self) -> dist.ProcessGroup:
        """Where gradients are reduce-scattered: the shard group, or the unit's own group
        (``set_separate_reduce_scatter_group``)."""
        separate = self.overrides.reduce_scatter_group
        if separate is not None and dist.get_process_group_ranks(
            separate
        ) == dist.get_process_group_ranks(self.info.shard_group):
            return separate
        return self.info.shard_group  # a child on another mesh keeps its own shard group

    def init_layout(self, on_grad_accumulated: Callable[[ShardedParam], None]) -> None:
        """Allocate the unsharded views (storage freed) and grad hooks; idempotent."""
        key = [(id(sp), sp.orig_dtype) for sp in self.params]  # a cast rebuilds it
        self._on_grad_accumulated = on_grad_accumulated
        self._grads_expected = sum(1 for sp in self.params if sp.requires_grad)
        if self._layout_key == key or not self.params:
            return
        if self.state is not ShardedState.SHARDED:
            raise RuntimeError(f"unit {self.name!r}: cannot change its parameters while unsharded")
        own, by_mesh = split_by_mesh(self.params, self.info)
        ext = [sp for sp in own if has_extension(sp.local)]
        self.extended = ExtensionGather(ext, on_grad_accumulated) if ext else None
        self.layout, others = split_by_dtype(
            [sp for sp in own if sp not in ext], self.mp_policy, self.name
        )
        own_dtype = own_dtype_policy(self.mp_policy)
        self.subgroups = [
            self._child(sub, self.info, f"{self.name} [{sub[0].orig_dtype}]", own_dtype)
            for sub in others
        ] + [
            self._child(sub, sub[0].info, f"{self.name} [{mesh_name(sub[0].info)}]")
            for sub in by_mesh
        ]
        for child in self.subgroups:
            child.init_layout(on_grad_accumulated)
        self.offsets = []
        off = 0
        for sp in self.layout:
            self.offsets.append(off)
            off += sp.shard_numel
        self.total = off
        dtype = self.compute_dtype()
        self.transport = decide(self, aliasable(self))
        if self.transport.local:  # [Note: a shard group of one rank]
            self.unsharded_buf, self._regions = None, []
            self._aliased = [sp.local for sp in self.layout]
            for sp, local in zip(self.layout, self._aliased):
                sp.make_unsharded(local, on_grad_accumulated)
        else:
            self.unsharded_buf = torch.empty(
                self.world * self.total, dtype=dtype, device=self.device
            )
            self._regions = self._make_regions()
            for sp, region in zip(self.layout, self._regions):
                # ``.data``: a version counter of its own (see [Note: one version counter per
                # unsharded parameter])
                view = sp.unsharded_view(region).data
                sp.make_unsharded(view, on_grad_accumulated)
        self._release()
        self._layout_key = key

    def _child(
        self,
        params: list[ShardedParam],
        info: MeshInfo,
        name: str,
        mp_policy: MixedPrecisionPolicy | None = None,
    ) -> ParamGroup:
        child = ParamGroup(
            params,
            info,
            self.device,
            mp_policy or self.mp_policy,
            name,
            self.comm_policy,
            offloaded=self.offloaded,
            pin_memory=self.pin_memory,
        )
        child.comm = self.comm  # shared, never copied: what the unit has, its children have
        child.overrides = self.overrides
        return child

    def bind(self, comm: CommContext) -> None:
        """Share ``comm`` (the root's, at lazy init) with this group and its children."""
        self.comm = comm
        for child in self.subgroups:
            child.bind(comm)

    def settings_changed(self) -> None:
        """A knob the transport depends on changed (custom collectives, the gradient divide
        factor; ``FSDPModule``'s setters call this): decide again, keeping the layout."""
        for g in (self, *self.subgroups):
            if g._layout_key:  # laid out (before that, lazy init decides)
                g.transport = decide(g, g.transport.local)

    @property
    def own_params(self) -> list[ShardedParam]:
        """The parameters this group gathers itself: its buffer's and the extension ones."""
        return self.layout + (self.extended.params if self.extended is not None else [])

    def regions(self) -> list[torch.Tensor]:
        """Per-parameter ``[world, shard_numel]`` views of the unsharded buffer (made once:
        views stay valid across the storage's resizes)."""
        return self._regions

    def _make_regions(self) -> list[torch.Tensor]:
        assert self.unsharded_buf is not None
        out, pos = [], 0
        for sp in self.layout:
            n = self.world * sp.shard_numel
            out.append(self.unsharded_buf[pos : pos + n].view(self.world, sp.shard_numel))
            pos += n
        return out

    @property
    def unsharded_bytes_allocated(self) -> int:
        """Bytes currently held by the unsharded buffer (0 when resharded)."""
        copies = sum(sp.unsharded_data_bytes for sp in self.layout)
        copies += sum(child.unsharded_bytes_allocated for child in self.subgroups)
        copies += self.extended.bytes_allocated if self.extended is not None else 0
        if self.unsharded_buf is None:
            return copies
        return self.unsharded_buf.untyped_storage().nbytes() + copies

    def unsharded_nbytes(self) -> int:
        """Bytes of the unit's gathered buffer (what a gather allocates; 0: none)."""
        buf = self.unsharded_buf
        return 0 if buf is None else buf.numel() * buf.element_size()

    def _release(self, how: Release = Release.FREE) -> None:
        """Resize the unsharded buffer (and any per-parameter copies) to 0 bytes, or hand its
        memory to the root's host strategy as ``how`` says ([Note: the host strategy] in
        ``fullshard.engine.host``; asked only where there is one)."""
        if self.transport.local:  # nothing was allocated ([Note: a shard group of one rank])
            return
        if self.keep_unsharded_storage and self.unsharded_buf is not None:
            if self.unsharded_buf.untyped_storage().nbytes():  # kept (set_keep_unsharded_storage)
                if self.extended is not None:
                    self.extended.release()
                return
        if self.unsharded_buf is not None:
            storage = self.unsharded_buf.untyped_storage()
            host = self.comm.host
            if how is Release.FREE or host is None or not host.release(storage, how, self):
                freed(storage, f"unit {self.name!r}'s unsharded buffer")
                storage.resize_(0)
        for sp in self.layout:
            sp.free_unsharded()
        if self.extended is not None:
            self.extended.release()

    def buffer_content(self) -> BufferContent | None:
        """What the unsharded buffer holds, if a later gather of this unit may take it back
        instead of gathering ([Note: taking back a unit's own gathered memory])."""
        buf = self.unsharded_buf
        if (
            buf is None
            or self.state is not ShardedState.UNSHARDED  # a gather in flight never finished
            or self._unsharded_versions() != self._gathered_versions  # a write into them
            or self.overrides.all_gather is not None  # a custom comm sees every gather
            or self.extended is not None
            or self.post_forward_group is not None
            or self.offloaded
        ):
            return None
        return BufferContent.of(self, self._shard_tensors())

    def _unsharded_versions(self) -> tuple[int, ...]:
        return tuple(
            sp.unsharded_param._version for sp in self.layout if sp.unsharded_param is not None
        )

    def _shard_tensors(self) -> tuple[torch.Tensor, ...]:
        """Each parameter's DTensor and its local tensor (an in-place update bumps the version
        counter of only the one it went through; see the Note)."""
        return tuple(t for sp in self.layout for t in (sp.sharded_param, sp.local))

    def _holds_current(self, content: object) -> bool:
        """``content`` is this unit's gather of its current shards."""
        return isinstance(content, BufferContent) and content.is_current(
            self, self._shard_tensors()
        )

    def take_back_gathered(self) -> bool:
        """Take back this unit's own released memory if it still holds the current gather, in
        place of gathering ([Note: taking back a unit's own gathered memory])."""
        buf, host = self.unsharded_buf, self.comm.host
        if buf is None or host is None:
            return False
        return host.take_back(buf.untyped_storage(), self.unsharded_nbytes(), self._holds_current)

    def check_materialised(self) -> None:
        """Raise FSDP2's error, naming them, if any parameter is still on the meta device."""
        meta = [sp.fqn for sp in self.params if sp.local.is_meta]
        if meta:
            raise RuntimeError(
                f"FSDP parameters should be materialized from meta device before training, "
                f"but the following were still on meta device: {meta}\n"
                f"For example, call module.to_empty(device) to materialize to device and "
                f"call module.reset_parameters() on each module to initialize values.\n"
                f"(fully_shard unit {self.name!r}; loading a checkpoint into the materialised "
                f"module works too)"
            )

    # ---------------------------------------------------------------------------- unshard
    def _to(self, new: ShardedState, gather: PendingGather | None = None) -> None:
        """Move to ``new``. The all-gather in flight belongs to the UNSHARDING state: set on
        entering it (None: nothing to wait for, a local unit or one with no buffer of its
        own), dropped on leaving it, so no gather is ever held outside UNSHARDING."""
        self.state = transition(self.name, self.state, new)
        self._gather = gather

    @labelled("all_gather")
    def unshard(self) -> None:
        """Issue the all-gather of this unit's parameters (no-op if unsharded or in flight)."""
        if self.pre_unshard is not None:
            self.pre_unshard(self)
        if not self.params or self.state in (ShardedState.UNSHARDED, ShardedState.UNSHARDING):
            return
        gather = None
        if self.transport.local:
            self._realias()
        elif self.layout:
            gather = start_gather(self)
        if self.extended is not None:
            self.extended.start(self)
        for child in self.subgroups:
            child.unshard()
        self._to(ShardedState.UNSHARDING, gather)

    def _realias(self) -> None:
        """Local transport: point the unsharded parameters at the current shards (a shard
        replaced after lazy init, e.g. by ``to_empty``, is re-aliased; see the Note)."""
        emit("gather_issue", self.name, "local")
        for i, sp in enumerate(self.layout):
            local = sp.local
            if local is not self._aliased[i]:
                self.check_materialised()
                assert sp.unsharded_param is not None
                sp.unsharded_param.data = local
                self._aliased[i] = local

    @labelled("all_gather_wait")
    def wait_for_unshard(self) -> None:
        """Finish the all-gather (issuing it if needed) and expose the unsharded parameters."""
        if not self.params or self.state is ShardedState.UNSHARDED:
            return
        self.unshard()
        pending, self._gather = self._gather, None  # consumed, even if finishing it raises
        if pending is not None:
            finish_gather(self, pending)
        if self.extended is not None:
            self.extended.finish(self)
        for child in self.subgroups:
            child.wait_for_unshard()
        for sp in self.own_params:
            sp.to_unsharded()
        self._gathered_versions = self._unsharded_versions()
        self._to(ShardedState.UNSHARDED)
        if self.post_unshard is not None:
            self.post_unshard(self)

    # ---------------------------------------------------------------------------- reshard
    @labelled("reshard")
    def reshard(self, how: Release = Release.FREE) -> None:
        """Free the unsharded parameters (and any kept copy); register the sharded ones.

        ``how``: the engine's own reshards in forward and backward may hand the memory to the
        root's host strategy (see :meth:`_release`)."""
        if self.state is ShardedState.UNSHARDING:  # prefetched but never used
            if self._gather is not None:
                self._gather.handle.wait()  # dropped with the state (below)
                self.kept.give_back(self._gather.packed)
            if self.extended is not None:
                self.extended.wait_dropped()
        self.post_forward_chunk = None
        for child in self.subgroups:
            child.reshard(how.for_children())
        if self.state is not ShardedState.SHARDED:
            self._free_unsharded(ShardedState.SHARDED, how)
        else:
            self._release()

    def _free_unsharded(self, new: ShardedState, how: Release = Release.FREE) -> None:
        if self.state is ShardedState.UNSHARDED:
            for sp in self.own_params:
                sp.sync_requires_grad()  # a requires_grad_ on the registered unsharded one
                sp.to_sharded()
        self._release(how)  # also a gather issued in place and never waited on
        self._to(new)

    def reshard_partial(self) -> None:
        """Reshard after forward but keep a copy sharded over ``post_forward_group`` (int k)."""
        if self.state is not ShardedState.UNSHARDED or self.post_forward_group is None:
            self.reshard()
            return
        for child in self.subgroups:
            if ranks_of(child.info) != ranks_of(self.info):  # another mesh: its own ranks
                child.reshard()  # ([Note: one group per mesh] in fullshard.engine.partition)
                continue
            child.post_forward_group = self.post_forward_group
            child.post_forward_index = self.post_forward_index
            child.reshard_partial()
        k = dist.get_world_size(self.post_forward_group)
        rows = self.world // k
        lo = self.post_forward_index * rows
        chunk = torch.empty(rows, self.total, dtype=self.compute_dtype(), device=self.device)
        with torch.no_grad():
            for region, off, sp in zip(self.regions(), self.offsets, self.layout):
                chunk[:, off : off + sp.shard_numel].copy_(region[lo : lo + rows])
        self.post_forward_chunk = chunk.view(-1)
        self._free_unsharded(ShardedState.SHARDED_POST_FORWARD)

    # ---------------------------------------------------------------------------- backward
    def sync_requires_grad(self) -> None:
        """Make each parameter's sharded and unsharded forms agree on ``requires_grad``,
        hook newly trainable ones and recount the gradients post-backward waits for ([Note:
        requires_grad set after fully_shard] in ``fullshard.engine.param``)."""
        for sp in self.params:
            sp.sync_requires_grad()
            up = sp.unsharded_param
            if up is not None and sp.requires_grad and not sp.grad_hooked:
                if self._on_grad_accumulated is not None:
                    sp.hook_grad(self._on_grad_accumulated)
        self._grads_expected = sum(1 for sp in self.params if sp.requires_grad)

    def holds_frozen(self) -> bool:
        """Whether a parameter of the unit gets no gradient (frozen; as of the last forward)."""
        return self._grads_expected < len(self.params)

    def on_grad_accumulated(self, sp: ShardedParam) -> bool:
        """Note that ``sp``'s gradient is ready; True when that completes the unit (each
        parameter counts once per backward, however often its hook fires).

        Never True with ``reduce_scatter_unused_params``: see [Note: unused parameters].
        """
        if id(sp) in self._grads_arrived:
            return False
        self._grads_arrived.add(id(sp))
        if self.overrides.reduce_scatter_unused_params:
            return False
        return len(self._grads_arrived) == self._grads_expected

    @labelled("reduce_scatter")
    def reduce_grads(
        self, after: AfterBackward | None = None, reshard: bool = True
    ) -> list[PendingReduce]:
        """Post-backward: take the gradients, reshard (unless ``reshard=False``; ``after``: how
        the root's host strategy takes the memory, see :meth:`reshard`), then reduce-scatter
        them.

        Returns the reductions in flight, one per group with gradients (this one and any
        child on another mesh); none while gradient sync is off, in which case gradients
        accumulate unsharded in reduce dtype.
        """
        groups = [self, *self.subgroups]
        ready = [(g, collect_grads(g)) for g in groups]
        reshard = reshard and self.reshard_after_backward
        how = Release.FREE
        if after is not None:
            how = after.release(bool(ready[0][1]), reshard, self.unsharded_nbytes())
        if reshard:
            self.reshard(how)
        if after is not None:
            after.before_reductions()
        pending = []
        for g, grads in ready:
            if not grads:
                continue
            if g.transport.local:  # [Note: a shard group of one rank]
                hand_out_local(g, grads)
            else:
                pending.append(start_reduce(g, grads))
        return pending

    def has_unreduced_grads(self) -> bool:
        """Whether a parameter of this unit (or a child group) holds an unsharded gradient not
        reduced yet: accumulated with gradient sync off, or left by a backward."""
        return any(
            sp.unsharded_accum_grad is not None
            or (sp.unsharded_param is not None and sp.unsharded_param.grad is not None)
            for g in (self, *self.subgroups)
            for sp in g.own_params
        )

    def reset_iter_state(self) -> None:
        """After an aborted forward/backward: sharded, nothing in flight, no gradient kept.

        Drops the unit's unreduced gradients (also those accumulated with gradient sync off
        and HSDP partial sums); sharded gradients already handed out stay.
        """
        self.reshard()  # waits for an all-gather in flight
        self._grads_arrived = set()
        self.partial = PartialReduce()
        for child in self.subgroups:
            child.partial = PartialReduce()
        for sp in self.params:
            sp.unsharded_accum_grad = None
            if sp.unsharded_param is not None:
                sp.unsharded_param.grad = None

    def finish_backward(self) -> None:
        """End of backward: drop per-backward counters; free anything still gathered."""
        self._grads_arrived = set()
        if self.reshard_after_backward or self.state is ShardedState.SHARDED_POST_FORWARD:
            self.reshard()
