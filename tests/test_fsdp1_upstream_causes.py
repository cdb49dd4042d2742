"""Causes found by running torch's own FSDP1 tests against fullshard's wrapper
(``scripts/fsdp1_upstream.py``, docs/fsdp1.md), each reproduced here against torch's FSDP1 in
one spawn (gloo, CPU, 2 ranks).

Ignored modules differing across ranks (torch's ``test_diff_ignored_modules_across_ranks``):
a child wrapper ignores rank-dependent modules and its parent is built without them (or with
them, or with the same parameters as ``ignored_states``). FSDP1's parent ignores what its
children ignore; fullshard's parent sharded the child's ignored parameters, a different number
on each rank, and the ranks' all-gathers disagreed (gloo aborts).

Frozen and trainable parameters in one policy target (torch's ``test_frozen_params``): FSDP1
refuses it with ``use_orig_params=False`` and warns with ``True``; fullshard wrapped silently.

``summon_full_params`` between forward and backward (torch's ``test_with_grads_core``): the
root, left unsharded by forward, came out of the block resharded under fullshard, so its
modules showed other parameters (the shards, with the last step's gradients) than before the
block; FSDP1 leaves the root as it found it. And gradients changed inside
``summon_full_params(with_grads=True)`` were dropped; FSDP1 writes them back with ``writeback``.

Optimizer state (torch's ``test_fsdp_optim_state.py``): optimizers listing the parameters in
another order on each rank made the full export's gathers disagree (gloo reset); a rank whose
optimizer lacks a parameter rank 0's has got no error (FSDP1: ``RuntimeError``); the deprecated
``optim_input`` gave no ``FutureWarning``; a state dict without ``param_groups`` raised
``KeyError`` (FSDP1 exports it without them).
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from fsdp1_cases import CPU, ENGINES, full_grads, max_diff
from fullshard.testing import run_distributed


class _Ignored(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(4, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weight


class _Model(nn.Module):
    """torch's test's model: ``rank + 1`` ignored modules in ``layer1``; the other weights are
    the same on every rank (FSDP1's flat shards and fullshard's per-parameter shards of
    rank-dependent weights would assemble different models)."""

    def __init__(self, num_ignored: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layer0 = nn.Linear(3, 5)
        first, second, last = nn.Linear(5, 4), nn.Linear(4, 4), nn.Linear(4, 4)
        self.layer2 = nn.Linear(4, 2)
        self.layer3 = nn.Linear(2, 2)
        ignored = [_Ignored() for _ in range(num_ignored)]
        self.layer1 = nn.Sequential(first, second, *ignored, last)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in (self.layer0, self.layer1, self.layer2, self.layer3):
            x = torch.relu(layer(x))
        return x


def _train(engine: str, to_root: bool, as_states: bool) -> dict[str, Any]:
    fsdp = ENGINES[engine]
    model = _Model(num_ignored=dist.get_rank() + 1)
    mods = [m for m in model.layer1.modules() if isinstance(m, _Ignored)]
    params = [p for m in mods for p in m.parameters()]
    child_kw = {"ignored_states": params} if as_states else {"ignored_modules": mods}
    model.layer1 = fsdp(model.layer1, device_id=CPU, **child_kw)
    model.layer3 = fsdp(model.layer3, device_id=CPU)
    root_kw: dict[str, Any] = {}
    if to_root:
        root_kw = {"ignored_states": params} if as_states else {"ignored_modules": mods}
    root = fsdp(model, device_id=CPU, **root_kw)
    optim = torch.optim.Adam(root.parameters(), lr=1e-2)
    torch.manual_seed(10 + dist.get_rank())
    losses = []
    for _ in range(3):
        loss = root(torch.randn(8, 3)).sum()
        loss.backward()
        optim.step()
        optim.zero_grad()
        losses.append(loss.item())
    return {
        "losses": losses,
        "ignored": [p.detach().clone() for p in params],
        "ignored_plain": [not isinstance(p, DTensor) for p in params],
    }


def _ranks_ignore_different_modules() -> dict[str, Any]:
    out = {}
    for to_root in (False, True):
        for as_states in (False, True):
            for engine in ENGINES:
                out[f"to_root={to_root}/states={as_states}/{engine}"] = _train(
                    engine, to_root, as_states
                )
    return out


def test_ranks_ignoring_different_modules_match_fsdp1() -> None:
    """Each rank's losses and its ignored parameters (left plain, trained locally) after 3
    Adam steps are torch's FSDP1's, whether the parent names the children's ignored modules
    or not."""
    for rank, got in enumerate(run_distributed(_ranks_ignore_different_modules, 2)):
        cases = sorted(k.rsplit("/", 1)[0] for k in got if k.endswith("/fullshard"))
        assert len(cases) == 4, cases
        for case in cases:
            ours, ref = got[f"{case}/fullshard"], got[f"{case}/torch"]
            assert len(ours["ignored"]) == rank + 1
            assert all(ours["ignored_plain"]), (rank, case)
            torch.testing.assert_close(ours["losses"], ref["losses"], msg=f"rank {rank} {case}")
            for a, b in zip(ours["ignored"], ref["ignored"]):
                torch.testing.assert_close(a, b, msg=f"rank {rank} {case}")


class _Lora(nn.Module):
    """A frozen base weight beside a trainable adapter in one block (torch's ``LoraModel``)."""

    def __init__(self) -> None:
        super().__init__()
        self.base = nn.Linear(4, 4)
        self.adapter = nn.Linear(4, 4, bias=False)
        self.base.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + self.adapter(x)


def _frozen_mix_outcome(engine: str, use_orig_params: bool, split: bool) -> str:
    """What ``FSDP(model, auto_wrap_policy=ModuleWrapPolicy(...))`` does with a block that
    mixes frozen and trainable parameters: the error's or the warning's first sentence."""
    import warnings

    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    classes = {_Lora, nn.Linear} if split else {_Lora}
    model = nn.Sequential(nn.Linear(4, 4), _Lora())
    kwargs = {"auto_wrap_policy": ModuleWrapPolicy(classes), "use_orig_params": use_orig_params}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            ENGINES[engine](model, device_id=CPU, **kwargs)
        except ValueError as e:
            return "ValueError: " + str(e).split("\n")[0]
    mixed = [
        str(w.message).split("\n")[0] for w in caught if "requires_grad=True" in str(w.message)
    ]
    return "warning: " + mixed[0] if mixed else "ok"


def _frozen_mix_cases() -> dict[str, str]:
    return {
        f"orig={orig}/split={split}/{engine}": _frozen_mix_outcome(engine, orig, split)
        for orig in (False, True)
        for split in (False, True)
        for engine in ENGINES
    }


def test_frozen_and_trainable_params_in_one_unit_match_fsdp1() -> None:
    """A policy target mixing frozen and trainable parameters: ``ValueError`` with
    ``use_orig_params=False``, a warning with ``True`` (both naming the block and FSDP1's
    sentence), nothing once the frozen layer is a unit of its own: as torch's FSDP1."""
    got = run_distributed(_frozen_mix_cases, 2)[0]
    phrases = {
        "orig=False": "FSDP does not support wrapping such modules when use_orig_params=False.",
        "orig=True": "We do not recommend wrapping such modules",
    }
    for orig, phrase in phrases.items():
        ours, ref = got[f"{orig}/split=False/fullshard"], got[f"{orig}/split=False/torch"]
        kind = "ValueError" if orig == "orig=False" else "warning"
        first = f"{kind}: 1 has both parameters with requires_grad=True and False"
        assert ours.split(". ")[0] == ref.split(". ")[0] == first, (ours, ref)
        assert phrase in ours and phrase in ref, (ours, ref)
    for case in ("orig=False/split=True", "orig=True/split=True"):
        assert got[f"{case}/fullshard"] == got[f"{case}/torch"] == "ok", got


def _shown(model: nn.Module) -> list[tuple[str, tuple[int, ...], bool]]:
    """What a user sees of the parameters: name, shape, whether a gradient is there."""
    return [(n, tuple(p.shape), p.grad is not None) for n, p in model.named_parameters()]


def _summon_mid_step(engine: str) -> dict[str, Any]:
    """Two steps; in the second, ``summon_full_params(with_grads=True)`` between forward and
    backward; what the modules show just before and just after the block."""
    fsdp = ENGINES[engine]
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))
    model[0] = fsdp(model[0], device_id=CPU, use_orig_params=True)
    root = fsdp(model, device_id=CPU, use_orig_params=True)
    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(dist.get_rank()))
    root(x).sum().backward()
    out = root(x)
    before = _shown(root)
    with fsdp.summon_full_params(root, with_grads=True, writeback=False):
        pass
    after = _shown(root)
    out.sum().backward()
    return {"before": before, "after": after, "grads": full_grads(root, fsdp)}


def _summon_mid_step_cases() -> dict[str, Any]:
    return {engine: _summon_mid_step(engine) for engine in ENGINES}


def test_summon_between_forward_and_backward_leaves_root_as_found() -> None:
    """Between forward and backward the root's modules show the same parameters (and
    gradients) after a ``summon_full_params`` block as before it, and backward then gives
    torch's FSDP1 gradients."""
    for got in run_distributed(_summon_mid_step_cases, 2):
        for engine in ENGINES:
            assert got[engine]["after"] == got[engine]["before"], (engine, got[engine])
        assert max_diff(got["fullshard"]["grads"], got["torch"]["grads"]) < 1e-5


def _grads_changed_in_block(engine: str, writeback: bool) -> float:
    """Doubles every full gradient inside ``summon_full_params(with_grads=True)``; the ratio
    of the gradients after the block to those before (2 if written back, 1 if not)."""
    fsdp = ENGINES[engine]
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))
    model[0] = fsdp(model[0], device_id=CPU, use_orig_params=True)
    root = fsdp(model, device_id=CPU, use_orig_params=True)
    root(
        torch.randn(4, 6, generator=torch.Generator().manual_seed(dist.get_rank()))
    ).sum().backward()
    before = full_grads(root, fsdp)
    with fsdp.summon_full_params(root, with_grads=True, writeback=writeback):
        for p in root.parameters():
            p.grad *= 2
    after = full_grads(root, fsdp)
    ratios = {
        round(float((after[k] * before[k]).sum() / before[k].square().sum()), 4) for k in before
    }
    assert len(ratios) == 1, ratios
    return ratios.pop()


def _grads_changed_cases() -> dict[str, float]:
    return {
        f"{engine}/writeback={wb}": _grads_changed_in_block(engine, wb)
        for engine in ENGINES
        for wb in (False, True)
    }


def test_summon_with_grads_writes_gradients_back_as_fsdp1() -> None:
    """Gradients changed inside ``summon_full_params(with_grads=True)`` are kept with
    ``writeback=True`` and dropped with ``False``, as torch's FSDP1."""
    for got in run_distributed(_grads_changed_cases, 2):
        assert got == {
            "torch/writeback=False": 1.0,
            "torch/writeback=True": 2.0,
            "fullshard/writeback=False": 1.0,
            "fullshard/writeback=True": 2.0,
        }, got


def _bn_warning(engine: str) -> list[str]:
    """The warnings of wrapping a model with a BatchNorm under ``MixedPrecision`` and a policy
    that wraps nothing: the BatchNorm becomes a unit of its own, in full precision."""
    import warnings

    from torch.distributed.fsdp import MixedPrecision

    model = nn.Sequential(nn.Linear(2, 4), nn.BatchNorm1d(4), nn.Linear(4, 2))
    mp = MixedPrecision(param_dtype=torch.float16)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        wrapped = ENGINES[engine](
            model, device_id=CPU, mixed_precision=mp, auto_wrap_policy=lambda *a, **k: False
        )
    assert isinstance(wrapped.module[1], ENGINES[engine]), engine
    return [
        f"{w.category.__name__}: separate"
        for w in caught
        if "These modules will be wrapped as separate FSDP" in str(w.message)
    ]


def _bn_warning_cases() -> dict[str, list[str]]:
    return {engine: _bn_warning(engine) for engine in ENGINES}


def test_mixed_precision_batchnorm_unit_warns_as_fsdp1() -> None:
    """Under ``MixedPrecision`` with an ``auto_wrap_policy``, BatchNorm modules become their own
    full-precision units with FSDP1's ``UserWarning`` saying so (torch's ``test_mp_batchnorm``)."""
    got = run_distributed(_bn_warning_cases, 2)[0]
    assert got["fullshard"] == got["torch"] == ["UserWarning: separate"], got


def _layers() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 6), nn.ReLU(), nn.Linear(6, 2))


def _nested(engine: str) -> nn.Module:
    fsdp = ENGINES[engine]
    model = _layers()
    model[2] = fsdp(model[2], device_id=CPU, use_orig_params=True)
    return fsdp(model, device_id=CPU, use_orig_params=True)


def _stepped(model: nn.Module, params: list[Any]) -> torch.optim.Optimizer:
    optim = torch.optim.Adam(params, lr=1e-2)
    torch.manual_seed(1)  # the same batches on every rank: the average is one process's step
    for _ in range(2):
        model(torch.randn(3, 4)).sum().backward()
        optim.step()
        optim.zero_grad()
    return optim


def _plain(osd: dict[str, Any]) -> dict[str, dict[str, torch.Tensor]]:
    """Copies (torch's FSDP1 on the CPU hands back one reused buffer for several states)."""
    return {
        n: {k: torch.as_tensor(v).clone() for k, v in e.items()} for n, e in osd["state"].items()
    }


def _one_process_state() -> dict[str, dict[str, torch.Tensor]]:
    """The oracle: the same layers, groups and batches in one process."""
    model = _layers()
    params = list(model.parameters())
    optim = _stepped(model, [{"params": params[:2]}, {"params": params[2:], "lr": 5e-3}])
    names = {id(p): n for n, p in model.named_parameters()}
    return {names[id(p)]: dict(optim.state[p]) for p in params if p in optim.state}


def _optim_state_causes(engine: str) -> dict[str, Any]:
    fsdp, rank, out = ENGINES[engine], dist.get_rank(), {}
    # two groups, listed in another order on rank 1
    model = _nested(engine)
    params = list(model.parameters())
    groups = [{"params": params[:2]}, {"params": params[2:], "lr": 5e-3}]
    if rank == 1:
        groups = [
            {"params": g["params"][::-1], **{k: v for k, v in g.items() if k != "params"}}
            for g in groups[::-1]
        ]
    full = fsdp.full_optim_state_dict(model, _stepped(model, groups), rank0_only=False)
    out["diff_order"] = _plain(full)
    # rank 1's optimizer lacks the last parameter
    model = _nested(engine)
    params = list(model.parameters())
    optim = _stepped(model, params if rank == 0 else params[:-1])
    try:
        fsdp.full_optim_state_dict(model, optim)
        out["missing"] = "no error"
    except RuntimeError as e:
        out["missing"] = str(e)
    # optim_input: FSDP1's FutureWarning
    model = _nested(engine)
    optim = _stepped(model, list(model.parameters()))
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        fsdp.full_optim_state_dict(model, optim, optim_input=list(model.parameters()))
    out["warned"] = [w.category.__name__ for w in seen if "optim_input" in str(w.message)]
    # no param_groups: exported without them, loaded back with them added
    osd = optim.state_dict()
    groups_before = osd.pop("param_groups")
    exported = fsdp.optim_state_dict(model, optim, optim_state_dict=osd)
    out["exported_groups"] = exported.get("param_groups")
    to_load = fsdp.optim_state_dict_to_load(model, optim, exported)
    to_load["param_groups"] = groups_before
    optim.load_state_dict(to_load)
    out["reloaded"] = _plain(fsdp.optim_state_dict(model, optim))
    return out


def _optim_state_cases() -> dict[str, Any]:
    return {"one": _one_process_state(), **{e: _optim_state_causes(e) for e in ENGINES}}


def test_optimizer_state_edge_cases_match_fsdp1() -> None:
    """A different parameter order on each rank: the full state is one process's (and
    reloads); a rank missing state: FSDP1's ``RuntimeError``; ``optim_input``: FSDP1's
    ``FutureWarning``; a state dict without ``param_groups``: exported without them, as FSDP1."""
    for got in run_distributed(_optim_state_cases, 2):
        mine, theirs, one = got["fullshard"], got["torch"], got["one"]
        assert mine["diff_order"].keys() == one.keys()
        for name, entries in one.items():
            for key, value in entries.items():
                torch.testing.assert_close(mine["diff_order"][name][key], value, msg=name + key)
        assert mine["reloaded"].keys() == theirs["reloaded"].keys()
        # a RuntimeError on every rank naming the parameter (FSDP1's wording varies)
        assert "4.bias" in theirs["missing"] and "4.bias" in mine["missing"], mine["missing"]
        assert "at least the optimizer states needed by rank 0" in mine["missing"]
        assert theirs["warned"] and mine["warned"] == ["FutureWarning"] * len(mine["warned"])
        assert theirs["exported_groups"] is None and mine["exported_groups"] is None
