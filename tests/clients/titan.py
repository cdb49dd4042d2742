"""torchtitan as a client (``test_clients.py``): its llama3 model, its FSDP and its chunked loss.

torchtitan's own pieces, as its trainer puts them together, at a tiny size on CPU/gloo: the
llama3 model built from its config (its debug flavour's layout, 2 layers of width 16), its
activation checkpointing (``FullAC``) or none, its FSDP application (``apply_fsdp_to_decoder``:
the embedding, each block, and the final norm with the output projection as one unit, then the
root) and its chunked cross-entropy (``ChunkedLossWrapper``, 8 chunks: the model stops at the
norm, the loss calls the output projection once per chunk, each chunk with a backward of its
own). Two substitutions for the CPU, the same under both engines: the blocks' inner attention
is torchtitan's SDPA module (its FlexAttention has no backward on CPU; torchtitan's own tests
swap it in the same way), and reductions are plain sums (``set_force_sum_reduction_for_comms``:
torchtitan turns FSDP's gradient division off, which FSDP2 does with a ``PREMUL_SUM`` gloo
lacks).

Per step: every unit's gathers before the first chunk, in each chunk and in the backward
through the blocks (``unit_gathers``), and the loss.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from clients import check_units, engine
from unit_gathers import by_part, unit_gathers

DIM, VOCAB, SEQ, CHUNKS, STEPS = 16, 64, 16, 8, 5
ROWS = 4  # global batch: rows of SEQ + 1 tokens


def tiny_llama3(ckpt: bool) -> nn.Module:
    """torchtitan's llama3 on the meta device, checkpointed (``FullAC``) if ``ckpt``."""
    from torchtitan.distributed.activation_checkpoint import FullAC
    from torchtitan.models import llama3
    from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm
    from torchtitan.models.common.attention import ScaledDotProductAttention

    cfg = llama3.Llama3Model.Config(
        dim=DIM,
        vocab_size=VOCAB,
        tok_embeddings=Embedding.Config(
            num_embeddings=VOCAB, embedding_dim=DIM, param_init=llama3._EMBEDDING_INIT
        ),
        norm=RMSNorm.Config(normalized_shape=DIM, param_init=llama3._NORM_INIT),
        lm_head=Linear.Config(
            in_features=DIM, out_features=VOCAB, param_init=llama3._output_linear_init(DIM)
        ),
        layers=llama3._build_llama3_layers(
            n_layers=2,
            dim=DIM,
            n_heads=2,
            hidden_dim=32,
            rope=ComplexRoPE.Config(dim=DIM // 2, max_seq_len=SEQ, theta=500000, scaling="llama"),
            attn_backend="flex",
        ),
    )
    for layer in cfg.layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    with torch.device("meta"):
        model = cfg.build()
    if ckpt:
        FullAC.Config().build().apply(model)
    return model


def shard_and_init(model: nn.Module) -> None:
    """torchtitan's FSDP (fp32), then its weight init on the CPU, as its trainer does."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule
    from torchtitan.distributed.fsdp import apply_fsdp_to_decoder

    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("fsdp",))
    fp32 = torch.float32
    apply_fsdp_to_decoder(model, mesh, param_dtype=fp32, reduce_dtype=fp32, pp_enabled=False)
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.set_force_sum_reduction_for_comms(True)
    torch.manual_seed(0)
    model.to_empty(device="cpu")
    with torch.no_grad():
        model.init_weights(buffer_device=None)  # type: ignore[operator]
    model.train()


def _units(model: nn.Module) -> dict[str, nn.Module]:
    return {
        "root": model,
        "tok_embeddings": model.tok_embeddings,
        "layers.0": model.layers["0"],  # type: ignore[index]
        "layers.1": model.layers["1"],  # type: ignore[index]
        "head": model.norm,  # with lm_head
    }


def _tokens(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(500 + step)
    rows = torch.randint(0, VOCAB, (ROWS, SEQ + 1), generator=g)
    per = ROWS // dist.get_world_size()
    mine = rows[dist.get_rank() * per : (dist.get_rank() + 1) * per]
    return mine[:, :-1], mine[:, 1:]


def _step(model: nn.Module, loss_fn: Any, name: str, step: int) -> dict[str, Any]:
    """One step's forward (to the norm), chunked loss and backward, as torchtitan's trainer
    runs them; the gathers of each part and the loss."""
    inputs, labels = _tokens(step)
    tokens = torch.tensor(float(labels.numel() * dist.get_world_size()))
    marks: list[int] = []
    with unit_gathers(name, _units(model)) as gathered:
        # a chunk starts at the output projection's pre-forward, before the unit's own
        hook = model.lm_head.register_forward_pre_hook(
            lambda *_: marks.append(len(gathered())), prepend=True
        )
        loss, _ = loss_fn(model(inputs), labels, tokens)
        hook.remove()
        marks.append(len(gathered()))  # then the backward through the blocks
        loss.backward()
        log = gathered()
    total = loss.detach().clone()
    dist.all_reduce(total)  # each rank's loss is its share of the global mean
    return {**by_part(log, marks), "loss": total.item()}


def torchtitan_client(name: str, ckpt: bool) -> list[dict[str, Any]]:
    """STEPS training steps (AdamW) of the tiny llama3 under ``name``'s engine."""
    from torchtitan.components.loss import ChunkedLossWrapper, CrossEntropyLoss
    from torchtitan.distributed import utils as titan_dist

    titan_dist.set_spmd_backend("partial_dtensor")  # plain data parallelism: no SPMD types
    with engine(name):
        model = tiny_llama3(ckpt)
        shard_and_init(model)
        check_units(model, name)
        loss_fn = ChunkedLossWrapper.Config(
            num_chunks=CHUNKS, loss_fn=CrossEntropyLoss.Config()
        ).build()
        loss_fn.set_lm_head(model.lm_head)
        model._skip_lm_head = True
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        steps = []
        for step in range(STEPS):
            steps.append(_step(model, loss_fn, name, step))
            opt.step()
            opt.zero_grad()
    return steps


def two_ranks() -> dict[str, Any]:
    """Both engines, without and with activation checkpointing (one spawn)."""
    return {
        (name, ckpt): torchtitan_client(name, ckpt)
        for ckpt in (False, True)
        for name in ("torch", "fullshard")
    }
