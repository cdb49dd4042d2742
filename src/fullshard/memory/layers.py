"""Trace three blocks, plan them all: how the planner scales to 100+-layer models.

[Note: tracing three blocks]
A fake-tensor step costs the same per op whatever the tensors' sizes, so its time grows with
the number of blocks, not their width (32 Llama 3.1 8B blocks at 2 x 8192 tokens: ~57 s on
this 2-core VM; 126 blocks of 405B would be minutes). The blocks of a decoder are identical,
so the planner traces a copy of the model with ``TRACED_BLOCKS`` = 3 of them -- the first (it
follows the embedding), a middle one, the last (the final norm and head follow it) -- and
:func:`expand` rebuilds the step of all ``L``: block ``j`` of ``1 .. L-2`` repeats the middle
block's segments, each with the live bytes shifted by ``(j - 1)`` times what one block keeps
for backward (the middle block's forward growth), and the last block and everything after it
by ``L - 3`` times that. Units (shapes) repeat the same way. Exact for identical blocks
(checked against a full trace in ``tests/test_plan_cluster.py``); a model whose blocks differ
(per-layer ``layer_types`` of different shapes, mixtures of dense and MoE layers) should be
planned with ``max_traced_blocks=0`` (trace every block).
"""

from __future__ import annotations

import copy
import dataclasses
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from fullshard.memory.spec import Segment, Unit

__all__ = ["TRACED_BLOCKS", "block_count", "expand", "with_blocks"]

TRACED_BLOCKS = 3


def block_count(model_cfg: Any, hf_cfg: Any) -> int | None:
    """The number of repeated blocks the config declares (``None`` when unknown)."""
    if model_cfg is not None:
        return int(model_cfg.n_layer)
    for name in ("num_hidden_layers", "n_layer", "num_layers"):
        n = getattr(hf_cfg, name, None)
        if isinstance(n, int):
            return n
    return None


def with_blocks(model_cfg: Any, hf_cfg: Any, n: int) -> tuple[Any, Any]:
    """Copies of the configs with ``n`` blocks."""
    if model_cfg is not None:
        return dataclasses.replace(model_cfg, n_layer=n), None
    cfg = copy.deepcopy(hf_cfg)
    for name in ("num_hidden_layers", "n_layer", "num_layers"):
        if isinstance(getattr(cfg, name, None), int):
            setattr(cfg, name, n)
    types = getattr(cfg, "layer_types", None)
    if isinstance(types, list):
        cfg.layer_types = types[:n]
    return None, cfg


def _groups(
    segments: list[Segment],
) -> tuple[list[Segment], dict[tuple[str, int], list[Segment]], list[Segment]]:
    """(prefix, {(phase, traced block): its segments}, middle); backward groups follow the
    middle in the step."""
    prefix: list[Segment] = []
    middle: list[Segment] = []
    groups: dict[tuple[str, int], list[Segment]] = {}
    cur: list[Segment] | None = None
    for s in segments:
        if s.unit > 0:
            cur = groups.setdefault((s.phase, s.unit), [])
        elif s.unit < 0 or (
            s.phase == "backward" and cur is not None and cur[0].phase == "forward"
        ):
            cur = middle
        elif cur is None:
            cur = prefix
        cur.append(s)
    return prefix, groups, middle


def _shift(s: Segment, k: int, d: int, dh: int, unit: int | None, label: str | None) -> Segment:
    out = dataclasses.replace(
        s,
        start=s.start + k * d,
        peak=s.peak + k * d,
        reduce_at=None if s.reduce_at is None else s.reduce_at + k * d,
        start_hidden=s.start_hidden + k * dh,
        peak_hidden=s.peak_hidden + k * dh,
        reduce_hidden=s.reduce_hidden + k * dh,
    )
    if unit is not None:
        out.after = unit
        if s.unit > 0:
            out.unit = unit
            out.label = label or s.label
    return out


def expand(
    units: list[Unit], segments: list[Segment], n_blocks: int
) -> tuple[list[Unit], list[Segment]]:
    """The units and segments of ``n_blocks`` blocks from a trace of :data:`TRACED_BLOCKS`."""
    t = TRACED_BLOCKS
    if len(units) != t + 1 or n_blocks <= t:
        raise ValueError(f"expand needs a trace of {t} blocks and n_blocks > {t}")
    prefix, groups, middle = _groups(segments)
    fwd1, fwd2 = groups[("forward", 2)][0], groups[("forward", 3)][0]
    d, dh = fwd2.start - fwd1.start, fwd2.start_hidden - fwd1.start_hidden
    base = units[1].name.rsplit(".", 1)[0]
    names = [f"{base}.{j}" for j in range(n_blocks)]
    new_units = [units[0]] + [
        dataclasses.replace(units[1 if j == 0 else (t if j == n_blocks - 1 else 2)], name=names[j])
        for j in range(n_blocks)
    ]

    def traced(j: int) -> tuple[int, int]:  # (traced unit, shift in blocks)
        if j == 0:
            return 1, 0
        if j == n_blocks - 1:
            return t, n_blocks - t
        return 2, j - 1

    out = list(prefix)
    for phase, order in (("forward", range(n_blocks)), ("backward", range(n_blocks - 1, -1, -1))):
        for j in order:
            k, shift = traced(j)
            label = f"{phase} {names[j]}"
            out += [_shift(s, shift, d, dh, j + 1, label) for s in groups[(phase, k)]]
        if phase == "forward":
            out += [
                _shift(s, n_blocks - t, d, dh, n_blocks if s.after == t else s.after, None)
                for s in middle
            ]
    return new_units, out
