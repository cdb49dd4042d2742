"""fullshard.rl colocated sync: trainers hand engine processes whole per-dtype buckets through
IPC (shared memory on the CPU); the engines view them without a copy and load them, bit for bit
against ``full_tensor()`` (the distributed cases live in ``tests/rl_colocated_cases.py``)."""

from __future__ import annotations

import pickle
from typing import Any

import pytest
import torch

from fullshard.rl import (
    BucketMessage,
    SyncReport,
    colocated_buckets,
    publish_colocated,
    receive_colocated,
)
from fullshard.testing import run_distributed
from rl_sync_cases import assert_same

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def world() -> list[dict[str, Any]]:
    """Trainers 0-1, engines 2-3 (``rl_colocated_cases.colocated_world``): one spawn."""
    from rl_colocated_cases import colocated_world

    return run_distributed(colocated_world, 4, timeout=180)


def test_every_trainer_hands_its_engine_the_full_weights(world: list[dict[str, Any]]) -> None:
    """World size 2, every rank its own engine: after each publication (between training
    steps) each engine's bf16 weights equal the trainers' ``full_tensor()``, bit for bit (one
    pair sharing buckets by file descriptor, the other by file name)."""
    trainers, engines = world[:2], world[2:]
    assert [r["strategy"] for r in world] == ["file_descriptor", "file_system"] * 2
    for i in range(2):
        assert_same(trainers[1]["stages"][i], trainers[0]["stages"][i], f"round {i}", ordered=False)
        for e, engine in enumerate(engines):
            assert_same(
                engine["stages"][i],
                trainers[0]["stages"][i],
                f"engine {e} round {i}",
                ordered=False,
            )
    first, second = engines[0]["stages"][:2]
    assert any(not torch.equal(first[n], second[n]) for n in first)  # the weights did move
    for r, (trainer, engine) in enumerate(zip(trainers, engines, strict=True)):
        sent: list[SyncReport] = trainer["reports"]
        assert {s.path for s in sent} == {"colocated"} and all(s.gathers == 3 for s in sent)
        assert all(s.messages > 2 for s in sent), [s.messages for s in sent]  # several buckets
        if r == 1:  # receive_colocated: the buckets and bytes the trainer lent; the callback
            got: list[SyncReport] = engine["reports"]
            assert [g.messages for g in got] == [s.messages for s in sent]
            assert [g.bytes_received for g in got] == [s.bytes_sent for s in sent]
            assert {g.path for g in got} == {"colocated"}
            assert all(sorted(n) == sorted(first) for n in engine["loaded"])


def test_engines_view_the_buckets_without_a_copy(world: list[dict[str, Any]]) -> None:
    """Every view the engine loads lies in its bucket's shared-memory storage, one bf16
    handle per bucket, every weight once per publication."""
    engine = world[2]
    weights = len(engine["stages"][0])
    for checks in engine["checks"][:2]:
        assert checks["copies"] == [] and checks["shared"], checks
        assert checks["views"] == weights and checks["buckets"] > 2, checks
        assert checks["dtypes"] == {"torch.bfloat16"}


def test_a_bucket_is_reused_only_after_the_engine_acknowledged_it(
    world: list[dict[str, Any]],
) -> None:
    """The trainer writes a ring slot again only after the engine's ack of the bucket it held
    (the engine holds each bucket a while before loading it, and saw none change), and waits
    for every ack before it returns."""
    for trainer in world[:2]:
        for events in trainer["events"] + [trainer.get("alone_events", [])][: 1 - trainer["rank"]]:
            reused = [k for kind, k in events if kind == "reuse"]
            assert reused, events
            for k in reused:
                assert events.index(("ack", k)) < events.index(("reuse", k)), events
            sends = sum(kind == "send" for kind, _ in events)
            assert [k for kind, k in events if kind == "ack"] == list(range(sends + 1)), events
    assert world[0]["events"][0].count(("reuse", 0)) == 1
    for checks in world[2]["checks"]:
        assert checks["overwritten"] == [], checks


def test_world_size_one_mixed_dtypes(world: list[dict[str, Any]]) -> None:
    """A one-rank mesh, units in float32 and bfloat16 published in their own dtypes: one
    bucket per dtype at a time (a ring of one), a weight larger than a bucket alone in its own,
    every weight bit for bit in its dtype."""
    trainer, engine = world[0], world[2]
    checks = engine["checks"][2]
    assert_same(engine["stages"][2], trainer["alone_oracle"], "mixed dtypes", ordered=False)
    assert checks["dtypes"] == {"torch.float32", "torch.bfloat16"}, checks
    assert checks["copies"] == [] and checks["overwritten"] == [], checks
    report: SyncReport = trainer["alone_report"]
    assert report.gathers == 0 and report.messages == checks["buckets"] >= 3, report


class _Pipe:
    """A link whose other end is a list of byte strings (the trainer's side, scripted)."""

    def __init__(self, incoming: list[bytes]) -> None:
        self.incoming, self.sent = incoming, []  # type: list[bytes], list[bytes]

    def send_bytes(self, buf: bytes) -> None:
        self.sent.append(buf)

    def recv_bytes(self) -> bytes:
        return self.incoming.pop(0)


def test_bad_input_errors_name_the_fix() -> None:
    model = torch.nn.Linear(2, 2)
    with pytest.raises(ValueError, match=r"buffers \(0\) must be positive"):
        publish_colocated(model, _Pipe([]), buffers=0)
    with pytest.raises(ValueError, match="give a WeightReceiver, a load callback, or both"):
        receive_colocated(_Pipe([]))
    with pytest.raises(TypeError, match="expected a BucketMessage, got dict"):
        next(colocated_buckets(_Pipe([pickle.dumps({"not": "a bucket"})])))
    end = _Pipe([pickle.dumps(BucketMessage(0, torch.uint8, 0, None))])
    assert list(colocated_buckets(end)) == [] and end.sent == [b"ack 0"]
