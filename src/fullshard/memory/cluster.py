"""``fullshard plan --gpus N``: memory, step time and traffic per GPU of a cluster-scale run.

[Note: the ZeRO-3 theory per mesh dimension]
Ranks are laid out as torchtitan's ``(pp, dp_replicate, dp_shard, tp)`` mesh, TP innermost
(contiguous ranks, so a TP group of <= ``gpus_per_node`` stays on NVLink). ``S = dp_shard``,
``R = dp_replicate``, ``T = tp``, ``P = pp``. Of a model of ``Psi`` parameters each GPU owns
the TP-local part of its pipeline stage, ``Psi_l ~ Psi / (T P)`` (norm weights are replicated
over TP, so slightly more), and keeps per GPU (``b_p``: param dtype bytes, 2 for bf16)::

    sharded params, grads, AdamW states     16 Psi_l / S          (fp32 masters: 4 + 4 + 8)
    gathered units                           b_p * (units in flight) of Psi_l / L each
    hpZ (reshard_after_forward=k)            + b_p Psi_l / k      (the copy kept for backward)
    activations                              traced on the TP-local model; with sequence
                                             parallelism the residual stream's are / T,
                                             except the ones a matmul reads (the
                                             all-gathered inputs of column-parallel linears)

The TP-local model divides the attention heads, KV heads, MLP width and vocabulary by ``T``
(embedding and head sharded over the vocabulary, the loss computed on sharded logits:
torchtitan's loss parallel); norms stay whole.

The collective volumes per step, bytes each rank sends (ring: ``(n-1)/n`` of the buffer)::

    dp_shard  all-gather      (S-1)/S * b_p Psi_l       forward, and again in backward unless
                                                        the unit stays gathered (root, PP);
                                                        hpZ: the backward one over k ranks
    dp_shard  reduce-scatter  (S-1)/S * b_r Psi_l       b_r: reduce dtype bytes (fp32: 4)
    dp_replicate all-reduce   2 (R-1)/R * b_r Psi_l / S (HSDP: the shards' gradients)
    tp        all-gather / reduce-scatter of [b, s, d] activations, (T-1)/T * b_p b s d each:
              4 per block forward, 4 backward, 4 more with full AC's recompute (2 with
              selective AC: torchtitan's policy saves the reduce-scatters' outputs), 2 + 2 for
              the embedding and the head, per micro-batch
    pp        one [b, s, d] / T activation forward and its gradient backward per micro-batch

which ``tests/test_plan_cluster.py`` checks against these formulas for each degree. The
memory comes from :func:`fullshard.memory.planner.plan` of the TP-local stage (its engine
model ``fullshard-nccl``), the time from :mod:`fullshard.memory.timing`.

Pipeline parallelism is modelled as torchtitan runs it (1F1B, ``reshard_after_forward=False``):
the stage keeps its units gathered, accumulates unsharded fp32 gradients over its
``m`` micro-batches, holds ``min(P, m)`` micro-batches' activations (the first stage), and
takes ``(m + P - 1)`` micro-batch times per step. One stage is planned with the embedding and
the head both (the maximum over stages, as torchtitan reports it).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

import torch

from fullshard.memory.ac import ac_mode
from fullshard.memory.hardware import GPU
from fullshard.memory.planner import Plan, PlanSpec, Segment, plan
from fullshard.memory.timing import (
    CAUSAL_SKIP,
    HBM_EFFICIENCY,
    OPTIMIZER_BYTES_PER_PARAM,
    SegmentCost,
    collective_time,
    compute_time,
    link_for,
)
from fullshard.models import GPTConfig

__all__ = [
    "RESERVE_FRACTION",
    "ClusterPlan",
    "ClusterSpec",
    "cluster_plan",
    "model_params",
    "volumes",
]

#: The CUDA caching allocator's reserve above the peak of live tensors (what
#: ``torch.cuda.max_memory_reserved`` adds to ``max_memory_allocated``: block rounding and
#: fragmentation). Fitted on one row only, torchtitan's Llama 3.1 8B on 8 H100 (FSDP, eager),
#: whose published memory is the reserved peak.
RESERVE_FRACTION = 0.20


@dataclass(kw_only=True, frozen=True)
class ClusterSpec:
    """A training run across a cluster: the model, the mesh, the batch, the hardware."""

    model: GPTConfig | None = None
    hf_config: Any = None
    gpus: int
    gpu: GPU
    gpus_per_node: int | None = None
    """``None``: the GPU's."""
    dp_replicate: int = 1
    dp_shard: int = -1
    """-1: what the other degrees leave (``gpus / (dp_replicate * tp * pp)``)."""
    tp: int = 1
    pp: int = 1
    hpz: int = 0
    """``reshard_after_forward=k``: keep a copy sharded over ``k`` ranks for backward (0: off)."""
    batch: int
    """Micro-batch per data-parallel rank (sequences)."""
    seq: int
    local_batch: int | None = None
    """Sequences per data-parallel rank per step (default ``batch``); with PP the stage runs
    ``local_batch / batch`` micro-batches."""
    param_dtype: torch.dtype = torch.bfloat16
    reduce_dtype: torch.dtype = torch.float32
    ac: str = "full"
    compile: bool = False
    float8: bool = False
    optimizer: str = "adamw"

    def __post_init__(self) -> None:
        ac_mode(self.ac)
        other = self.dp_replicate * self.tp * self.pp
        if self.dp_shard == -1:
            if self.gpus % other:
                raise ValueError(
                    f"--gpus {self.gpus} is not a multiple of dp_replicate x tp x pp = {other}"
                )
            object.__setattr__(self, "dp_shard", self.gpus // other)
        if self.dp_shard * other != self.gpus:
            raise ValueError(
                f"dp_replicate {self.dp_replicate} x dp_shard {self.dp_shard} x tp {self.tp} x "
                f"pp {self.pp} = {self.dp_shard * other}, not --gpus {self.gpus}"
            )
        if self.hpz and (self.hpz < 1 or self.dp_shard % self.hpz):
            raise ValueError(f"--hpz {self.hpz} must divide dp_shard {self.dp_shard}")
        if self.microbatches * self.batch != (self.local_batch or self.batch):
            raise ValueError(
                f"local batch {self.local_batch} is not a multiple of the micro-batch {self.batch}"
            )
        if self.float8 and not self.gpu.fp8_flops:
            raise ValueError(f"--float8: {self.gpu.name} has no fp8 tensor cores")

    @property
    def node(self) -> int:
        return self.gpus_per_node or self.gpu.gpus_per_node

    @property
    def microbatches(self) -> int:
        return max(1, (self.local_batch or self.batch) // self.batch)

    @property
    def mesh(self) -> str:
        dims = [("pp", self.pp), ("dp_replicate", self.dp_replicate)]
        dims += [("dp_shard", self.dp_shard), ("tp", self.tp)]
        return " x ".join(f"{n} {d}" for n, d in dims if d > 1 or n == "dp_shard")


# ---- the per-GPU model: TP-local shapes, one pipeline stage -----------------------------------


def _hf_local(cfg: Any, tp: int, layers: int) -> Any:
    import copy

    out = copy.deepcopy(cfg)
    heads = cfg.num_attention_heads
    kv = getattr(cfg, "num_key_value_heads", None) or heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    for name, n in (
        ("num_attention_heads", heads),
        ("num_key_value_heads", kv),
        ("intermediate_size", cfg.intermediate_size),
        ("vocab_size", cfg.vocab_size),
    ):
        if n % tp:
            raise ValueError(f"--tp {tp} does not divide the model's {name} ({n})")
        setattr(out, name, n // tp)
    out.head_dim = head_dim
    out.num_hidden_layers = layers
    return out


def local_configs(spec: ClusterSpec) -> tuple[GPTConfig | None, Any]:
    """The configs of one GPU's model: its pipeline stage, its TP shard of every matrix."""
    if spec.model is not None:
        if spec.tp > 1:
            raise ValueError("--tp needs a Hugging Face (Llama-style) config: --hf-config")
        layers = math.ceil(spec.model.n_layer / spec.pp)
        return dataclasses.replace(spec.model, n_layer=layers), None
    layers = math.ceil(spec.hf_config.num_hidden_layers / spec.pp)
    return None, _hf_local(spec.hf_config, spec.tp, layers)


def memory_spec(spec: ClusterSpec) -> PlanSpec:
    """What :func:`fullshard.memory.planner.plan` traces for one GPU."""
    model, hf = local_configs(spec)
    r, s = spec.dp_replicate, spec.dp_shard
    return PlanSpec(
        model=model,
        hf_config=hf,
        world_size=r * s,
        mesh=(r, s) if r > 1 else None,
        param_dtype=spec.param_dtype,
        batch=spec.batch,
        seq=spec.seq,
        optimizer=spec.optimizer,
        ac=spec.ac,
        tp=spec.tp,
        reshard_after_forward=spec.pp == 1,
        engine="fullshard-nccl",
    )


# ---- traffic -----------------------------------------------------------------------------------


def _bytes(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _width(spec: ClusterSpec) -> int:
    return spec.model.d_model if spec.model is not None else int(spec.hf_config.hidden_size)


def _layers(spec: ClusterSpec) -> int:
    return spec.model.n_layer if spec.model is not None else int(spec.hf_config.num_hidden_layers)


def volumes(spec: ClusterSpec, unit_numels: list[int]) -> dict[str, dict[str, float]]:
    """Bytes each GPU sends per step, by mesh dimension and collective ([Note: the ZeRO-3
    theory per mesh dimension]). ``unit_numels``: the TP-local padded numel of each unit,
    the root first."""
    s, r, t, k = spec.dp_shard, spec.dp_replicate, spec.tp, spec.hpz
    bp, br = _bytes(spec.param_dtype), _bytes(spec.reduce_dtype)
    psi = sum(unit_numels)
    blocks = sum(unit_numels[1:])
    out: dict[str, dict[str, float]] = {}
    ag = (s - 1) / s * bp * psi
    if spec.pp == 1 and not k:  # blocks gather again in backward; the root stays gathered
        ag += (s - 1) / s * bp * blocks
    out["dp_shard"] = {"all_gather": ag, "reduce_scatter": (s - 1) / s * br * psi}
    if k and spec.pp == 1:
        out["dp_shard"]["all_gather_hpz"] = (k - 1) / k * bp * blocks
    out["dp_replicate"] = {"all_reduce": 2 * (r - 1) / r * br * psi / s}
    act = spec.batch * spec.seq * _width(spec) * bp
    per_block = 8 + {"full": 4, "selective": 2, "none": 0}[ac_mode(spec.ac)]
    n_tp = (per_block * _layers(spec) / spec.pp + 4) * spec.microbatches
    out["tp"] = {"all_gather+reduce_scatter": n_tp * (t - 1) / t * act}
    out["pp"] = {"send_recv": (2 * spec.microbatches * act / t) if spec.pp > 1 else 0.0}
    return out


# ---- the plan ----------------------------------------------------------------------------------


@dataclass
class ClusterPlan:
    """The prediction for one GPU of the cluster."""

    spec: ClusterSpec
    memory: Plan
    peak_bytes: int
    reserved_bytes: int
    step_time_s: float
    compute_s: float
    exposed_comm_s: float
    optimizer_s: float
    bubble_s: float
    tokens_per_s_per_gpu: float
    mfu: float
    flops_per_token: float
    comm: dict[str, dict[str, Any]] = field(default_factory=dict)

    def to_dict(self, reserve: bool = False) -> dict[str, Any]:
        d = {
            "gpus": self.spec.gpus,
            "gpu": self.spec.gpu.name,
            "mesh": self.spec.mesh,
            "peak_memory_gib": self.peak_bytes / 2**30,
            "step_time_s": self.step_time_s,
            "tokens_per_s_per_gpu": self.tokens_per_s_per_gpu,
            "mfu": self.mfu,
            "exposed_comm_s": self.exposed_comm_s,
            "compute_s": self.compute_s,
            "optimizer_s": self.optimizer_s,
            "pipeline_bubble_s": self.bubble_s,
            "model_flops_per_token": self.flops_per_token,
            "comm": self.comm,
            "memory": self.memory.to_dict(),
        }
        if reserve:
            d["reserved_memory_gib"] = self.reserved_bytes / 2**30
        return d


def _flops_per_token(spec: ClusterSpec, n_params: int) -> float:
    """torchtitan's MFU numerator: ``6 N + 12 L H Q T`` (N without the input embedding)."""
    if spec.model is not None:
        c = spec.model
        heads, width, vocab, layers = c.n_head, c.d_model, c.vocab_size, c.n_layer
    else:
        c = spec.hf_config
        heads, width, vocab = c.num_attention_heads, c.hidden_size, c.vocab_size
        layers = c.num_hidden_layers
    head_dim = getattr(c, "head_dim", None) or width // heads
    return 6 * (n_params - vocab * width) + 12 * layers * heads * head_dim * spec.seq


def model_params(spec: ClusterSpec, p: Plan) -> int:
    """The whole model's parameters from one GPU's TP-local stage: matrices x T (1-D weights
    are replicated over TP), blocks x P."""
    t = spec.tp
    per_unit = [sum(math.prod(s) * (t if len(s) > 1 else 1) for s in u.shapes) for u in p.units]
    return per_unit[0] + sum(per_unit[1:]) * _layers(spec) // max(1, len(p.units) - 1)


def _peak_bytes(spec: ClusterSpec, p: Plan, numels: list[int], bp: int) -> int:
    """One GPU's peak: the memory plan's, plus hpZ's secondary copies and, with pipeline
    stages, the micro-batches 1F1B keeps in flight."""
    t, m = spec.tp, spec.microbatches
    peak = p.peak.total
    if spec.hpz and spec.pp == 1:
        peak += bp * sum(numels[1:]) // spec.hpz
    if spec.pp > 1:
        # 1F1B: the first stage holds min(P, m) micro-batches' block activations (what its
        # blocks keep for backward, from the first block's input to the last block's output)
        blk = [i for i, x in enumerate(p.segments) if x.phase == "forward" and x.unit > 0]
        into, out_of = p.segments[blk[0]], p.segments[blk[-1] + 1]

        def held(x: Segment) -> int:
            return x.start - x.start_grads - x.start_hidden + x.start_hidden // t

        saved = held(out_of) - held(into) + spec.batch * spec.seq * _width(spec) * bp // t
        peak += (min(spec.pp, m) - 1) * max(saved, 0)
        if m > 1:
            peak += 4 * sum(numels)  # unsharded fp32 gradients accumulated over micro-batches
    return peak


def _compute_chunks(spec: ClusterSpec, p: Plan) -> tuple[list[list[float]], list[list[float]]]:
    """The compute of each unit's forward and backward in schedule order, ``[unit,
    seconds]`` per chunk (the root's forward first, its backward last)."""
    g, t = spec.gpu, spec.tp
    hid = 1 - 1 / t

    def seconds(s: Segment) -> float:
        c = SegmentCost(
            mm_flops=s.mm_flops,
            attn_flops=s.attn_flops - CAUSAL_SKIP * s.causal_attn_flops,
            mem_bytes=s.mem_bytes - hid * s.hidden_mem_bytes,
            mm_operand_bytes=s.mm_operand_bytes,
        )
        return compute_time(
            c, g, compile=spec.compile, float8=spec.float8, fp32=spec.param_dtype == torch.float32
        )

    fwd: list[list[float]] = [[0, 0.0]]
    bwd: list[list[float]] = []
    for seg in p.segments:
        if seg.phase == "forward":
            if seg.unit > 0:
                fwd.append([seg.unit, 0.0])
            fwd[-1][1] += seconds(seg)
        else:
            if seg.unit > 0 or not bwd:
                bwd.append([max(seg.unit, 0), 0.0])
            bwd[-1][1] += seconds(seg)
    return fwd, bwd


def _comm_summary(vol: dict[str, dict[str, float]], links: list[tuple[Any, int]]) -> dict[str, Any]:
    """Per parallel dimension: bytes per step, the collectives, the link and the group size."""
    return {
        dim: {
            "bytes_per_step": sum(v.values()),
            "collectives": v,
            "link": link.kind,
            "group": n,
        }
        for (dim, v), (link, n) in zip(
            vol.items(),
            links,
        )
    }


def cluster_plan(spec: ClusterSpec) -> ClusterPlan:
    """Plan one GPU of ``spec``'s cluster: memory, step time, traffic ([Note: the time model])."""
    g, t = spec.gpu, spec.tp
    mspec = memory_spec(spec)
    p = plan(mspec)
    m = spec.microbatches
    bp = _bytes(spec.param_dtype)
    numels = [u.padded_numel for u in p.units]
    peak = _peak_bytes(spec, p, numels, bp)
    reserved = int(peak * (1 + RESERVE_FRACTION))
    vol = volumes(spec, numels)
    s_, r_, k = spec.dp_shard, spec.dp_replicate, spec.hpz
    shard_link = link_for(g, s_, t, spec.node)
    hpz_link = link_for(g, k, t, spec.node) if k else shard_link
    rep_link = link_for(g, r_, t * s_, spec.node)
    tp_link = link_for(g, t, 1, spec.node)
    pp_link = link_for(g, spec.pp, t * s_ * r_, spec.node)
    bpr = _bytes(spec.reduce_dtype)

    def ag(u: int, n: int, link: Any) -> float:
        return collective_time(n, (n - 1) / n * bp * numels[u], link)

    def rs(u: int) -> float:
        shard = numels[u] / s_
        return collective_time(s_, (s_ - 1) / s_ * bpr * numels[u], shard_link) + collective_time(
            r_, 2 * (r_ - 1) / r_ * bpr * shard, rep_link
        )

    fwd, bwd = _compute_chunks(spec, p)
    compute = sum(c for _, c in fwd) + sum(c for _, c in bwd)
    # overlap: the next unit's gather under this chunk (forward); the next gather and the
    # previous unit's reduction under this chunk (backward)
    exposed = ag(0, s_, shard_link)
    for i, (_, c) in enumerate(fwd):
        nxt = ag(int(fwd[i + 1][0]), s_, shard_link) if i + 1 < len(fwd) else 0.0
        exposed += max(0.0, nxt - c)
    regather = spec.pp == 1
    prev_rs = 0.0
    for i, (u, c) in enumerate(bwd):
        nxt_u = int(bwd[i + 1][0]) if i + 1 < len(bwd) else 0
        nxt = ag(nxt_u, k or s_, hpz_link) if regather and nxt_u > 0 else 0.0
        exposed += max(0.0, nxt + prev_rs - c)
        prev_rs = rs(int(u)) if u > 0 else 0.0
    exposed += prev_rs + rs(0)
    tp_s = collective_time(t, vol["tp"]["all_gather+reduce_scatter"] / m, tp_link)
    tp_calls = (8 + {"full": 4, "selective": 2, "none": 0}[ac_mode(spec.ac)]) * _layers(
        spec
    ) / spec.pp + 4
    tp_s = 0.0 if t == 1 else tp_s + (tp_calls - 1) * (t - 1) * tp_link.alpha_s
    pp_s = collective_time(spec.pp, vol["pp"]["send_recv"] / m, pp_link)
    per_mb = compute + tp_s + pp_s
    bubble = (spec.pp - 1) * per_mb if spec.pp > 1 else 0.0
    shard_numel = sum(u.shard_numel for u in p.units)
    opt = shard_numel * OPTIMIZER_BYTES_PER_PARAM / (g.hbm_bytes_per_s * HBM_EFFICIENCY)
    step = m * per_mb + bubble + exposed + opt
    tokens = (spec.local_batch or spec.batch) * spec.seq / t / spec.pp  # per GPU per step
    n_full = model_params(spec, p)
    fpt = _flops_per_token(spec, n_full)
    tps = tokens / step
    links = [(shard_link, s_), (rep_link, r_), (tp_link, t), (pp_link, spec.pp)]
    comm = _comm_summary(vol, links)
    comm["tp"]["exposed_s"] = m * tp_s
    comm["pp"]["exposed_s"] = m * pp_s
    comm["dp"] = {"exposed_s": exposed}
    return ClusterPlan(
        spec=spec,
        memory=p,
        peak_bytes=peak,
        reserved_bytes=reserved,
        step_time_s=step,
        compute_s=m * compute,
        exposed_comm_s=exposed + m * (tp_s + pp_s),
        optimizer_s=opt,
        bubble_s=bubble,
        tokens_per_s_per_gpu=tps,
        mfu=tps * fpt / g.bf16_flops,
        flops_per_token=fpt,
        comm=comm,
    )
