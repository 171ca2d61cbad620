"""Context parallelism for diffusers' FluxTransformer2DModel (joint text+image attention), on the generic path.

engines.parallel.generic runs diffusers' own forward with the class's `_cp_plan`: both token streams and their position
ids are split (each padded to a multiple of the sequence degree: rank s holds text chunk s and image chunk s), the
rotary embedding is computed from the split ids, so rope and tokens stay aligned, and the image tokens are gathered at
proj_out. FLUX's speed features, each undone by restore():
- pipelines/flux/attention.py: every FluxAttention's processor, with the attention call split and, for the all-gather
  strategy, the projections ordered around the K/V exchanges;
- pipelines/flux/blocks.py: with one sequence axis (Ulysses, ring or all-gather) and no tp axis, the 38 single-stream
  blocks become OverlappedSingleBlocks: same parameters and math, ordered so that the MLP computes while the
  attention's exchanges travel (diffusers' order leaves every exchange exposed);
- engines/parallel/modulation.py: with one sequence axis the AdaLN modulations of all blocks are computed once per
  forward and shared out over the ranks (flux_modulation says which);
- engines/parallel/tensor_parallel.py: with a tp axis every block's linears are split (flux_weights says how); this one
  is not undone (the weights that are not kept are gone).
Measured on 2 H200s, FLUX.1-dev 1024², in one run against the hand-written forward this path replaced: within 0.8%
on every plan (docs/models.md).
"""

from __future__ import annotations

from typing import Any

from diffusers.models.transformers.transformer_flux import FluxTransformer2DModel
from torch import nn

from engines.parallel.generic import generic_adapter
from engines.parallel.mesh import ParallelMesh
from engines.parallel.modulation import SharedModulation
from engines.parallel.tensor_parallel import COLUMN, ROW, LinearSplit, WeightSplit, local_heads
from pipelines.flux.attention import FluxContextParallelProcessor
from pipelines.flux.blocks import OverlappedSingleBlock


def _attention_weights(prefix: str, attn: nn.Module, streams: tuple[str, ...]) -> dict[str, LinearSplit]:
    """q/k/v projections of a FLUX attention (column-parallel), plain and, after diffusers'
    fuse_qkv_projections, fused (packed q, k, v): `streams` are the fused names, to_qkv and to_added_qkv."""
    plain = {"to_qkv": ("to_q", "to_k", "to_v"), "to_added_qkv": ("add_q_proj", "add_k_proj", "add_v_proj")}
    out = {f"{prefix}.{name}": COLUMN for stream in streams for name in plain[stream]}
    if attn.fused_projections:
        out |= {f"{prefix}.{stream}": LinearSplit(style="column", blocks=(attn.inner_dim,) * 3) for stream in streams}
    return out


def flux_weights(model: FluxTransformer2DModel, tp: int) -> WeightSplit:
    """FLUX.1's tensor-parallel split (engines.parallel.tensor_parallel): per double-stream block, both streams'
    q/k/v and MLP-in column-parallel, their attention outputs and MLP-out row-parallel; per single-stream
    block, q/k/v and proj_mlp column-parallel and proj_out row-parallel over its two input parts,
    [attention, MLP]. The AdaLN modulation linears (norm*.linear) stay whole."""
    linears: dict[str, LinearSplit] = {}
    for index, block in enumerate(model.transformer_blocks):
        prefix = f"transformer_blocks.{index}"
        linears |= _attention_weights(f"{prefix}.attn", block.attn, ("to_qkv", "to_added_qkv"))
        linears |= {f"{prefix}.attn.to_out.0": ROW, f"{prefix}.attn.to_add_out": ROW}
        for ff in ("ff", "ff_context"):
            linears |= {f"{prefix}.{ff}.net.0.proj": COLUMN, f"{prefix}.{ff}.net.2": ROW}
    for index, block in enumerate(model.single_transformer_blocks):
        prefix = f"single_transformer_blocks.{index}"
        linears |= _attention_weights(f"{prefix}.attn", block.attn, ("to_qkv",))
        linears[f"{prefix}.proj_mlp"] = COLUMN
        attention_width = model.config.num_attention_heads * model.config.attention_head_dim
        linears[f"{prefix}.proj_out"] = LinearSplit(style="row", blocks=(attention_width, block.mlp_hidden_dim))
    heads = local_heads(model.config.num_attention_heads, tp)
    attentions = [f"transformer_blocks.{i}.attn" for i in range(len(model.transformer_blocks))]
    attentions += [f"single_transformer_blocks.{i}.attn" for i in range(len(model.single_transformer_blocks))]
    return WeightSplit(linears=linears, head_counts={name: {"heads": heads} for name in attentions})


def flux_modulation(model: FluxTransformer2DModel, mesh: ParallelMesh) -> SharedModulation | None:
    """FLUX's AdaLN modulations shared out over the sequence ranks (engines.parallel.modulation), for plans whose
    sequence ranks form one group (one sequence axis: Ulysses, ring or all-gather); None for the others. Its
    consumers, in call order: each double block (image and text stream norms), each single block, norm_out; the
    conditioning is time_text_embed's output."""
    axes = mesh.sequence_axes()
    if len(axes) != 1:
        return None
    singles = [getattr(block, "block", block) for block in model.single_transformer_blocks]  # through the overlap
    norms = ([[block.norm1, block.norm1_context] for block in model.transformer_blocks]
             + [[block.norm] for block in singles] + [[model.norm_out]])
    return SharedModulation(norms, *axes[0], source="time_text_embed",
                            consumers=(("transformer_blocks.*", "temb"), ("single_transformer_blocks.*", "temb"),
                                       ("norm_out", "conditioning_embedding")))


def overlapped_single_block(block: nn.Module, mesh: ParallelMesh, layout: Any) -> OverlappedSingleBlock | None:
    """A single-stream block with its exchanges overlapped by its MLP (pipelines.flux.blocks), for plans with one
    sequence axis and no tp axis (a row-parallel proj_out is already split by its input columns); None for the
    others."""
    if len(mesh.sequence_axes()) != 1 or mesh.plan.tp > 1:
        return None
    return OverlappedSingleBlock(block, mesh, layout)


parallelize_flux = generic_adapter(segments=("encoder_hidden_states", "hidden_states"), shared=("img_ids", "txt_ids"),
                                   weights=flux_weights, processor={"": FluxContextParallelProcessor},
                                   blocks={"single_transformer_blocks": overlapped_single_block},
                                   modulation=flux_modulation)
"""Shard FLUX's text and image tokens over the mesh's sequence ranks (and its batch over CFG groups), and its block
weights over the tp ranks, with the speed features above."""
