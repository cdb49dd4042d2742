"""Traps torch FSDP2's users reported in 2026, each run under fullshard and under torch FSDP2
(the same model, data and steps, in one spawn of 4 gloo ranks) and checked against one process
(the oracle); where FSDP2 gets it right, fullshard is also compared with FSDP2 directly.

1. ``head_reuse`` (pytorch/pytorch#183702): ``fully_shard([norm, mtp, head])``, one unit of
   several modules, whose head is called by a multi-token-prediction module and by the main
   path in one forward (either order; the MTP module keeps its logits for the loss to read);
   also a unit whose module returns its input beside its output (``passthrough``).
2. ``muon_empty_shards`` (microsoft/dion#83): Muon on weights whose dim 0 is below the world
   size, (2, 8) and (1, 16) on 4 ranks (ranks with empty shards). fullshard runs
   ``WholeTensor(fullshard.optim.Muon)``; FSDP2's users run Muon on the shards
   (``fullshard.optim.Muon``: ``torch.optim.Muon``'s step, in float32 as the oracle).
3. ``mixed_grad_dtypes`` (pytorch/pytorch#196996): bf16 compute, fp32 reduction, gradient
   accumulation (sync off, then on): a parameter first used on the synced micro-step
   (``fresh``), or never used with ``set_reduce_scatter_unused_params(True)`` (``unused``),
   beside a frozen bf16 parameter in a unit of fp32 ones.
4. ``unfreeze_mixed_precision`` (pytorch/pytorch#186998): a unit frozen for its first forward
   under bf16/fp32 mixed precision, then unfrozen; with fp32 and with bf16 sharded parameters.
5. ``order`` (verl-project/verl#6365): ``named_parameters`` / ``named_buffers`` / ``state_dict``
   order and values on every rank equal to the unwrapped model's (tied embedding and head, a
   unit of several modules, buffers of different sizes), built plainly or on the meta device;
   the buffers are broadcast from rank 0 by that order, as verl loads them.

Every check also records what each engine did; ``pytest -s`` prints it (README's table), and
on the torch releases in ``FSDP2_OUTCOMES`` what FSDP2 does is asserted too.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from fsdp2_trap_cases import CASES, NEEDS, WORLD, run_all, runnable
from fullshard.engine.compat import TORCH_VERSION
from fullshard.testing import run_distributed
from torch_versions import needs_method


@pytest.fixture(scope="module")
def results() -> dict[tuple[str, str, str], dict[str, Any]]:
    # a collective one rank never reaches fails in 2 minutes rather than hanging the spawn
    return run_distributed(run_all, WORLD, timeout=600, pg_timeout=120)[0]


def _diff(got: Any, want: Any, tol: tuple[float, float], where: str = "") -> str | None:
    """Where ``got`` differs from ``want`` (tensors within ``tol``), or ``None``."""
    if isinstance(want, dict):
        if not isinstance(got, dict) or set(got) != set(want):
            return (
                f"{where}: keys {sorted(got) if isinstance(got, dict) else got} vs {sorted(want)}"
            )
        pairs: list[tuple[Any, Any, str]] = [(got[k], want[k], f"{where}.{k}") for k in want]
    elif isinstance(want, list | tuple) and not isinstance(want, str):
        if not isinstance(got, list | tuple) or len(got) != len(want):
            return f"{where}: {got!r} vs {want!r}"
        pairs = [(g, w, f"{where}[{i}]") for i, (g, w) in enumerate(zip(got, want))]
    elif isinstance(want, torch.Tensor):
        try:
            torch.testing.assert_close(got, want, atol=tol[0], rtol=tol[1])
        except AssertionError as e:
            return f"{where}: {str(e).splitlines()[0]} ({str(e).splitlines()[-1].strip()})"
        return None
    elif isinstance(want, float):
        ok = abs(got - want) <= tol[0] + tol[1] * abs(want)
        return None if ok else f"{where}: {got} vs {want}"
    else:
        return None if got == want else f"{where}: {got!r} vs {want!r}"
    return next((d for g, w, at in pairs if (d := _diff(g, w, tol, at)) is not None), None)


def _verdict(result: dict[str, Any], want: Any, tol: tuple[float, float]) -> str:
    """``ok`` (equal to one process), ``raises: ...`` or ``wrong: ...``."""
    if "error" in result:
        return f"raises: {result['error']}"
    if "orders" in result["ok"]:
        return _order_verdict(result["ok"], want)
    d = _diff(result["ok"], want, tol)
    return "ok" if d is None else f"wrong: {d}"


def _order_verdict(got: dict[str, Any], want: dict[str, Any]) -> str:
    """Every rank's order (built, and after a step) is the unwrapped model's; the values
    (parameters where initialised, buffers always) are its too."""
    ranks = got["orders"] + got["after_step"]
    bad = sorted({i % WORLD for i, o in enumerate(ranks) if o != want["order"]})
    if bad:
        return f"wrong: the order on rank(s) {bad} is not the unwrapped model's"
    keys = ["buffers"] + (["values"] if want["values"] is not None else [])
    d = _diff({k: got[k] for k in keys}, {k: want[k] for k in keys}, (0.0, 0.0))
    return "ok" if d is None else f"wrong: {d}"


# What torch FSDP2 does, per torch release (``pytest -s`` prints it): "ok" equal to one
# process, "raises" or "wrong". Asserted where the installed torch is listed.
FSDP2_OUTCOMES: dict[tuple[int, int], dict[tuple[str, str], str]] = {
    (2, 9): {
        ("head_reuse", "mtp_first"): "ok",
        ("head_reuse", "head_first"): "raises",  # setStorage
        ("head_reuse", "passthrough"): "ok",
        ("muon_empty_shards", "(2, 8) and (1, 16) on 4 ranks"): "ok",  # 2.9's DTensor add_
        ("mixed_grad_dtypes", "fresh"): "raises",  # (no set_reduce_scatter_unused_params)
        ("unfreeze_mixed_precision", "fp32 params"): "raises",
        ("unfreeze_mixed_precision", "bf16 params"): "wrong",
        ("order", "plain init"): "ok",
        ("order", "meta init"): "ok",
    },
    (2, 13): {
        ("head_reuse", "mtp_first"): "ok",
        ("head_reuse", "head_first"): "raises",  # setStorage: the head's storage was freed
        ("head_reuse", "passthrough"): "ok",
        ("muon_empty_shards", "(2, 8) and (1, 16) on 4 ranks"): "raises",  # add_ placement
        ("mixed_grad_dtypes", "fresh"): "raises",  # uniform gradient dtype assertion
        ("mixed_grad_dtypes", "unused"): "raises",
        ("unfreeze_mixed_precision", "fp32 params"): "raises",  # bf16 gradient, fp32 param
        ("unfreeze_mixed_precision", "bf16 params"): "wrong",  # reduced in bf16
        ("order", "plain init"): "ok",
        ("order", "meta init"): "ok",
    },
    (2, 15): {
        ("head_reuse", "mtp_first"): "ok",
        ("head_reuse", "head_first"): "raises",  # setStorage, as 2.13
        ("head_reuse", "passthrough"): "ok",
        ("muon_empty_shards", "(2, 8) and (1, 16) on 4 ranks"): "raises",  # as 2.13
        ("mixed_grad_dtypes", "fresh"): "ok",  # fixed since 2.13
        ("mixed_grad_dtypes", "unused"): "ok",
        ("unfreeze_mixed_precision", "fp32 params"): "ok",
        ("unfreeze_mixed_precision", "bf16 params"): "ok",
        ("order", "plain init"): "ok",
        ("order", "meta init"): "ok",
    },
}


def _cases() -> list[Any]:
    """The cases, each skipped (naming the method) where the installed torch lacks what it
    calls."""
    return [
        pytest.param(
            t, c, id=f"{t}-{c}", marks=[needs_method(NEEDS[(t, c)])] if (t, c) in NEEDS else []
        )
        for t, c in CASES
    ]


@pytest.mark.parametrize(("trap", "case"), _cases())
def test_fullshard_avoids_the_trap(trap: str, case: str, results) -> None:
    _, oracle, tol = CASES[(trap, case)]
    want = oracle()
    ours, theirs = results[(trap, case, "fullshard")], results[(trap, case, "fsdp2")]
    verdict = _verdict(ours, want, tol)
    assert verdict == "ok", f"{trap} ({case}): fullshard {verdict}"
    if _verdict(theirs, want, tol) == "ok" and "orders" not in ours["ok"]:
        d = _diff(ours["ok"], theirs["ok"], tol)  # and FSDP2, where it gets it right
        assert d is None, f"{trap} ({case}): fullshard vs FSDP2 {d}"


def test_fsdp2_outcomes(results) -> None:
    """What torch FSDP2 did in each case (printed; asserted on the releases listed)."""
    rows = []
    for (trap, case), (_, oracle, tol) in CASES.items():
        if not runnable(trap, case):
            rows.append((trap, case, f"not run: no {NEEDS[(trap, case)]}", "not run"))
            continue
        want = oracle()
        theirs = _verdict(results[(trap, case, "fsdp2")], want, tol)
        ours = _verdict(results[(trap, case, "fullshard")], want, tol)
        rows.append((trap, case, theirs, ours))
    print(f"\ntorch {torch.__version__}: trap | case | torch FSDP2 | fullshard")
    for row in rows:
        print(" | ".join(row))
    expected = FSDP2_OUTCOMES.get(TORCH_VERSION)
    if expected is None:
        return
    got = {(t, c): v.split(":")[0] for t, c, v, _ in rows if not v.startswith("not run")}
    assert got == expected, got
