"""Small training runs under the stream checker, one per kind of stream work the engine does;
``python -m stream_cases`` prints, as one JSON line, every rank's report: per case, its first
unordered accesses and the error that stopped it (``None`` if it ran to the end).
``tests/test_stream_mutations.py`` runs it against copies of ``src/`` with one stream call
changed ([Note: the stream interface] in fullshard.engine.streams)."""

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
# the first's gradients, and after a backward that raised half-way (reset_iter_state, then
# the host reads the gradients handed out; no window of reductions in flight, so some finish
# first); an all-reduce hook on a stream of its own; Shard(1) parameters (unsharded data of
# their own, freed on their own) beside an all-gather extension's parameter
OFFLOAD = {"offload_policy": CPUOffloadPolicy(pin_memory=False)}
CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "packed": ("packed", {}),
    "p2p": ("p2p", {}),
    "offload": ("packed", OFFLOAD),
    "offload_accumulate": ("packed", OFFLOAD),
    "offload_reset": ("packed", OFFLOAD),
    "hook": ("packed", {}),
    "placements": ("packed", {}),
}


class _Boom(RuntimeError):
    pass


def _raise_in_backward(model: Any) -> None:
    """A backward that raises once the blocks' gradients are reduced (at the embedding's
    output), then ``reset_iter_state()`` and a host read of every gradient handed out."""

    def boom(_: Any) -> None:
        raise _Boom

    def arm(module: Any, inputs: Any, out: torch.Tensor) -> None:
        out.register_hook(boom)

    handle = model.embed.register_forward_hook(arm)
    x, y = batch(0)
    try:
        loss_fn(model(x), y).backward()
    except _Boom:
        pass
    handle.remove()
    model.reset_iter_state()
    for p in model.parameters():
        if p.grad is not None:
            p.grad.sum()


def _placements(net: Any) -> dict[str, Any]:
    """Block 1's down projection an all-gather extension's parameter, blocks 0 and 2's
    sharded on dim 1: the fully_shard kwargs."""
    from torch import nn
    from torch.distributed.tensor import Shard

    from test_composition_extra import Bf16Gather

    block = net.blocks[1]
    block.down.weight = nn.Parameter(Bf16Gather(block.down.weight.detach().clone()))
    dim1 = {id(net.blocks[i].down.weight) for i in (0, 2)}
    return {"shard_placement_fn": lambda p: Shard(1) if id(p) in dim1 else None}


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
    net = make_net()
    if name == "placements":
        kwargs = _placements(net)
    off = ("small_unit_window",) if name == "offload_reset" else ()
    policy = CommPolicy(transport=transport, cpu_fast_paths_off=off)
    model = shard_net(net, comm_policy=policy, **kwargs)
    if name == "hook":  # every unit's hook scales its reduced gradients on the "hook" stream
        stream = new_stream(torch.device("cpu"), "hook")
        for unit in (model.embed, *model.blocks, model):
            unit.set_all_reduce_hook(lambda t: t.mul_(1.0), stream=stream)  # type: ignore[operator]
    opt = make_optimizer(model)
    with check_streams() as checker:
        if name == "offload_reset":
            _raise_in_backward(model)
        for step in range(2):
            if name == "offload_accumulate":
                _accumulating_step(model, opt, step)
            else:
                sharded_step(model, opt, step)
    return checker.violations[:3]


def run_cases() -> dict[str, dict[str, Any]]:
    """Per case: ``violations`` (the checker's first three) and ``error`` (what stopped it)."""
    out: dict[str, dict[str, Any]] = {}
    for name in CASES:
        try:
            out[name] = {"violations": _case(name), "error": None}
        except Exception as e:  # a crash, reported as one: the checker did not notice it
            out[name] = {"violations": [], "error": f"{type(e).__name__}: {e}"}
    return out


if __name__ == "__main__":
    print(json.dumps(run_distributed(run_cases, 2, timeout=300)))
