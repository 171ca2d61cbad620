"""Context parallelism for diffusers' FluxTransformer2DModel (joint text+image attention).

Both token streams are sharded, each padded to a multiple of the sequence degree: rank s holds
text chunk s and image chunk s, with their position ids. ParallelFlux runs FLUX's forward itself
(embeddings, rotary embedding, the double- and single-stream blocks, norm_out, proj_out: diffusers
0.42's order, the same submodules) on the shards: the rotary embedding is computed from the sharded
ids, so rope and tokens stay aligned, and both kinds of block see the local sequence [text chunk,
image chunk]. Owning the forward lets it hand each block its modulation (below); it takes no
ControlNet residuals and no IP-Adapter inputs.

What changes in the model, by concern (each undone by ParallelFlux.restore):
- pipelines/flux/attention.py: every FluxAttention's processor, with the attention call made
  context-parallel; the shard layout reaches it through `joint_attention_kwargs`, the channel FLUX
  already forwards to every attention call.
- pipelines/flux/blocks.py: with one sequence axis (Ulysses, ring or all-gather) the 38 single-stream
  blocks become OverlappedSingleBlocks: same parameters and math, ordered so that the MLP computes
  while the attention's exchanges travel (diffusers' order leaves every exchange exposed).
- pipelines/flux/modulation.py: with one sequence axis the AdaLN modulations of all blocks are computed
  once per forward and shared out over the ranks (SharedModulation).
- engines/parallel/tensor_parallel.py: with a tp axis every block's linears are split (flux_weights says how);
  this one is not undone (the weights that are not kept are gone). The single-stream blocks then stay
  diffusers' own: OverlappedSingleBlock splits proj_out by input columns itself, which the row-parallel
  proj_out already is.
"""

from __future__ import annotations

from typing import Any

import torch
from diffusers.models.modeling_outputs import Transformer2DModelOutput
from diffusers.models.transformers.transformer_flux import FluxTransformer2DModel
from torch import nn

from engines.parallel.generic import generic_adapter
from engines.parallel.mesh import ParallelMesh
from engines.parallel.sharding import ShardLayout, check_batch, gather_batch, gather_tokens, shard_tokens, split_batch
from engines.parallel.tensor_parallel import COLUMN, ROW, LinearSplit, WeightSplit, local_heads, split_over_mesh
from engines.parallel.wrapper import ParallelTransformer, replace_processors
from pipelines.flux.attention import FluxContextParallelProcessor
from pipelines.flux.blocks import OverlappedSingleBlock
from pipelines.flux.modulation import SharedModulation

TEXT, IMAGE = 0, 1  # segment order of FLUX's joint sequence


def shard_joint_tokens(
    hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor, img_ids: torch.Tensor, txt_ids: torch.Tensor,
    mesh: ParallelMesh,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, ShardLayout | None]:
    """This rank's image chunk, text chunk and their ids (FLUX.1 and FLUX.2 lay out [text, image] alike),
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


class ParallelFlux(ParallelTransformer):
    """FluxTransformer2DModel across ranks; same call as the model, full output on every rank."""

    def __init__(self, model: FluxTransformer2DModel, mesh: ParallelMesh, replaced: list[tuple[nn.Module, Any]],
                 modulation: SharedModulation | None = None) -> None:
        super().__init__(model, mesh, replaced)
        self.modulation = modulation

    def forward(
        self,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor,
        pooled_projections: torch.Tensor,
        timestep: torch.Tensor,
        img_ids: torch.Tensor,
        txt_ids: torch.Tensor,
        guidance: torch.Tensor | None = None,
        joint_attention_kwargs: dict[str, Any] | None = None,
        return_dict: bool = True,
    ) -> Transformer2DModelOutput | tuple[torch.Tensor]:
        """Run one denoiser call; arguments and result as FluxTransformer2DModel.forward."""
        mesh, plan = self.mesh, self.mesh.plan
        attention_kwargs = dict(joint_attention_kwargs or {})
        if "ip_adapter_image_embeds" in attention_kwargs:
            raise ValueError("IP-Adapter inputs are not supported by the context-parallel FLUX transformer")
        batch = hidden_states.shape[0]
        check_batch(batch, mesh)
        hidden_states, encoder_hidden_states, pooled_projections, timestep, guidance = (
            split_batch(t, mesh, batch=batch)
            for t in (hidden_states, encoder_hidden_states, pooled_projections, timestep, guidance)
        )
        num_image_tokens = hidden_states.shape[1]
        hidden_states, encoder_hidden_states, img_ids, txt_ids, layout = shard_joint_tokens(
            hidden_states, encoder_hidden_states, img_ids, txt_ids, mesh)
        if layout is not None:
            attention_kwargs["cp_layout"] = layout
        self.real_tokens = None if layout is None else (1, layout.valid(IMAGE, mesh.seq_rank))

        output = self._blocks_forward(hidden_states, encoder_hidden_states, pooled_projections, timestep, img_ids,
                                      txt_ids, guidance, attention_kwargs or None)

        if plan.seq_degree > 1:
            output = gather_tokens(output, mesh, length=num_image_tokens, dim=1)
        output = gather_batch(output, mesh)
        return Transformer2DModelOutput(sample=output) if return_dict else (output,)

    def _blocks_forward(
        self,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor,
        pooled_projections: torch.Tensor,
        timestep: torch.Tensor,
        img_ids: torch.Tensor,
        txt_ids: torch.Tensor,
        guidance: torch.Tensor | None,
        joint_attention_kwargs: dict[str, Any] | None,
    ) -> torch.Tensor:
        """FLUX's forward on this rank's shard: embeddings, rotary embedding, blocks, norm_out,
        proj_out, each block given its modulation (SharedModulation's, or the model's temb)."""
        model = self.model
        hidden_states = model.x_embedder(hidden_states)
        timestep = timestep.to(hidden_states.dtype) * 1000
        if guidance is None:
            temb = model.time_text_embed(timestep, pooled_projections)
        else:
            temb = model.time_text_embed(timestep, guidance.to(hidden_states.dtype) * 1000, pooled_projections)
        encoder_hidden_states = model.context_embedder(encoder_hidden_states)
        image_rotary_emb = model.pos_embed(torch.cat((txt_ids, img_ids), dim=0))
        blocks = [*model.transformer_blocks, *model.single_transformer_blocks]
        modulations = self.modulation(temb) if self.modulation is not None else [temb] * (len(blocks) + 1)
        for block, modulation in zip(blocks, modulations):
            encoder_hidden_states, hidden_states = block(
                hidden_states=hidden_states,
                encoder_hidden_states=encoder_hidden_states,
                temb=modulation,
                image_rotary_emb=image_rotary_emb,
                joint_attention_kwargs=joint_attention_kwargs,
            )
        hidden_states = model.norm_out(hidden_states, modulations[-1])
        return model.proj_out(hidden_states)

    def restore(self) -> nn.Module:
        """Put the original single-stream blocks, modulation projections and attention processors
        back; return the model."""
        if self.modulation is not None:
            self.modulation.restore()
        blocks = self.model.single_transformer_blocks
        for index, block in enumerate(blocks):
            if isinstance(block, OverlappedSingleBlock):
                blocks[index] = block.block
        return super().restore()


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


def parallelize_flux(model: FluxTransformer2DModel, mesh: ParallelMesh) -> ParallelFlux:
    """Shard FLUX's text and image tokens over the mesh's sequence ranks (and its batch over CFG groups),
    and its block weights over the tp ranks.

    With one sequence axis (Ulysses, ring or all-gather) and no tp axis the single-stream blocks become
    OverlappedSingleBlocks; with one sequence axis the modulations are shared (restore() undoes both).
    """
    plan = mesh.plan
    plan.check(num_heads=model.config.num_attention_heads)
    split_over_mesh(model, flux_weights, mesh)
    replaced = []
    if plan.seq_degree > 1:
        attentions = [b.attn for b in model.transformer_blocks] + [b.attn for b in model.single_transformer_blocks]
        replaced = replace_processors(attentions, FluxContextParallelProcessor(mesh))
    modulation = None
    axes = mesh.sequence_axes()
    if len(axes) == 1:  # one sequence axis
        blocks = model.single_transformer_blocks
        for index, block in enumerate(blocks if plan.tp == 1 else []):
            blocks[index] = OverlappedSingleBlock(block, mesh)
        modulation = SharedModulation(model, *axes[0])
        modulation.install()
    return ParallelFlux(model, mesh, replaced, modulation)


parallelize_flux_generic = generic_adapter(segments=("encoder_hidden_states", "hidden_states"),
                                           shared=("img_ids", "txt_ids"), weights=flux_weights)
"""FLUX.1 on the generic path (engines/parallel/generic.py), by diffusers' own plan: no overlapped single blocks, no
shared modulation. The family's record keeps parallelize_flux until a GPU run of the step benchmark (--adapter generic)
shows which is faster."""
