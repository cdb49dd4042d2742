"""The stream interface: side streams for communication and offload copies, the same calls on
every device.

[Note: the stream interface]
This module is the only one in the engine that names CUDA's stream API. Its functions hand
out stream objects — torch's ``torch.cuda.Stream`` / ``Event`` for CUDA devices, the stream
checker's :class:`~fullshard.engine.streamcheck.LogicalStream` / ``LogicalEvent`` for every
other device ([Note: logical streams] in ``fullshard.engine.streamcheck``) — and the engine
calls torch's methods on them: ``wait_stream``, ``wait_event``, ``record_event``,
``synchronize``. So each ordering line of the engine is one line that runs on CUDA and on
every CPU test; on the CPU it does nothing unless a checker records, and then it is checked.
``tests/test_stream_mutations.py`` deletes each such line of ``src/`` in turn and shows that a
CPU case fails.

[Note: streams and buffer lifetimes]
The engine issues all-gathers on ``gather``, reduce-scatters on ``reduce`` and CPU-offload
copies on ``offload`` — each side stream first waits for the compute stream, so it sees
everything queued before it. Rules that keep peak memory deterministic without
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

[Note: the offload copy on the CPU]
On a CPU run the gradient shards already live in host memory; the copy is made anyway (one
copy of each reduced shard, on the logical offload stream), so the copy and its ordering are
the lines CUDA runs, and a host read of a gradient before its copy has landed is an
unordered access on every checked CPU run, as it would be a race on CUDA.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from .streamcheck import LogicalStream, current_logical, on_logical

__all__ = ["CommStreams", "current_stream", "new_stream", "on_stream", "user_stream"]


def new_stream(device: torch.device, name: str) -> Any:
    """A side stream for ``device`` (``name``: what a stream checker calls it)."""
    if device.type == "cuda":
        return torch.cuda.Stream(device=device)
    return LogicalStream(name)


def current_stream(device: torch.device) -> Any:
    """The stream ``device``'s ops are queued on now."""
    if device.type == "cuda":
        return torch.cuda.current_stream(device)
    return current_logical()


def on_stream(stream: Any) -> contextlib.AbstractContextManager[Any]:
    """Queue the block's ops on ``stream`` (one from :func:`new_stream`)."""
    if isinstance(stream, LogicalStream):
        return on_logical(stream)
    return torch.cuda.stream(stream)


def user_stream(stream: object, device: torch.device, what: str) -> Any:
    """The stream the engine runs a user's work on for a ``stream`` the user passed (``what``
    names the argument in the error), for a unit on ``device``.

    [Note: a user's stream]
    On CUDA it is the user's ``torch.cuda.Stream`` of the unit's device itself (a
    ``torch.Stream`` of that device as the same ``torch.cuda.Stream``). Elsewhere
    torch's streams order nothing (a ``torch.cpu.Stream`` is a stub), so the user's stream
    stands for a logical stream of its own, where the engine runs that work with the same
    waits as on CUDA, which the stream checker checks: a logical stream as it is, a
    ``torch.Stream`` of the device (``torch.Stream(device="cpu")``) the logical stream named
    after its id (equal ``torch.Stream`` objects, equal streams), a ``torch.cpu.Stream`` one
    named after the object. Anything else is refused.
    """
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        if isinstance(stream, torch.Stream) and stream.device == torch.device("cuda", index):
            if not isinstance(stream, torch.cuda.Stream):  # torch.Stream(device="cuda")
                stream = torch.cuda.Stream(  # the same stream, as torch.cuda.current_stream
                    stream_id=stream.stream_id,
                    device_index=stream.device_index,
                    device_type=stream.device_type,
                )
            return stream
        fix = f"a torch.cuda.Stream of device cuda:{index}"
    elif isinstance(stream, LogicalStream):
        return stream
    elif isinstance(stream, torch.Stream) and stream.device.type == device.type:
        return LogicalStream(f"{device.type} stream {stream.stream_id}")
    elif isinstance(stream, torch.cpu.Stream) and device.type == "cpu":
        return LogicalStream(f"torch.cpu.Stream at {id(stream):#x}")
    else:
        fix = f'a torch.Stream(device="{device.type}")'
    raise ValueError(f"{what}={stream!r} cannot run work for a unit on {device}; pass {fix}")


class CommStreams:
    """The side streams one root's units share (created at lazy init)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._streams = {name: new_stream(device, name) for name in ("gather", "reduce", "offload")}
        self._host_copies: list[tuple[Any, torch.Tensor]] = []  # (event, source) not waited on

    @contextlib.contextmanager
    def use(self, name: str) -> Iterator[None]:
        """Run the block on side stream ``name`` after it waits for the current stream."""
        side = self._streams[name]
        side.wait_stream(current_stream(self.device))  # rule 1: it sees what came before
        with on_stream(side):
            yield

    def to_host(self, tensor: torch.Tensor, pin: bool) -> torch.Tensor:
        """Copy ``tensor`` to host memory on the offload stream (waited on by
        :meth:`wait_host_copies`; see [Note: the offload copy on the CPU])."""
        if tensor.device.type == "cpu":
            out = torch.empty_like(tensor)
        else:
            out = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu", pin_memory=pin)
        with self.use("offload"):
            out.copy_(tensor, non_blocking=pin)
            # ``tensor`` (device memory) must outlive the copy: kept with its event
            self._host_copies.append((self._streams["offload"].record_event(), tensor))
        return out

    def wait_host_copies(self) -> None:
        """Block until every copy issued by :meth:`to_host` has landed."""
        for event, _ in self._host_copies:
            event.synchronize()
        self._host_copies.clear()
