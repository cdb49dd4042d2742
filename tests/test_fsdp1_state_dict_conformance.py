"""fullshard's ``FullyShardedDataParallel`` state dicts against torch's FSDP1 where torch's own
FSDP1 tests (``test_fsdp_state_dict.py``) check details: models under activation-checkpoint
wrappers, ignored modules and states, ``LOCAL_STATE_DICT``'s ``_flat_param`` entries, and the
missing / unexpected keys ``load_state_dict`` reports.

One spawn (gloo, CPU, 2 ranks) runs every case under both engines (torch's FSDP1 with
``device_id=torch.device("cpu")``); each test reads its part of the results. Values are
compared bit for bit, storage sharing by ``data_ptr()`` as torch's tests do.
"""

from __future__ import annotations

import io
import traceback
from collections.abc import Callable
from functools import partial
from itertools import product
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._state_dict_utils import _gather_state_dict
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    CheckpointImpl,
    apply_activation_checkpointing,
    checkpoint_wrapper,
)
from torch.distributed.fsdp import (
    FullStateDictConfig,
    MixedPrecision,
    ShardingStrategy,
    StateDictType,
)

from fsdp1_cases import BF16, CPU, ENGINES, full_state, local_shard, make_net, train, wrap
from fullshard.fsdp1 import FullyShardedDataParallel as OurFSDP
from fullshard.testing import run_distributed

TYPES = FULL, SHARDED, LOCAL = (
    StateDictType.FULL_STATE_DICT,
    StateDictType.SHARDED_STATE_DICT,
    StateDictType.LOCAL_STATE_DICT,
)
FP16 = MixedPrecision(
    param_dtype=torch.float16, reduce_dtype=torch.float16, buffer_dtype=torch.float16
)
AC_MODES = ("source", "dest", "both", "source_after_wrap", "both_after_wrap")


def _describe(value: Any) -> Any:
    """A state-dict value as plain, picklable data: ``ShardedTensor`` -> its size and local
    pieces (offsets, tensor); ``DTensor`` -> its local piece; a tensor -> a copy."""
    if callable(getattr(value, "local_shards", None)):
        pieces = [(tuple(s.metadata.shard_offsets), s.tensor.clone()) for s in value.local_shards()]
        return ("ShardedTensor", tuple(value.size()), pieces)
    if hasattr(value, "to_local"):
        return ("DTensor", tuple(value.shape), value.to_local().clone())
    return ("Tensor", tuple(value.shape), value.detach().clone())


def _state_dict(engine: str, model: nn.Module, kind: StateDictType, **kw: Any) -> Any:
    with ENGINES[engine].state_dict_type(model, kind):
        return model.state_dict(**kw)


def _load(engine: str, model: nn.Module, kind: StateDictType, sd: Any, strict: bool = True) -> Any:
    with ENGINES[engine].state_dict_type(model, kind):
        return model.load_state_dict(sd, strict=strict)


# ------------------------------------------------------------- activation checkpointing
def _ac_simple(engine: str, ac: bool, seed: int) -> nn.Module:
    """torch's test's ``_get_simple_model``: ``FSDP(checkpoint_wrapper(lin))``."""
    torch.manual_seed(seed)
    lin: nn.Module = nn.Linear(10, 10, bias=False)
    return ENGINES[engine](checkpoint_wrapper(lin) if ac else lin, device_id=CPU)  # type: ignore[no-any-return]


def _ac_nested(engine: str, ac: bool, seed: int) -> nn.Module:
    """torch's test's ``_get_simple_nested_model``: a wrapper around a sequential of a nested
    wrapper and a linear, each maybe under ``checkpoint_wrapper``."""
    torch.manual_seed(seed)
    cls = ENGINES[engine]
    lin1: nn.Module = nn.Linear(10, 10, bias=False)
    lin2: nn.Module = nn.Linear(10, 10, bias=False)
    if ac:
        lin1, lin2 = checkpoint_wrapper(lin1), checkpoint_wrapper(lin2)
    seq: nn.Module = nn.Sequential(cls(lin1, device_id=CPU), lin2)
    return cls(checkpoint_wrapper(seq) if ac else seq, device_id=CPU)  # type: ignore[no-any-return]


def _ac_after_wrap(model: nn.Module) -> None:
    """``apply_activation_checkpointing`` on the linears of a wrapped model."""
    wrapper = partial(checkpoint_wrapper, checkpoint_impl=CheckpointImpl.NO_REENTRANT)
    apply_activation_checkpointing(
        model, checkpoint_wrapper_fn=wrapper, check_fn=lambda m: isinstance(m, nn.Linear)
    )


def _ac_case(engine: str, build: Callable[..., nn.Module], mode: str, kind: Any) -> Any:
    """torch's ``test_fsdp_state_dict_with_activation_checkpoint``: save from the source,
    load (strict) into a destination built from another seed: gathered (full tensors) under
    the destination's default type, as torch's test does, and, for fullshard, as saved (torch's
    FSDP1 loads its ``ShardedTensor`` only on GPUs) and saved on rank 0 only, offloaded, then
    broadcast (torch's test's ``rank0_only_and_offload``)."""
    source = build(engine, mode in ("source", "both"), seed=0)
    if mode in ("source_after_wrap", "both_after_wrap"):
        _ac_after_wrap(source)
    saved = _state_dict(engine, source, kind)
    out: dict[str, Any] = {"keys": list(saved)}
    forms = {"gathered": (FULL, _gather_state_dict(saved))}
    if engine == "fullshard":
        forms["as_saved"] = (kind, saved)
        if kind is FULL:  # torch's FSDP1 crashes offloading on a CPU
            config = FullStateDictConfig(rank0_only=True, offload_to_cpu=True)
            with OurFSDP.state_dict_type(source, FULL, config):
                rank0 = [source.state_dict()]
            dist.broadcast_object_list(rank0, src=0)
            forms["rank0_offload"] = (FULL, rank0[0])
    for form, (load_kind, sd) in forms.items():
        dest = build(engine, mode in ("dest", "both"), seed=1)
        if mode == "both_after_wrap":
            _ac_after_wrap(dest)
        _load(engine, dest, load_kind, sd)
        out[form] = full_state(dest, ENGINES[engine])
    out["source"] = full_state(source, ENGINES[engine])
    return out


# ----------------------------------------------------------------------- ignored modules
class IgnoringModel(nn.Module):
    """torch's test's ``Model``: ``inner`` (a wrapper, maybe ignoring its own module) and
    ``outer``, each with a buffer and a non-persistent one."""

    def __init__(self, engine: str, ignore_inner: bool, mp: bool, states: bool, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.inner = nn.Linear(4, 4)
        self.inner.buffer = nn.Buffer(torch.randn(5, 5))
        self.inner.register_buffer("np_buffer", torch.randn(5, 5), persistent=False)
        ignore: dict[str, Any] = {}
        if ignore_inner:
            own = list(self.inner.parameters()) if states else [self.inner]
            ignore = {"ignored_states" if states else "ignored_modules": own}
        self.inner = ENGINES[engine](
            self.inner, mixed_precision=FP16 if mp else None, device_id=CPU, **ignore
        )
        self.outer = nn.Linear(4, 5)
        self.outer.buffer = nn.Buffer(torch.randn(5, 5))
        self.outer.register_buffer("np_buffer", torch.randn(5, 5), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.outer(self.inner(x) + self.inner(x))  # type: ignore[no-any-return]


def _ignoring(engine: str, ignore_inner: bool, mp: bool, states: bool, seed: int) -> nn.Module:
    """An ``IgnoringModel`` wrapped, ignoring ``outer`` (its module, or its parameters)."""
    model = IgnoringModel(engine, ignore_inner, mp, states, seed)
    outer = list(model.outer.parameters()) if states else [model.outer]
    ignore = {"ignored_states" if states else "ignored_modules": outer}
    return ENGINES[engine](model, mixed_precision=FP16 if mp else None, device_id=CPU, **ignore)  # type: ignore[no-any-return]


def _ignored_case(engine: str, ignore_inner: bool, mp: bool, states: bool, kind: Any) -> Any:
    """torch's ``test_state_dict_with_ignored_modules`` (``states``: ``ignored_states``
    instead), every state-dict type: each entry described, whether it shares the module's
    tensor's storage, and the load of the state dict into a model from another seed."""
    wrapped = _ignoring(engine, ignore_inner, mp, states, seed=0)
    inner, outer = wrapped.module.inner, wrapped.module.outer
    tensors = {"outer.weight": outer.weight, "outer.bias": outer.bias}
    tensors |= {"outer.buffer": outer.buffer, "inner.buffer": inner.buffer}
    if ignore_inner:
        tensors |= {"inner.weight": inner.weight, "inner.bias": inner.bias}
    sd = _state_dict(engine, wrapped, kind, prefix="foo.")
    out = {
        "entries": {k: (*_describe(v), v.dtype) for k, v in sd.items()},
        "shares": {k: t.data_ptr() == sd[f"foo.{k}"].data_ptr() for k, t in tensors.items()},
    }
    fresh = _ignoring(engine, ignore_inner, mp, states, seed=1)
    out["load"] = _load(engine, fresh, kind, {k[4:]: v for k, v in sd.items()})
    source, loaded = (full_state(m, ENGINES[engine]) for m in (wrapped, fresh))
    out["reloaded"] = all(torch.equal(source[k], loaded[k]) for k in source)
    return out


# ------------------------------------------------------------------------- LOCAL_STATE_DICT
def _local_case(engine: str, uop: bool, mp: Any) -> tuple[Any, Any, Any]:
    """The fsdp1_cases model after one step: its LOCAL_STATE_DICT as is, described, and its
    full state dict."""
    model = wrap(engine, use_orig_params=uop, mixed_precision=mp)
    train(model, 1)
    sd = _state_dict(engine, model, LOCAL)
    return sd, {k: _describe(v) for k, v in sd.items()}, full_state(model)


def _local_loads(uop: bool, mp: Any, saved: dict[str, Any]) -> dict[str, Any]:
    """Each engine's LOCAL_STATE_DICT into a fresh model of each engine (torch's FSDP1 loads
    none with use_orig_params=True), and fullshard's through torch.save / torch.load: the
    loaded model's full state dict."""
    out = {}
    pairs = [("fullshard", "fullshard"), ("fullshard", "torch"), ("torch", "fullshard")]
    for target, source in pairs[: 2 if uop else 3]:
        fresh = wrap(target, model=make_net(seed=7), use_orig_params=uop, mixed_precision=mp)
        result = _load(target, fresh, LOCAL, saved[source])
        out[f"{target}<-{source}"] = (result, full_state(fresh))
    buffer = io.BytesIO()
    torch.save(saved["fullshard"], buffer)
    buffer.seek(0)
    fresh = wrap("fullshard", model=make_net(seed=7), use_orig_params=uop, mixed_precision=mp)
    _load("fullshard", fresh, LOCAL, torch.load(buffer, weights_only=False))
    out["fullshard<-fullshard(torch.save)"] = (None, full_state(fresh))
    return out


def _local_edge_cases() -> dict[str, Any]:
    """LOCAL_STATE_DICT under NO_SHARD (FSDP1 gives a full state dict, with a warning); what
    it refuses, in one line each; and the LOCAL_STATE_DICT of earlier fullshard versions (the
    parameters' names, each rank's rows) still loads."""
    out: dict[str, Any] = {}
    for engine in ENGINES:
        model = wrap(engine, sharding_strategy=ShardingStrategy.NO_SHARD)
        with pytest.warns(UserWarning, match="full_state_dict will be returned"):
            sd = _state_dict(engine, model, LOCAL)
        out[f"no_shard/{engine}"] = {k: _describe(v) for k, v in sd.items()}
        fresh = wrap(engine, model=make_net(seed=7), sharding_strategy=ShardingStrategy.NO_SHARD)
        _load(engine, fresh, LOCAL, sd)
        loaded, original = full_state(fresh), full_state(model)
        out[f"no_shard_load/{engine}"] = all(torch.equal(loaded[k], original[k]) for k in original)
    model = wrap("fullshard", use_orig_params=False)
    sd = _state_dict("fullshard", model, LOCAL)
    sd["_flat_param"] = sd["_flat_param"].local_shards()[0].tensor[:-1]
    try:
        _load("fullshard", wrap("fullshard", model=make_net(seed=7)), LOCAL, sd)
    except ValueError as e:
        out["short"] = str(e)
    mixed = make_net()
    mixed.head.to(torch.float64)
    try:
        _state_dict("fullshard", wrap("fullshard", model=mixed), LOCAL)
    except ValueError as e:
        out["dtypes"] = str(e)
    legacy = {k: local_shard(v) for k, v in _state_dict("fullshard", model, SHARDED).items()}
    fresh = wrap("fullshard", model=make_net(seed=7), use_orig_params=False)
    _load("fullshard", fresh, LOCAL, legacy)
    loaded, original = full_state(fresh), full_state(model)
    out["legacy"] = str(all(torch.equal(loaded[k], original[k]) for k in original))
    return out


# ------------------------------------------------------------------- incompatible keys
def _incompatible_case(engine: str, ac: bool, kind: Any) -> Any:
    """torch's ``test_full_state_dict_missing_unexpected_keys_cleaned``: one key dropped, one
    added; ``strict=False``'s result and ``strict=True``'s message."""
    model = _ac_nested(engine, ac, seed=0)
    sd = _state_dict(engine, model, kind)
    sd.pop(next(iter(sd)))
    sd["unexpected"] = torch.ones(1)
    result = _load(engine, model, kind, sd, strict=False)
    try:
        _load(engine, model, kind, sd, strict=True)
        message = "no error"
    except RuntimeError as e:
        message = str(e)
    return (list(result.missing_keys), list(result.unexpected_keys), message)


# -------------------------------------------------------------------------------- spawn
def _ac_cases(out: dict[str, Any]) -> None:
    for engine, build, mode, kind in product(
        ENGINES, (_ac_simple, _ac_nested), AC_MODES, TYPES[:2]
    ):
        label = f"{build.__name__}/{mode}/{kind.name}"
        out[f"ac/{engine}/{label}"] = _ac_case(engine, build, mode, kind)


def _ignored_cases(out: dict[str, Any]) -> None:
    flags = (False, True)
    for engine, ignore_inner, mp, states, kind in product(ENGINES, flags, flags, flags, TYPES):
        label = f"inner={ignore_inner}/mp={mp}/states={states}/{kind.name}"
        out[f"ignored/{engine}/{label}"] = _ignored_case(engine, ignore_inner, mp, states, kind)


def _keys_cases(out: dict[str, Any]) -> None:
    for engine, ac, kind in product(ENGINES, (False, True), TYPES[:2]):
        out[f"keys/{engine}/ac={ac}/{kind.name}"] = _incompatible_case(engine, ac, kind)


def _local_cases(out: dict[str, Any]) -> None:
    for uop in (False, True):
        for mp_name, mp in (("fp32", None), ("bf16", BF16)):
            saved, label = {}, f"uop={uop}/{mp_name}"
            for engine in ENGINES:
                saved[engine], out[f"local/{engine}/{label}"], out[f"full/{engine}/{label}"] = (
                    _local_case(engine, uop, mp)
                )
            out[f"local_loads/{label}"] = _local_loads(uop, mp, saved)
    out["local_edge_cases"] = _local_edge_cases()


def _cases() -> dict[str, Any]:
    """Every case; a section that raises is recorded (``error/<section>``, the traceback) and
    the others still run, so each test fails on its own."""
    out: dict[str, Any] = {}
    sections = {"ac": _ac_cases, "ignored": _ignored_cases, "keys": _keys_cases}
    sections["local"] = _local_cases
    for name, section in sections.items():
        try:
            section(out)
        except Exception:  # reported by the section's test
            out[f"error/{name}"] = traceback.format_exc()
        dist.barrier()
    return out


def _no_error(out: dict[str, Any], section: str) -> None:
    assert f"error/{section}" not in out, out[f"error/{section}"]


@pytest.fixture(scope="module")
def results() -> list[dict[str, Any]]:
    return run_distributed(_cases, 2, timeout=600)


def _equal(a: Any, b: Any) -> bool:
    """Described state-dict entries equal bit for bit."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(_equal, a, b))
    return bool(a == b)


def _same_state(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return list(a) == list(b) and all(_equal(a[k], b[k]) for k in a)


def test_activation_checkpointed_models_save_and_load_as_fsdp1(results: list[Any]) -> None:
    """Under checkpoint wrappers applied before or after wrapping, on the source, the
    destination or both: FSDP1's keys (the wrappers' prefixes stripped) and values, and the
    state dict loads (strict) into a model from another seed, as saved and gathered."""
    for rank, out in enumerate(results):
        _no_error(out, "ac")
        for label in (k for k in out if k.startswith("ac/fullshard/")):
            ours, theirs = out[label], out[label.replace("/fullshard/", "/torch/")]
            assert ours["keys"] == theirs["keys"], (rank, label)
            assert _same_state(ours["source"], theirs["source"]), (rank, label)
            forms = ["gathered", "as_saved"] + (["rank0_offload"] if "/FULL" in label else [])
            for form in forms:
                assert _same_state(ours[form], ours["source"]), (rank, label, form)
            assert _same_state(theirs["gathered"], theirs["source"]), (rank, label)


def _as_dtensor(entry: Any) -> Any:
    """torch's ``ShardedTensor`` entry described as fullshard's ``DTensor`` one (its one
    piece; the same rows)."""
    if entry[0] != "ShardedTensor" or len(entry[2]) != 1:
        return entry
    return ("DTensor", entry[1], entry[2][0][1], *entry[3:])


def _casts_buffer(label: str, key: str) -> bool:
    """A buffer that torch's FSDP1 casts to ``buffer_dtype`` when the state dict is taken (its
    lazy init), before any forward, and fullshard at the first forward: torch's own test skips
    the non-ignored one; with ``ignored_states`` torch also leaves the root's cast one in
    fp16 in its full state dicts. The ignored modules' buffers are compared."""
    if "mp=True" not in label or "buffer" not in key:
        return False
    return "states=True" in label or ("inner=False" in label and "inner.buffer" in key)


def test_ignored_modules_and_states_are_the_modules_own_tensors(results: list[Any]) -> None:
    """torch's ignored-modules state-dict test, with ``ignored_states`` too and under every
    type: the same entries (keys, types, dtypes, values) as torch's FSDP1, the ignored
    parameters and the buffers the module's own tensors (same storage) exactly where torch's
    are, nested wrappers' ignored modules ignored by the outer one, and the dict loads back."""
    for rank, out in enumerate(results):
        _no_error(out, "ignored")
        for label in (k for k in out if k.startswith("ignored/fullshard/")):
            ours, theirs = out[label], out[label.replace("/fullshard/", "/torch/")]
            assert list(ours["entries"]) == list(theirs["entries"]), (rank, label)
            for key, entry in ours["entries"].items():
                if not _casts_buffer(label, key):
                    theirs_entry = theirs["entries"][key]
                    if "SHARDED" in label:
                        theirs_entry = _as_dtensor(theirs_entry)
                    assert _equal(entry, theirs_entry), (rank, label, key)
            for key, shared in ours["shares"].items():
                if not _casts_buffer(label, key):
                    assert shared == theirs["shares"][key], (rank, label, key)
            assert not ours["load"].missing_keys and not ours["load"].unexpected_keys
            assert ours["reloaded"], (rank, label)
        every_type = [k for k in out if k.startswith("ignored/fullshard/inner=True/mp=True")]
        assert len(every_type) == 6 and all(all(out[k]["shares"].values()) for k in every_type)


def test_local_state_dict_is_fsdp1s_flat_param_and_round_trips(results: list[Any]) -> None:
    """LOCAL_STATE_DICT: FSDP1's ``_flat_param`` entries (key, order, size, each rank's
    offsets and values, padding included; with use_orig_params=True also the parameters'
    1-D pieces), for fp32 and bf16 after a step; each engine's loads into the other (torch's
    FSDP1 loads none with use_orig_params=True) and into itself, through torch.save too."""
    for rank, out in enumerate(results):
        _no_error(out, "local")
        for label in (
            k[len("local/fullshard/") :] for k in out if k.startswith("local/fullshard/")
        ):
            ours, theirs = out[f"local/fullshard/{label}"], out[f"local/torch/{label}"]
            assert list(ours) == list(theirs), (rank, label, list(ours), list(theirs))
            assert ours["_flat_param"][0] == "ShardedTensor"
            for key, entry in ours.items():
                assert _equal(entry, theirs[key]), (rank, label, key)
            full = out[f"full/fullshard/{label}"]
            assert _same_state(full, out[f"full/torch/{label}"]), (rank, label)
            for how, (result, loaded) in out[f"local_loads/{label}"].items():
                source = out[f"full/{how.split('<-')[1].split('(')[0]}/{label}"]
                if result is not None:
                    assert not result.missing_keys and not result.unexpected_keys, (label, how)
                assert _same_state(loaded, source), (rank, label, how)
        refusals = out["local_edge_cases"]
        no_shard = refusals["no_shard/fullshard"]
        assert list(no_shard) == list(refusals["no_shard/torch"]), rank
        assert all(_equal(v, refusals["no_shard/torch"][k]) for k, v in no_shard.items())
        assert refusals["no_shard_load/fullshard"] and refusals["no_shard_load/torch"], rank
        assert "'_fsdp_wrapped_module._flat_param' holds" in refusals["short"]
        assert "torch.float32, torch.float64: use SHARDED_STATE_DICT" in refusals["dtypes"]
        assert refusals["legacy"] == "True"


def test_load_reports_missing_and_unexpected_keys_as_fsdp1(results: list[Any]) -> None:
    """``load_state_dict``'s missing and unexpected keys without the wrappers' prefixes
    (``_fsdp_wrapped_module.``, ``_checkpoint_wrapped_module.``): the ``strict=False`` result
    and the ``strict=True`` message are torch's FSDP1's, character for character."""
    for out in results:
        _no_error(out, "keys")
        for label in (k for k in out if k.startswith("keys/fullshard/")):
            ours, theirs = out[label], out[label.replace("/fullshard/", "/torch/")]
            assert ours == theirs, (label, ours, theirs)
            assert ours[0] == ["0.weight"] and ours[1] == ["unexpected"], (label, ours)
