"""fullshard.rl: publishing weights, shard rows, XOR deltas and a receiver, against
``full_tensor()`` (the distributed cases live in ``tests/rl_sync_cases.py``)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.overrides import TorchFunctionMode

from fullshard.rl import (
    DeltaRows,
    Receivers,
    WeightReceiver,
    checkpoint_name,
    decode_xor,
    encode_xor,
)
from fullshard.rl.delta import bits
from fullshard.rl.wire import backend_device
from fullshard.testing import run_distributed
from rl_sync_cases import assert_same

pytest.importorskip("transformers")


def test_checkpoint_names_drop_wrappers() -> None:
    assert checkpoint_name("_orig_mod.model.layers.0._checkpoint_wrapped_module.mlp.w") == (
        "model.layers.0.mlp.w"
    )
    assert checkpoint_name("_fsdp_wrapped_module.layers.1.w") == "layers.1.w"
    assert checkpoint_name("lm_head.weight") == "lm_head.weight"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_xor_round_trip_is_bit_exact(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    old = torch.randn(37, 5).to(dtype)
    new = old.clone()
    new[3:9] += 0.5  # a few rows change
    new[20, 2] = float("nan")  # any bit pattern round-trips
    mask = bits(new) ^ bits(old)
    payload = encode_xor(mask)
    assert len(payload) < mask.numel() * mask.element_size()  # mostly zeros compress
    restored = bits(old.clone()) ^ decode_xor(payload, mask.shape, dtype)
    assert torch.equal(restored, bits(new))


def test_receiver_applies_the_overlap_of_any_layout() -> None:
    full = torch.arange(70.0).view(14, 5)
    recv = WeightReceiver.row_split({"w": torch.zeros(14, 5)}, 1, 3)  # rows 5..9
    assert recv.offsets("w") == (5, 0)
    # a training rank's rows 4..10 of a Shard(0) layout, and a Shard(1) piece: columns 2..4
    assert recv.apply_piece("w", full[4:11], (4, 0)) == 25
    assert torch.equal(recv.weights["w"], full[5:10])
    recv.weights["w"].zero_()
    recv.apply_piece("w", full[:, :2], (0, 0))
    recv.apply_piece("w", full[:, 2:], (0, 2))
    assert torch.equal(recv.weights["w"], full[5:10])
    # a delta XORs only the overlap; a piece outside it writes nothing
    new = full.clone()
    new[6] += 1
    mask = bits(new) ^ bits(full)
    d = DeltaRows("w", full.shape, full.dtype, 0, 0, 14, mask, int(mask.count_nonzero()))
    recv.apply_delta(d)
    assert torch.equal(recv.weights["w"], new[5:10])
    assert recv.apply_piece("w", full[:3], (0, 0)) == 0


def test_receiver_errors_name_the_weight() -> None:
    recv = WeightReceiver({"w": torch.zeros(4, dtype=torch.bfloat16)})
    with pytest.raises(KeyError, match="no weight 'v'"):
        recv.apply_full("v", torch.zeros(4))
    mask = torch.zeros(4, dtype=torch.int32)
    with pytest.raises(ValueError, match=r"delta of 'w' in torch\.float32 cannot apply"):
        recv.apply_xor("w", mask, (0,), torch.float32)


def test_receivers_box_splits_rows_like_torch_chunk() -> None:
    to = Receivers(ranks=(2, 3, 4), split_rows=True)
    shape = torch.Size([7, 2])
    assert [to.box(i, shape) for i in range(3)] == [
        ((0, 0), (3, 2)),
        ((3, 0), (3, 2)),
        ((6, 0), (1, 2)),
    ]
    assert Receivers(ranks=(2,)).box(0, shape) == ((0, 0), (7, 2))


def test_trainer_side_on_two_ranks() -> None:
    from rl_sync_cases import trainer_cases

    results = run_distributed(trainer_cases, 2, timeout=240)
    for rank, res in enumerate(results):
        assert res["oracle_names"] == res["hf_names"], rank  # no wrapper prefixes, tied once
        assert res["wrapped_fqns"][0].startswith("_orig_mod.")
        for label in ("tiny", "one"):
            names = res[f"{label}_names"]  # in bucket order, each once
            assert sorted(names) == sorted(res["hf_names"]) and len(set(names)) == len(names)
            assert res[f"{label}_exact"], (rank, label)
            assert res[f"{label}_dtypes"] == ["torch.bfloat16"]  # cast before the gather
        assert res["tiny_gathers"] == 3  # one per unit: root and two layers
        assert res["one_gathers"] == 1  # the units share one bucket
        assert res["one_bytes"] >= 2 * res["wire_numel"]  # bf16 on the wire, padded
        assert res["one_bytes"] < 2 * res["wire_numel"] * 1.1
        assert res["events"] == [
            "issue",
            "issue",
            "consume root",
            "issue",
            "consume 0",
            "consume 1",
        ]
        assert res["rows_exact"] and res["split_exact"], rank
        assert res["delta_exact"], rank
        assert res["delta_changed"] > 0 and res["second_delta_changed"] == 0
        assert res["delta_bytes"] < res["raw_bytes"]


@pytest.fixture(scope="module")
def sync_ranks() -> list[dict[str, Any]]:
    """Trainers 0-1 and receiver 2 (``rl_sync_cases.sync_world``), one spawn for both tests."""
    from rl_sync_cases import sync_world

    return run_distributed(sync_world, 3, timeout=240)


def test_receiver_rank_gets_full_rows_and_deltas_bit_exact(
    sync_ranks: list[dict[str, Any]],
) -> None:
    trainer0, trainer1, receiver = sync_ranks
    stages = ("full", "rows", "delta 1", "delta 2", "delta 3")
    for i, what in enumerate(stages):
        assert_same(receiver["stages"][i], trainer0["stages"][i], what)
        assert_same(trainer1["stages"][i], trainer0["stages"][i], what)
    assert not all(
        torch.equal(receiver["stages"][2][n], receiver["stages"][4][n])
        for n in receiver["stages"][2]
    )  # the weights did move
    full: Any = trainer0["reports"][0]
    assert full.gathers == 3 and trainer1["reports"][0].bytes_sent == 0  # rank 0 sends
    rows = trainer0["reports"][1].bytes_sent + trainer1["reports"][1].bytes_sent
    deltas = [
        trainer0["reports"][i].bytes_sent + trainer1["reports"][i].bytes_sent for i in (2, 3, 4)
    ]
    assert deltas[0] < rows and deltas[2] < rows, (deltas, rows)  # compressed ones
    assert receiver["reports"][1].bytes_received == rows
    assert all(trainer0["reports"][i].changed > 0 for i in (2, 3, 4))


def test_the_wire_moves_tensors_on_its_backends_device(sync_ranks: list[dict[str, Any]]) -> None:
    """Every tensor handed to send / recv / irecv is on the wire's device (gloo: the CPU), in
    every stage of the 3-rank sync; deltas are compressed by default on gloo, and sent raw
    when asked (bit for bit all the same: the stages of the test above)."""
    ranks = sync_ranks
    for rank, res in enumerate(ranks):
        assert res["wire_device"] == "cpu" and res["wire_tensors"] == ["cpu"], (rank, res)
        assert res["wire_calls"] > 0 and {r.device for r in res["reports"] if r.messages} == {"cpu"}
        assert {r.path for r in res["reports"]} == {"wire"}, rank  # SyncReport says which way
        assert [r.compressed for r in res["reports"][2:]] == [True, False, True], rank
    for i in range(5):  # a raw delta applies as bit for bit as a compressed one
        assert_same(ranks[2]["stages"][i], ranks[0]["stages"][i], f"stage {i}")
    for i in (1, 2, 3, 4):  # rows and deltas: each trainer sends its own half, none relays
        sent = [ranks[r]["reports"][i].bytes_sent for r in (0, 1)]
        assert min(sent) > 0.4 * sum(sent), (i, sent)


@pytest.mark.parametrize(
    ("backend", "want"),
    [
        ("gloo", "cpu"),
        ("cpu:gloo,cuda:gloo", "cpu"),  # gloo's configuration: CUDA staged through the host
        ("nccl", "cuda:1"),
        ("cuda:nccl", "cuda:1"),
        ("cpu:gloo,cuda:nccl", "cuda:1"),  # the accelerator's backend carries the weights
        ("xccl", "xpu:1"),
    ],
)
def test_backend_device(monkeypatch: pytest.MonkeyPatch, backend: str, want: str) -> None:
    monkeypatch.setenv("LOCAL_RANK", "1")  # no accelerator here: LOCAL_RANK picks the index
    monkeypatch.setattr(torch.accelerator, "current_accelerator", lambda *a, **k: None)
    assert backend_device(backend) == torch.device(want)
    if want != "cpu":  # the group's bound device_id, then the current device, win
        kind = torch.device(want).type
        assert backend_device(backend, torch.device(kind, 3)) == torch.device(kind, 3)
        monkeypatch.setattr(
            torch.accelerator, "current_accelerator", lambda *a, **k: torch.device(kind)
        )
        monkeypatch.setattr(torch.accelerator, "current_device_index", lambda: 2)
        assert backend_device(backend) == torch.device(kind, 2)


def test_backend_device_refuses_an_unknown_backend() -> None:
    with pytest.raises(ValueError, match=r"backend 'smoke'.*init the world with 'nccl' or 'gloo'"):
        backend_device("cpu:smoke")


def test_the_wire_allocates_on_the_device_it_is_given(monkeypatch: pytest.MonkeyPatch) -> None:
    """A seam standing for NCCL on a CPU machine: with the wire's device set to ``meta`` (any
    device but the CPU), every tensor send_rows and send_deltas hand to ``dist.send`` lives
    there, and deltas go uncompressed (an accelerator's link: no zlib by default)."""
    from fullshard.rl import ShardDeltas, send_deltas, send_rows, wire

    sent: list[torch.device] = []
    monkeypatch.setattr(wire, "wire_device", lambda group=None: torch.device("meta"))
    monkeypatch.setattr(torch.distributed, "send", lambda t, *a, **k: sent.append(t.device))
    model = torch.nn.Sequential(torch.nn.Linear(6, 4), torch.nn.Linear(4, 2))
    to = Receivers(ranks=(1,))
    rows = send_rows(model, to, dtype=torch.bfloat16)
    deltas = ShardDeltas(model, dtype=torch.bfloat16)
    with torch.no_grad():
        model[0].weight.add_(1.0)
    report = send_deltas(deltas, to)
    assert rows.device == report.device == "meta" and report.changed == 24
    assert not report.compressed
    assert len(sent) == 4 and set(sent) == {torch.device("meta")}, sent


class _HostSyncs(TorchFunctionMode):
    """Counts the calls that read a tensor's values on the host (a device sync on CUDA)."""

    SYNCS = frozenset({"__int__", "__float__", "__bool__", "item", "tolist", "cpu", "numpy"})

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if getattr(func, "__name__", "") in self.SYNCS:
            self.calls.append(func.__name__)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("to_host", [False, True])
def test_shard_deltas_sync_the_host_once(to_host: bool) -> None:
    """One host read per delta, however many weights (it was one per weight), exact counts."""
    from fullshard.rl import ShardDeltas

    model = torch.nn.Sequential(*(torch.nn.Linear(5, 5) for _ in range(4)))  # 8 weights
    deltas = ShardDeltas(model, dtype=torch.bfloat16)
    with torch.no_grad():
        model[1].weight[2].add_(1.0)
    with _HostSyncs() as syncs:
        ds = deltas.delta(to_host=to_host)
    assert syncs.calls == ["tolist"], syncs.calls
    assert [d.changed for d in ds] == [0, 0, 5, 0, 0, 0, 0, 0]
    assert all(d.mask.dtype == torch.int16 and d.mask.shape == d.shape for d in ds)


def test_weight_sync_bench_checks_the_receiver() -> None:
    from fullshard.bench.weight_sync import METHODS, WeightSyncConfig, run, table

    cfg = WeightSyncConfig(n_layer=1, d_model=32, n_head=4, vocab_size=64, repeats=1, lr=1e-3)
    result = run(cfg, timeout=240)
    rows = {r["method"]: r for r in result["rows"]}
    assert list(rows) == list(METHODS)
    assert all(r["weights_equal"] for r in rows.values())
    weights = rows["full_tensor"]["messages"]  # one gather and one message per weight
    assert rows["full_tensor"]["collective_calls"] == weights > 2
    assert rows["publish"]["collective_calls"] == 1  # both units in one bucket
    colocated = rows["colocated"]  # the same gather, one bucket lent through shared memory
    assert colocated["collective_calls"] == 1 and colocated["messages"] == 1
    assert colocated["bytes_to_receiver"] == result["numel"] * 2  # every bf16 weight, once
    assert rows["rows"]["collective_calls"] == 0 and rows["delta"]["changed"] > 0
    assert rows["delta_raw"]["changed"] > 0  # raw masks (NCCL's default), bit for bit too
    assert "| publish |" in table(result)


def test_hsdp_replicas_and_plain_weights_are_sent_once() -> None:
    """Under HSDP both replicas hold the same rows and an ignored weight is whole on every
    rank: each piece is sent by one rank, so the receiver (listing all four trainers) is exact
    after rows and after deltas (an XOR sent twice would undo itself)."""
    from rl_sync_cases import hsdp_sync_world

    *trainers, receiver = run_distributed(hsdp_sync_world, 5, timeout=300)
    for i, what in enumerate(("rows", "delta 1", "delta 2")):
        assert_same(receiver["stages"][i], trainers[0]["stages"][i], what)
    assert not torch.equal(
        receiver["stages"][0]["model.norm.weight"], receiver["stages"][2]["model.norm.weight"]
    )  # the ignored weight moved, and arrived
    sent = [sum(t["reports"][i].bytes_sent for t in trainers) for i in range(3)]
    first = [t["reports"][0].bytes_sent for t in trainers]
    assert first[2] < first[0] and first[3] < first[1], first  # the second replica: end markers
    assert receiver["reports"][0].bytes_received == sent[0]
    assert all(t["reports"][i].changed == 0 for t in trainers[2:] for i in (1, 2))


def test_tensor_parallel_weights_publish_whole() -> None:
    """FSDP + TP: publish gathers TP weights through DTensor (cast first), exact; rows and
    deltas, which need a box of rows per rank, refuse them naming the weight and the fix."""
    from rl_sync_cases import tp_publish_case

    out = run_distributed(tp_publish_case, 4, timeout=300)[0]
    assert "Shard" in out["placements"] and out["names"] and out["exact"], out
    for what in ("rows", "deltas"):
        assert "weight '0.up.weight' is tensor parallel" in out[what], out
        assert "send_full / publish" in out[what]


def test_deltas_come_to_the_host_in_one_packed_copy() -> None:
    """The masks packed behind the counts (what a CUDA delta copies to the host at once) come
    back equal, whatever their widths and sizes (each view needs an aligned start)."""
    from fullshard.rl.delta import _packed_to_host

    masks = [
        torch.arange(7, dtype=torch.int16).view(7, 1),
        torch.arange(3, dtype=torch.int32) - 5,
        torch.tensor(9, dtype=torch.int64),
        torch.arange(5, dtype=torch.uint8),
        torch.arange(6, dtype=torch.int16).view(2, 3),
    ]
    counts = torch.stack([torch.count_nonzero(m) for m in masks])
    changed, host = _packed_to_host(counts, masks)
    assert changed == [6, 3, 1, 4, 5]
    for got, want in zip(host, masks, strict=True):
        assert got.dtype == want.dtype and torch.equal(got, want), (got, want)
