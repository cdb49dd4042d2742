"""GPU checks (NCCL, CUDA, bf16, offload). Skipped without CUDA; run on a GPU machine with
``python -m pytest -q tests/test_gpu.py``. One GPU suffices: NCCL at world size 1."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode

from fullshard import CPUOffloadPolicy, MixedPrecisionPolicy
from fullshard.module import unit_state
from fullshard.testing import free_port
from parity import batch, full_state, loss_fn, make_net, make_optimizer, shard_net

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def nccl():
    import os

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _train(model, steps=3):
    opt = make_optimizer(model)
    losses = []
    for step in range(steps):
        x, y = (t.cuda() for t in batch(step))
        loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def test_nccl_parity_bf16_and_offload(nccl) -> None:
    ref = make_net().cuda()
    ref_losses = _train(ref)
    ours = shard_net(make_net().cuda())
    assert next(ours.parameters()).device.type == "cuda"
    assert _train(ours) == pytest.approx(ref_losses, rel=1e-5)
    a, b = full_state(ours), {k: v for k, v in ref.state_dict().items()}
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=1e-4, rtol=0)

    bf16 = shard_net(make_net().cuda(), mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16))
    assert _train(bf16) == pytest.approx(ref_losses, rel=3e-2)

    off = shard_net(make_net(), offload_policy=CPUOffloadPolicy(pin_memory=True))
    assert {p.to_local().device.type for p in off.parameters()} == {"cpu"}
    assert _train(off) == pytest.approx(ref_losses, rel=1e-5)


def test_offloaded_gradients_have_landed_where_the_host_reads_them(nccl) -> None:
    """With CPU offload the reduced shards are copied to pinned host memory without blocking;
    added into an existing gradient (accumulation) or seen by a post-accumulate-grad hook,
    they must have landed first."""
    ref = shard_net(make_net().cuda())
    off = shard_net(make_net(), offload_policy=CPUOffloadPolicy(pin_memory=True))
    seen: dict[int, list[torch.Tensor]] = {}  # each parameter's gradients as its hook saw them
    for p in off.parameters():
        p.register_post_accumulate_grad_hook(
            lambda q: seen.setdefault(id(q), []).append(q.grad.to_local().clone())
        )
    for model in (ref, off):
        for step in range(2):  # two micro-batches: the second adds into the first's gradients
            x, y = (t.cuda() for t in batch(step))
            loss_fn(model(x), y).backward()
    for a, b in zip(ref.parameters(), off.parameters()):
        want = a.grad.to_local().cpu()
        assert len(seen[id(b)]) == 2  # once per backward
        torch.testing.assert_close(b.grad.to_local(), want, atol=1e-5, rtol=0)
        torch.testing.assert_close(seen[id(b)][-1], want, atol=1e-5, rtol=0)


@pytest.mark.parametrize("source", ["process_group", "symmetric"])
def test_comm_buffers_from_backend(nccl, source: str) -> None:
    """set_allocate_memory_from_process_group_for_comm(True) / set_symm_mem_for_comm() on
    every unit: every all-gather and reduce-scatter buffer comes from the backend (symmetric:
    from the device's symmetric-memory pool), with the default run's losses (world size 1:
    the same arithmetic, so exactly)."""
    from torch.distributed import _symmetric_memory as symm_mem

    from fullshard import FSDPModule
    from fullshard.engine.overrides import BackendAllGather, BackendReduceScatter

    expected = _train(shard_net(make_net().cuda()))
    model = shard_net(make_net().cuda())
    units = [m for m in model.modules() if isinstance(m, FSDPModule)]
    allocated: list[torch.Tensor] = []
    for unit in units:
        if source == "process_group":
            unit.set_allocate_memory_from_process_group_for_comm(True)
        else:
            unit.set_symm_mem_for_comm()
        ov = unit_state(unit).group.overrides
        assert isinstance(ov.all_gather, BackendAllGather) and ov.all_gather.source == source
        assert isinstance(ov.reduce_scatter, BackendReduceScatter)
        for comm in (ov.all_gather, ov.reduce_scatter):
            inner = comm.allocate

            def spy(*args, _inner=inner, **kwargs):
                t = _inner(*args, **kwargs)
                allocated.append(t)
                return t

            comm.allocate = spy  # type: ignore[method-assign]
    assert _train(model) == expected
    assert allocated and all(t.is_cuda for t in allocated)
    if source == "symmetric":  # the buffers live in the symmetric-memory pool
        assert symm_mem.get_mem_pool(allocated[0].device).snapshot()
    else:  # the two knobs decide the same buffers; False goes back to torch.empty
        with pytest.raises(AssertionError, match="use one of them"):
            units[0].set_symm_mem_for_comm()
        units[0].set_allocate_memory_from_process_group_for_comm(False)
        assert unit_state(units[0]).group.overrides.all_gather is None


def test_post_optim_event_waited_once(nccl) -> None:
    """set_post_optim_event: the next forward waits on the event (recorded on another stream
    after the optimizer step) once, then the hook is gone; the losses are unchanged."""
    expected = _train(shard_net(make_net().cuda()), steps=2)
    model = shard_net(make_net().cuda())
    hooks = len(model._forward_pre_hooks)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        torch.cuda._sleep(1_000_000)  # work the event stands for, still running when set
        event = side.record_event()
    model.set_post_optim_event(event)
    assert len(model._forward_pre_hooks) == hooks + 1
    assert _train(model, steps=2) == expected
    assert len(model._forward_pre_hooks) == hooks  # used once, then dropped


@pytest.mark.parametrize("kind", ["torch.cuda.Stream", "torch.Stream"])
def test_all_reduce_hook_runs_on_its_stream(nccl, kind: str) -> None:
    """set_all_reduce_hook(stream=): the hook runs on that stream (a ``torch.Stream`` of the
    device stands for the same stream) and the gradients are handed out after it: a hook that
    sleeps on its stream before doubling the reduced shards still doubles every gradient."""
    ref = make_net().cuda()
    x, y = (t.cuda() for t in batch(0))
    loss_fn(ref(x), y).backward()
    model = shard_net(make_net().cuda())
    stream = torch.cuda.Stream() if kind == "torch.cuda.Stream" else torch.Stream(device="cuda")
    seen = []

    def slow_double(t: torch.Tensor) -> None:
        seen.append(torch.cuda.current_stream().stream_id)
        torch.cuda._sleep(5_000_000)  # the hand-out must wait for this stream's work
        t.mul_(2)

    for unit in (model.embed, *model.blocks, model):
        unit.set_all_reduce_hook(slow_double, stream=stream)
    loss_fn(model(x), y).backward()
    assert seen and set(seen) == {stream.stream_id}
    for p, q in zip(model.parameters(), ref.parameters()):
        if q.grad is not None:
            torch.testing.assert_close(p.grad.full_tensor(), 2 * q.grad, atol=1e-5, rtol=1e-4)


class _CpuResults(TorchFunctionMode):
    """Records the torch functions that produce a weight-sized tensor (64 elements or more)
    in host memory."""

    def __init__(self) -> None:
        super().__init__()
        self.hits: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if isinstance(out, torch.Tensor) and out.device.type == "cpu" and out.numel() >= 64:
            self.hits.append(getattr(func, "__name__", str(func)))
        return out


def test_colocated_buckets_over_cuda_ipc(nccl) -> None:
    """publish_colocated to an engine process on the same GPU (benchmarks/gpu_check_colocated's
    engine, over a pipe): one CUDA IPC handle per bf16 bucket, buckets that never leave the
    device (no tensor in host memory on the trainer's side), every weight the engine loads a
    view inside its bucket, and its weights equal to ``publish()``'s bit for bit."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from gpu_check_colocated import differ_then_stop, engine_process

    from fullshard.rl import publish, publish_colocated

    model = shard_net(make_net().cuda())
    _train(model)
    local = {n: t.clone() for n, t in publish(model, dtype=torch.bfloat16)}
    with engine_process({n: (tuple(t.shape), t.dtype) for n, t in local.items()}) as conn:
        conn.send("sync")
        with _CpuResults() as host:
            report = publish_colocated(model, conn, dtype=torch.bfloat16, bucket_bytes=1 << 8)
        seen = conn.recv()
        differ = differ_then_stop(conn, local)  # shared back through CUDA IPC
    assert report.path == "colocated" and report.device == "cuda:0", report
    assert report.messages == seen["buckets"] > 1 and host.hits == [], (report, host.hits)
    assert seen["copies"] == [] and seen["devices"] == {"cuda:0"} and differ == [], seen


def _capturable_net(bf16: bool):
    from fullshard.capture import make_capturable

    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16) if bf16 else MixedPrecisionPolicy()
    model = shard_net(make_net().cuda(), mp_policy=mp)
    make_capturable(model)
    return model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def _graph_step(model):
    from fullshard.capture import finalize

    def step(x, y):
        loss = loss_fn(model(x), y)
        loss.backward()
        finalize(model)
        return loss.detach()

    return step


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32-local", "bf16-packed"])
def test_cuda_graph_replays_a_step(nccl, bf16: bool) -> None:
    """[Note: a capturable step] (fullshard.engine.kept): the whole step (forward, loss,
    backward, finalize) captured with torch.cuda.graphs after warm-up, then replayed, gives
    the losses and parameters of the same steps run eagerly, bit for bit."""
    from fullshard.capture import count_engine_work

    warm, steps = 3, 4
    data = [tuple(t.cuda() for t in batch(s)) for s in range(warm + steps)]
    eager, opt = _capturable_net(bf16)
    step, eager_losses = _graph_step(eager), []
    for x, y in data:
        eager_losses.append(step(x, y))
        opt.step()
        opt.zero_grad(set_to_none=False)

    model, opt = _capturable_net(bf16)
    step, losses = _graph_step(model), []
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for x, y in data[:warm]:  # the last one (the steady state) counted
            with count_engine_work() as seen:
                losses.append(step(x, y))
            opt.step()
            opt.zero_grad(set_to_none=False)
    torch.cuda.current_stream().wait_stream(side)
    assert seen.created == [] and seen.syncs == [], (seen.created, seen.syncs)
    sx, sy = (t.clone() for t in data[warm])
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_loss = step(sx, sy)
    for x, y in data[warm:]:
        sx.copy_(x)
        sy.copy_(y)
        graph.replay()
        losses.append(static_loss.clone())
        opt.step()
        opt.zero_grad(set_to_none=False)
    assert all(torch.equal(a, b) for a, b in zip(losses, eager_losses)), (losses, eager_losses)
    a, b = full_state(model), full_state(eager)
    assert all(torch.equal(a[k], b[k]) for k in a), [k for k in a if not torch.equal(a[k], b[k])]
