"""Checkpoints on gloo ranks: bit-exact round trip, resume, resharding to 1/3/4 ranks and HSDP.

One 2-rank run trains 6 steps straight (the oracle) and, from the same seed, 3 steps then saves.
Fresh processes then resume from that checkpoint on 2 ranks and reshard it onto 1, 3 and 4
ranks (and a 2x2 HSDP mesh).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file
from torch.distributed.device_mesh import init_device_mesh

import fullshard.checkpoint as ckpt
from fullshard import CPUOffloadPolicy
from fullshard.checkpoint import saving
from fullshard.checkpoint.cli import main
from fullshard.checkpoint.export import export
from fullshard.testing import run_distributed
from test_checkpoint_models import (
    TinyNet,
    assert_same,
    batch,
    eval_loss,
    full_optim_state,
    full_weights,
    local_state,
    make_model,
    make_optimizer,
    train_step,
)

STEPS = 6
SAVE_AT = 3


def _run(fn: Callable[..., dict[str, Any]], world: int, *args: Any) -> list[dict[str, Any]]:
    return run_distributed(fn, world, *args, timeout=600)


def _train_and_save(root: str) -> dict[str, Any]:
    """Oracle (6 straight steps), then 3 steps + save, round trip and async save checks."""
    rank = dist.get_rank()
    model, opt = make_model(seed=0), None
    opt = make_optimizer(model)
    losses, weights_at = [], {}
    for step in range(STEPS):
        if step == SAVE_AT:
            weights_at[SAVE_AT] = full_weights(model)
            optim_at = full_optim_state(model, opt)
            next_eval = eval_loss(model, SAVE_AT)
        losses.append(train_step(model, opt, step))
    final = full_weights(model)

    model_b = make_model(seed=0)
    opt_b = make_optimizer(model_b)
    for step in range(SAVE_AT):
        assert train_step(model_b, opt_b, step) == losses[step]
    path = Path(root) / "checkpoints" / f"step_{SAVE_AT:08d}"
    ckpt.save(path, model=model_b, optimizer=opt_b, extra={"step": SAVE_AT, "rank0": rank})
    assert ckpt.latest_checkpoint(Path(root) / "checkpoints") == path

    # Round trip into a differently initialised model and a fresh optimizer: bit-exact shards.
    model_c = make_model(seed=123)
    opt_c = make_optimizer(model_c)
    extra = ckpt.load(path, model=model_c, optimizer=opt_c)
    assert extra == {"step": SAVE_AT, "rank0": 0}, extra
    assert_same(local_state(model_c, opt_c), local_state(model_b, opt_b), "round trip")
    assert opt_c.param_groups[0]["betas"] == opt_b.param_groups[0]["betas"]
    # ...and both keep training identically.
    assert train_step(model_c, opt_c, SAVE_AT) == train_step(model_b, opt_b, SAVE_AT)

    # Async save: snapshot now, training may change the weights before the write finishes.
    snapshot = local_state(model_c, opt_c)
    handle = ckpt.save(
        Path(root) / "async" / "step_4", model=model_c, optimizer=opt_c, async_save=True
    )
    train_step(model_c, opt_c, SAVE_AT + 1)
    assert handle.wait() == Path(root) / "async" / "step_4"
    model_d = make_model(seed=7)
    opt_d = make_optimizer(model_d)
    ckpt.load(handle.path, model=model_d, optimizer=opt_d)
    assert_same(local_state(model_d, opt_d), snapshot, "async save")

    # A rank that fails mid-save (disk full, ...) fails the save on every rank; nothing is
    # published and the partial directory is removed.
    failing = Path(root) / "failing" / "step_1"
    original = saving._write_blocks
    if rank == 1:
        saving._write_blocks = _disk_full  # type: ignore[assignment]
    try:
        ckpt.save(failing, model=model_b, optimizer=opt_b)
        raise AssertionError("save should have failed")
    except (OSError, RuntimeError) as e:
        expected_error = "No space left" if rank == 1 else "failed on another rank"
        assert expected_error in str(e), e
    finally:
        saving._write_blocks = original
    assert not failing.exists() and not list(failing.parent.glob("*.partial"))

    # CPU-offloaded shards (the engine's OffloadPolicy) checkpoint the same way.
    policies = {"offload_policy": CPUOffloadPolicy(pin_memory=False)}
    model_p = make_model(seed=0, **policies)
    opt_p = make_optimizer(model_p)
    train_step(model_p, opt_p, 0)
    ckpt.save(Path(root) / "policies" / "step_1", model=model_p, optimizer=opt_p)
    model_q = make_model(seed=1, **policies)
    opt_q = make_optimizer(model_q)
    ckpt.load(Path(root) / "policies", model=model_q, optimizer=opt_q)
    assert_same(local_state(model_q, opt_q), local_state(model_p, opt_p), "with policies")
    assert train_step(model_q, opt_q, 1) == train_step(model_p, opt_p, 1)

    full_sd = ckpt.get_full_state_dict(model_b)
    expected = full_weights(model_b)
    if rank == 0:
        assert_same(full_sd, expected, "full state dict")
        assert full_sd["head.weight"] is full_sd["emb.weight"]
    else:
        assert full_sd == {}
    return {
        "losses": losses,
        "weights": weights_at[SAVE_AT],
        "optim": optim_at,
        "final": final,
        "next_eval": next_eval,
    }


def _disk_full(*args: Any) -> Any:
    raise OSError(28, "No space left on device (simulated)")


def _resume(root: str) -> dict[str, Any]:
    model = make_model(seed=99)
    opt = make_optimizer(model)
    extra = ckpt.load(Path(root), model=model, optimizer=opt)  # a run dir: newest checkpoint
    losses = [train_step(model, opt, step) for step in range(extra["step"], STEPS)]
    return {"losses": losses, "final": full_weights(model)}


def _reshard(root: str, hsdp: bool) -> dict[str, Any]:
    world = dist.get_world_size()
    mesh = (
        init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
        if hsdp
        else None
    )
    model = make_model(seed=5, mesh=mesh, units=world != 3)  # 3 ranks: another unit layout
    opt = make_optimizer(model)
    ckpt.load(Path(root) / "checkpoints" / f"step_{SAVE_AT:08d}", model=model, optimizer=opt)
    out = {
        "weights": full_weights(model),
        "optim": full_optim_state(model, opt),
        "next_eval": eval_loss(model, SAVE_AT),
    }
    # Full weights in: export on rank 0, then every rank keeps only its rows of the file.
    exported = Path(root) / f"export{world}{'hsdp' if hsdp else ''}.safetensors"
    if dist.get_rank() == 0:
        export(Path(root) / "checkpoints", exported)
    dist.barrier()
    from_file = make_model(seed=8, mesh=mesh)
    ckpt.load_full_state_dict_from_file(from_file, exported)
    assert_same(full_weights(from_file), out["weights"], "load_full_state_dict_from_file")
    from_dict = make_model(seed=9, mesh=mesh)
    ckpt.load_full_state_dict(from_dict, load_file(exported))
    assert_same(full_weights(from_dict), out["weights"], "load_full_state_dict")
    if hsdp:
        # Save from the HSDP mesh (replicas write once) and load into a plain 1-D model.
        path = Path(root) / f"hsdp{world}" / "step_3"
        ckpt.save(path, model=model, optimizer=opt)
        files = sorted(p.name for p in path.glob("*.safetensors"))
        model_1d = make_model(seed=6)
        opt_1d = make_optimizer(model_1d)
        ckpt.load(path, model=model_1d, optimizer=opt_1d)
        assert_same(full_weights(model_1d), out["weights"], "HSDP save -> 1-D load")
        assert_same(full_optim_state(model_1d, opt_1d), out["optim"], "HSDP save -> 1-D optim")
        out["hsdp_files"] = files
    return out


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]]]:
    """The run directory and the 2 ranks' results of ``_train_and_save``."""
    root = tmp_path_factory.mktemp("run")
    return root, _run(_train_and_save, 2, str(root))


def test_round_trip_and_async_save_on_2_ranks(saved: tuple[Path, list[dict[str, Any]]]) -> None:
    root, _ = saved  # the checks run inside the ranks; here: what landed on disk
    path = root / "checkpoints" / f"step_{SAVE_AT:08d}"
    assert sorted(p.name for p in path.iterdir()) == [
        "manifest.json",
        "rank_00000.safetensors",
        "rank_00001.safetensors",
    ]
    assert not list(root.rglob("*.partial"))


def test_resume_is_bit_exact(saved: tuple[Path, list[dict[str, Any]]]) -> None:
    root, refs = saved
    for res, ref in zip(_run(_resume, 2, str(root)), refs):  # per rank: each has its own data
        assert res["losses"] == ref["losses"][SAVE_AT:]
        assert_same(res["final"], ref["final"], "resumed weights")


@pytest.mark.parametrize("world", [1, 3, 4])
def test_reshard_to_other_world_sizes(saved: tuple[Path, list[dict[str, Any]]], world: int) -> None:
    root, (ref, _) = saved
    for res in _run(_reshard, world, str(root), world == 4):
        assert_same(res["weights"], ref["weights"], f"weights on {world} ranks")
        assert_same(res["optim"], ref["optim"], f"optimizer state on {world} ranks")
        assert res["next_eval"] == ref["next_eval"]
        if world == 4:  # 2x2 HSDP: only replica 0 writes, one file per shard rank
            assert res["hsdp_files"] == ["rank_00000.safetensors", "rank_00001.safetensors"]


def test_export_loads_into_an_unsharded_model(
    saved: tuple[Path, list[dict[str, Any]]], tmp_path: Path
) -> None:
    root, (ref, _) = saved
    reference = TinyNet()
    reference.load_state_dict(ref["weights"])
    x, _ = batch(SAVE_AT)
    out = tmp_path / "model.safetensors"
    assert main(["export", str(root), str(out)]) == 0  # run dir -> its newest checkpoint
    model = TinyNet()
    model.load_state_dict(load_file(out))  # strict: tied head.weight is in the file too
    with torch.no_grad():
        assert torch.equal(model(x), reference(x))

    out16 = tmp_path / "bf16" / "model.safetensors"
    assert main(["export", str(root), str(out16), "--dtype", "bf16"]) == 0
    sd16 = load_file(out16)
    assert sd16["fc1.weight"].dtype == torch.bfloat16
    assert torch.equal(sd16["fc1.weight"], ref["weights"]["fc1.weight"].to(torch.bfloat16))

    # Hugging Face style sharded set when larger than --max-shard-size.
    outs = tmp_path / "sharded" / "model.safetensors"
    assert main(["export", str(root), str(outs), "--max-shard-size", "200B"]) == 0
    index = json.loads((tmp_path / "sharded" / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 1 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    merged: dict[str, torch.Tensor] = {}
    for f in files:
        merged.update(load_file(tmp_path / "sharded" / f))
    assert_same(merged, ref["weights"], "sharded export")


def test_inspect_prints_the_expected_fields(
    saved: tuple[Path, list[dict[str, Any]]], capsys: pytest.CaptureFixture[str]
) -> None:
    root, _ = saved
    assert main(["inspect", str(root / "checkpoints")]) == 0
    text = capsys.readouterr().out
    for expected in (
        f"step_{SAVE_AT:08d}",
        "world size: 2",
        f"step: {SAVE_AT}",
        "rank_00000.safetensors",
        "rank_00001.safetensors",
        "emb.weight",
        "float32  [13, 6]  312 bytes  2 shard(s)",
        "fc2.bias",
        "head.weight  tied to emb.weight",
        "exp_avg, exp_avg_sq, step",
        "total tensor bytes: 2144",
        "checksums: ok (2 files verified)",
    ):
        assert expected in text, f"{expected!r} not in:\n{text}"
