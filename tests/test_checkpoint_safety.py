"""Integrity and safety: corruption and truncation are caught with the file and tensor named,
crafted manifests are rejected before any tensor byte is read, and no pickle ever runs.

These run in one process on an unsharded model (the format is the same at any world size).
"""

from __future__ import annotations

import json
import pickle
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

import fullshard.checkpoint as ckpt
from fullshard.checkpoint.cli import main
from fullshard.checkpoint.safetensors_io import read_header
from test_checkpoint_models import TinyNet, make_model, make_optimizer


@pytest.fixture(scope="module")
def good(tmp_path_factory: pytest.TempPathFactory) -> Path:
    model = make_model(seed=0)
    opt = make_optimizer(model)
    model(torch.zeros(2, 3, dtype=torch.long)).sum().backward()
    opt.step()
    path = tmp_path_factory.mktemp("good") / "step_00000001"
    ckpt.save(path, model=model, optimizer=opt, extra={"step": 1})
    return path


def _copy(good: Path, tmp_path: Path) -> Path:
    dst = tmp_path / "step_00000001"
    shutil.copytree(good, dst)
    return dst


def _load(path: Path) -> None:
    model = TinyNet()
    ckpt.load(path, model=model, optimizer=make_optimizer(model))


def _tensor_offset(path: Path, key: str) -> int:
    entries, _, _ = read_header(path / "rank_00000.safetensors")
    return entries[key].begin


def test_flipped_byte_is_detected_naming_file_and_tensor(good: Path, tmp_path: Path) -> None:
    path = _copy(good, tmp_path)
    f = path / "rank_00000.safetensors"
    data = bytearray(f.read_bytes())
    data[_tensor_offset(path, "model/fc1.weight") + 5] ^= 0x40
    f.write_bytes(data)
    with pytest.raises(ckpt.CheckpointError) as e:
        _load(path)
    msg = str(e.value)
    assert "checksum mismatch" in msg and "rank_00000.safetensors" in msg
    assert "model/fc1.weight" in msg and "expected crc32" in msg


def test_flipped_header_byte_is_detected(good: Path, tmp_path: Path) -> None:
    path = _copy(good, tmp_path)
    f = path / "rank_00000.safetensors"
    data = bytearray(f.read_bytes())
    i = data.index(b'"shape":[7,6]')
    data[i + 9] = ord("8")  # fc1.weight claims 8 rows: same file size, different header
    f.write_bytes(data)
    with pytest.raises(ckpt.CheckpointError, match=r"rank_00000\.safetensors.*(corrupted|header)"):
        _load(path)


def test_truncated_file_is_detected(good: Path, tmp_path: Path) -> None:
    path = _copy(good, tmp_path)
    f = path / "rank_00000.safetensors"
    f.write_bytes(f.read_bytes()[:-7])
    with pytest.raises(ckpt.CheckpointError) as e:
        _load(path)
    msg = str(e.value)
    assert "truncated" in msg and "rank_00000.safetensors" in msg
    assert "model/emb.weight" in msg  # names what the file holds
    assert main(["inspect", str(path)]) == 1  # reported as a failed file


def test_inspect_reports_a_corrupted_file(
    good: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = _copy(good, tmp_path)
    f = path / "rank_00000.safetensors"
    data = bytearray(f.read_bytes())
    data[-1] ^= 0xFF
    f.write_bytes(data)
    assert main(["inspect", str(path)]) == 1
    assert "checksums: FAILED" in capsys.readouterr().out


def _tamper(good: Path, tmp_path: Path, edit: Any) -> Path:
    path = _copy(good, tmp_path)
    doc = json.loads((path / "manifest.json").read_text())
    edit(doc)
    (path / "manifest.json").write_text(json.dumps(doc))
    return path


def _rename_file(doc: dict[str, Any], new: str) -> None:
    doc["files"][new] = doc["files"].pop("rank_00000.safetensors")
    for rec in doc["model"].values():
        for s in rec["shards"]:
            s["file"] = new


def _set(field: str, value: Any, tensor: str = "fc1.weight") -> Any:
    def edit(doc: dict[str, Any]) -> None:
        doc["model"][tensor][field] = value

    return edit


def _set_shard(field: str, value: Any) -> Any:
    def edit(doc: dict[str, Any]) -> None:
        doc["model"]["fc1.weight"]["shards"][0][field] = value

    return edit


CRAFTED = {
    "parent_path": (lambda d: _rename_file(d, "../rank_00000.safetensors"), "not allowed"),
    "absolute_path": (lambda d: _rename_file(d, "/etc/passwd"), "not allowed"),
    "subdir_path": (lambda d: _rename_file(d, "sub/rank_00000.safetensors"), "not allowed"),
    "dotdot_name": (lambda d: _rename_file(d, "..x"), "not allowed"),
    "absurd_shape": (_set("shape", [2**40, 2**20]), "at most"),
    "negative_shape": (_set("shape", [-7, 6]), "integer >= 0"),
    "unknown_dtype": (_set("dtype", "PICKLE"), "one of"),
    "wrong_dtype": (_set("dtype", "I32"), "should be torch.int32"),
    "shard_outside_tensor": (_set_shard("offset", [5, 0]), "spans"),
    "shard_bigger_than_file": (_set_shard("shape", [7, 10**9]), "spans|needs"),
    "gap_in_tiling": (_set("shape", [8, 6]), "tile"),
    "wrong_checksum_count": (_set_shard("crc32", []), "checksums"),
    "not_a_manifest": (lambda d: d.update(format="torch-dcp"), "not a fullshard-checkpoint"),
}


@pytest.mark.parametrize("case", sorted(CRAFTED))
def test_crafted_manifest_is_rejected(good: Path, tmp_path: Path, case: str) -> None:
    edit, match = CRAFTED[case]
    path = _tamper(good, tmp_path, edit)
    with pytest.raises(ckpt.CheckpointError, match=match):
        _load(path)


class _Payload:
    """Unpickling this creates the marker file: proof that a pickle ran."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (Path.touch, (self.marker,))


def test_pickle_payloads_never_run(good: Path, tmp_path: Path) -> None:
    marker = tmp_path / "PWNED"
    payload = pickle.dumps(_Payload(marker))
    # 1. A rank file replaced by a pickle (as torch.save would write): rejected.
    path = _copy(good, tmp_path / "a")
    (path / "rank_00000.safetensors").write_bytes(payload)
    with pytest.raises(ckpt.CheckpointError):
        _load(path)
    # 2. The manifest replaced by a pickle: rejected.
    path = _copy(good, tmp_path / "b")
    (path / "manifest.json").write_bytes(payload)
    with pytest.raises(ckpt.CheckpointError, match="not valid JSON"):
        _load(path)
    # 3. Pickles dropped next to a good checkpoint (DCP's .metadata, a .pt): never opened.
    path = _copy(good, tmp_path / "c")
    (path / ".metadata").write_bytes(payload)
    (path / "optim.pt").write_bytes(payload)
    _load(path)
    assert main(["inspect", str(path)]) == 0
    assert not marker.exists()
    # The payload is real: unpickling it does create the marker.
    pickle.loads(payload)
    assert marker.exists()


def test_missing_and_unexpected_keys_are_named(good: Path) -> None:
    class Other(TinyNet):
        def __init__(self) -> None:
            super().__init__()
            self.extra = torch.nn.Linear(2, 2)

    with pytest.raises(
        ckpt.CheckpointError, match=r"missing keys \['extra.weight', 'extra.bias'\]"
    ):
        ckpt.load(good, model=Other())
    model = Other()
    ckpt.load(good, model=model, strict=False)
    assert torch.equal(model.fc1.weight, ckpt.get_full_state_dict(make_loaded(good))["fc1.weight"])


def make_loaded(path: Path) -> TinyNet:
    model = TinyNet()
    ckpt.load(path, model=model)
    return model


def test_partial_reads_verify_only_the_blocks_they_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from fullshard.checkpoint import saving as save_module

    monkeypatch.setattr(save_module, "BLOCK_BYTES", 3 * 6 * 4)  # 3 rows of emb.weight per block
    model = TinyNet()
    path = tmp_path / "ckpt"
    ckpt.save(path, model=model)
    reader = ckpt.CheckpointReader(path)
    rec = reader.manifest.model["emb.weight"]
    assert rec.shards[0].rows_per_block == 3 and len(rec.shards[0].crc32) == 5
    full = model.emb.weight.detach()
    for lo, hi in [(0, 13), (0, 1), (2, 4), (3, 6), (5, 13), (12, 13)]:
        box = ((lo, 0), (hi - lo, 6))
        assert torch.equal(reader.read_box(rec, "emb.weight", box), full[lo:hi])
    assert torch.equal(reader.read_box(rec, "emb", ((4, 2), (5, 3))), full[4:9, 2:5])
    # Corrupt row 10 (block 3): rows in other blocks still read; rows in block 3 fail.
    f = path / "rank_00000.safetensors"
    data = bytearray(f.read_bytes())
    data[_tensor_offset(path, "model/emb.weight") + 10 * 6 * 4] ^= 1
    f.write_bytes(data)
    reader = ckpt.CheckpointReader(path)
    assert torch.equal(reader.read_box(rec, "emb.weight", ((0, 0), (9, 6))), full[:9])
    with pytest.raises(ckpt.CheckpointError, match=r"rows \[9, 12\)"):
        reader.read_box(rec, "emb.weight", ((11, 0), (1, 6)))


def test_full_state_dict_with_only_one_tied_name(tmp_path: Path) -> None:
    source = TinyNet()
    sd = {k: v for k, v in source.state_dict().items() if k != "emb.weight"}  # only the head
    model = TinyNet()
    ckpt.load_full_state_dict(model, sd)
    assert model.emb.weight is model.head.weight
    assert torch.equal(model.emb.weight, source.emb.weight)
    with pytest.raises(ckpt.CheckpointError, match=r"shape mismatches \[fc1.bias"):
        ckpt.load_full_state_dict(model, {**sd, "fc1.bias": torch.zeros(3)})


def test_optimizer_mismatch_is_reported_before_the_model_changes(good: Path) -> None:
    model = TinyNet()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    opt = torch.optim.AdamW([model.fc1.weight, model.fc1.bias])
    with pytest.raises(ckpt.CheckpointError, match=r"unexpected keys \['emb.weight'"):
        ckpt.load(good, model=model, optimizer=opt)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
