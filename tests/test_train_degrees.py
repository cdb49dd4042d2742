"""``fullshard train --dp-replicate R --dp-shard S --tp T``: the checks before launch (fast, no
processes), and the mesh and placements each flag builds (one 4-rank gloo spawn, many cases).
Training runs under each layout, resumes across layouts and two torchrun nodes are in
``tests/test_multinode.py``."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from fullshard.module import unit_state
from fullshard.testing import run_distributed
from fullshard.train import cli
from fullshard.train.config import ConfigError, TrainConfig, from_toml, replace
from fullshard.train.degrees import Degrees, check_reshard, resolve
from fullshard.train.presets import get_preset

LLAMA = {
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 256,
    "max_position_embeddings": 128,
}


def _cfg(**changes: Any) -> TrainConfig:
    return replace(get_preset("tiny"), **changes)


def _refusal(cfg: TrainConfig, world: int, node: int | None = None) -> str:
    with pytest.raises(ConfigError) as e:
        resolve(cfg, world, node_size=node)
    message = str(e.value)
    assert "\n" not in message, message
    return message


# ---------------------------------------------------------------- degrees, no processes


def test_degrees_resolve_with_shard_taking_the_rest() -> None:
    assert resolve(_cfg(), 4) == Degrees(1, 4, 1)  # default: every rank shards
    assert resolve(_cfg(dp_replicate=2), 4) == Degrees(2, 2, 1)
    assert resolve(_cfg(tp=2), 4) == Degrees(1, 2, 2)
    assert resolve(_cfg(dp_replicate=2, dp_shard=1, tp=2), 4) == Degrees(2, 1, 2)
    d = resolve(_cfg(dp_replicate=2, tp=2), 8)
    assert (d.dp, d.world, d.shape) == (4, 8, (2, 2, 2))
    assert [d.dp_rank(r) for r in range(8)] == [0, 0, 1, 1, 2, 2, 3, 3]  # TP peers share rows
    # several machines: the default (all shard) may cross nodes; replicas across nodes fit
    assert resolve(_cfg(), 4, node_size=2) == Degrees(1, 4, 1)
    assert resolve(_cfg(dp_replicate=2, dp_shard=2), 4, node_size=2) == Degrees(2, 2, 1)


def test_degree_refusals_name_the_flags_the_numbers_and_the_fix() -> None:
    m = _refusal(_cfg(dp_replicate=2, dp_shard=3), 4)
    assert "--dp-replicate 2 x --dp-shard 3 x --tp 1 = 6" in m and "4 ranks" in m
    assert "make the product 4" in m and "--dp-shard 0" in m
    m = _refusal(_cfg(dp_replicate=3), 4)
    assert "--dp-replicate 3 x --tp 1 = 3 does not divide the 4 ranks" in m
    m = _refusal(_cfg(tp=4), 8, node=2)
    assert "--tp 4 does not divide the 2 ranks of a node" in m and "LOCAL_WORLD_SIZE" in m
    m = _refusal(_cfg(dp_replicate=1, dp_shard=4), 4, node=2)
    assert "--dp-shard 4 x --tp 1 = 4 ranks per shard group" in m and "2 ranks of a node" in m
    assert "--dp-shard 2 --dp-replicate 2" in m  # the layout that fits, as flags
    m = _refusal(_cfg(dp_replicate=2, dp_shard=2, tp=2), 8, node=2)
    assert "--dp-shard 1 --dp-replicate 4" in m

    with pytest.raises(ConfigError, match=r"--reshard-after-forward 3 must divide --dp-shard 4"):
        check_reshard(_cfg(reshard_after_forward="3"), Degrees(1, 4, 1))
    check_reshard(_cfg(reshard_after_forward="2"), Degrees(1, 4, 1))
    for bad in ("0", "two", "-1"):
        with pytest.raises(ConfigError, match="--reshard-after-forward must be auto, true"):
            _cfg(reshard_after_forward=bad)
    for name in ("tp", "dp_replicate"):
        with pytest.raises(ConfigError, match="must be a positive integer"):
            _cfg(**{name: 0})
    with pytest.raises(ConfigError, match="--dp-shard must be zero or a positive integer"):
        _cfg(dp_shard=-1)


def test_reshard_after_forward_int_from_flags_and_toml(tmp_path: Path) -> None:
    assert cli.parse_config(["--reshard-after-forward", "2"]).reshard_group == 2
    assert cli.parse_config(["--reshard-after-forward", "true"]).reshard_group is None
    path = tmp_path / "c.toml"
    path.write_text("reshard_after_forward = 2\ndp_replicate = 2\ntp = 2\n")
    assert from_toml(str(path)) == {"reshard_after_forward": "2", "dp_replicate": 2, "tp": 2}
    cfg = cli.parse_config(["--config", str(path)])
    assert (cfg.reshard_group, cfg.dp_replicate, cfg.tp) == (2, 2, 2)


def _main(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str]:
    code = cli.main(list(args))
    return code, capsys.readouterr().err.strip()


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        (["--tp", "3", "--nproc", "3", "--global-batch", "6", "--micro-batch", "2"],
         ["--tp 3 does not divide --n-head 4", "use --tp 1 (or another divisor of 4)"]),
        (["--dp-shard", "2", "--tp", "2", "--micro-batch", "3"],
         ["--global-batch 8 is not divisible by data-parallel ranks (4 ranks / --tp 2)",
          "2 x 3 = 6", "use --global-batch 12"]),
        (["--dp-replicate", "2", "--dp-shard", "2", "--nproc", "2"],
         ["--dp-replicate 2 x --dp-shard 2 x --tp 1 = 4, but the job has 2 ranks"]),
        (["--tp", "2", "--optimizer", "muon"],
         ["--optimizer muon with --tp 2", "use --optimizer adamw, or --tp 1"]),
        (["--dp-shard", "4", "--reshard-after-forward", "3"],
         ["--reshard-after-forward 3 must divide --dp-shard 4", "1, 2, 4"]),
        (["--hf-config", json.dumps(LLAMA), "--tp", "4", "--nproc", "4", "--global-batch", "4",
          "--micro-batch", "4"],
         ["--tp 4 does not divide num_key_value_heads 2", "--tp 2"]),
        (["--hf-config", json.dumps({"model_type": "gpt2", "n_embd": 32, "n_layer": 1,
                                     "n_head": 2, "vocab_size": 256, "bos_token_id": 0,
                                     "eos_token_id": 0}), "--tp", "2"],
         ["--tp 2: no tensor-parallel plan for GPT2LMHeadModel", "use --tp 1"]),
    ],
)  # fmt: skip
def test_cli_refuses_before_launch_in_one_line(
    flags: list[str],
    expected: list[str],
    corpus: Path,
    tmp_path: Path,
    no_launch: list[object],
    capsys: pytest.CaptureFixture[str],
) -> None:
    args = ["--preset", "tiny", "--data", str(corpus), "--run-dir", str(tmp_path / "run")]
    code, err = _main(capsys, *args, *flags)
    assert code == 2 and no_launch == [], err
    assert err.startswith("fullshard train: error: ") and "\n" not in err, err
    for text in expected:
        assert text in err, err
    assert not (tmp_path / "run").exists()  # refused before anything was written


def test_cli_launches_the_product_of_the_degrees(
    corpus: Path, tmp_path: Path, no_launch: list[Any], capsys: pytest.CaptureFixture[str]
) -> None:
    """``--dp-replicate 2 --dp-shard 2`` (no --nproc) launches 4 ranks and says which mesh."""
    args = ["--preset", "tiny", "--data", str(corpus), "--run-dir", str(tmp_path / "run")]
    assert cli.main([*args, "--dp-replicate", "2", "--dp-shard", "2"]) == 0
    out = capsys.readouterr().out
    assert no_launch[0] == (tmp_path / "run" / "config.toml",)
    assert "launching 4 rank(s), mesh 2 x 2 x 1 (dp_replicate x dp_shard x tp)" in out, out
    saved = from_toml(str(tmp_path / "run" / "config.toml"))
    assert (saved["dp_replicate"], saved["dp_shard"], saved["tp"]) == (2, 2, 1)


# ---------------------------------------------------------------- the mesh each flag builds


CASES: dict[str, dict[str, Any]] = {
    "default": {},
    "hsdp": {"dp_replicate": 2},
    "replicate": {"dp_replicate": 4, "dp_shard": 1},
    "tp": {"tp": 2, "reshard_after_forward": "2"},
    "hsdp_tp": {"dp_replicate": 2, "dp_shard": 1, "tp": 2},
    "llama_tp": {"tp": 2, "hf_config": json.dumps(LLAMA)},
}


def _layouts(names: list[str]) -> dict[str, Any]:
    """On 4 gloo ranks: the mesh, the groups and the parameter placements each set of flags
    gives, and one forward/backward against the unsharded model (GPT and HF Llama)."""
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from fullshard.train.models import build_model, logits_of, units_of
    from fullshard.train.parallelize import ParallelPlan, build_mesh, parallelize

    rank = dist.get_rank()
    out: dict[str, Any] = {}
    x = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))
    for name in names:
        cfg = _cfg(**CASES[name])
        degrees = resolve(cfg, 4)
        meshes = build_mesh(degrees, "cpu")
        torch.manual_seed(0)
        ref = build_model(cfg)
        torch.manual_seed(0)
        model = build_model(cfg)
        units = units_of(model)
        plan = ParallelPlan(reshard_after_forward=cfg.reshard_after_forward)
        parallelize(model, units, plan, mesh=meshes.dp, tp_mesh=meshes.tp)
        params = dict(model.named_parameters())
        probes = [n for n in params if n.endswith(("qkv.weight", "q_proj.weight", "ln1.weight"))]
        probes += [n for n in params if n.endswith(("k_proj.weight", "down_proj.weight"))]
        placements = {}
        for n in probes[:3]:
            p = params[n]
            assert isinstance(p, DTensor), n
            placements[re.sub(r"^.*?\.\d+\.", "", n)] = (  # blocks.0.attn.qkv -> attn.qkv
                p.device_mesh.mesh_dim_names,
                [str(pl) for pl in p.placements],
                list(p._local_tensor.shape),
            )
        loss = logits_of(model, x).float().pow(2).mean()
        loss.backward()
        ref_loss = logits_of(ref, x).float().pow(2).mean()
        ref_loss.backward()
        grads_close = all(
            torch.allclose(p.grad.full_tensor(), params_ref.grad, atol=1e-5, rtol=1e-4)
            for (n, p), params_ref in zip(model.named_parameters(), ref.parameters(), strict=True)
            if p.grad is not None
        )
        out[name] = {
            "shape": list(meshes.full.shape),
            "names": meshes.full.mesh_dim_names,
            "dp_names": meshes.dp.mesh_dim_names,
            "tp": None
            if meshes.tp is None
            else dist.get_process_group_ranks(meshes.tp.get_group()),
            "shard": dist.get_process_group_ranks(meshes.full["dp_shard"].get_group()),
            "replicate": dist.get_process_group_ranks(meshes.full["dp_replicate"].get_group()),
            "placements": placements,
            "reshard": unit_state(units.layers[0]).reshard_after_forward,
            "loss_close": abs(float(loss) - float(ref_loss)) < 1e-5 * abs(float(ref_loss)),
            "grads_close": grads_close,
            "rank": rank,
        }
    return out


def test_each_flag_builds_its_mesh_and_placements() -> None:
    # [Note: one TP mesh per process] A second init_device_mesh with the same dim names in one
    # process gives TP DTensors whose root mesh is the first one's, which fully_shard then
    # refuses; the trainer builds one mesh per process, so each TP case gets its own ranks
    # (forked from the harness's server: a fraction of a second each).
    groups = [["default", "hsdp", "replicate"], ["tp"], ["hsdp_tp"], ["llama_tp"]]
    results = [{} for _ in range(4)]
    for names in groups:
        for mine, got in zip(results, run_distributed(_layouts, 4, names, timeout=240)):
            mine.update(got)
    r0, r3 = results[0], results[3]
    assert r0["default"]["shape"] == [1, 4, 1] and r0["default"]["dp_names"] == ("dp_shard",)
    assert r0["default"]["names"] == ("dp_replicate", "dp_shard", "tp")
    assert r0["default"]["shard"] == [0, 1, 2, 3] and r0["default"]["tp"] is None
    # HSDP: replicas are the slow dim (across nodes), shard groups are neighbours
    hsdp = r3["hsdp"]
    assert hsdp["shape"] == [2, 2, 1] and hsdp["dp_names"] == ("dp_replicate", "dp_shard")
    assert (hsdp["shard"], hsdp["replicate"]) == ([2, 3], [1, 3])
    assert hsdp["placements"]["ln1.weight"][1] == ["R", "S(0)"]
    replicate = r3["replicate"]
    assert replicate["shape"] == [4, 1, 1] and replicate["replicate"] == [0, 1, 2, 3]
    assert replicate["placements"]["ln1.weight"][2] == [64]  # whole on every rank
    # TP: neighbours; a TP weight's sharded form lives on (dp_shard, tp)
    tp = r3["tp"]
    assert tp["shape"] == [1, 2, 2] and (tp["tp"], tp["shard"]) == ([2, 3], [1, 3])
    mesh_names, places, local = tp["placements"]["attn.qkv.weight"]
    assert mesh_names == ("dp_shard", "tp") and places[1] == "S(0)", places
    assert local == [192 // 2 // 2, 64]  # 3 x d_model rows over tp, then over dp_shard
    assert (tp["reshard"], r0["default"]["reshard"]) == (2, None)  # --reshard-after-forward 2
    assert tp["placements"]["ln1.weight"][0] == ("dp_shard",)  # norms: dp only
    hsdp_tp = r0["hsdp_tp"]
    assert hsdp_tp["shape"] == [2, 1, 2] and hsdp_tp["tp"] == [0, 1]
    assert hsdp_tp["replicate"] == [0, 2]
    llama = r0["llama_tp"]["placements"]["self_attn.q_proj.weight"]
    assert llama[0] == ("dp_shard", "tp") and llama[2] == [64 // 2 // 2, 64]
    for results_of_rank in results:
        for name, case in results_of_rank.items():
            assert case["loss_close"] and case["grads_close"], (name, case["rank"])
