"""The distributed cases of ``tests/test_rl_sync.py`` (importable, so forkserver ranks can run
them): a tiny Hugging Face Llama, built locally, trained under fullshard and published.

The Llama has uneven dims (a 67-token vocabulary over 2 ranks: 34 + 33 rows), tied embeddings
and, in the naming case, a checkpoint-wrapped block under ``torch.compile``'s ``_orig_mod``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from fullshard import count_collectives, fully_shard
from fullshard.rl import (
    Receivers,
    ShardDeltas,
    WeightReceiver,
    publish,
    receive,
    send_deltas,
    send_full,
    send_rows,
    shard_rows,
)
from fullshard.rl import weights as publish_module
from fullshard.rl.delta import bits, decode_xor
from fullshard.rl.wire import wire_device
from hf_local import tiny_llama

VOCAB = 67


def assert_same(
    got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], what: str, *, ordered: bool = True
) -> None:
    """Bit-equal named tensors (dtypes too); ``ordered``: in the same order as well."""
    assert (list(got) == list(want)) if ordered else (sorted(got) == sorted(want)), what
    bad = [n for n in want if got[n].dtype != want[n].dtype or not torch.equal(got[n], want[n])]
    assert not bad, f"{what}: {bad[:4]} differ"


def make_llama(seed: int = 0, dtype: torch.dtype = torch.float32) -> nn.Module:
    """A 2-layer, 32-wide Llama with tied embeddings (no download)."""
    return tiny_llama(VOCAB, max_positions=32, tie=True, seed=seed).to(dtype)


def shard_llama(model: nn.Module, mesh: DeviceMesh | None = None, wrap: bool = False) -> None:
    """fully_shard each decoder layer (the first checkpoint-wrapped if ``wrap``), then the root."""
    layers = model.model.layers  # type: ignore[union-attr]
    if wrap:
        layers[0] = checkpoint_wrapper(layers[0])
    for layer in layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)


def train(model: nn.Module, opt: torch.optim.Optimizer, steps: int, seed: int) -> None:
    """``steps`` AdamW steps on random tokens (the same on every training rank)."""
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        ids = torch.randint(0, VOCAB, (2, 12), generator=g)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()


def full_weights(model: nn.Module, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The oracle: every parameter's ``full_tensor()`` in ``dtype``, by HF name (tied once)."""
    out = {}
    for fqn, p in model.named_parameters():
        name = fqn.replace("_orig_mod.", "").replace("_checkpoint_wrapped_module.", "")
        full = p.full_tensor() if isinstance(p, DTensor) else p.detach()
        out[name] = full.to(dtype)
    return out


def _publish_cases(model: nn.Module) -> dict[str, Any]:
    """Names, values, gathers per bucket and the pipelining order of ``publish``."""
    res: dict[str, Any] = {}
    oracle = full_weights(model, torch.bfloat16)
    for label, bucket in (("tiny", 1), ("one", 1 << 30)):
        with count_collectives() as stats:
            got = list(publish(model, dtype=torch.bfloat16, bucket_bytes=bucket))
        res[f"{label}_names"] = [n for n, _ in got]
        res[f"{label}_exact"] = all(
            t.dtype == torch.bfloat16 and torch.equal(t, oracle[n]) for n, t in got
        )
        res[f"{label}_gathers"] = stats.calls("all_gather")
        res[f"{label}_bytes"] = stats.bytes("all_gather")
        res[f"{label}_dtypes"] = sorted({str(r.dtype) for r in stats.records})
    res["oracle_names"] = list(oracle)
    res["hf_names"] = [n for n, _ in make_llama().named_parameters()]
    res["wire_numel"] = sum(t.numel() for t in oracle.values())
    # Pipelining: bucket i + 1's gather is issued before bucket i's first tensor is consumed.
    events: list[str] = []
    real = publish_module.all_gather

    def spy(*args: Any, **kwargs: Any) -> Any:
        events.append("issue")
        return real(*args, **kwargs)

    publish_module.all_gather = spy  # type: ignore[assignment]
    try:
        last = None
        for name, _ in publish(model, dtype=torch.bfloat16, bucket_bytes=1):
            unit = name.split(".")[2] if name.startswith("model.layers.") else "root"
            if unit != last:
                events.append(f"consume {unit}")
                last = unit
    finally:
        publish_module.all_gather = real  # type: ignore[assignment]
    res["events"] = events
    return res


def _rows_and_delta_cases(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    """Shard rows against full_tensor(); a row-split receiver; XOR deltas bit for bit."""
    res: dict[str, Any] = {}
    oracle = full_weights(model, torch.bfloat16)
    rows = shard_rows(model, dtype=torch.bfloat16)
    res["rows_exact"] = all(
        torch.equal(r.local, oracle[r.name].narrow(r.dim, r.start, r.stop - r.start)) for r in rows
    )
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, rows)
    split = [
        WeightReceiver.row_split(make_llama(seed=5, dtype=torch.bfloat16), i, 3) for i in range(3)
    ]
    for rank_rows in everyone:
        for r in rank_rows:
            for recv in split:
                recv.apply_rows(r)
    res["split_exact"] = all(
        torch.equal(t, oracle[n][recv.offsets(n)[0] :][: t.shape[0]])
        for recv in split
        for n, t in recv.weights.items()
    )
    deltas = ShardDeltas(model, dtype=torch.bfloat16)
    old = {r.name: bits(r.local).clone() for r in shard_rows(model, dtype=torch.bfloat16)}
    train(model, opt, 1, seed=9)
    new = {r.name: bits(r.local) for r in shard_rows(model, dtype=torch.bfloat16)}
    ds = deltas.delta()
    res["delta_exact"] = all(
        torch.equal(old[d.name] ^ decode_xor(d.encode(), d.mask.shape, d.dtype), new[d.name])
        for d in ds
    )
    res["delta_changed"] = sum(d.changed for d in ds)
    res["delta_bytes"] = sum(len(d.encode()) for d in ds)
    res["raw_bytes"] = sum(d.mask.numel() * 2 for d in ds)
    res["second_delta_changed"] = sum(d.changed for d in deltas.delta())  # nothing since
    return res


def trainer_cases() -> dict[str, Any]:
    """2 training ranks: publish (names under wrappers, values, gathers, order), rows, deltas."""
    model = make_llama()
    shard_llama(model, wrap=True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    train(model, opt, 2, seed=1)
    compiled = torch.compile(model)  # never run: only its ``_orig_mod.`` names matter here
    res = _publish_cases(compiled)
    res["wrapped_fqns"] = [n for n, _ in compiled.named_parameters()][:3]
    res.update(_rows_and_delta_cases(model, opt))
    return res


def _snapshot(receiver: WeightReceiver) -> dict[str, torch.Tensor]:
    return {n: t.clone() for n, t in receiver.weights.items()}


class _WireSpy:
    """Records the device of every tensor handed to ``dist.send`` / ``recv`` / ``irecv``."""

    NAMES = ("send", "recv", "irecv")

    def __init__(self) -> None:
        self.devices: list[str] = []
        self.real = {name: getattr(dist, name) for name in self.NAMES}

    def __enter__(self) -> _WireSpy:
        for name, real in self.real.items():

            def spy(tensor: torch.Tensor, *args: Any, _real: Any = real, **kw: Any) -> Any:
                self.devices.append(str(tensor.device))
                return _real(tensor, *args, **kw)

            setattr(dist, name, spy)
        return self

    def __exit__(self, *_: object) -> None:
        for name, real in self.real.items():
            setattr(dist, name, real)


def sync_world() -> dict[str, Any]:
    """Training ranks 0-1 (their own mesh) and an inference rank 2 holding a bf16 HF Llama:
    full, rows, then three steps of deltas (the second uncompressed); each stage's weights,
    the wire's device and the devices of the tensors handed to the wire returned."""
    with _WireSpy() as spy:
        out = _sync_world()
    out["wire_device"], out["wire_tensors"] = str(wire_device()), sorted(set(spy.devices))
    out["wire_calls"] = len(spy.devices)
    return out


def _sync_world() -> dict[str, Any]:
    rank = dist.get_rank()
    trainers = dist.new_group([0, 1])
    to = Receivers(ranks=(2,))
    out: dict[str, Any] = {"stages": [], "reports": []}
    if rank == 2:
        receiver = WeightReceiver(make_llama(seed=7, dtype=torch.bfloat16))
        for _stage in range(5):
            out["reports"].append(receive(receiver, (0,) if _stage == 0 else (0, 1)))
            out["stages"].append(_snapshot(receiver))
        return out
    model = make_llama()
    shard_llama(model, DeviceMesh.from_group(trainers, "cpu"))
    opt = torch.optim.AdamW(model.parameters(), lr=2e-4)
    train(model, opt, 1, seed=3)
    out["reports"].append(send_full(model, to, dtype=torch.bfloat16, bucket_bytes=1 << 14))
    out["stages"].append(full_weights(model, torch.bfloat16))
    train(model, opt, 2, seed=4)
    out["reports"].append(send_rows(model, to, dtype=torch.bfloat16))
    out["stages"].append(full_weights(model, torch.bfloat16))
    deltas = ShardDeltas(model, dtype=torch.bfloat16)
    for step in range(3):
        train(model, opt, 1, seed=10 + step)
        compress = False if step == 1 else None  # None: the backend's default (gloo: on)
        out["reports"].append(send_deltas(deltas, to, compress=compress))
        out["stages"].append(full_weights(model, torch.bfloat16))
    return out


def _hsdp_mesh() -> DeviceMesh | None:
    """Training ranks 0-3 as a 2x2 HSDP mesh (replicate, shard); rank 4 makes the groups too
    (``new_group`` is collective) and gets ``None``."""
    groups = {}
    for kind, members in (("rep", ([0, 2], [1, 3])), ("shard", ([0, 1], [2, 3]))):
        for ranks in members:
            group = dist.new_group(ranks)
            if dist.get_rank() in ranks:
                groups[kind] = group
    if dist.get_rank() == 4:
        return None
    return DeviceMesh.from_group(
        [groups["rep"], groups["shard"]],
        "cpu",
        mesh=torch.arange(4).view(2, 2),
        mesh_dim_names=("replicate", "shard"),
    )


def hsdp_sync_world() -> dict[str, Any]:
    """HSDP trainers 0-3 (2 replicas x 2 shards) with the final norm's weight ignored (a plain
    tensor on every rank), and a receiver on rank 4 that lists every trainer as a sender:
    rows, then two steps of deltas, each stage's weights returned for the parent."""
    mesh = _hsdp_mesh()
    out: dict[str, Any] = {"stages": [], "reports": []}
    if mesh is None:
        receiver = WeightReceiver(make_llama(seed=7, dtype=torch.bfloat16))
        for _stage in range(3):
            out["reports"].append(receive(receiver, (0, 1, 2, 3)))
            out["stages"].append(_snapshot(receiver))
        return out
    to = Receivers(ranks=(4,))
    model = make_llama()
    ignored = {model.model.norm.weight}  # type: ignore[union-attr]
    with torch.no_grad():  # small values, so AdamW's steps show in bf16
        for w in ignored:
            w.copy_(torch.rand(w.shape, generator=torch.Generator().manual_seed(5)) / 64)
    for layer in model.model.layers:  # type: ignore[union-attr]
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh, ignored_params=ignored)
    opt = torch.optim.AdamW(model.parameters(), lr=2e-4)
    train(model, opt, 1, seed=3)
    out["reports"].append(send_rows(model, to, dtype=torch.bfloat16))
    out["stages"].append(full_weights(model, torch.bfloat16))
    deltas = ShardDeltas(model, dtype=torch.bfloat16)
    for step in range(2):
        train(model, opt, 1, seed=20 + step)
        out["reports"].append(send_deltas(deltas, to))
        out["stages"].append(full_weights(model, torch.bfloat16))
    return out


class _TPBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(10)
        self.up = nn.Linear(10, 14)  # 14 / tp 2 = 7 rows, uneven over dp 2
        self.down = nn.Linear(14, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(self.norm(x))))


def tp_publish_case() -> dict[str, Any]:
    """FSDP over dp 2 x TP 2: publish gives every weight, TP ones included, equal to
    ``full_tensor()`` in bf16; shard_rows and ShardDeltas refuse the TP weights by name."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    torch.manual_seed(0)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    model = nn.Sequential(_TPBlock(), _TPBlock())
    for block in model:
        parallelize_module(block, mesh["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
        fully_shard(block, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(1)
    for _ in range(2):
        model(torch.randn(4, 10, generator=g)).sum().backward()
        opt.step()
        opt.zero_grad()
    oracle = full_weights(model, torch.bfloat16)
    got = dict(publish(model, dtype=torch.bfloat16, bucket_bytes=1 << 10))
    out: dict[str, Any] = {
        "placements": str(model[0].up.weight.placements),
        "names": sorted(got) == sorted(oracle),
        "exact": all(
            t.dtype == torch.bfloat16 and torch.equal(t, oracle[n]) for n, t in got.items()
        ),
    }
    for what, call in (("rows", lambda: shard_rows(model)), ("deltas", lambda: ShardDeltas(model))):
        try:
            call()
        except ValueError as e:
            out[what] = str(e)
    return out
