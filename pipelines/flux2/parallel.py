"""Context parallelism for diffusers' Flux2Transformer2DModel (FLUX.2: dev and the Klein variants).

FLUX.2 keeps FLUX.1's token layout: double-stream blocks attend over [text, image] with separate
weights per stream, single-stream blocks run on the concatenated sequence, the rotary embedding
comes from position ids. Reference images (image editing) are more image tokens, concatenated to
the latents by the pipeline with their own ids, so they shard like any image token. As for FLUX.1
(pipelines/flux/parallel.py), both streams are sharded, each padded to a multiple of the sequence degree, and
ParallelFlux2 runs the model's forward itself on the shards: rank s holds text chunk s and image
chunk s, the rotary embedding is computed from the sharded ids, and the local sequence of a single
block is [text chunk, image chunk].

Where FLUX.2's blocks differ from FLUX.1's, and what this adapter does there:
- Double-stream attention (Flux2Attention) has FLUX.1's projections, norms and output layers under
  the same names, so FLUX.1's processor (pipelines.flux.attention) serves it unchanged, the
  all-gather reordering included.
- Single-stream attention (Flux2ParallelSelfAttention) fuses q/k/v and the MLP's input into one
  projection and the attention and MLP outputs into one: Flux2SingleProcessor below keeps that
  fusion and makes only the attention call context-parallel. FLUX.1's OverlappedSingleBlock
  reorders FLUX.1's separate MLP around the exchanges; with the fused projections there is
  nothing left to move, so FLUX.2's single blocks stay as they are.
- Modulation: FLUX.2 computes every block's AdaLN parameters once per forward, from shared
  modulation layers (FLUX.1 has one per block, which engines.parallel.modulation shares out), so
  there is nothing to share.
- Reference-image K/V caching (kv_cache_mode) is not supported: every step attends to the
  reference tokens afresh, which is what diffusers does without the cache.
"""

from __future__ import annotations

from typing import Any

import torch
from diffusers.models._modeling_parallel import ContextParallelInput, ContextParallelOutput
from diffusers.models.embeddings import apply_rotary_emb
from diffusers.models.modeling_outputs import Transformer2DModelOutput
from diffusers.models.transformers.transformer_flux2 import Flux2Transformer2DModel
from torch import nn

from engines.parallel.attention import split_attention
from engines.parallel.generic import generic_adapter
from engines.parallel.mesh import ParallelMesh
from engines.parallel.sharding import ShardLayout, check_batch, gather_batch, gather_tokens, shard_tokens, split_batch
from engines.parallel.tensor_parallel import COLUMN, ROW, LinearSplit, WeightSplit, local_heads, split_over_mesh
from engines.parallel.wrapper import ParallelTransformer, replace_processors
from pipelines.flux.attention import FluxContextParallelProcessor

TEXT, IMAGE = 0, 1  # segment order of FLUX's joint sequence


def shard_joint_tokens(
    hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor, img_ids: torch.Tensor, txt_ids: torch.Tensor,
    mesh: ParallelMesh,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, ShardLayout | None]:
    """This rank's image chunk, text chunk and their ids (FLUX.2 lays out [text, image] as FLUX.1 does),
    and their layout for the attention processors; the whole tokens and None without a sequence axis.
    Batched (deprecated) ids are taken by their first entry, as diffusers does."""
    txt_ids = txt_ids[0] if txt_ids.ndim == 3 else txt_ids
    img_ids = img_ids[0] if img_ids.ndim == 3 else img_ids
    degree = mesh.plan.seq_degree
    if degree == 1:
        return hidden_states, encoder_hidden_states, img_ids, txt_ids, None
    layout = ShardLayout(lengths=(encoder_hidden_states.shape[1], hidden_states.shape[1]), degree=degree)
    s = mesh.seq_rank
    return (shard_tokens(hidden_states, layout, segment=IMAGE, shard=s, dim=1),
            shard_tokens(encoder_hidden_states, layout, segment=TEXT, shard=s, dim=1),
            shard_tokens(img_ids, layout, segment=IMAGE, shard=s, dim=0),
            shard_tokens(txt_ids, layout, segment=TEXT, shard=s, dim=0), layout)


class Flux2SingleProcessor:
    """Flux2ParallelSelfAttnProcessor (diffusers 0.42) with the attention call made context-parallel."""

    def __init__(self, mesh: ParallelMesh) -> None:
        self.attention = split_attention(mesh)

    def __call__(
        self,
        attn: Any,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        image_rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
        cp_layout: ShardLayout | None = None,
    ) -> torch.Tensor:
        if cp_layout is None:
            raise RuntimeError("this FLUX.2 model is parallelized: call the module returned by parallelize_flux2")
        if attention_mask is not None:
            raise ValueError("FLUX.2 attention masks are not supported with context parallelism")
        projected = attn.to_qkv_mlp_proj(hidden_states)
        # q/k/v's share of the fused projection by the global ratio, as diffusers: under tensor parallelism
        # each rank's slice keeps [q, k, v, MLP] in that ratio (flux2_weights)
        qkv_width = 3 * attn.inner_dim
        local_qkv = projected.shape[-1] * qkv_width // (qkv_width + attn.mlp_hidden_dim * attn.mlp_mult_factor)
        qkv, mlp = projected.split([local_qkv, projected.shape[-1] - local_qkv], dim=-1)
        query, key, value = (x.unflatten(-1, (-1, attn.head_dim)) for x in qkv.chunk(3, dim=-1))
        query, key = attn.norm_q(query), attn.norm_k(key)
        if image_rotary_emb is not None:
            query = apply_rotary_emb(query, image_rotary_emb, sequence_dim=1)
            key = apply_rotary_emb(key, image_rotary_emb, sequence_dim=1)
        out = self.attention(query, key, value, layout=cp_layout)
        out = out.flatten(2, 3).to(query.dtype)
        return attn.to_out(torch.cat([out, attn.mlp_act_fn(mlp)], dim=-1))


class ParallelFlux2(ParallelTransformer):
    """Flux2Transformer2DModel across ranks; same call as the model, full output on every rank."""

    def forward(
        self,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor,
        timestep: torch.Tensor,
        img_ids: torch.Tensor,
        txt_ids: torch.Tensor,
        guidance: torch.Tensor | None = None,
        joint_attention_kwargs: dict[str, Any] | None = None,
        return_dict: bool = True,
        kv_cache: Any = None,
        kv_cache_mode: str | None = None,
        num_ref_tokens: int = 0,
        ref_fixed_timestep: float = 0.0,
    ) -> Transformer2DModelOutput | tuple[torch.Tensor]:
        """Run one denoiser call; arguments and result as Flux2Transformer2DModel.forward."""
        if kv_cache is not None or kv_cache_mode is not None:
            raise ValueError("reference K/V caching is not supported by the context-parallel FLUX.2 transformer")
        mesh, plan = self.mesh, self.mesh.plan
        batch = hidden_states.shape[0]
        check_batch(batch, mesh)
        hidden_states, encoder_hidden_states, timestep, guidance = (
            split_batch(t, mesh, batch=batch) for t in (hidden_states, encoder_hidden_states, timestep, guidance))
        num_image_tokens = hidden_states.shape[1]
        hidden_states, encoder_hidden_states, img_ids, txt_ids, layout = shard_joint_tokens(
            hidden_states, encoder_hidden_states, img_ids, txt_ids, mesh)
        attention_kwargs = dict(joint_attention_kwargs or {})
        if layout is not None:
            attention_kwargs["cp_layout"] = layout
        self.real_tokens = None if layout is None else (1, layout.valid(IMAGE, mesh.seq_rank))

        output = self._blocks_forward(hidden_states, encoder_hidden_states, timestep, img_ids, txt_ids, guidance,
                                      attention_kwargs or None)

        if plan.seq_degree > 1:
            output = gather_tokens(output, mesh, length=num_image_tokens, dim=1)
        output = gather_batch(output, mesh)
        return Transformer2DModelOutput(sample=output) if return_dict else (output,)

    def _blocks_forward(
        self,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor,
        timestep: torch.Tensor,
        img_ids: torch.Tensor,
        txt_ids: torch.Tensor,
        guidance: torch.Tensor | None,
        joint_attention_kwargs: dict[str, Any] | None,
    ) -> torch.Tensor:
        """FLUX.2's forward (diffusers 0.42, without the K/V cache) on this rank's shard."""
        model = self.model
        text_length = encoder_hidden_states.shape[1]  # this rank's text chunk, padding included
        timestep = timestep.to(hidden_states.dtype) * 1000
        if guidance is not None:
            guidance = guidance.to(hidden_states.dtype) * 1000
        temb = model.time_guidance_embed(timestep, guidance)
        mod_img = model.double_stream_modulation_img(temb)
        mod_txt = model.double_stream_modulation_txt(temb)
        mod_single = model.single_stream_modulation(temb)
        hidden_states = model.x_embedder(hidden_states)
        encoder_hidden_states = model.context_embedder(encoder_hidden_states)
        text_rotary, image_rotary = model.pos_embed(txt_ids), model.pos_embed(img_ids)
        rotary = (torch.cat([text_rotary[0], image_rotary[0]], dim=0),
                  torch.cat([text_rotary[1], image_rotary[1]], dim=0))
        for block in model.transformer_blocks:
            encoder_hidden_states, hidden_states = block(
                hidden_states=hidden_states, encoder_hidden_states=encoder_hidden_states, temb_mod_img=mod_img,
                temb_mod_txt=mod_txt, image_rotary_emb=rotary, joint_attention_kwargs=joint_attention_kwargs)
        hidden_states = torch.cat([encoder_hidden_states, hidden_states], dim=1)
        for block in model.single_transformer_blocks:
            hidden_states = block(hidden_states=hidden_states, encoder_hidden_states=None, temb_mod=mod_single,
                                  image_rotary_emb=rotary, joint_attention_kwargs=joint_attention_kwargs)
        hidden_states = model.norm_out(hidden_states[:, text_length:], temb)
        return model.proj_out(hidden_states)


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


def parallelize_flux2(model: Flux2Transformer2DModel, mesh: ParallelMesh) -> ParallelFlux2:
    """Shard FLUX.2's text and image tokens over the mesh's sequence ranks (and its batch over CFG groups),
    and its block weights over the tp ranks (not undone by restore())."""
    mesh.plan.check(num_heads=model.config.num_attention_heads)
    split_over_mesh(model, flux2_weights, mesh)
    replaced: list[tuple[nn.Module, Any]] = []
    if mesh.plan.seq_degree > 1:
        replaced = replace_processors([b.attn for b in model.transformer_blocks], FluxContextParallelProcessor(mesh))
        replaced += replace_processors([b.attn for b in model.single_transformer_blocks], Flux2SingleProcessor(mesh))
    return ParallelFlux2(model, mesh, replaced)


_IDS = ContextParallelInput(split_dim=0, expected_dims=2)
_TOKENS = ContextParallelInput(split_dim=1, expected_dims=3)

parallelize_flux2_generic = generic_adapter(
    plan={"": {"hidden_states": _TOKENS, "encoder_hidden_states": _TOKENS, "img_ids": _IDS, "txt_ids": _IDS},
          "proj_out": ContextParallelOutput(gather_dim=1, expected_dims=3)},
    segments=("encoder_hidden_states", "hidden_states"), shared=("img_ids", "txt_ids"), weights=flux2_weights,
    processor={"transformer_blocks": FluxContextParallelProcessor})
"""FLUX.2 on the generic path (engines/parallel/generic.py): diffusers' forward, FLUX.1's processor in the double-stream
blocks (the all-gather reordering), diffusers' own in the single-stream blocks with its attention call split. diffusers'
plan splits ids with a batch dimension ([B, S, 4]); our pipeline passes them without one ([S, 4], shared by the batch),
so this plan splits them along their first. The family's record keeps parallelize_flux2 until a GPU run of the step
benchmark (--adapter generic) shows which is faster."""
