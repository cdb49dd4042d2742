"""CUDA streams for communication and offload copies; no-ops on the CPU.

[Note: streams and buffer lifetimes]
On an accelerator the engine issues all-gathers on ``gather``, reduce-scatters on ``reduce``
and CPU-offload copies on ``offload`` — each side stream first waits for the compute stream,
so it sees everything queued before it. Rules that keep peak memory deterministic without
``record_stream``:

- every communication buffer is allocated on the compute (current) stream, before the side
  stream is entered, so the caching allocator ties its memory to the compute stream (the
  p2p reduce-scatter's scratch is the exception, safe because each side stream first waits
  for the compute stream: see ``collectives._reduce_scatter_p2p``);
- the engine holds a buffer (the pending gather or reduction object keeps the reference) until
  the compute stream has waited for the side stream's work on it (``Handle.wait`` makes the
  current stream wait for the collective); only then is the reference dropped, so the memory
  can only be reused by work ordered after its last use;
- device-to-host gradient copies (offload) are waited on at the end of backward, before the
  optimizer can read the host gradients.

On the CPU there are no streams: every method runs its body directly, so the same code path
runs in CI on every commit; under ``fullshard.engine.streamcheck.check_streams`` the same calls run on
logical streams and the rules above are checked ([Note: checking stream order on the CPU]).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from .backend import BackendPlan
from .streamcheck import active_checker

__all__ = ["CommStreams"]


class CommStreams:
    """The side streams one root's units share (created at lazy init)."""

    def __init__(self, device: torch.device, plan: BackendPlan) -> None:
        self.device = device
        self.enabled = plan.streams  # CUDA ([Note: the backend plan] in fullshard.engine.backend)
        self._streams: dict[str, Any] = {}
        if self.enabled:
            for name in ("gather", "reduce", "offload"):
                self._streams[name] = torch.cuda.Stream(device=device)
        self._host_copies: list[Any] = []  # events of D2H copies not yet waited on

    @contextlib.contextmanager
    def use(self, name: str) -> Iterator[None]:
        """Run the block on side stream ``name`` after it waits for the current stream (on
        the CPU: on a logical stream while a stream checker records, see
        [Note: checking stream order on the CPU] in fullshard.engine.streamcheck)."""
        if self.enabled:
            stream = self._streams[name]
            self._side_waits_current(stream)
            with torch.cuda.stream(stream):
                yield
            return
        checker = active_checker()
        if checker is None:
            yield
            return
        self._side_waits_current(name)
        with checker.on(name):
            yield

    def _side_waits_current(self, stream: Any) -> None:
        """Rule 1: the side stream sees everything queued on the current one before it."""
        if self.enabled:
            stream.wait_stream(torch.cuda.current_stream(self.device))
            return
        checker = active_checker()
        if checker is not None:
            checker.wait(stream, checker.snapshot())

    def moves_to_host(self, tensor: torch.Tensor) -> bool:
        """Whether :meth:`to_host` copies ``tensor``: a device tensor, or any tensor while a
        stream checker records (see [Note: the offload copy on the CPU])."""
        return tensor.device.type != "cpu" or active_checker() is not None

    def to_host(self, tensor: torch.Tensor, pin: bool) -> torch.Tensor:
        """Copy ``tensor`` to host memory on the offload stream (waited on by
        :meth:`wait_host_copies`); on the CPU, ``tensor`` itself.

        [Note: the offload copy on the CPU]
        On a CPU run the gradient shards already live in host memory, so nothing is copied and
        no stream orders the host's reads after a copy. While a stream checker records, the
        copy is made anyway (same values) on the logical offload stream and
        :meth:`wait_host_copies` makes the current stream wait for it, so a host read of a
        gradient before its copy has landed is an unordered access on every CI run, as it
        would be a race on CUDA.
        """
        checker = active_checker()
        if tensor.device.type == "cpu" and checker is None:
            return tensor
        if tensor.device.type == "cpu":
            out = torch.empty_like(tensor)
        else:
            out = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu", pin_memory=pin)
        with self.use("offload"):
            out.copy_(tensor, non_blocking=pin)
            if self.enabled:
                event: Any = torch.cuda.Event()
                event.record()
            else:
                assert checker is not None
                event = checker.snapshot()
            # ``tensor`` (device memory) must outlive the copy: keep it with the event.
            self._host_copies.append((event, tensor))
        return out

    def wait_host_copies(self) -> None:
        """Block until every D2H copy issued by :meth:`to_host` has landed (under a stream
        checker: the current stream waits for the offload stream's copies)."""
        checker = active_checker()
        for event, _ in self._host_copies:
            if isinstance(event, dict):  # a checker's snapshot
                if checker is not None:
                    checker.wait(checker.current, event)
            else:
                event.synchronize()
        self._host_copies.clear()
