"""One transport decision per unit ([Note: transports] in fullshard.engine.transport): the
unit's ``Transport`` is decided at lazy init and again when a setting it depends on changes
(``ParamGroup._choose_transport``), and every gather and reduction does what it says. A unit
that asked for ``p2p`` but needs one packed buffer in a direction (a custom collective, an
int8 wire) says so in its transport, and the event log shows the same."""

from __future__ import annotations

from typing import Any

import torch

from fullshard import CommPolicy, count_collectives
from fullshard.api import _all_states
from fullshard.engine.events import record_events
from fullshard.testing import run_distributed
from parity import make_net, make_optimizer, shard_net, sharded_step
from test_fsdp2_compat import _CountingAllGather, _CountingReduceScatter

# case -> (CommPolicy kwargs, what each block's transport must say after step 1)
CASES: dict[str, tuple[dict[str, Any], tuple[bool, bool]]] = {
    "p2p": ({}, (True, True)),
    "custom all-gather set after the first step": ({}, (False, True)),
    "custom reduce-scatter set after the first step": ({}, (True, False)),
    "int8 all-gather wire": ({"all_gather_dtype": torch.int8}, (False, True)),
}


def _run() -> dict[str, Any]:
    out: dict[str, Any] = {}
    for case, (policy, _) in CASES.items():
        model = shard_net(make_net(), comm_policy=CommPolicy(transport="p2p", **policy))
        opt = make_optimizer(model)
        sharded_step(model, opt, 0)  # lazy init: the transports are decided
        if case.startswith("custom all-gather"):
            for block in model.blocks:
                block.set_custom_all_gather(_CountingAllGather())  # type: ignore[operator]
        if case.startswith("custom reduce-scatter"):
            for block in model.blocks:
                block.set_custom_reduce_scatter(_CountingReduceScatter())  # type: ignore[operator]
        with record_events() as log, count_collectives():
            sharded_step(model, opt, 1)
        states = {st.name: st for st in _all_states(model)}
        said, did = {}, {}
        for i in range(len(model.blocks)):
            name = f"blocks.{i}"
            t = states[name].group.transport
            said[name] = (t.gathers_in_pieces, t.reduces_in_pieces)
            details = {
                (e.kind, e.detail)
                for e in log
                if e.unit == name and e.kind in ("gather_issue", "reduce_issue")
            }
            did[name] = (
                ("gather_issue", "pieces") in details,
                ("reduce_issue", "pieces") in details,
                ("gather_issue", "packed") in details,
                ("reduce_issue", "packed") in details,
            )
        out[case] = (said, did)
    return out


def test_each_unit_does_what_its_transport_says() -> None:
    for rank_out in run_distributed(_run, 2, timeout=600):
        for case, (said, did) in rank_out.items():
            want = CASES[case][1]
            for unit, flags in said.items():
                assert flags == want, f"{case}: {unit}'s transport says {flags}, want {want}"
                pieces_g, pieces_r, packed_g, packed_r = did[unit]
                # blocks.1's parameters get no gradient in the parity model: no reduction
                assert pieces_g == flags[0] and packed_g == (not flags[0]), (case, unit, did[unit])
                if pieces_r or packed_r:
                    assert pieces_r == flags[1] and packed_r == (not flags[1]), (case, unit)
