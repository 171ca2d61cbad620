"""Context parallelism for diffusers' Flux2Transformer2DModel (FLUX.2: dev and the Klein variants).

FLUX.2 keeps FLUX.1's token layout: double-stream blocks attend over [text, image] with separate
weights per stream, single-stream blocks run on the concatenated sequence, the rotary embedding
comes from position ids. Reference images (image editing) are more image tokens, concatenated to
the latents by the pipeline with their own ids, so they shard like any image token. It runs on the generic
path (engines/parallel/generic.py): diffusers' own forward, both streams and their ids split at the model's
input (each padded to a multiple of the sequence degree), the output gathered after proj_out. On 2 H200s its
step equals the hand-written forward it replaced (docs/models.md).

Where FLUX.2's blocks differ from FLUX.1's, and what this adapter does there:
- Double-stream attention (Flux2Attention) has FLUX.1's projections, norms and output layers under
  the same names, so FLUX.1's processor (pipelines.flux.attention) serves it unchanged, the
  all-gather reordering included.
- Single-stream attention (Flux2ParallelSelfAttention) fuses q/k/v and the MLP's input into one
  projection and the attention and MLP outputs into one: diffusers' processor keeps that fusion and the
  generic path splits only its attention call. FLUX.1's OverlappedSingleBlock reorders FLUX.1's separate MLP
  around the exchanges; with the fused projections there is nothing left to move.
- Modulation: FLUX.2 computes every block's AdaLN parameters once per forward, from shared
  modulation layers (FLUX.1 has one per block, which engines.parallel.modulation shares out), so
  there is nothing to share.
- Reference-image K/V caching (kv_cache_mode) is not supported: the pipeline never asks for it, and every step
  attends to the reference tokens afresh, which is what diffusers does without the cache.
"""

from __future__ import annotations

from diffusers.models._modeling_parallel import ContextParallelInput, ContextParallelOutput
from diffusers.models.transformers.transformer_flux2 import Flux2Transformer2DModel

from engines.parallel.generic import generic_adapter
from engines.parallel.tensor_parallel import COLUMN, ROW, LinearSplit, WeightSplit, local_heads
from pipelines.flux.attention import FluxContextParallelProcessor


def flux2_weights(model: Flux2Transformer2DModel, tp: int) -> WeightSplit:
    """FLUX.2's tensor-parallel split (engines.parallel.tensor_parallel): per double-stream block, both streams'
    q/k/v column-parallel and attention outputs row-parallel, the SwiGLU MLP-in column-parallel over its
    [gate, up] halves and MLP-out row-parallel; per single-stream block, the fused projection
    column-parallel over its [q, k, v, gate, up] parts and the fused output row-parallel over
    [attention, MLP]. The shared modulation layers stay whole."""
    linears: dict[str, LinearSplit] = {}
    for index, block in enumerate(model.transformer_blocks):
        prefix = f"transformer_blocks.{index}"
        if block.attn.fused_projections:
            raise ValueError("tensor parallelism splits FLUX.2's unfused q/k/v projections: do not fuse them")
        names = ("to_q", "to_k", "to_v", "add_q_proj", "add_k_proj", "add_v_proj")
        linears |= {f"{prefix}.attn.{name}": COLUMN for name in names}
        linears |= {f"{prefix}.attn.to_out.0": ROW, f"{prefix}.attn.to_add_out": ROW}
        swiglu = LinearSplit(style="column", blocks=(block.mlp_hidden_dim,) * 2)
        for ff in ("ff", "ff_context"):
            linears |= {f"{prefix}.{ff}.linear_in": swiglu, f"{prefix}.{ff}.linear_out": ROW}
    for index, block in enumerate(model.single_transformer_blocks):
        prefix, attn = f"single_transformer_blocks.{index}.attn", block.attn
        mlp = (attn.mlp_hidden_dim,) * attn.mlp_mult_factor
        linears[f"{prefix}.to_qkv_mlp_proj"] = LinearSplit(style="column", blocks=(attn.inner_dim,) * 3 + mlp)
        linears[f"{prefix}.to_out"] = LinearSplit(style="row", blocks=(attn.inner_dim, attn.mlp_hidden_dim))
    heads = {"heads": local_heads(model.config.num_attention_heads, tp)}
    attentions = [f"transformer_blocks.{i}.attn" for i in range(len(model.transformer_blocks))]
    attentions += [f"single_transformer_blocks.{i}.attn" for i in range(len(model.single_transformer_blocks))]
    return WeightSplit(linears=linears, head_counts={name: heads for name in attentions})


_IDS = ContextParallelInput(split_dim=0, expected_dims=2)
_TOKENS = ContextParallelInput(split_dim=1, expected_dims=3)

parallelize_flux2 = generic_adapter(
    plan={"": {"hidden_states": _TOKENS, "encoder_hidden_states": _TOKENS, "img_ids": _IDS, "txt_ids": _IDS},
          "proj_out": ContextParallelOutput(gather_dim=1, expected_dims=3)},
    segments=("encoder_hidden_states", "hidden_states"), shared=("img_ids", "txt_ids"), weights=flux2_weights,
    processor={"transformer_blocks": FluxContextParallelProcessor})
"""FLUX.2's adapter: diffusers' forward, FLUX.1's processor in the double-stream blocks (the all-gather reordering),
diffusers' own in the single-stream blocks with its attention call split. diffusers' plan splits ids with a batch
dimension ([B, S, 4]); our pipeline passes them without one ([S, 4], shared by the batch), so this plan splits them
along their first."""
