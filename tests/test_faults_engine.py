"""Engine faults: a rank that stops participating, or takes a different path, never hangs the
others forever — they fail within the process group's timeout, naming collective, unit, rank."""

from __future__ import annotations

import time

import torch.distributed as dist

from fullshard.engine.collectives import CollectiveError
from fullshard.testing import ChildFailed, run_distributed
from parity import batch, loss_fn, make_net, shard_net


def _stuck_rank() -> str:
    model = shard_net(make_net())
    x, y = batch(0)
    if dist.get_rank() == 1:
        time.sleep(12)  # "stuck in user code"; never joins the forward's all-gathers
        return "stuck"
    start = time.monotonic()
    try:
        loss_fn(model(x[:12]), y[:12]).backward()
    except CollectiveError as e:
        return f"{time.monotonic() - start:.1f}|{e}"
    return "no error"


def test_stuck_rank_fails_fast_with_a_named_collective() -> None:
    out = run_distributed(_stuck_rank, 2, pg_timeout=3, timeout=120)[0]
    elapsed, msg = out.split("|", 1)
    assert float(elapsed) < 11, elapsed  # the timeout (3 s), not the other rank's 12 s sleep
    assert "rank 0" in msg and "all_gather" in msg and "unit" in msg, msg


def _divergent_path() -> str:
    model = shard_net(make_net())
    x, y = batch(0)
    if dist.get_rank() == 1:  # a data-dependent branch: this rank never runs blocks[1]

        def skip_block_1(idx):
            h = model.embed(idx)
            for i, block in enumerate(model.blocks):
                if i != 1:
                    h = block(h)
            return model.head(model.norm(h))

        model.forward = skip_block_1  # type: ignore[method-assign]
    try:
        for _ in range(2):
            loss_fn(model(x[:12]), y[:12]).backward()
    except CollectiveError as e:
        return str(e)
    except RuntimeError as e:  # gloo may also detect the mismatch itself
        return f"runtime: {e}"
    return "no error"


def test_divergent_path_errors_instead_of_hanging() -> None:
    """Documented outcome: an error, never a hang. The rank that still waits gets a
    CollectiveError naming the unit within the timeout; gloo may abort the rank whose message
    sizes no longer match (under torchrun the elastic agent then restarts the group)."""
    try:
        outs = run_distributed(_divergent_path, 2, pg_timeout=3, timeout=120)
    except ChildFailed as e:
        assert "timed out after" not in str(e), str(e)  # finished long before the harness limit
        return
    assert all(o != "no error" for o in outs), outs
