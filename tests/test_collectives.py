"""Every all-gather / reduce-scatter algorithm gives the collective's exact answer.

One 4-rank spawn checks each algorithm (the backend's collective, the reduce-scatter as an
all-reduce, and the point-to-point exchange of [Note: p2p on gloo]) on the world group and on
2-rank subgroups (whose group ranks differ from global ranks), several exchanges in flight at
once and waited out of order, a bf16 buffer, and which algorithm ``"auto"`` picks on gloo.
Values are small integers, so every summation order gives the same bits.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from fullshard.engine import collectives as C
from fullshard.engine import p2p
from fullshard.engine.backend import P2P_MIN_BYTES, P2P_SMALL_BYTES
from fullshard.testing import run_distributed

N = 1000  # elements per rank's chunk
_P2P_AG, _P2P_RS = p2p.P2PAllGather(algorithm="p2p"), p2p.P2PReduceScatter(algorithm="p2p")


def _chunk(global_rank: int, tag: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """What ``global_rank`` contributes: distinct small integers per rank and per call."""
    return (torch.arange(N) % 7 + 10 * global_rank + 100 * tag).to(dtype)


def _full(global_rank: int, size: int, tag: int) -> torch.Tensor:
    """A reduce-scatter input: ``size`` rows, row ``r`` scaled by ``r + 1``."""
    return torch.cat([_chunk(global_rank, tag) * (r + 1) for r in range(size)])


def _check_group(group: dist.ProcessGroup, members: list[int], tag: int) -> list[str]:
    me, size = dist.get_rank(), len(members)
    gr = dist.get_rank(group)
    done = []
    for algo in ("all_gather", "p2p", "auto"):
        for in_place in (True, False):
            out = torch.full((size * N,), -1.0)
            inp = out.view(size, N)[gr] if in_place else torch.empty(N)
            inp.copy_(_chunk(me, tag))
            C.all_gather(out, inp, group, comm=p2p.P2PAllGather(algorithm=algo)).wait()
            want = torch.cat([_chunk(g, tag) for g in members])
            assert torch.equal(out, want), (algo, in_place, members)
            done.append(f"ag:{algo}:{size}")
    for algo in ("reduce_scatter", "all_reduce", "p2p", "auto"):
        inp, out = _full(me, size, tag), torch.full((N,), -1.0)
        C.reduce_scatter(out, inp, group, comm=p2p.P2PReduceScatter(algorithm=algo)).wait()
        want = sum(_chunk(g, tag) for g in members) * (gr + 1)
        assert torch.equal(out, want), (algo, members)
        done.append(f"rs:{algo}:{size}")
    return done


def _concurrent(group: dist.ProcessGroup, members: list[int]) -> None:
    """Three gathers and two reductions in flight together, waited in reverse order."""
    me, size, gr = dist.get_rank(), len(members), dist.get_rank(group)
    gathers, reduces = [], []
    for tag in range(3):
        out = torch.empty(size * N)
        inp = out.view(size, N)[gr]
        inp.copy_(_chunk(me, tag))
        gathers.append((C.all_gather(out, inp, group, comm=_P2P_AG), out, tag))
        if tag < 2:
            rs_out = torch.empty(N)
            h = C.reduce_scatter(rs_out, _full(me, size, tag), group, comm=_P2P_RS)
            reduces.append((h, rs_out, tag))
    for h, _, _ in reversed(gathers + reduces):
        h.wait()
    for _, out, tag in gathers:
        assert torch.equal(out, torch.cat([_chunk(g, tag) for g in members]))
    for _, out, tag in reduces:
        assert torch.equal(out, sum(_chunk(g, tag) for g in members) * (gr + 1))


SIZES = [5, 0, 3, 1000]  # elements per piece (one empty), the same on every rank


def _pieces(group: dist.ProcessGroup, members: list[int], tag: int) -> None:
    """all_gather_pieces / reduce_scatter_pieces: uneven and empty pieces, two of each in flight
    at once next to a packed p2p gather, waited out of order."""
    me, size, gr = dist.get_rank(), len(members), dist.get_rank(group)
    nbytes = size * sum(SIZES) * 4

    def piece(g: int, k: int, t: int) -> torch.Tensor:
        return _chunk(g, t)[: SIZES[k]] + k

    handles, gathered, reduced = [], [], []
    for t in (tag, tag + 1):
        bufs = [[torch.full((n,), -1.0) for n in SIZES] for _ in range(size)]
        for k in range(len(SIZES)):
            bufs[gr][k].copy_(piece(me, k, t))
        handles.append(p2p.all_gather_pieces(bufs, group, nbytes=nbytes))
        gathered.append((bufs, t))
        contrib = [[piece(me, k, t) * (r + 1) for k in range(len(SIZES))] for r in range(size)]
        outs = [torch.full((n,), -1.0) for n in SIZES]
        handles.append(p2p.reduce_scatter_pieces(contrib, outs, group, nbytes=nbytes))
        reduced.append((outs, t))
    packed = torch.empty(size * N)
    packed.view(size, N)[gr].copy_(_chunk(me, tag))
    handles.append(C.all_gather(packed, packed.view(size, N)[gr], group, comm=_P2P_AG))
    for h in reversed(handles):
        h.wait()
    assert torch.equal(packed, torch.cat([_chunk(g, tag) for g in members]))
    for bufs, t in gathered:
        for r, g in enumerate(members):
            for k in range(len(SIZES)):
                assert torch.equal(bufs[r][k], piece(g, k, t)), (r, k, members)
    for outs, t in reduced:
        for k in range(len(SIZES)):
            want = sum(piece(g, k, t) for g in members) * (gr + 1)
            assert torch.equal(outs[k], want), (k, members)


def _stress(group: dist.ProcessGroup, members: list[int]) -> None:
    """Many small exchanges of unequal pieces back to back, three in flight at a time: pieces
    sharing a tag can be matched out of order by gloo (a 96-byte message into a 16-byte
    receive), so each needs its own."""
    me, size, gr = dist.get_rank(), len(members), dist.get_rank(group)
    sizes = [24, 4, 18, 3, 6]
    inflight: list[tuple[C.Handle, list[list[torch.Tensor]], int]] = []
    for it in range(150):
        bufs = [[torch.empty(n) for n in sizes] for _ in range(size)]
        for k in range(len(sizes)):
            bufs[gr][k].fill_(1000 * it + 10 * me + k)
        inflight.append((p2p.all_gather_pieces(bufs, group, nbytes=0), bufs, it))
        if len(inflight) == 3:
            h, bufs, i = inflight.pop(0)
            h.wait()
            for r, g in enumerate(members):
                for k, n in enumerate(sizes):
                    assert torch.equal(bufs[r][k], torch.full((n,), 1000.0 * i + 10 * g + k))
    for h, _, _ in inflight:
        h.wait()


def _grouped(group: dist.ProcessGroup, members: list[int]) -> None:
    """The exchange as one batch (what CUDA tensors take, for NCCL), run here on gloo: every
    rank sends each peer two tensors (one empty) and gets the peer's, group ranks mapped to
    global ones."""
    me, gr, size = dist.get_rank(), dist.get_rank(group), len(members)
    sends = [[_chunk(me, 7 + r), torch.empty(0)] for r in range(size)]
    recvs = [[torch.full((N,), -1.0), torch.empty(0)] for _ in range(size)]
    for work in p2p._exchange_grouped(sends, recvs, group, base=0):
        work.wait()
    for r, got in enumerate(recvs):
        if r != gr:
            assert torch.equal(got[0], _chunk(members[r], 7 + gr)), (members, r)


def _rank_main() -> dict[str, object]:
    me = dist.get_rank()
    world = dist.group.WORLD
    assert world is not None
    evens, odds = dist.new_group([0, 2]), dist.new_group([1, 3])
    pair, members = (evens, [0, 2]) if me % 2 == 0 else (odds, [1, 3])
    done = _check_group(world, [0, 1, 2, 3], tag=1) + _check_group(pair, members, tag=2)
    _concurrent(world, [0, 1, 2, 3])
    _concurrent(pair, members)
    _pieces(world, [0, 1, 2, 3], tag=3)
    _pieces(pair, members, tag=5)
    _stress(world, [0, 1, 2, 3])
    _stress(pair, members)
    done.append("pieces")
    for group, ranks in ((world, [0, 1, 2, 3]), (pair, members)):
        _grouped(group, ranks)
    done.append("grouped")
    # synchronous calls (torch's protocol: done when they return, no work to wait on)
    for comm in (_P2P_AG, p2p.P2PAllGather(algorithm="all_gather")):
        out = torch.full((4 * N,), -1.0)
        assert comm(out, _chunk(me, 9), world, async_op=False) is None
        assert torch.equal(out, torch.cat([_chunk(g, 9) for g in range(4)]))
    for algo in ("p2p", "all_reduce", "reduce_scatter"):
        rs_out = torch.full((N,), -1.0)
        rs = p2p.P2PReduceScatter(algorithm=algo)
        assert rs(rs_out, _full(me, 4, 9), world, async_op=False) is None
        assert torch.equal(rs_out, sum(_chunk(g, 9) for g in range(4)) * (me + 1)), algo
    done.append("sync")
    # bf16 through the exchange (values stay exact in bf16)
    out = torch.empty(4 * N, dtype=torch.bfloat16)
    C.all_gather(out, _chunk(me, 0, torch.bfloat16), world, comm=_P2P_AG).wait()
    assert torch.equal(out, torch.cat([_chunk(g, 0, torch.bfloat16) for g in range(4)]))
    # what "auto" picks on gloo, as recorded
    big = P2P_MIN_BYTES // 4 // 2  # fp32 elements per rank: a full buffer of >= P2P_MIN_BYTES
    mid = P2P_SMALL_BYTES // 4  # 2 ranks: a full buffer of 2 x P2P_SMALL_BYTES, between both
    with C.count_collectives() as stats:
        for group, size in ((world, 4), (pair, 2)):
            for n in (N, mid, big):
                ag, rs = p2p.P2PAllGather(), p2p.P2PReduceScatter()  # the group's plan
                C.all_gather(torch.empty(size * n), torch.zeros(n), group, comm=ag).wait()
                C.reduce_scatter(torch.empty(n), torch.zeros(size * n), group, comm=rs).wait()
    picked = [(r.kind, r.group_size, r.algorithm) for r in stats.records]
    bad = "no error"
    try:
        p2p.P2PAllGather(algorithm="ring")
    except ValueError as e:
        bad = str(e)
    return {"done": done, "picked": picked, "bad": bad}


@pytest.fixture(scope="module")
def results() -> list[dict[str, object]]:
    return run_distributed(_rank_main, 4, timeout=240)


def test_every_algorithm_matches_the_collective(results: list[dict[str, object]]) -> None:
    done = results[0]["done"]
    assert isinstance(done, list)
    for kind, algos in (
        ("ag", ("all_gather", "p2p", "auto")),
        ("rs", ("reduce_scatter", "all_reduce", "p2p", "auto")),
    ):
        for algo in algos:
            for size in (4, 2):
                assert f"{kind}:{algo}:{size}" in done
    assert "pieces" in done and "grouped" in done and "sync" in done


def test_auto_picks_p2p_where_it_is_faster_and_free(results: list[dict[str, object]]) -> None:
    # 4 ranks: gloo's all-gather and the in-place all-reduce below P2P_MIN_BYTES, the p2p
    # all-gather above it. 2 ranks: p2p for small buffers (one round trip, not gloo's) and
    # large ones, gloo's collectives between (see backend.P2P_SMALL_BYTES)
    assert results[0]["picked"] == [
        ("all_gather", 4, "all_gather"),
        ("reduce_scatter", 4, "all_reduce"),
        ("all_gather", 4, "all_gather"),
        ("reduce_scatter", 4, "all_reduce"),
        ("all_gather", 4, "p2p"),
        ("reduce_scatter", 4, "all_reduce"),  # p2p would need 2 chunks of scratch
        ("all_gather", 2, "p2p"),
        ("reduce_scatter", 2, "p2p"),
        ("all_gather", 2, "all_gather"),
        ("reduce_scatter", 2, "all_reduce"),
        ("all_gather", 2, "p2p"),
        ("reduce_scatter", 2, "p2p"),
    ]


def test_unknown_algorithm_is_named(results: list[dict[str, object]]) -> None:
    assert "'ring'" in str(results[0]["bad"])
