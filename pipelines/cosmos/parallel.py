"""Context parallelism for diffusers' CosmosTransformer3DModel (video self-attention, text cross-attention).

Video tokens are sharded (padded to a multiple of the sequence degree); self-attention becomes
context-parallel, cross-attention stays local (each rank's queries against the replicated text,
no communication).

Two adapters, the same split. `parallelize_cosmos` (the record's) replays diffusers' forward (diffusers 0.42, same
submodules, same order) and shards the four per-token tensors (tokens, rotary tables, learnable position
embedding, per-frame time embeddings) once, right before the blocks; the blocks forward `image_rotary_emb`
untouched to self-attention, so the sharded rope travels there together with its shard layout (ShardedRotary).
`parallelize_cosmos_generic` runs diffusers' own forward on the generic path (engines/parallel/generic.py) with
COSMOS_PLAN: the rotary tables and position embedding split as their modules return them, the patchified tokens at
the first block, and per-frame time embeddings (per token: diffusers expands them in its body, after any module)
at every block and the final norm. The record keeps the first until a GPU run shows the second as fast
(`PART=adapters benchmarks/multi_gpu.sh`). Tests compare both against the model's own forward.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from diffusers.models._modeling_parallel import ContextParallelInput, ContextParallelOutput
from diffusers.models.embeddings import apply_rotary_emb
from diffusers.models.modeling_outputs import Transformer2DModelOutput
from diffusers.models.transformers.transformer_cosmos import CosmosTransformer3DModel

from engines.parallel.attention import split_attention
from engines.parallel.generic import ParallelGeneric, generic_adapter
from engines.parallel.mesh import ParallelMesh
from engines.parallel.sharding import ShardLayout, check_batch, gather_batch, gather_tokens, shard_tokens, split_batch
from engines.parallel.tensor_parallel import COLUMN, ROW, LinearSplit, WeightSplit, local_heads, split_over_mesh
from engines.parallel.wrapper import ParallelTransformer, replace_processors

VIDEO = 0  # the only segment of Cosmos' self-attention sequence


def resize_padding_mask(mask: torch.Tensor, size: tuple[int, int] | list[int]) -> torch.Tensor:
    """Nearest-neighbour resize of a (..., H, W) mask: torch-only equivalent of the torchvision
    `transforms.functional.resize(mask, size, InterpolationMode.NEAREST)` call in diffusers' Cosmos."""
    lead = mask.shape[:-2]
    flat = mask.reshape(-1, 1, *mask.shape[-2:]).float()  # interpolate wants (N, C, H, W) floats
    out = F.interpolate(flat, size=tuple(size), mode="nearest")
    return out.reshape(*lead, *out.shape[-2:]).to(mask.dtype)


class ShardedRotary(NamedTuple):
    """This shard's rotary cos/sin (S, D) and the layout of the sequence they belong to."""

    cos: torch.Tensor
    sin: torch.Tensor
    layout: ShardLayout


class CosmosContextParallelProcessor:
    """CosmosAttnProcessor2_0 for self-attention (attn1), with the attention call made context-parallel."""

    def __init__(self, mesh: ParallelMesh, layout: Callable[[], ShardLayout] | None = None) -> None:
        self.attention = split_attention(mesh)
        self.layout = layout
        """The layout of the video tokens in the current call (on the generic path, whose rotary embedding arrives
        split as diffusers' (cos, sin)); None: the call's ShardedRotary carries it."""

    def __call__(
        self,
        attn: Any,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        image_rotary_emb: ShardedRotary | tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        if not isinstance(image_rotary_emb, ShardedRotary) and self.layout is not None and image_rotary_emb is not None:
            image_rotary_emb = ShardedRotary(*image_rotary_emb, self.layout())
        if not isinstance(image_rotary_emb, ShardedRotary):
            raise RuntimeError("this Cosmos model is parallelized: call the module returned by parallelize_cosmos")
        if encoder_hidden_states is not None or attention_mask is not None:
            raise ValueError("the context-parallel Cosmos processor serves self-attention only (no context, no mask)")
        query = attn.to_q(hidden_states).unflatten(2, (attn.heads, -1)).transpose(1, 2)
        key = attn.to_k(hidden_states).unflatten(2, (attn.heads, -1)).transpose(1, 2)
        value = attn.to_v(hidden_states).unflatten(2, (attn.heads, -1)).transpose(1, 2)
        query = attn.norm_q(query)
        key = attn.norm_k(key)
        rope = (image_rotary_emb.cos, image_rotary_emb.sin)
        query = apply_rotary_emb(query, rope, use_real=True, use_real_unbind_dim=-2)
        key = apply_rotary_emb(key, rope, use_real=True, use_real_unbind_dim=-2)
        # grouped-query attention, as in diffusers (a no-op for Cosmos' equal head counts)
        key = key.repeat_interleave(query.size(3) // key.size(3), dim=3)
        value = value.repeat_interleave(query.size(3) // value.size(3), dim=3)

        hidden_states = self.attention(
            query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), layout=image_rotary_emb.layout
        )
        hidden_states = hidden_states.flatten(2, 3).type_as(query)
        return attn.to_out[1](attn.to_out[0](hidden_states))


def _split_context(context: Any, mesh: ParallelMesh, batch: int) -> Any:
    if isinstance(context, tuple):
        return tuple(split_batch(c, mesh, batch=batch) for c in context)
    return split_batch(context, mesh, batch=batch)


class ParallelCosmos(ParallelTransformer):
    """CosmosTransformer3DModel across ranks; same call as the model, full output on every rank."""

    def forward(
        self,
        hidden_states: torch.Tensor,
        timestep: torch.Tensor,
        encoder_hidden_states: torch.Tensor | tuple[torch.Tensor, torch.Tensor | None],
        fps: int | None = None,
        condition_mask: torch.Tensor | None = None,
        padding_mask: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        return_dict: bool = True,
    ) -> Transformer2DModelOutput | tuple[torch.Tensor]:
        """Run one denoiser call; arguments and result as CosmosTransformer3DModel.forward."""
        model, mesh, plan = self.model, self.mesh, self.mesh.plan
        config = model.config
        batch = hidden_states.shape[0]
        check_batch(batch, mesh)
        hidden_states, timestep, condition_mask, attention_mask = (
            split_batch(t, mesh, batch=batch) for t in (hidden_states, timestep, condition_mask, attention_mask)
        )
        encoder_hidden_states = _split_context(encoder_hidden_states, mesh, batch)
        batch_size, _, num_frames, height, width = hidden_states.shape

        # --- replay of CosmosTransformer3DModel.forward (diffusers 0.42), steps 1-5 ---
        if condition_mask is not None:
            hidden_states = torch.cat([hidden_states, condition_mask], dim=1)
        if config.concat_padding_mask:
            if padding_mask is None:
                raise ValueError("this Cosmos transformer concatenates a padding mask: pass padding_mask")
            padding_mask = resize_padding_mask(padding_mask, hidden_states.shape[-2:])
            hidden_states = torch.cat(
                [hidden_states, padding_mask.unsqueeze(2).repeat(batch_size, 1, num_frames, 1, 1)], dim=1
            )
        if attention_mask is not None:
            attention_mask = attention_mask.unsqueeze(1).unsqueeze(1)  # [B, 1, 1, S_text]

        # Computed on the full grid on every rank, then sliced: exact, and cheap next to the blocks.
        rope_cos, rope_sin = model.rope(hidden_states, fps=fps)
        extra_pos_emb = model.learnable_pos_embed(hidden_states) if config.extra_pos_embed_type else None

        p_t, p_h, p_w = config.patch_size
        grid = (num_frames // p_t, height // p_h, width // p_w)
        hidden_states = model.patch_embed(hidden_states).flatten(1, 3)  # [B, THW, C]

        if timestep.ndim == 1:
            temb, embedded_timestep = model.time_embed(hidden_states, timestep)
        elif timestep.ndim == 5:
            if tuple(timestep.shape) != (batch_size, 1, num_frames, 1, 1):
                raise ValueError(f"expected timestep of shape [B, 1, T, 1, 1], got {tuple(timestep.shape)}")
            temb, embedded_timestep = model.time_embed(hidden_states, timestep.flatten())
            temb, embedded_timestep = (
                x.view(batch_size, grid[0], 1, 1, -1).expand(-1, -1, grid[1], grid[2], -1).flatten(1, 3)
                for x in (temb, embedded_timestep)
            )  # per-frame timesteps -> per-token embeddings [B, THW, C]
        else:
            raise ValueError(f"expected timestep of shape [B, 1, T, 1, 1] or [T], got {tuple(timestep.shape)}")

        text_context, img_context = (
            encoder_hidden_states if isinstance(encoder_hidden_states, tuple) else (encoder_hidden_states, None)
        )
        if config.use_crossattn_projection:
            text_context = model.crossattn_proj(text_context)
        if img_context is not None and config.img_context_dim_in:
            img_context = model.img_context_proj(img_context)
        context = (text_context, img_context) if isinstance(encoder_hidden_states, tuple) else text_context

        # --- sharding: tokens and every per-token tensor, along the same layout ---
        num_tokens = hidden_states.shape[1]
        rotary: tuple[torch.Tensor, torch.Tensor] | ShardedRotary = (rope_cos, rope_sin)
        self.real_tokens = None
        if plan.seq_degree > 1:
            layout = ShardLayout(lengths=(num_tokens,), degree=plan.seq_degree)
            self.real_tokens = (1, layout.valid(VIDEO, mesh.seq_rank))

            def shard(x: torch.Tensor, dim: int) -> torch.Tensor:
                return shard_tokens(x, layout, segment=VIDEO, shard=mesh.seq_rank, dim=dim)

            hidden_states = shard(hidden_states, 1)
            rotary = ShardedRotary(shard(rope_cos, 0), shard(rope_sin, 0), layout)
            if extra_pos_emb is not None:
                extra_pos_emb = shard(extra_pos_emb, 1)
            if temb.ndim == 3:
                temb, embedded_timestep = shard(temb, 1), shard(embedded_timestep, 1)

        for block in model.transformer_blocks:
            hidden_states = block(
                hidden_states,
                encoder_hidden_states=context,
                embedded_timestep=embedded_timestep,
                temb=temb,
                image_rotary_emb=rotary,
                extra_pos_emb=extra_pos_emb,
                attention_mask=attention_mask,
            )
        hidden_states = model.norm_out(hidden_states, embedded_timestep, temb)
        hidden_states = model.proj_out(hidden_states)
        if plan.seq_degree > 1:
            hidden_states = gather_tokens(hidden_states, mesh, length=num_tokens, dim=1)

        # --- unpatchify, as diffusers (its permutation is intentionally not the patchify inverse) ---
        hidden_states = hidden_states.unflatten(2, (p_h, p_w, p_t, -1))
        hidden_states = hidden_states.unflatten(1, grid)
        hidden_states = hidden_states.permute(0, 7, 1, 6, 2, 4, 3, 5)
        hidden_states = hidden_states.flatten(6, 7).flatten(4, 5).flatten(2, 3)

        hidden_states = gather_batch(hidden_states, mesh)
        return Transformer2DModelOutput(sample=hidden_states) if return_dict else (hidden_states,)


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


def _no_controlnet(model: CosmosTransformer3DModel) -> None:
    if model.config.controlnet_block_every_n is not None:
        raise ValueError("Cosmos transformers with controlnet blocks are not supported by parallelize_cosmos")


def parallelize_cosmos(model: CosmosTransformer3DModel, mesh: ParallelMesh) -> ParallelCosmos:
    """Shard Cosmos' video tokens over the mesh's sequence ranks (and its batch over CFG groups), and its
    block weights over the tp ranks (not undone by restore())."""
    _no_controlnet(model)
    mesh.plan.check(num_heads=model.config.num_attention_heads)
    split_over_mesh(model, cosmos_weights, mesh)
    replaced = []
    if mesh.plan.seq_degree > 1:
        replaced = replace_processors(
            [block.attn1 for block in model.transformer_blocks], CosmosContextParallelProcessor(mesh)
        )
    return ParallelCosmos(model, mesh, replaced)


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


def parallelize_cosmos_generic(model: CosmosTransformer3DModel, mesh: ParallelMesh) -> ParallelGeneric:
    """Cosmos on the generic path (engines/parallel/generic.py): diffusers' forward with COSMOS_PLAN, this module's
    processor in the self-attentions (diffusers' take no parallel_config), the cross-attentions local. The family's
    record keeps parallelize_cosmos until a GPU run of the step benchmark (--adapter generic) shows which is
    faster."""
    _no_controlnet(model)
    plan = {path: entry for path, entry in COSMOS_PLAN.items()
            if path != "learnable_pos_embed" or model.learnable_pos_embed is not None}
    return generic_adapter(plan=plan, shared=("padding_mask",), weights=cosmos_weights,
                           processor={"transformer_blocks.*.attn1": CosmosContextParallelProcessor})(model, mesh)
