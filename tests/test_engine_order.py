"""When things happen, observed from outside through the engine's event log.

Results and traffic counts cannot tell a prefetching engine from one that gathers late, or an
overlapped reduce-scatter from one deferred to the end of backward; the event log
(``fullshard.engine.events.record_events``) can. Also: ``set_reshard_after_forward``,
``set_is_last_backward`` and CPU offload checked by effects that vanish if they are ignored.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from fullshard import CommPolicy, CPUOffloadPolicy, count_collectives
from fullshard.engine.events import EngineEvent, record_events
from fullshard.engine.hooks import STATE_ATTR
from fullshard.testing import run_distributed
from parity import (
    GLOBAL_BATCH,
    batch,
    full_state,
    loss_fn,
    make_net,
    make_optimizer,
    reference_run,
    shard_net,
    sharded_step,
)

BLOCKS = ["blocks.0", "blocks.1", "blocks.2"]


def _index(log: list[EngineEvent], kind: str, unit: str) -> int:
    hits = [i for i, e in enumerate(log) if e.kind == kind and e.unit == unit]
    assert hits, f"no {kind} event for {unit}: {[(e.kind, e.unit) for e in log]}"
    return hits[0]


def _order(transport: str, explicit: bool) -> dict[str, object]:
    """One logged step after a warm-up step; returns the positions the test compares."""
    model = shard_net(make_net(), comm_policy=CommPolicy(transport=transport))
    if explicit:
        blocks = list(model.blocks)
        for i, b in enumerate(blocks[:-1]):
            b.set_modules_to_forward_prefetch([blocks[i + 1]])
    opt = make_optimizer(model)
    if not explicit:  # implicit prefetch follows the previous forward's order
        sharded_step(model, opt, 0)
    with record_events() as log:
        sharded_step(model, opt, 1)
    out: dict[str, object] = {}
    for i in range(len(BLOCKS) - 1):
        this, nxt = BLOCKS[i], BLOCKS[i + 1]
        out[f"fwd {nxt} gather < {this} forward_end"] = _index(log, "gather_issue", nxt) < _index(
            log, "forward_end", this
        )
    # [Note: a window for small units]: implicitly, these tiny blocks are gathered further
    # ahead on the CPU (blocks.2 before blocks.0 has computed); an explicit list is exact
    ahead = _index(log, "gather_issue", "blocks.2") < _index(log, "forward_end", "blocks.0")
    out["blocks.2 gathered ahead only implicitly"] = ahead != explicit
    end = _index(log, "backward_end", "Net (root)")
    out["blocks.2 reduce < blocks.1 backward_start"] = _index(
        log, "reduce_issue", "blocks.2"
    ) < _index(log, "backward_start", "blocks.1")
    out["blocks.0 reduce < backward_end"] = _index(log, "reduce_issue", "blocks.0") < end
    out["root reduce < backward_end"] = _index(log, "reduce_issue", "Net (root)") < end
    # blocks.1 holds a never-used Linear: its gradients never all arrive, so the end-of-
    # backward callback reduces it
    out["blocks.1 reduce in callback"] = _index(log, "reduce_issue", "blocks.1") > end
    # [Note: recycling unsharded buffers]: backward's first gathers (the root's, the last
    # block's and its prefetch, blocks.1) take back the memory their forward freed, which still
    # holds their parameters: no all-gather at all ([Note: taking back a unit's own gathered
    # memory]); blocks.0's was not kept (blocks.2, two on, gathers other bytes), so it
    # gathers; and nothing stays pooled after the step
    start = _index(log, "backward_start", "Net (root)")
    issues = [(e.unit, e.detail) for e in log[start:] if e.kind == "gather_issue"]
    for unit in ("blocks.2", "blocks.1"):
        out[f"{unit} backward gather only reused"] = [i for i in issues if i[0] == unit] == [
            (unit, "reused")
        ]
    if not explicit:  # the previous forward's order says blocks.2 comes two after blocks.0
        out["blocks.0 backward gather gathers"] = ("blocks.0", "reused") not in issues
    out["nothing pooled after the step"] = model.__dict__[STATE_ATTR].ctx.host.pool.nbytes == 0
    return out


def _knobs() -> dict[str, object]:
    world = dist.get_world_size()
    out: dict[str, object] = {}
    for transport in ("packed", "p2p"):
        for explicit in (False, True):
            out[f"order {transport} explicit={explicit}"] = _order(transport, explicit)

    # set_reshard_after_forward: a k that does not divide the shard group is refused, and the
    # policy changes how many gathers backward needs
    model = shard_net(make_net())
    with pytest.raises(ValueError, match="must divide the shard group size") as e:
        model.set_reshard_after_forward(world + 1)
    out["bad k"] = str(e.value)
    opt = make_optimizer(model)
    gathers = {}
    for value in (True, False, True):
        model.set_reshard_after_forward(value)
        with count_collectives() as stats:
            sharded_step(model, opt, 0)
        gathers[len(gathers)] = (value, stats.calls("all_gather"))
    out["gathers"] = gathers

    # set_is_last_backward(False): the last reductions of that backward stay in flight and
    # finish during the next backward; gradients are exact once a last backward ends
    model = shard_net(make_net())
    opt = make_optimizer(model)
    rank, per = dist.get_rank(), GLOBAL_BATCH // world
    losses, unwaited = [], []
    for step in range(3):
        x, y = batch(step)
        x, y = x[rank * per : (rank + 1) * per], y[rank * per : (rank + 1) * per]
        total = torch.zeros(())
        for i in range(2):
            model.set_is_last_backward(i == 1)
            half = slice(i * per // 2, (i + 1) * per // 2)
            with record_events() as log:
                loss = loss_fn(model(x[half]), y[half]) / 2
                loss.backward()
            issued = sum(e.kind == "reduce_issue" for e in log)
            waited = sum(e.kind == "reduce_wait" for e in log)
            unwaited.append(issued - waited)
            total += loss.detach()
        opt.step()
        opt.zero_grad()
        dist.all_reduce(total)
        losses.append((total / world).item())
    out["last_backward"] = (losses, full_state(model), unwaited)

    # CPU offload: the event log's h2d / d2h bytes against the bytes that really crossed
    # between devices (counted by _CrossDeviceCopies, independently of the engine), where the
    # states live and where forward computes, and the gradients (offload changes no number)
    copies = {}
    for name, policy in (("offload", CPUOffloadPolicy(pin_memory=False)), ("none", None)):
        kw = {"offload_policy": policy} if policy is not None else {}
        model = shard_net(make_net(), **kw)
        x, y = batch(0)
        seen: list[torch.device] = []
        hook = model.blocks[0].up.register_forward_pre_hook(
            lambda m, args, seen=seen: seen.append(m.weight.device)
        )
        with record_events() as log, _CrossDeviceCopies() as moved:
            loss_fn(
                model(x[rank * per : (rank + 1) * per]), y[rank * per : (rank + 1) * per]
            ).backward()
        hook.remove()
        states = [p.to_local() for p in model.parameters()]
        states += [p.grad.to_local() for p in model.parameters() if p.grad is not None]
        copies[name] = {
            "events": (
                sum(e.nbytes for e in log if e.kind == "h2d"),
                sum(e.nbytes for e in log if e.kind == "d2h"),
            ),
            "moved": (moved.h2d, moved.d2h),
            "shard_bytes": sum(p.to_local().numel() * 4 for p in model.parameters()),
            "grad_bytes": sum(
                p.grad.to_local().numel() * 4 for p in model.parameters() if p.grad is not None
            ),
            "state_devices": sorted({t.device.type for t in states}),
            "compute_device": sorted({d.type for d in seen}),
            "grads": {
                n: p.grad.full_tensor() for n, p in model.named_parameters() if p.grad is not None
            },
        }
    out["copies"] = copies
    out["stale"] = _stale_copies()
    for transport in ("packed", "p2p"):
        out[f"lent {transport}"] = [_lent_memory(transport, lends) for lends in (True, False)]
    return out


class _CrossDeviceCopies(TorchDispatchMode):
    """Bytes copied host -> device and device -> host while active (``copy_`` between tensors
    on different devices, ``to``/``_to_copy`` onto another device); a copy within one device
    counts in neither."""

    def __init__(self) -> None:
        super().__init__()
        self.h2d = self.d2h = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        src = dst = None
        if func is torch.ops.aten.copy_.default:
            dst, src = args[0].device, args[1]
        elif func is torch.ops.aten._to_copy.default and kwargs.get("device") is not None:
            dst, src = torch.device(kwargs["device"]), args[0]
        if src is not None and dst is not None and src.device != dst:
            nbytes = src.numel() * src.element_size()
            if src.device.type == "cpu":
                self.h2d += nbytes
            else:
                self.d2h += nbytes
        return func(*args, **kwargs)


def _clamp_weight(module: torch.nn.Module, args: object) -> None:
    with torch.no_grad():
        module.up.weight.clamp_(-0.05, 0.05)


def _touch_down_weight(module: torch.nn.Module, args: object) -> None:
    with torch.no_grad():  # bumps the version counter; the values stay
        module.weight.mul_(1.0)


def _stale_copies() -> dict[str, object]:
    """[Note: taking back a unit's own gathered memory]: a pooled copy is taken back only while
    it is what a gather would bring. Each case changes blocks.2 between its forward and its
    backward (or not), records which backward gathers were taken back, and compares the
    gradients with the same run on an engine that pools nothing."""
    rank, per = dist.get_rank(), GLOBAL_BATCH // dist.get_world_size()
    x, y = batch(0)
    x, y = x[rank * per : (rank + 1) * per], y[rank * per : (rank + 1) * per]

    def run(change: str, pool: bool) -> tuple[list[str], list[torch.Tensor]]:
        model = shard_net(make_net())
        loss_fn(model(x), y).backward()  # lazy init; the pool exists from here on
        model.zero_grad()
        if not pool:  # the host strategy without its pool: every buffer freed, every gather
            host = model.__dict__[STATE_ATTR].ctx.host
            host.pool, host.lends = None, False
        block = model.blocks[2]
        if change == "unsharded":  # writes into the gathered parameter during forward
            block.register_forward_pre_hook(_clamp_weight)  # after the unit's own (gather)
        if change == "sibling":  # writes into down.weight after up.weight was saved for backward
            # ([Note: one version counter per unsharded parameter]: up's backward still runs)
            block.down.register_forward_pre_hook(_touch_down_weight)
        loss = loss_fn(model(x), y)
        if change == "shard":  # an in-place update of the shard between forward and backward
            with torch.no_grad():
                block.up.weight.mul_(2.0)
        with record_events() as log:
            loss.backward()
        reused = sorted(e.unit for e in log if e.kind == "gather_issue" and e.detail == "reused")
        return reused, [p.grad.full_tensor() for p in model.parameters() if p.grad is not None]

    def equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
        return len(a) == len(b) and all(torch.equal(u, v) for u, v in zip(a, b))

    out: dict[str, object] = {}
    runs = {}
    for change in ("none", "shard", "unsharded", "sibling"):
        reused, grads = run(change, pool=True)
        plain_reused, plain = run(change, pool=False)
        out[change] = (reused, plain_reused, equal(grads, plain))
        runs[change] = grads
    out["sibling as none"] = equal(runs["sibling"], runs["none"])  # mul_(1.0) changes nothing
    return out


def _lent_memory(transport: str, lends: bool) -> dict[str, object]:
    """[Note: gradient memory lent for the next forward]: equal blocks, so that two blocks'
    gradient shards fill one block's unsharded buffer on 2 ranks. Runs a fixed script of steps
    (gradients set to None, kept by the user, zeroed in place, accumulated over two backwards)
    with the pool lending (``lends``) or not; the two runs must train the same."""
    import torch.nn.functional as F

    from fullshard import fully_shard
    from fullshard.models import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=32, seq_len=8, n_layer=4, d_model=16, n_head=2))
    for block in model.blocks:
        fully_shard(block, comm_policy=CommPolicy(transport=transport))
    fully_shard(model, comm_policy=CommPolicy(transport=transport))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(dist.get_rank())
    data = [torch.randint(0, 32, (2, 8), generator=gen) for _ in range(6)]

    def forward_backward(i: int) -> None:
        logits = model(data[i])
        F.cross_entropy(logits.flatten(0, 1), data[i].flatten()).backward()

    forward_backward(0)  # lazy init: the pool exists from here on
    ctx = model.__dict__[STATE_ATTR].ctx
    ctx.host.lends = lends
    # Lending serves the default one-unit prefetch; these tiny blocks would otherwise all be
    # gathered ahead at once ([Note: a window for small units] in fullshard.engine.window).
    ctx.host.window = None
    opt.step()
    opt.zero_grad()
    forward_backward(1)  # plans and lends slabs to its last reductions
    opt.step()
    opt.zero_grad()  # the gradients go: the slabs are free for the next forward's gathers
    with record_events() as log:
        forward_backward(2)
    first_backward = _index(log, "backward_start", "GPT (root)")
    out: dict[str, object] = {
        "fresh in forward": [
            e.unit
            for e in log[:first_backward]
            if e.kind == "unshard_alloc" and e.detail == "fresh"
        ]
    }
    held = [p.grad for p in model.parameters()]  # the user keeps the gradients
    snapshot = [g.clone() for g in held]
    opt.step()
    opt.zero_grad()
    forward_backward(3)
    out["held gradients intact"] = all(torch.equal(a, b) for a, b in zip(held, snapshot))
    del held
    opt.step()
    opt.zero_grad(set_to_none=False)  # zeroed in place: still the gradients' memory
    forward_backward(4)
    forward_backward(5)  # two backwards accumulate
    opt.step()
    out["params"] = [p.full_tensor() for p in model.parameters()]
    opt.zero_grad()
    pool = model.__dict__[STATE_ATTR].ctx.host.pool
    before = pool.slabs_started
    model.set_requires_gradient_sync(False)  # nothing is reduced: nothing may be lent
    forward_backward(0)
    out["slabs without sync"] = pool.slabs_started - before
    return out


@pytest.fixture(scope="module")
def results() -> list[dict[str, object]]:
    return run_distributed(_knobs, 2, timeout=600)


def test_prefetch_and_reduce_scatter_timing(results) -> None:
    for r in results:
        for case in (k for k in r if k.startswith("order")):
            checks = r[case]
            assert isinstance(checks, dict)
            failed = [name for name, ok in checks.items() if not ok]
            assert not failed, f"{case}: {failed}"


def test_set_reshard_after_forward(results) -> None:
    r = results[0]
    assert "reshard_after_forward=3" in r["bad k"] and "2" in r["bad k"]
    gathers = r["gathers"]
    # True: forward gathers 4 units, backward regathers blocks.0; the root, blocks.2 and
    # blocks.1 (the last block's prefetch) take back their pooled memory instead (the root
    # keeps its own only under None; [Note: taking back a unit's own gathered memory]);
    # False: backward gathers nothing
    assert gathers[0] == (True, 5) and gathers[1] == (False, 4) and gathers[2] == (True, 5)


def test_set_is_last_backward(results) -> None:
    ref_losses, ref_state = reference_run(3)
    losses, state, unwaited = results[0]["last_backward"]
    for a, b in zip(losses, ref_losses):
        assert abs(a - b) / abs(b) < 1e-5, (a, b)
    for k in ref_state:
        torch.testing.assert_close(state[k], ref_state[k], atol=1e-4, rtol=0)
    # not-last backwards leave their final reductions in flight; the last one of each step
    # waits for all of them (its own and the previous backward's leftovers)
    for first, last in zip(unwaited[0::2], unwaited[1::2]):
        assert first > 0 and first + last == 0, unwaited


def test_cpu_offload_keeps_states_on_the_host(results) -> None:
    for r in results:
        off, none = r["copies"]["offload"], r["copies"]["none"]
        # shards and gradient shards in host memory, forward on the compute device (on this
        # gloo run that is the host too); the gradients are those of the run without offload
        assert off["state_devices"] == ["cpu"] and off["compute_device"] == ["cpu"]
        assert off["grad_bytes"] == none["grad_bytes"] > 0
        for n, g in none["grads"].items():
            torch.testing.assert_close(off["grads"][n], g, rtol=0, atol=0)
        # without offload nothing is copied between devices, and no copy is reported
        assert none["events"] == none["moved"] == (0, 0)


def test_cross_device_copy_counter() -> None:
    """The counter the offload checks trust: host -> meta copies count, a host copy does not."""
    with _CrossDeviceCopies() as moved:
        torch.empty(4, device="meta").copy_(torch.ones(4))  # copy_: 16 bytes
        torch.ones(2, dtype=torch.float64).to("meta")  # _to_copy: 16 bytes
        torch.empty(8).copy_(torch.ones(8))  # within the host: not counted
        torch.ones(8).to("cpu")  # already there: no copy
    assert (moved.h2d, moved.d2h) == (32, 0)


def test_cpu_offload_reports_the_copies_it_makes(results) -> None:
    """The h2d / d2h events report what crossed between host and device: on an accelerator,
    every shard before its gathers and every gradient shard after its reduction; on this CPU
    run, where the compute device is the host, nothing (so no event bytes)."""
    for r in results:
        off = r["copies"]["offload"]
        assert off["events"] == off["moved"], off["events"]  # the log says what happened
        if off["compute_device"] != ["cpu"]:  # an accelerator: the copies offload implies
            h2d, d2h = off["moved"]
            assert d2h == off["grad_bytes"] > 0 and h2d >= off["shard_bytes"] > 0


def test_stale_pooled_copy_is_gathered_again(results) -> None:
    for r in results:
        stale = dict(r["stale"])
        assert stale.pop("sibling as none")
        for change, (reused, plain_reused, same) in stale.items():
            assert plain_reused == [], change  # no pool, nothing to take back
            assert same, f"{change}: gradients differ from the engine without a pool"
            # unchanged, blocks.2 regathers from its pooled memory (the root keeps its own
            # under None); a changed shard or a write into a gathered parameter: it gathers
            assert ("blocks.2" in reused) == (change == "none"), (change, reused)


def test_gradient_memory_lent_for_the_next_forward(results) -> None:
    for r in results:
        for transport in ("packed", "p2p"):
            lent, plain = r[f"lent {transport}"]
            # the forward's first block gathers take the memory the last gradients freed
            # (only the root allocates); without lending, blocks.0 allocates, and so does
            # blocks.1 in pieces (a packed gather allocates when it is waited on, by when
            # blocks.0's forward has freed its memory)
            first = ["blocks.0"] if transport == "packed" else ["blocks.0", "blocks.1"]
            assert [u for u in lent["fresh in forward"] if u.startswith("blocks")] == []
            assert [u for u in plain["fresh in forward"] if u.startswith("blocks")] == first
            # memory a gradient still uses is never taken: kept, zeroed in place, accumulated
            assert lent["held gradients intact"] and plain["held gradients intact"]
            assert lent["slabs without sync"] == plain["slabs without sync"] == 0
            for a, b in zip(lent["params"], plain["params"], strict=True):
                assert torch.equal(a, b), transport


def test_small_unit_window_gathers_ahead_each_unit_once() -> None:
    """[Note: a window for small units], the host strategy's plug-in: a unit's pre-hook
    gathers the next unit (the core's prefetch, ``StepOrder.next_in_*``) and the small ones
    after it up to the window, none of them twice in a step; a large unit ends a window; a
    new step starts issuing again; the reductions beyond the cap may stay while they fit."""
    from types import SimpleNamespace

    from fullshard.engine.order import StepOrder
    from fullshard.engine.window import SmallUnitWindow

    sizes = {"a": 10, "b": 10, "c": 10, "d": 10, "big": 100, "e": 10, "f": 10}
    order: StepOrder[str] = StepOrder()
    window = SmallUnitWindow(sizes.__getitem__, 25)  # the next unit and two more of 10
    for unit in sizes:
        order.record_forward(unit)
        order.record_post_forward(unit)
    order.begin_forward()
    window.new_step()
    ahead = {unit: window.forward(order, unit) for unit in sizes}
    assert ahead == {
        "a": ["b", "c", "d"],
        "b": ["c"],  # the next unit always; d was issued by a's window
        "c": ["d"],
        "d": ["big", "e", "f"],  # big, over the window, as the next unit: e, f beyond it
        "big": ["e"],
        "e": ["f"],
        "f": [],
    }
    assert [order.next_in_forward(u) for u in ("a", "d", "f")] == [["b"], ["big"], []]
    window.new_step()
    for unit in sizes:
        order.record_post_forward(unit)
    back = [window.backward(order, unit) for unit in reversed(sizes)]
    # f's window ends at big; e's next unit is big, and two small ones beyond it
    assert back == [["e"], ["big", "d", "c"], ["d", "b"], ["c", "a"], ["b"], ["a"], []]
    assert window.forward(order, "a") == ["b", "c", "d"]  # issued again in the new step
    in_flight = [SimpleNamespace(nbytes=10)]
    assert window.room_for_reduction(in_flight, 15)
    assert not window.room_for_reduction(in_flight, 16)
