"""KeptBuffers: a unit's communication buffers, kept across steps for a capturable step.

[Note: a capturable step]
A CUDA graph replays the kernels a capture recorded on the memory they used then, so a step
of ours can be captured (forward, loss, backward, ``finalize_backward``) only if, in the
steady state, the engine

1. allocates nothing: every tensor it computes into is one it already holds;
2. never waits on the host: no ``.item()`` / ``.tolist()``, no ``Event.synchronize``,
   ``Stream.synchronize`` or ``torch.cuda.synchronize``;
3. records and waits on events only on streams the capture owns: the current stream and
   streams that joined it inside the capture.

This is the contract of ``set_keep_unsharded_storage(True)`` (every unit) together with
manual backward finalization (``set_manual_backward_finalization(True)`` on the root, each
step ending with ``finalize_backward()``; [Note: manual backward finalization] in
``fullshard.engine.finalize``), on the core path: the one CUDA runs (packed transport, no host
strategy: [Note: the host strategy] in ``fullshard.engine.host``; a shard group of one rank
with the ``local`` transport moves nothing at all), no offload, no custom collectives, no
int8 or int ``reshard_after_forward`` gathers. One tensor the engine still makes: where
``MixedPrecisionPolicy.cast_forward_inputs`` casts floating-point forward inputs to
``param_dtype``, the cast input is a new activation, like any layer's output (a capture takes
it from its graph's pool; integer inputs such as token ids are not cast). How the engine
keeps it:

- the unsharded buffer keeps its storage on reshard (``ParamGroup._release``), so a gather
  refills the same memory, and the views autograd saved keep their addresses;
- the packed all-gather output and the reduce-scatter input and output come from the unit's
  :class:`KeptBuffers`: allocated at the first steps, taken again by every later gather and
  reduction of the same size and dtype. A buffer is taken while its collective is in flight
  and given back once the compute stream has waited for it (``finish_gather``,
  ``PendingReduce.finish``); a use while every kept one is taken (several reductions of one
  unit in flight, as manual finalization over several backward passes allows) keeps one
  more, never shares one;
- a reduce-scatter output that becomes gradients as it is (a parameter's ``.grad`` was
  ``None``: its shard is then a view of the output, no copy) is handed over and forgotten:
  the next reduction allocates again. In the steady state the sharded gradients exist (zero
  them in place, ``zero_grad(set_to_none=False)``, or accumulate) and each reduction adds
  into them from the kept output; a narrower shard (bf16 gradients, fp32 masters) is upcast
  inside the add, exactly, not through a cast copy (``ShardedParam.make_grad``);
- the side streams (``gather``, ``reduce``) first wait for the current stream on every use
  ([Note: the stream interface] in ``fullshard.engine.streams``), which inside a capture
  forks them from the capturing stream, and every collective is waited on by the current
  stream before the step ends (the iteration ends in ``finalize_backward``), which joins them
  back; the engine records no event on a stream outside that.

Reusing a buffer is safe without ``record_stream`` for the reason fresh buffers are ([Note:
streams and buffer lifetimes]): each side stream waits for the compute stream before it
writes, and the compute stream waits for the collective before the buffer is given back.

``tests/test_capturable_step.py`` counts, over steady-state steps at world sizes 1 and 2,
the tensors engine code creates and the host waits it makes (zero), and
``scripts/gpu_check.sh``'s ``graph`` line captures a Llama step with ``torch.cuda.graphs``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

__all__ = ["KeptBuffers"]


class KeptBuffers:
    """One unit's communication buffers by role (``"gather"``, ``"reduce_in"``,
    ``"reduce_out"``), kept while ``set_keep_unsharded_storage`` is on (see the Note): per
    role as many as were ever in flight at once (one, unless several reductions of the unit
    are: manual finalization over several backward passes)."""

    def __init__(self) -> None:
        self._bufs: dict[str, list[torch.Tensor]] = {}
        self._taken: set[int] = set()  # the storages of the buffers in use

    def take(
        self,
        keep: bool,
        role: str,
        numel: int,
        dtype: torch.dtype,
        make: Callable[[], torch.Tensor],
    ) -> torch.Tensor:
        """A 1-D buffer of ``numel`` elements of ``dtype`` for ``role``: with ``keep``, a kept
        one not in use (else ``make()``, kept from now on); without, ``make()``. Give it back
        with :meth:`give_back` once the compute stream has waited for its collective."""
        if not keep:
            return make()
        bufs = self._bufs.setdefault(role, [])
        free = [b for b in bufs if _key(b) not in self._taken]
        buf = next((b for b in free if b.numel() == numel and b.dtype == dtype), None)
        if buf is None:  # none free of this size: drop the free ones of other sizes
            bufs[:] = [b for b in bufs if _key(b) in self._taken]
            buf = make()
            bufs.append(buf)
        self._taken.add(_key(buf))
        return buf

    def give_back(self, *tensors: torch.Tensor | None) -> None:
        """The buffers ``tensors`` view are free again (their collectives have been waited
        on); tensors that are not kept buffers are ignored."""
        for t in tensors:
            if t is not None:
                self._taken.discard(_key(t))

    def forget(self, *tensors: torch.Tensor | None) -> None:
        """Stop keeping the buffers ``tensors`` view (handed over as gradients)."""
        keys = {_key(t) for t in tensors if t is not None}
        for bufs in self._bufs.values():
            bufs[:] = [b for b in bufs if _key(b) not in keys]
        self._taken -= keys

    def clear(self) -> None:
        """Keep nothing (``set_keep_unsharded_storage(False)``, ``fullshard.rl.sleep``)."""
        self._bufs.clear()
        self._taken.clear()


def _key(t: torch.Tensor) -> int:
    return int(t.untyped_storage()._cdata)
