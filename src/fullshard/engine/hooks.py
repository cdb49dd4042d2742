"""FSDPState: the module hooks of one ``fully_shard`` unit.

One training step as the hooks see it (docs/design.md has the whole picture):

- root pre-forward (first call): lazy init (:meth:`FSDPState.lazy_init`, its steps in
  ``fullshard.engine.init``) creates the :class:`~fullshard.engine.context.StepContext` the
  units share;
- unit pre-forward: finish this unit's all-gather, start the next unit's (prefetch: the order
  recorded in the previous forward, or ``set_modules_to_forward_prefetch``);
- unit post-forward: reshard (per ``reshard_after_forward``) and hook the outputs so the unit's
  pre-backward runs when their gradients arrive (a unit of several modules: once none of them
  is pending, or when the root's forward ends; [Note: a unit of several modules]);
- pre-backward: gather again, prefetch the unit that runs backward next;
- post-backward: fired when the last gradient of the unit has been accumulated; finishes the
  previous unit's reduction, then reshards and reduce-scatters (asynchronously);
- end of backward: the context's callback completes units whose backward never fired.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_map

from .backend import BackendPlan
from .context import StepContext
from .events import emit
from .group import ParamGroup
from .init import assign_shared_params, name_units, resolve_reshard_after_forward
from .labels import labelled
from .param import ShardedParam
from .policies import MixedPrecisionPolicy
from .state import ShardedState, TrainingState, training_transition
from .streams import CommStreams

__all__ = ["STATE_ATTR", "FSDPState", "states_under"]


def _in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


def _cast_floats(tree: Any, dtype: torch.dtype | None) -> Any:
    if dtype is None:
        return tree
    return tree_map(
        lambda t: t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t, tree
    )


STATE_ATTR = "_fullshard_state"  # where a unit module keeps its FSDPState (in __dict__)


def states_under(modules: Iterable[nn.Module]) -> list[FSDPState]:
    """Every unit state in the subtrees of ``modules``, once each, in module order."""
    out: list[FSDPState] = []
    for m in modules:
        for sub in m.modules():
            st = sub.__dict__.get(STATE_ATTR)
            if st is not None and st not in out:
                out.append(st)
    return out


class FSDPState:
    """Hooks and per-step state of one ``fully_shard`` unit."""

    def __init__(
        self,
        modules: tuple[nn.Module, ...],
        group: ParamGroup,
        reshard_after_forward: bool | int | None,
        mp_policy: MixedPrecisionPolicy,
    ) -> None:
        self.modules = modules
        self.group = group
        # as given to fully_shard / set_reshard_after_forward (validated there, by
        # init.check_reshard_after_forward); reshard_policy says what it means for this unit
        self.reshard_after_forward = reshard_after_forward
        self.mp_policy = mp_policy
        self._training_state = TrainingState.IDLE
        self.ctx: StepContext[FSDPState] | None = None  # set by lazy init
        self.forward_prefetch: list[FSDPState] | None = None  # explicit, else implicit
        self.backward_prefetch: list[FSDPState] | None = None
        self._is_last_backward = True  # until lazy init (see is_last_backward)
        # read on the root ([Note: manual backward finalization] in fullshard.engine.finalize)
        self.manual_backward_finalization = False
        self.shared_streams: CommStreams | None = None  # root: from share_comm_ctx
        # the next unit out, as fully_shard was applied bottom-up (see outermost)
        self.enclosing: weakref.ref[FSDPState] | None = None
        # ids of the unit's modules whose forward has not finished in this forward: the unit's
        # post-forward runs when the last one's does (a unit of several modules)
        self._forward_pending: set[int] = set()
        # [Note: parameters read after the unit's last gradient]
        self.nests_units = False  # other units run inside this one's forward (set by lazy init)
        self._input_grads_pending = 0  # this step's input-gradient hooks not fired yet
        # root: fullshard.rl.sleep's host buffer, kept for the next sleep ([Note: one host
        # buffer per model] in fullshard.rl.sleep)
        self.sleep_host: torch.Tensor | None = None

    @property
    def name(self) -> str:
        return self.group.name

    @property
    def is_root(self) -> bool:
        return self.ctx is not None and self.ctx.root is self

    @property
    def is_last_backward(self) -> bool:
        """``set_is_last_backward``'s flag. As in FSDP2 it is the step context's, which every
        unit of the root shares, so setting it on any unit sets it for the whole model; before
        lazy init a unit holds its own, and the context starts from the root's (a non-root
        unit's is dropped then, as FSDP2 drops its context)."""
        return self.ctx.is_last_backward if self.ctx is not None else self._is_last_backward

    @is_last_backward.setter
    def is_last_backward(self, value: bool) -> None:
        if self.ctx is not None:
            self.ctx.is_last_backward = value
        else:
            self._is_last_backward = value

    @property
    def training_state(self) -> TrainingState:
        """Where the unit is in the step ([Note: training state] in fullshard.engine.state)."""
        return self._training_state

    @training_state.setter
    def training_state(self, new: TrainingState) -> None:
        self._training_state = training_transition(self.name, self._training_state, new)

    def outermost(self) -> FSDPState:
        """The outermost unit around this one: the root its forward will have. Lazy init
        starts there when a method needs the unit before any forward (``unshard()`` ahead of
        the first forward, as FSDP2 allows), so the unit does not become a root itself."""
        st = self
        while st.enclosing is not None and (up := st.enclosing()) is not None:
            st = up
        return st

    def subtree_states(self) -> list[FSDPState]:
        """States of every FSDP unit in this unit's module subtree (this one first)."""
        return states_under(self.modules)

    def _context(self) -> StepContext[FSDPState]:
        return self.ctx or self.lazy_init()

    def reset_forward(self) -> None:
        """Forget a forward that did not finish (end of backward, ``reset_iter_state``)."""
        self._forward_pending = set()
        self._input_grads_pending = 0

    # ------------------------------------------------------------------------- lazy init
    def lazy_init(self) -> StepContext[FSDPState]:
        """Make this unit the root of every unit below it (``fullshard.engine.init`` has the
        steps): name units and parameters, settle tied parameters, create the context every
        unit shares, build each unit's layout and resolve its ``reshard_after_forward``."""
        states = self.subtree_states()
        for st in states[1:]:
            if st.manual_backward_finalization:
                raise RuntimeError(
                    f"set_manual_backward_finalization was called on the unit {st.name!r}, "
                    f"which is not the root: call it on the module fully_shard was applied "
                    f"to last"
                )
        units = [(st.modules, st.group) for st in states]
        name_units(self.modules, units)
        group = self.group
        plan = BackendPlan.for_group(
            group.info.shard_group, group.device, group.comm_policy.cpu_fast_paths_off
        )
        # share_comm_ctx: one set of streams for several roots
        ctx = StepContext(self, states, group.device, plan, self.shared_streams)
        assign_shared_params(units)
        for st in states:
            st.ctx = ctx
            st.group.bind(ctx.comm)
            st.group.init_layout(st.on_grad_accumulated)
            st.resolve_reshard()
            st.nests_units = len(st.subtree_states()) > 1
        return ctx

    @property
    def reshard_policy(self) -> bool | int:
        """What this unit does after forward: ``True`` free, ``False`` keep, int ``k`` keep a
        copy sharded over ``k`` ranks (``reshard_after_forward`` resolved for this unit)."""
        return resolve_reshard_after_forward(
            self.reshard_after_forward, self.is_root, self.group.world
        )

    def resolve_reshard(self) -> None:
        """Give the group the ``k``-rank subgroup an int policy keeps its copy in (or none)."""
        policy, group = self.reshard_policy, self.group
        if isinstance(policy, bool):
            group.post_forward_group = None
        else:
            pg, index = self._context().post_forward_subgroup(group.info, policy)
            group.post_forward_group, group.post_forward_index = pg, index

    # --------------------------------------------------------------------------- forward
    # [Note: hooks under torch.compile]
    # Compiling a model that holds units (``torch.compile(model)``) makes dynamo trace module
    # hooks too; ours resize storages, issue collectives and swap registered parameters,
    # which a graph cannot hold. Both forward hooks are ``torch.compiler.disable``d: dynamo
    # breaks the graph at each unit boundary and runs them eagerly (FSDP2's default,
    # ``skip_fsdp_hooks``, does the same for its own). The backward hooks run eagerly anyway.
    @torch.compiler.disable
    @labelled("pre_forward")
    def pre_forward(
        self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """Forward pre-hook: lazy init, unshard, prefetch, cast inputs."""
        if self.mp_policy.cast_forward_inputs and self.mp_policy.param_dtype is not None:
            args, kwargs = _cast_floats((args, kwargs), self.mp_policy.param_dtype)
        # Under a torch.func transform (jvp, vmap) the engine's own work (lazy init, gathers,
        # resharding) runs outside it: its buffers stay plain tensors, which the transform
        # would wrap (a wrapper has no storage to free); the forward still runs inside, with
        # the gathered parameters as constants (as FSDP2).
        if torch._C._are_functorch_transforms_active():
            with torch._C._DisableFuncTorch():
                self._unshard_for_forward()
        else:
            self._unshard_for_forward()
        if torch.is_grad_enabled() and not _in_backward() and self.group.holds_frozen():
            self._watch_input_grads((args, kwargs))
        return args, kwargs

    def _unshard_for_forward(self) -> None:
        ctx = self._context()
        if _in_backward():  # recomputation under activation checkpointing
            self.group.wait_for_unshard()
            return
        if self.is_root and self.training_state is TrainingState.IDLE:
            ctx.begin_forward()
        self.training_state = TrainingState.FORWARD
        if not self._forward_pending:  # the first of the unit's modules to run
            self._forward_pending = {id(m) for m in self.modules}
        ctx.order.record_forward(self)
        self.group.sync_requires_grad()  # [Note: requires_grad set after fully_shard]
        # Issue this unit's gather (unless prefetched) and the next one's before waiting, so
        # the next gather's bytes move while this one's are waited on and computed with.
        self.group.unshard()
        targets = self.forward_prefetch
        for nxt in ctx.implicit_forward_prefetch(self) if targets is None else targets:
            nxt.group.unshard()
        self.group.wait_for_unshard()
        emit("forward_start", self.name)

    @torch.compiler.disable
    @labelled("post_forward")
    def post_forward(
        self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any
    ) -> Any:
        """Forward hook: reshard per policy, hook outputs for pre-backward, cast outputs."""
        if _in_backward():  # recomputation: the same outputs as the forward's, cast alike
            return _cast_floats(output, self.mp_policy.output_dtype)
        emit("forward_end", self.name)
        if torch._C._are_functorch_transforms_active():
            with torch._C._DisableFuncTorch():
                ended = self._module_forward_done(module)
        else:
            ended = self._module_forward_done(module)
        # A local unit ([Note: a shard group of one rank] in fullshard.engine.transport) needs no
        # pre-backward hook (nothing to gather; its parameters' post-accumulate-grad hooks
        # queue the end-of-backward callback).
        hooks = [st._pre_backward_hook for st in ended if not st.group.transport.local]
        if self not in ended and not self.group.transport.local:
            hooks.append(self._partial_pre_backward_hook)
        if torch.is_grad_enabled() and hooks:
            tensors, _ = tree_flatten(output)
            for t in tensors:
                if isinstance(t, torch.Tensor) and t.requires_grad:
                    for hook in hooks:
                        t.register_hook(hook)
        return _cast_floats(output, self.mp_policy.output_dtype)

    # [Note: a unit of several modules]
    # ``fully_shard([norm, output])`` makes one unit of several modules, and its forward spans
    # their calls: it starts with the first call while none is pending (``_forward_pending``
    # is filled with all of them) and ends with the call that leaves none pending. Only then
    # does the unit's post-forward run (reshard per ``reshard_after_forward``, its place in
    # the post-forward order), and only the outputs of that call get the hook that starts the
    # unit's backward (state PRE_BACKWARD, gather, prefetch the unit whose backward runs
    # next). A module may also run more or fewer times than the others: torchtitan's model
    # runs the norm, then its chunked loss calls the output projection once per chunk of the
    # sequence, each chunk with a backward of its own. Three rules keep such a unit to one
    # gather per forward, as FSDP2 (torch 2.13):
    # - when the root's forward ends, every unit still pending ends its forward there (the
    #   hook that starts its backward goes on the root's outputs);
    # - a call that does not end the unit's forward leaves the unit gathered, and its outputs
    #   get a hook that only makes sure the unit is gathered for their backward: a chunk's
    #   backward is not the unit's, and prefetching the units before it (the last block) there
    #   would gather them once per chunk, each dropped again when that backward ends;
    # - the end of every backward (and ``reset_iter_state``) forgets what was pending, so each
    #   chunk, and each step, starts the unit's forward afresh (no step inherits the last
    #   chunk's pending module, which would end the unit's next forward early, after the norm).
    def _module_forward_done(self, module: nn.Module) -> list[FSDPState]:
        """One of the unit's modules finished its forward; returns the units whose forward
        ended with it ([Note: a unit of several modules])."""
        ctx = self._context()
        self._forward_pending.discard(id(module))
        if self._forward_pending:
            return []
        ended = [self]
        self._end_forward(ctx)
        if self.is_root:  # units whose forward is still pending end with the root's
            for st in ctx.states:
                if st is not self and st._forward_pending:
                    st._forward_pending = set()
                    st._end_forward(ctx)
                    ended.append(st)
        return ended

    def _end_forward(self, ctx: StepContext[FSDPState]) -> None:
        """The unit's post-forward: its place in the post-forward order, reshard per policy.

        A local unit ([Note: a shard group of one rank] in fullshard.engine.transport) frees
        nothing by resharding: it stays unsharded until its backward is done (as
        reshard_after_forward False)."""
        local = self.group.transport.local
        ctx.order.record_post_forward(self)
        if not torch.is_grad_enabled():
            # No backward will come for this forward: free, unless the user asked to keep the
            # unit (an explicit reshard_after_forward=False keeps it gathered, as FSDP2 does:
            # a decode loop's forwards then gather it once; the root's default None frees)
            if self.reshard_after_forward is not False:
                self.group.reshard()
            if self.is_root:  # nor a gather soon
                ctx.forward_without_backward()
        elif self.reshard_policy is True and not local:
            self.group.reshard(ctx.release_after_forward(self))
        elif self.reshard_policy is not False and not local:
            self.group.reshard_partial()
        self.training_state = TrainingState.IDLE

    # -------------------------------------------------------------------------- backward
    def _pre_backward_hook(self, grad: torch.Tensor) -> None:
        self.pre_backward()

    def _partial_pre_backward_hook(self, grad: torch.Tensor) -> None:
        self.pre_backward(starts=False)

    @labelled("pre_backward")
    def pre_backward(self, starts: bool = True) -> None:
        """Gather this unit for its backward and prefetch the unit that runs backward next.

        ``starts=False``: the backward of a call that did not end the unit's forward ([Note:
        a unit of several modules]): only make sure the unit is gathered."""
        ctx = self._context()
        ctx.ensure_end_of_backward_callback()
        # Another output's hook: in PRE_BACKWARD the unit is gathered already; in
        # POST_BACKWARD every gradient of the unit is in and what the rest of the backward may
        # still read of it is gathered ([Note: parameters read after the unit's last gradient]).
        if self.training_state in (TrainingState.PRE_BACKWARD, TrainingState.POST_BACKWARD):
            return
        if not starts:
            if self.group.unshard_in_backward:
                self.group.wait_for_unshard()
            return
        self.training_state = TrainingState.PRE_BACKWARD
        emit("backward_start", self.name)
        if self.group.unshard_in_backward:
            self.group.unshard()  # issued before the prefetch, waited on after (as forward)
        targets = self.backward_prefetch
        for prev in ctx.implicit_backward_prefetch(self) if targets is None else targets:
            if prev.training_state is not TrainingState.POST_BACKWARD:
                if prev.group.unshard_in_backward:
                    prev.group.unshard()
        if self.group.unshard_in_backward:
            self.group.wait_for_unshard()

    def on_grad_accumulated(self, sp: ShardedParam) -> None:
        """Post-accumulate-grad hook of each parameter: the last one triggers post-backward."""
        if self.group.on_grad_accumulated(sp):
            self.post_backward()

    @labelled("post_backward")
    def post_backward(self) -> None:
        """All of the unit's gradients are ready: reshard and reduce-scatter them."""
        ctx = self._context()
        ctx.ensure_end_of_backward_callback()  # a local unit has no pre-backward hook
        # Finish the previous unit's reduction first (it has had this unit's whole backward to
        # complete in the background), so its buffer is freed before this one is allocated:
        # at most one reduction in flight (set_reduce_scatter_max_input_buffers: more).
        ctx.reduce(self, post_backward=True, reshard=not self._read_after_last_grad())
        self.training_state = TrainingState.POST_BACKWARD

    # [Note: parameters read after the unit's last gradient]
    # Post-backward fires when the unit's last trainable gradient has been accumulated, and
    # reshards. Autograd may still read the unit's parameters after that, but only those that
    # get no gradient (frozen ones): a trainable parameter read later would get a gradient
    # later. Such a read computes the gradient of something the unit's forward consumed:
    # - its inputs: a frozen layer between the unit's input and its trainable layers (a LoRA
    #   block, a frozen projection before a trainable head). The unit then stays gathered
    #   until the gradients of all its inputs are computed (a hook on them, registered in
    #   forward, only for units that hold a frozen parameter), as FSDP2's post-backward,
    #   which runs on the unit's inputs' gradients;
    # - the output of a unit run inside this unit's forward (the root, or any unit that nests
    #   units, with a frozen parameter applied to a child's output): the unit stays gathered
    #   until the end of backward, as FSDP2's root.
    # Without frozen parameters nothing is read later, and a pre-backward hook that fires
    # after the post-backward (another output of the unit whose gradient arrives last, e.g. a
    # root returning two heads' outputs) leaves the unit as it is.
    def _read_after_last_grad(self) -> bool:
        """Whether the backward may still read this unit's parameters after its last gradient
        (see the Note): the reshard after backward then waits."""
        if not self.group.holds_frozen():
            return False
        return self.nests_units or self._input_grads_pending > 0

    def _watch_input_grads(self, inputs: Any) -> None:
        """Reshard after backward once the gradients of this forward's inputs are computed
        (see the Note)."""
        tensors = [
            t for t in tree_flatten(inputs)[0] if isinstance(t, torch.Tensor) and t.requires_grad
        ]
        if not tensors:
            return
        self._input_grads_pending += 1
        torch.autograd.graph.register_multi_grad_hook(tensors, self._input_grads_done, mode="all")

    def _input_grads_done(self, grads: Any) -> None:
        self._input_grads_pending = max(self._input_grads_pending - 1, 0)
        if (
            self._input_grads_pending == 0
            and not self.nests_units
            and self.training_state is TrainingState.POST_BACKWARD
            and self.group.reshard_after_backward
        ):
            self.group.reshard()

    # --------------------------------------------------------------------------- helpers
    def reshard_if_idle(self) -> None:
        """Make sure modules show sharded parameters (e.g. before ``state_dict``)."""
        if self.training_state is TrainingState.IDLE and self.group.state in (
            ShardedState.UNSHARDED,
            ShardedState.UNSHARDING,
        ):
            self.group.reshard()
