"""``fullshard plan --gpus N ...``: the cluster planner's flags, output and ``--budget`` ranking.

Examples::

    fullshard plan --preset llama3.1-8b --gpus 8 --gpu h100 --batch 2 --seq 8192 --ac selective
    fullshard plan --preset llama3.1-70b --gpus 256 --gpu h100 --tp 8 --batch 16 --seq 8192 \\
        --ac full --compile --float8 --json
    fullshard plan --preset llama3.1-405b --gpus 512 --gpu h100 --budget 80GiB --batch 1 --seq 8192
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import sys
from typing import TYPE_CHECKING, Any

from fullshard.memory.hardware import GPUS

if TYPE_CHECKING:
    from fullshard.memory.cluster import ClusterPlan, ClusterSpec
    from fullshard.memory.planner import PlanSpec

__all__ = ["HF_SHAPES", "add_arguments", "rank_configs", "run"]

_LLAMA3 = {
    "model_type": "llama",
    "vocab_size": 128256,
    "rope_theta": 500000.0,
    "rms_norm_eps": 1e-5,
    "max_position_embeddings": 131072,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
}
#: Llama 3.1 shapes (Meta's config.json of each size): ``--preset`` names for Hugging Face
#: models built from a config (nothing is downloaded).
HF_SHAPES: dict[str, dict[str, Any]] = {
    "llama3.1-8b": _LLAMA3
    | {
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
    },
    "llama3.1-70b": _LLAMA3
    | {
        "hidden_size": 8192,
        "intermediate_size": 28672,
        "num_hidden_layers": 80,
        "num_attention_heads": 64,
        "num_key_value_heads": 8,
    },
    "llama3.1-405b": _LLAMA3
    | {
        "hidden_size": 16384,
        "intermediate_size": 53248,
        "num_hidden_layers": 126,
        "num_attention_heads": 128,
        "num_key_value_heads": 8,
    },
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    c = p.add_argument_group(
        "cluster (--gpus N: memory, step time, tokens/s and traffic per GPU; see "
        "fullshard.memory.timing for the time model)"
    )
    c.add_argument("--gpus", type=int, help="GPUs in the run: plan at cluster scale")
    c.add_argument("--gpus-per-node", type=int, help="GPUs per NVLink domain (default: the GPU's)")
    c.add_argument("--gpu", choices=sorted(GPUS), default="h100", help="accelerator (table)")
    c.add_argument(
        "--gpu-set",
        action="append",
        default=[],
        metavar="FIELD=VALUE",
        help="override a field of the GPU table, e.g. bf16_flops=800e12 (repeatable)",
    )
    c.add_argument("--dp-replicate", type=int, default=1, help="HSDP replicas")
    c.add_argument("--dp-shard", type=int, default=-1, help="FSDP degree (-1: the rest)")
    c.add_argument("--tp", type=int, default=1, help="tensor-parallel degree (sequence parallel)")
    c.add_argument("--pp", type=int, default=1, help="pipeline stages (1F1B)")
    c.add_argument("--hpz", type=int, default=0, help="reshard_after_forward=k (hpZ) group size")
    c.add_argument("--local-batch", type=int, help="sequences per DP rank per step (PP)")
    c.add_argument("--compile", action="store_true", help="torch.compile (fused elementwise)")
    c.add_argument("--float8", action="store_true", help="float8 linears (fp8 tensor cores)")
    c.add_argument(
        "--reserve",
        action="store_true",
        help="also estimate the CUDA caching allocator's reserved peak",
    )


def _gpu_overrides(items: list[str]) -> dict[str, float]:
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"--gpu-set {item!r}: expected FIELD=VALUE")
        try:
            out[key.strip()] = float(value)
        except ValueError:
            raise ValueError(f"--gpu-set {item!r}: {value!r} is not a number") from None
    return out


def cluster_spec(args: argparse.Namespace, base: PlanSpec) -> ClusterSpec:
    """The run these flags describe; ``base`` is the single-machine spec of the same model."""
    import torch

    from fullshard.memory.cluster import ClusterSpec
    from fullshard.memory.hardware import gpu

    hf = base.hf_config
    if isinstance(hf, str):
        from transformers import AutoConfig

        hf = AutoConfig.from_pretrained(hf, local_files_only=True)
    return ClusterSpec(
        model=base.model,
        hf_config=hf,
        gpus=args.gpus,
        gpu=gpu(args.gpu, _gpu_overrides(args.gpu_set)),
        gpus_per_node=args.gpus_per_node,
        dp_replicate=args.dp_replicate,
        dp_shard=args.dp_shard,
        tp=args.tp,
        pp=args.pp,
        hpz=args.hpz,
        batch=base.batch,
        seq=base.seq,
        local_batch=args.local_batch,
        param_dtype=base.param_dtype if args.dtype else torch.bfloat16,
        ac=base.ac_mode,
        compile=args.compile,
        float8=args.float8,
        optimizer=base.optimizer,
    )


def rank_configs(
    spec: ClusterSpec, budget: int, acs: tuple[str, ...] | None = None
) -> list[tuple[str, ClusterPlan | None, str]]:
    """FSDP / HSDP / hpZ at each TP degree of a node (x each of ``acs``, default the spec's
    AC), ranked by predicted tokens/s among those whose peak fits ``budget``, then the rest;
    ``(name, plan, why not)``."""
    from fullshard.memory.cluster import cluster_plan

    node = spec.node
    out: list[tuple[str, ClusterPlan | None, str]] = []
    tps = [t for t in (1, 2, 4, 8) if t <= node and node % t == 0]
    for tp in tps:
        shard_in_node = node // tp
        rest = spec.gpus // (tp * spec.pp)
        meshes: list[tuple[str, dict[str, Any]]] = [
            (f"FSDP {rest}", {"dp_replicate": 1, "dp_shard": -1, "hpz": 0})
        ]
        if rest > shard_in_node > 1 and rest % shard_in_node == 0:
            meshes.append(
                (
                    f"HSDP {rest // shard_in_node}x{shard_in_node}",
                    {"dp_replicate": rest // shard_in_node, "dp_shard": shard_in_node, "hpz": 0},
                )
            )
            meshes.append(
                (
                    f"FSDP {rest} + hpZ {shard_in_node}",
                    {"dp_replicate": 1, "dp_shard": -1, "hpz": shard_in_node},
                )
            )
        for (mesh_name, dims), ac in itertools.product(meshes, acs or (spec.ac,)):
            name = f"{mesh_name}" + (f" x TP {tp}" if tp > 1 else "")
            name += f" x PP {spec.pp}" if spec.pp > 1 else ""
            try:
                s = dataclasses.replace(spec, tp=tp, ac=ac, **dims)
                p = cluster_plan(s)
            except ValueError as e:
                out.append((name, None, str(e)))
                continue
            why = "" if p.peak_bytes <= budget else "over budget"
            out.append((f"{name}, AC {s.ac}", p, why))
    fits = [o for o in out if o[1] is not None and not o[2]]
    fits.sort(key=lambda o: -o[1].tokens_per_s_per_gpu)  # type: ignore[union-attr]
    return fits + [o for o in out if o not in fits]


def _gib(n: float) -> str:
    return f"{n / 2**30:.1f} GiB"


def render(p: ClusterPlan, reserve: bool) -> str:
    from fullshard.memory.cluster import model_params

    s = p.spec
    flags = [f"AC {s.ac}", "compile" if s.compile else "eager"] + (["float8"] if s.float8 else [])
    lines = [
        f"fullshard plan: {model_params(s, p.memory) / 1e9:.2f} B params, "
        f"{s.gpus} x {s.gpu.name} ({s.node} per node), mesh {s.mesh}, micro-batch "
        f"{s.batch} x {s.seq}, {s.microbatches} micro-batch(es) per step, {', '.join(flags)}",
        "",
        f"peak memory per GPU (live tensors): {_gib(p.peak_bytes)}  at: {p.memory.peak.label}",
    ]
    if reserve:
        lines.append(f"with the caching allocator's reserve (estimate): {_gib(p.reserved_bytes)}")
    lines += [
        f"step time: {p.step_time_s:.3f} s  (compute {p.compute_s:.3f}, exposed comm "
        f"{p.exposed_comm_s:.3f}, optimizer {p.optimizer_s:.3f}, pipeline bubble {p.bubble_s:.3f})",
        f"tokens/s per GPU: {p.tokens_per_s_per_gpu:,.0f}   MFU: {100 * p.mfu:.1f}% "
        f"(6N + 12 L H Q T FLOPs per token, bf16 peak)",
        "traffic per GPU per step:",
    ]
    for dim, c in p.comm.items():
        if dim == "dp" or not c.get("bytes_per_step"):
            continue
        parts = ", ".join(f"{k} {v / 1e9:.2f} GB" for k, v in c["collectives"].items() if v)
        lines.append(f"  {dim:<13} over {c['group']} ranks ({c['link']}): {parts}")
    return "\n".join(lines)


def run(args: argparse.Namespace, base: PlanSpec, budget: int | None) -> int:
    """``fullshard plan --gpus N``: print (or ``--json``) the plan; rank configs under --budget."""
    from fullshard.memory.cluster import cluster_plan

    try:
        spec = cluster_spec(args, base)
        p = cluster_plan(spec)
    except ValueError as e:
        print(f"fullshard plan: {e}", file=sys.stderr)
        return 2
    result: dict[str, Any] = p.to_dict(args.reserve)
    text = [render(p, args.reserve)]
    status = 0
    if budget is not None:
        # without --ac, the AC mode is one of the choices too
        ranked = rank_configs(spec, budget, None if args.ac else ("none", "selective", "full"))
        text.append(f"\nconfigurations under {_gib(budget)} per GPU, by predicted tokens/s:")
        rows = []
        for name, q, why in ranked:
            if q is None:
                text.append(f"  {'-':>9}  {'-':>10}  {name}: {why}")
                continue
            mark = "  (over budget)" if why else ""
            text.append(
                f"  {q.tokens_per_s_per_gpu:>9,.0f}  {_gib(q.peak_bytes):>10}  {name}{mark}"
            )
            rows.append(
                {
                    "config": name,
                    "fits": not why,
                    "tokens_per_s_per_gpu": q.tokens_per_s_per_gpu,
                    "peak_memory_gib": q.peak_bytes / 2**30,
                    "step_time_s": q.step_time_s,
                }
            )
        result["ranking"] = rows
        if not any(r["fits"] for r in rows):
            status = 1
            text.append("nothing tried fits: more GPUs, a smaller micro-batch, or full AC")
    if args.json:
        json.dump(result, sys.stdout, indent=1)
        print()
    else:
        print("\n".join(text))
    return status
