"""Context parallelism for diffusers' CosmosTransformer3DModel (video self-attention, text cross-attention).

Video tokens are sharded (padded to a multiple of the sequence degree); self-attention becomes
context-parallel, cross-attention stays local (each rank's queries against the replicated text,
no communication). It runs on the generic path (engines/parallel/generic.py): diffusers' own forward with
COSMOS_PLAN, the rotary tables and position embedding split as their modules return them, the patchified tokens at
the first block, and per-frame time embeddings (per token: diffusers expands them in its body, after any module)
at every block and the final norm. On 2 H200s its step equals the hand-written forward it replaced
(docs/models.md).
"""
from __future__ import annotations

from typing import Any

import torch
from diffusers.models._modeling_parallel import ContextParallelInput, ContextParallelOutput
from diffusers.models.embeddings import apply_rotary_emb
from diffusers.models.transformers.transformer_cosmos import CosmosTransformer3DModel

from engines.parallel.generic import ParallelGeneric, SplitProcessor, generic_adapter
from engines.parallel.mesh import ParallelMesh
from engines.parallel.tensor_parallel import COLUMN, ROW, LinearSplit, WeightSplit, local_heads


class CosmosContextParallelProcessor(SplitProcessor):
    """CosmosAttnProcessor2_0 for self-attention (attn1), with the attention call made context-parallel."""

    def __call__(
        self,
        attn: Any,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        image_rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        if image_rotary_emb is None:
            raise ValueError("the context-parallel Cosmos processor needs the rotary embedding of its split tokens")
        if encoder_hidden_states is not None or attention_mask is not None:
            raise ValueError("the context-parallel Cosmos processor serves self-attention only (no context, no mask)")
        query = attn.to_q(hidden_states).unflatten(2, (attn.heads, -1)).transpose(1, 2)
        key = attn.to_k(hidden_states).unflatten(2, (attn.heads, -1)).transpose(1, 2)
        value = attn.to_v(hidden_states).unflatten(2, (attn.heads, -1)).transpose(1, 2)
        query = attn.norm_q(query)
        key = attn.norm_k(key)
        query = apply_rotary_emb(query, image_rotary_emb, use_real=True, use_real_unbind_dim=-2)
        key = apply_rotary_emb(key, image_rotary_emb, use_real=True, use_real_unbind_dim=-2)
        # grouped-query attention, as in diffusers (a no-op for Cosmos' equal head counts)
        key = key.repeat_interleave(query.size(3) // key.size(3), dim=3)
        value = value.repeat_interleave(query.size(3) // value.size(3), dim=3)

        hidden_states = self.attention(
            query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), layout=self.layout()
        )
        hidden_states = hidden_states.flatten(2, 3).type_as(query)
        return attn.to_out[1](attn.to_out[0](hidden_states))


def cosmos_weights(model: CosmosTransformer3DModel, tp: int) -> WeightSplit:
    """Cosmos' tensor-parallel split (engines.parallel.tensor_parallel): per block, the self- and cross-attention's
    q/k/v (the cross-attention's k/v from the replicated text) and the MLP-in column-parallel, their
    outputs and the MLP-out row-parallel; the AdaLN(-LoRA) modulation stays whole. diffusers' processor
    reads `heads` from the attention module: each rank's count is set there."""
    if model.config.img_context_dim_in:
        raise ValueError("tensor parallelism does not split Cosmos' image-context cross-attention (Predict2.5)")
    linears: dict[str, LinearSplit] = {}
    for index in range(len(model.transformer_blocks)):
        prefix = f"transformer_blocks.{index}"
        for attn in ("attn1", "attn2"):
            linears |= {f"{prefix}.{attn}.{name}": COLUMN for name in ("to_q", "to_k", "to_v")}
            linears[f"{prefix}.{attn}.to_out.0"] = ROW
        linears |= {f"{prefix}.ff.net.0.proj": COLUMN, f"{prefix}.ff.net.2": ROW}
    heads = {"heads": local_heads(model.config.num_attention_heads, tp)}
    return WeightSplit(linears=linears, head_counts={f"transformer_blocks.{i}.{attn}": heads
                                                     for i in range(len(model.transformer_blocks))
                                                     for attn in ("attn1", "attn2")})


_TOKENS = ContextParallelInput(split_dim=1, expected_dims=3)
"""Per-token tensors [B, S, C]; a [B, C] one (the time embeddings of one timestep a sample) stays whole."""
_ROTARY = ContextParallelInput(split_dim=0, expected_dims=2, split_output=True)

COSMOS_PLAN = {
    "rope": {0: _ROTARY, 1: _ROTARY},
    "learnable_pos_embed": {0: ContextParallelInput(split_dim=1, expected_dims=3, split_output=True)},
    "transformer_blocks.0": {"hidden_states": _TOKENS},
    "transformer_blocks.*": {"embedded_timestep": _TOKENS, "temb": _TOKENS},
    "norm_out": {"embedded_timestep": _TOKENS, "temb": _TOKENS},
    "proj_out": ContextParallelOutput(gather_dim=1, expected_dims=3),
}
"""Where Cosmos' tokens are split and gathered on the generic path: the rotary tables and the learnable position
embedding as they are made (on the whole grid, as diffusers makes them), the patchified tokens at the first block,
per-frame time embeddings (video-to-world: per token) at each block and the final norm, the output gathered after
proj_out (diffusers' unpatchify then runs on the whole sequence)."""


def parallelize_cosmos(model: CosmosTransformer3DModel, mesh: ParallelMesh) -> ParallelGeneric:
    """Cosmos on the generic path (engines/parallel/generic.py): diffusers' forward with COSMOS_PLAN, this module's
    processor in the self-attentions (diffusers' take no parallel_config), the cross-attentions local; its block
    weights split over the tp ranks (not undone by restore())."""
    if model.config.controlnet_block_every_n is not None:
        raise ValueError("Cosmos transformers with controlnet blocks are not supported by parallelize_cosmos")
    plan = {path: entry for path, entry in COSMOS_PLAN.items()
            if path != "learnable_pos_embed" or model.learnable_pos_embed is not None}
    return generic_adapter(plan=plan, shared=("padding_mask",), weights=cosmos_weights,
                           processor={"transformer_blocks.*.attn1": CosmosContextParallelProcessor})(model, mesh)
