"""`fullshard plan --gpus N`: the pieces of the cluster planner against measurement and theory.

- selective activation checkpointing's bytes against a real CPU run with the same policy;
- the traced FLOPs of a block against the closed form;
- three traced blocks extended to all against a trace of every block;
- the collective volumes per mesh dimension against the ZeRO-3 formulas, for each degree
  ([Note: the ZeRO-3 theory per mesh dimension] in fullshard.memory.cluster);
- the CLI's JSON and the --budget ranking.
"""

from __future__ import annotations

import json
from dataclasses import asdict

import pytest
import torch

from fullshard.bench.cli import fullshard_available
from fullshard.memory.cli import main
from fullshard.memory.cluster import (
    ClusterSpec,
    cluster_plan,
    memory_spec,
    model_params,
    volumes,
)
from fullshard.memory.hardware import gpu
from fullshard.memory.measure import measure_rank
from fullshard.memory.planner import PlanSpec, plan
from fullshard.models import GPTConfig
from fullshard.testing import run_distributed

ENGINE = "fullshard" if fullshard_available() is None else "fsdp2"
ACT_HEAVY = GPTConfig(n_layer=2, d_model=128, n_head=4, seq_len=128, tie_embeddings=False)


def _llama(layers: int = 4) -> object:
    from fullshard.train import hf

    return hf.make_config(
        {
            "model_type": "llama",
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": layers,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "vocab_size": 96,
            "tie_word_embeddings": False,
        }
    )


def test_selective_ac_bytes_match_a_measured_cpu_run() -> None:
    """The planner traces torchtitan's op policy; a real 2-rank run applies the same policy.
    Selective must sit strictly between full and none, and match the measured peak."""
    peaks = {
        ac: plan(PlanSpec(model=ACT_HEAVY, world_size=2, batch=4, seq=128, ac=ac, engine=ENGINE))
        for ac in ("none", "selective", "full")
    }
    acts = {ac: p.peak.bytes["activations"] for ac, p in peaks.items()}
    assert acts["full"] < acts["selective"] < acts["none"], acts
    # what the policy saves per block: the outputs of the 1st and 3rd matmuls (qkv 3d, MLP
    # fc 4d) and of attention (d, + its fp32 logsumexp per head), and the block's output
    b, s, d, h = 2, 64, 64, 4
    cfg = GPTConfig(n_layer=5, d_model=d, n_head=h, seq_len=s, tie_embeddings=False)
    seg = {
        x.label: x
        for x in plan(PlanSpec(model=cfg, world_size=2, batch=b, seq=s, ac="selective")).segments
    }
    per_block = seg["forward blocks.3"].start - seg["forward blocks.2"].start
    assert per_block == (3 + 4 + 1 + 1) * b * s * d * 4 + b * h * s * 4
    ranks = run_distributed(
        measure_rank, 2, asdict(ACT_HEAVY), 4, 128, ENGINE, 3, True, "selective", timeout=180
    )
    measured = max(r["peak_bytes"] for r in ranks)
    predicted = peaks["selective"].peak.total
    assert predicted == pytest.approx(measured, rel=0.10), (predicted, measured, acts)


def test_traced_block_flops_match_the_closed_form() -> None:
    """A GPT block's matmuls: qkv 3d^2, proj d^2, MLP 8d^2 per token (2 FLOPs per MAC);
    attention 4 b s^2 d; backward twice the matmuls and 2.5x the attention (as torch counts)."""
    b, s, d = 2, 64, 128
    cfg = GPTConfig(n_layer=5, d_model=d, n_head=4, seq_len=s, tie_embeddings=False)
    p = plan(PlanSpec(model=cfg, world_size=2, batch=b, seq=s))
    seg = {x.label: x for x in p.segments}
    fwd, bwd = seg["forward blocks.2"], seg["backward blocks.2"]
    mm = 2 * b * s * 12 * d * d
    attn = 4 * b * s * s * d
    assert fwd.mm_flops == mm and fwd.attn_flops == attn
    assert fwd.causal_attn_flops == attn  # is_causal: the time model skips the masked half
    assert bwd.mm_flops == 2 * mm and bwd.attn_flops == int(2.5 * attn)
    # full AC: backward recomputes the block's forward up to the last tensor backward needs
    # (torch's non-reentrant checkpoint stops early: the MLP's output matmul, 4 d^2 per
    # token, is not recomputed)
    pf = plan(PlanSpec(model=cfg, world_size=2, batch=b, seq=s, ac="full"))
    bwd_ac = {x.label: x for x in pf.segments}["backward blocks.2"]
    assert bwd_ac.mm_flops == 3 * mm - 2 * b * s * 4 * d * d
    assert bwd_ac.attn_flops == attn + int(2.5 * attn)


def test_three_traced_blocks_extend_to_a_full_trace() -> None:
    """[Note: tracing three blocks]: the plan of 7 blocks from 3 equals tracing all 7."""
    cfg = GPTConfig(n_layer=7, d_model=64, n_head=4, seq_len=64, tie_embeddings=False)
    for ac in ("none", "selective"):
        spec = PlanSpec(model=cfg, world_size=2, batch=2, seq=64, ac=ac)
        short, full = plan(spec), plan(PlanSpec(**{**spec.__dict__, "max_traced_blocks": 0}))
        assert short.peak.total == full.peak.total, ac
        assert [e.total for e in short.events] == [e.total for e in full.events], ac
        for field in ("mm_flops", "attn_flops", "mem_bytes"):
            assert sum(getattr(x, field) for x in short.segments) == sum(
                getattr(x, field) for x in full.segments
            ), field


def _cluster(**kw: object) -> ClusterSpec:
    args: dict[str, object] = {
        "hf_config": _llama(),
        "gpu": gpu("h100"),
        "batch": 2,
        "seq": 32,
        "ac": "full",
    }
    return ClusterSpec(**{**args, **kw})  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "kw",
    [
        {"gpus": 8},
        {"gpus": 64},
        {"gpus": 32, "dp_replicate": 4},
        {"gpus": 32, "hpz": 8},
        {"gpus": 16, "tp": 2},
        {"gpus": 32, "tp": 2, "pp": 2, "local_batch": 8},
    ],
    ids=["fsdp8", "fsdp64", "hsdp4x8", "hpz8", "fsdp8-tp2", "fsdp8-tp2-pp2"],
)
def test_collective_volumes_follow_zero3_theory(kw: dict[str, int]) -> None:
    spec = _cluster(**kw)
    s, r, t, k, pp = spec.dp_shard, spec.dp_replicate, spec.tp, spec.hpz, spec.pp
    p = plan(memory_spec(spec))
    units = [u.padded_numel for u in p.units]
    psi, blocks = sum(units), sum(units[1:])
    # the TP-local model: every matrix / T, norms replicated; the stage: layers / P
    full = plan(PlanSpec(hf_config=_llama(4 // pp), world_size=s, batch=2, seq=32))
    norms = sum(n for u in full.units for sh in u.shapes if len(sh) == 1 for n in sh)
    assert sum(u.numel for u in p.units) == (full.n_params - norms) // t + norms
    v = volumes(spec, units)
    regather = 0 if (k or pp > 1) else (s - 1) / s * 2 * blocks
    assert v["dp_shard"]["all_gather"] == pytest.approx((s - 1) / s * 2 * psi + regather)
    assert v["dp_shard"]["reduce_scatter"] == pytest.approx((s - 1) / s * 4 * psi)
    if k:
        assert v["dp_shard"]["all_gather_hpz"] == pytest.approx((k - 1) / k * 2 * blocks)
    assert v["dp_replicate"]["all_reduce"] == pytest.approx(2 * (r - 1) / r * 4 * psi / s)
    m = spec.microbatches
    act = 2 * 32 * 64 * 2  # b s d, bf16
    tp_calls = ((8 + 4) * 4 / pp + 4) * m  # full AC: 4 fwd + 4 bwd + 4 recompute per block
    assert v["tp"]["all_gather+reduce_scatter"] == pytest.approx(tp_calls * (t - 1) / t * act)
    assert v["pp"]["send_recv"] == pytest.approx(2 * m * act / t if pp > 1 else 0)
    # per-GPU model states: 16 bytes per local shard element (fp32 params, grads, AdamW)
    cp = cluster_plan(spec)
    shard = sum(u.shard_numel for u in p.units)
    step = cp.memory.events[-1].bytes
    assert step["sharded params"] + step["sharded grads"] + step["optimizer states"] == 16 * shard
    assert shard == sum(
        -(-sh[0] // s) * (int(torch.tensor(sh).prod()) // sh[0]) for u in p.units for sh in u.shapes
    )


def test_cluster_cli_json_and_budget_ranking(capsys: pytest.CaptureFixture[str]) -> None:
    cfg = json.dumps(
        {
            "model_type": "llama",
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 4,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "vocab_size": 96,
        }
    )
    common = ["--hf-config", cfg, "--gpus", "16", "--batch", "2", "--seq", "32", "--ac", "full"]
    assert main([*common, "--json", "--reserve"]) == 0
    out = json.loads(capsys.readouterr().out)
    for key in ("peak_memory_gib", "reserved_memory_gib", "step_time_s", "tokens_per_s_per_gpu"):
        assert out[key] > 0, key
    assert 0 < out["mfu"] < 1 and out["exposed_comm_s"] >= 0
    assert out["comm"]["dp_shard"]["group"] == 16 and out["comm"]["dp_shard"]["link"] == "network"
    assert main([*common, "--json", "--budget", "80GiB"]) == 0
    ranking = json.loads(capsys.readouterr().out)["ranking"]
    tps = [r["tokens_per_s_per_gpu"] for r in ranking if r["fits"]]
    assert len(tps) >= 4 and tps == sorted(tps, reverse=True)
    assert any("TP 2" in r["config"] for r in ranking) and any(
        "HSDP" in r["config"] for r in ranking
    )
    # without --ac, the AC mode is ranked too
    bare = ["--hf-config", cfg, "--gpus", "8", "--batch", "2", "--seq", "32"]
    assert main([*bare, "--json", "--budget", "80GiB"]) == 0
    ranking = json.loads(capsys.readouterr().out)["ranking"]
    assert {r["config"].rsplit("AC ", 1)[1] for r in ranking} == {"none", "selective", "full"}


def test_405b_at_512_gpus_plans_in_seconds(monkeypatch: pytest.MonkeyPatch) -> None:
    """Llama 3.1 405B, 512 GPUs (FSDP 8 x TP 8 x PP 8): three traced blocks, not 126."""
    import time

    import fullshard.memory.planner as planner
    from fullshard.memory.cluster_cli import HF_SHAPES
    from fullshard.train import hf

    built: list[int] = []
    build = planner.build_model

    def spy(spec: PlanSpec) -> torch.nn.Module:
        model = build(spec)
        built.append(len(model.model.layers))  # type: ignore[arg-type, union-attr]
        return model

    monkeypatch.setattr(planner, "build_model", spy)

    cfg = hf.make_config(dict(HF_SHAPES["llama3.1-405b"]))
    start = time.perf_counter()
    spec = ClusterSpec(
        hf_config=cfg,
        gpu=gpu("h100"),
        gpus=512,
        tp=8,
        pp=8,
        batch=4,
        local_batch=32,
        seq=8192,
        ac="full",
    )
    p = cluster_plan(spec)
    assert time.perf_counter() - start < 60
    assert built == [3]  # the stage's 16 blocks, traced as 3
    # the whole model from one GPU's stage: matrices x TP, blocks x stages (Meta: 405.9 B)
    assert model_params(spec, p.memory) == pytest.approx(405.85e9, rel=0.01)
    assert p.comm["tp"]["link"] == "nvlink" and p.comm["dp_shard"]["link"] == "network"
    assert p.comm["pp"]["group"] == 8 and p.bubble_s > 0


def test_units_kept_after_forward_are_gathered_one_at_a_time() -> None:
    """reshard_after_forward=False (what PP runs): each unit is gathered when forward reaches
    it (plus the prefetch) and then kept, not all at the step's start with all their buffers."""
    cfg = GPTConfig(n_layer=6, d_model=64, n_head=4, seq_len=32, tie_embeddings=False)
    spec = PlanSpec(
        model=cfg,
        world_size=4,
        batch=1,
        seq=32,
        reshard_after_forward=False,
        engine="fullshard-nccl",
    )
    p = plan(spec)
    first = next(e for e in p.events if e.label.startswith("all-gather"))
    assert first.label.startswith("all-gather of root, blocks.0 ("), first.label
    kept = {e.label: e.bytes.get("gathered units", 0) for e in p.events}
    assert kept["loss"] == sum(u.padded_numel * 4 for u in p.units)  # all kept until backward


def test_exposed_communication_follows_the_overlap_model() -> None:
    """[Note: the time model]: a collective costs (n-1) alpha + v / bandwidth; what the
    prefetch schedule cannot hide under compute is exposed, never more than all of it, and
    the step is compute + exposed + optimizer."""
    from fullshard.memory.timing import collective_time, link_for

    h100 = gpu("h100")
    net = link_for(h100, 16, 1, 8)
    assert net.kind == "network" and link_for(h100, 8, 1, 8).kind == "nvlink"
    assert link_for(h100, 8, 2, 8).kind == "network"  # 8 ranks 2 apart span two nodes
    assert collective_time(16, 1e9, net) == pytest.approx(15 * net.alpha_s + 1e9 / net.bytes_per_s)
    fast, slow = (
        cluster_plan(_cluster(gpus=16, gpu=gpu("h100", {"network_bytes_per_s": bw})))
        for bw in (1e15, 1e6)
    )
    for p in (fast, slow):
        assert p.step_time_s == pytest.approx(p.compute_s + p.exposed_comm_s + p.optimizer_s)
    assert fast.compute_s == slow.compute_s
    # at 1 MB/s the wire dwarfs the compute: nearly every byte is exposed, and no more
    link = link_for(slow.spec.gpu, 16, 1, 8)
    wire = sum(slow.comm["dp_shard"]["collectives"].values()) / link.bytes_per_s
    assert (
        0.9 * wire < slow.exposed_comm_s <= wire + 16 * 15 * link.alpha_s * len(slow.memory.units)
    )
    assert fast.exposed_comm_s < 0.01 * slow.exposed_comm_s


def test_hugging_face_models_trace_their_eager_causal_attention() -> None:
    """transformers takes fake tensors for graph tracing and would build an explicit causal
    mask; a real unpadded training batch calls SDPA with is_causal=True, as the trace must."""
    p = plan(PlanSpec(hf_config=_llama(), world_size=2, batch=2, seq=32))
    attn = sum(x.attn_flops for x in p.segments)
    assert attn > 0 and sum(x.causal_attn_flops for x in p.segments) == attn
