"""Small training runs under the stream checker, one per kind of stream work the engine does;
``python -m stream_cases`` prints, as one JSON line, each case's first unordered accesses (or
the error that stopped it). ``tests/test_stream_mutations.py`` runs it against copies of
``src/`` with one stream call changed ([Note: the stream interface] in
fullshard.engine.streams)."""

from __future__ import annotations

import json
from typing import Any

import torch

from fullshard import CommPolicy, CPUOffloadPolicy
from fullshard.engine.streamcheck import check_streams
from fullshard.engine.streams import new_stream
from fullshard.testing import run_distributed
from parity import batch, loss_fn, make_net, make_optimizer, shard_net, sharded_step

# case -> (transport, fully_shard kwargs): the parity model with either transport; CPU offload
# (its gradient copies on the offload stream), also adding a second backward's shards into
# the first's gradients; an all-reduce hook on a stream of its own
OFFLOAD = {"offload_policy": CPUOffloadPolicy(pin_memory=False)}
CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "packed": ("packed", {}),
    "p2p": ("p2p", {}),
    "offload": ("packed", OFFLOAD),
    "offload_accumulate": ("packed", OFFLOAD),
    "hook": ("packed", {}),
}


def _accumulating_step(model: Any, opt: Any, step: int) -> None:
    """Two backward passes with gradient sync on, then the optimizer: the second pass's
    reduced shards are added into the gradients the first one left."""
    for i in range(2):
        x, y = batch(step * 2 + i)
        loss_fn(model(x), y).backward()
    opt.step()
    opt.zero_grad()


def _case(name: str) -> list[str]:
    transport, kwargs = CASES[name]
    model = shard_net(make_net(), comm_policy=CommPolicy(transport=transport), **kwargs)
    if name == "hook":  # every unit's hook scales its reduced gradients on the "hook" stream
        stream = new_stream(torch.device("cpu"), "hook")
        for unit in (model.embed, *model.blocks, model):
            unit.set_all_reduce_hook(lambda t: t.mul_(1.0), stream=stream)  # type: ignore[operator]
    opt = make_optimizer(model)
    with check_streams() as checker:
        for step in range(2):
            if name == "offload_accumulate":
                _accumulating_step(model, opt, step)
            else:
                sharded_step(model, opt, step)
    return checker.violations[:3]


def run_cases() -> dict[str, list[str]]:
    out = {}
    for name in CASES:
        try:
            out[name] = _case(name)
        except Exception as e:  # a mutation may break the engine outright: noticed too
            out[name] = [f"error: {type(e).__name__}: {e}"]
    return out


if __name__ == "__main__":
    print(json.dumps(run_distributed(run_cases, 2, timeout=300)[0]))
