"""``fullshard train --ft-serve-lighthouse``: the torchft lighthouse served from a launch.

A fault-tolerant job's replica groups meet at a torchft lighthouse (``--ft-lighthouse
HOST:PORT``). For a small job, one launch can serve it: its launcher process (not a worker, so
the group's own failures and restarts leave it up) binds the address's port on every interface
for as long as the launch runs, and every group, this one included, joins ``HOST:PORT``. The
lighthouse forms quorums from whichever groups heartbeat (one is enough: ``min_replicas=1``)
and drops a group whose heartbeats stop (torchft's default, 5 s).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from urllib.parse import urlsplit

from fullshard.train.config import ConfigError, TrainConfig

__all__ = ["lighthouse_port", "lighthouse_url", "served_lighthouse"]


def lighthouse_url(address: str) -> str:
    """``--ft-lighthouse`` as torchft's clients take it: ``HOST:PORT`` gets its ``http://``."""
    return address if "://" in address else f"http://{address}"


def lighthouse_port(address: str) -> int:
    """The port of ``HOST:PORT`` (or ``http://HOST:PORT``), or a :class:`ConfigError`."""
    parts = urlsplit(lighthouse_url(address))
    try:
        port = parts.port
    except ValueError:
        port = None
    if not parts.hostname or not port:
        raise ConfigError(
            f"--ft-lighthouse {address!r} is not HOST:PORT (for example 10.0.0.1:29510); "
            "--ft-serve-lighthouse serves that port"
        )
    return port


@contextlib.contextmanager
def served_lighthouse(cfg: TrainConfig) -> Iterator[None]:
    """Serve the lighthouse while the block runs when ``cfg.ft_serve_lighthouse`` (else
    nothing); a port that cannot be bound is a :class:`ConfigError` naming it."""
    if not cfg.ft_serve_lighthouse:
        yield
        return
    port = lighthouse_port(cfg.ft_lighthouse)
    from torchft.coordination import LighthouseServer

    try:
        server = LighthouseServer(bind=f"[::]:{port}", min_replicas=1)
    except Exception as e:  # torchft raises a RuntimeError from its Rust server
        raise ConfigError(
            f"--ft-serve-lighthouse could not serve port {port} ({e}); pick a free port in "
            "--ft-lighthouse, or drop --ft-serve-lighthouse to join the lighthouse already there"
        ) from None
    print(f"fullshard train: serving the torchft lighthouse on port {port}", flush=True)
    try:
        yield
    finally:
        server.shutdown()
