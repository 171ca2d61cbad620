"""Context parallelism for diffusers' FluxTransformer2DModel (joint text+image attention).

Both token streams are sharded, each padded to a multiple of the sequence degree: rank s holds
text chunk s and image chunk s, with their position ids. Diffusers' own FLUX forward then runs
unchanged on the shards: it computes the rotary embedding from the sharded ids, so rope and
tokens stay aligned, and the double- and single-stream blocks both see the local sequence
[text chunk, image chunk]. The attention processor is replaced; the shard layout reaches it
through `joint_attention_kwargs`, the channel FLUX already forwards to every attention call.

With a Ulysses-only or ring-only plan the 38 single-stream blocks are also replaced, by
OverlappedSingleBlock: same parameters and math, ordered so that the MLP branch computes while the
attention's exchanges travel (diffusers' order leaves every all-to-all exposed; docs/benchmarks.md).
With such a plan the AdaLN modulations of all blocks are also computed once per forward, shared out
over the ranks (SharedModulation), and ParallelFlux runs diffusers' forward loop itself to hand each
block its own.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from diffusers.models.embeddings import apply_rotary_emb
from diffusers.models.modeling_outputs import Transformer2DModelOutput
from diffusers.models.transformers.transformer_flux import (
    FluxSingleTransformerBlock,
    FluxTransformer2DModel,
    _get_qkv_projections,
)
from torch import nn

from engines.attention import GatherAttention, RingAttention, UlyssesAttention, context_parallel_attention
from engines.collectives import all_gather, linear_after
from engines.mesh import ParallelMesh
from engines.plan import ParallelPlan
from engines.sharding import ShardLayout, check_batch, gather_batch, gather_tokens, shard_tokens, split_batch
from engines.wrapper import ParallelTransformer, replace_processors

TEXT, IMAGE = 0, 1  # segment order of FLUX's joint sequence


def _query_key_value(
    attn: Any,
    hidden_states: torch.Tensor,
    encoder_hidden_states: torch.Tensor | None,
    image_rotary_emb: tuple[torch.Tensor, torch.Tensor] | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k, v (BSHD) as diffusers' FluxAttnProcessor makes them: projections, q/k norms, the text
    stream's in front (double-stream blocks), rotary embedding."""
    query, key, value, encoder_query, encoder_key, encoder_value = _get_qkv_projections(
        attn, hidden_states, encoder_hidden_states
    )
    if encoder_hidden_states is None or attn.added_kv_proj_dim is None:  # a single-stream block
        # (diffusers' fused projections give (None,) for the missing text stream, not None)
        encoder_query = encoder_key = encoder_value = encoder_norm_q = encoder_norm_k = None
    else:
        encoder_norm_q, encoder_norm_k = attn.norm_added_q, attn.norm_added_k
    return (
        _joint(attn, query, encoder_query, attn.norm_q, encoder_norm_q, image_rotary_emb),
        _joint(attn, key, encoder_key, attn.norm_k, encoder_norm_k, image_rotary_emb),
        _joint(attn, value, encoder_value, None, None, None),
    )


def _keys(
    attn: Any,
    hidden_states: torch.Tensor,
    encoder_hidden_states: torch.Tensor,
    image_rotary_emb: tuple[torch.Tensor, torch.Tensor] | None,
) -> torch.Tensor:
    """k of a double-stream block (unfused projections), as _query_key_value makes it."""
    return _joint(attn, attn.to_k(hidden_states), attn.add_k_proj(encoder_hidden_states), attn.norm_k,
                  attn.norm_added_k, image_rotary_emb)


def _projected_after(
    hidden_states: torch.Tensor,
    encoder_hidden_states: torch.Tensor,
    proj: nn.Linear,
    encoder_proj: nn.Linear,
    after: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """proj(hidden_states) and encoder_proj(encoder_hidden_states) of a double-stream block, both
    ordered after the op that produced `after` (collectives.linear_after)."""
    return (linear_after(hidden_states, proj.weight, proj.bias, after),
            linear_after(encoder_hidden_states, encoder_proj.weight, encoder_proj.bias, after))


def _values(attn: Any, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor,
            after: torch.Tensor) -> list[torch.Tensor]:
    """v of a double-stream block (unfused projections) as its text and image parts, in the joint
    order: the K/V all-gather takes them apart, which spares their concatenation. Both projections
    are ordered after the op that produced `after` (the keys' all-gather, which travels meanwhile)."""
    value, encoder_value = _projected_after(hidden_states, encoder_hidden_states, attn.to_v, attn.add_v_proj, after)
    return [_joint(attn, encoder_value, None, None, None, None), _joint(attn, value, None, None, None, None)]


def _queries(
    attn: Any,
    hidden_states: torch.Tensor,
    encoder_hidden_states: torch.Tensor,
    image_rotary_emb: tuple[torch.Tensor, torch.Tensor] | None,
    after: torch.Tensor,
) -> torch.Tensor:
    """q of a double-stream block (unfused projections), as _query_key_value makes it, with both
    projections ordered after the op that produced `after` (collectives.linear_after)."""
    query, encoder_query = _projected_after(hidden_states, encoder_hidden_states, attn.to_q, attn.add_q_proj, after)
    return _joint(attn, query, encoder_query, attn.norm_q, attn.norm_added_q, image_rotary_emb)


def _gathers_kv(plan: ParallelPlan) -> bool:
    """Whether FLUX's blocks share K/V with ONE all-gather (GatherAttention): ring-only plans with 2
    ring ranks, where the gathered K/V fit beside the rest; more ring ranks pass K/V around."""
    return plan.ulysses == 1 and plan.ring == 2 and plan.kv_exchange == "ring"


def _plain_projections(attn: Any) -> bool:
    """Whether q and v come from plain nn.Linear projections (not fused, not wrapped by an adapter)."""
    return not attn.fused_projections and all(
        type(proj) is nn.Linear for proj in (attn.to_q, attn.add_q_proj, attn.to_v, attn.add_v_proj))


def _joint(
    attn: Any,
    x: torch.Tensor,
    encoder_x: torch.Tensor | None,
    norm: nn.Module | None,
    encoder_norm: nn.Module | None,
    image_rotary_emb: tuple[torch.Tensor, torch.Tensor] | None,
) -> torch.Tensor:
    """One of q, k, v (BSHD) from its projections of the image and (double blocks) text streams:
    split into heads, the q/k norms (None for v), text in front, rotary embedding (None for v)."""
    x = x.unflatten(-1, (-1, attn.head_dim))
    if norm is not None:
        x = norm(x)
    if encoder_x is not None:
        encoder_x = encoder_x.unflatten(-1, (-1, attn.head_dim))
        if encoder_norm is not None:
            encoder_x = encoder_norm(encoder_x)
        x = torch.cat([encoder_x, x], dim=1)
    if image_rotary_emb is not None:
        x = apply_rotary_emb(x, image_rotary_emb, sequence_dim=1)
    return x


class FluxContextParallelProcessor:
    """FluxAttnProcessor with the attention call made context-parallel (same projections, norms, rope).

    With 2 ring ranks (ring-only plan) a double-stream block's attention is reordered around one
    K/V all-gather (GatherAttention): the keys of both streams are projected first and their
    all-gather issued, the values are projected while the keys travel (on copy engines; NCCL
    gathers both at once) and their all-gather issued, the queries are projected while the values
    travel, then one attention kernel runs over every key. Ring attention would instead hide its
    K/V pass under the attention to the own K/V, but pays for it with two attention kernels and a
    log-sum-exp merge; a double block has no other compute to hide the exchange behind
    (docs/benchmarks.md, sixth session).
    """

    def __init__(self, mesh: ParallelMesh) -> None:
        self.mesh = mesh
        self.gather_double = _gathers_kv(mesh.plan)

    def __call__(
        self,
        attn: Any,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        image_rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
        cp_layout: ShardLayout | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if cp_layout is None:
            raise RuntimeError("this FLUX model is parallelized: call the module returned by parallelize_flux")
        if attention_mask is not None:
            raise ValueError("FLUX attention masks are not supported with context parallelism")
        double = encoder_hidden_states is not None and attn.added_kv_proj_dim is not None
        if double and self.gather_double and _plain_projections(attn):
            gather = GatherAttention(mesh=self.mesh, layout=cp_layout)
            key = _keys(attn, hidden_states, encoder_hidden_states, image_rotary_emb)
            keys = gather.start_keys(key)
            value = _values(attn, hidden_states, encoder_hidden_states, after=keys)
            pending = gather.start_values(value, keys)
            query = _queries(attn, hidden_states, encoder_hidden_states, image_rotary_emb, after=pending)
            hidden_states = gather.finish(gather.attend_query(query, pending))
        else:
            query, key, value = _query_key_value(attn, hidden_states, encoder_hidden_states, image_rotary_emb)
            hidden_states = context_parallel_attention(query, key, value, mesh=self.mesh, layout=cp_layout)
        hidden_states = hidden_states.flatten(2, 3).to(query.dtype)

        if encoder_hidden_states is None:
            return hidden_states
        text_len = encoder_hidden_states.shape[1]
        encoder_hidden_states, hidden_states = hidden_states.split_with_sizes(
            [text_len, hidden_states.shape[1] - text_len], dim=1
        )
        hidden_states = attn.to_out[1](attn.to_out[0](hidden_states.contiguous()))
        encoder_hidden_states = attn.to_add_out(encoder_hidden_states.contiguous())
        return hidden_states, encoder_hidden_states


class OverlappedSingleBlock(nn.Module):
    """diffusers' FluxSingleTransformerBlock for Ulysses-only or ring-only plans, with its
    exchanges overlapped.

    The block computes mlp = GELU(proj_mlp(x)) and attention(x) side by side, then
    proj_out(cat(attention, mlp)). diffusers runs the MLP first and the attention after, so each
    exchange of the attention waits with nothing to do. Here (engines.attention's UlyssesAttention;
    for ring, GatherAttention with 2 ring ranks, RingAttention with more):
    1. q/k/v are projected and their head-scatter all-to-all (Ulysses), the all-gather of this
       rank's K/V (2 ring ranks) or its first K/V pass (more) is issued;
    2. the MLP runs while it travels (4x the FLOPs of the q/k/v projections);
    3. Ulysses: attention, then its token-gather all-to-all is issued, and the MLP's share of
       proj_out runs while that travels: proj_out(cat(a, m)) = a W_a^T + m W_m^T + b, W_a and W_m
       being column slices of proj_out's weight (views: no copy);
       ring: the MLP's share of proj_out also runs before the attention (nothing travels after
       it), so the K/V exchange has both GEMMs to hide under: inside a CUDA graph its local
       copy-out may run as a kernel, which waits for free SMs (docs/benchmarks.md, sixth session);
    4. the attention's share is added. Residual and gate as in diffusers.
    Splitting proj_out also spares the concatenation, which under ring fused with the LSE merge
    into one slow kernel (150 us a block at FLUX 1024², against ~40 us for GELU alone).
    Same parameters (the original block is a child; ParallelFlux.restore puts it back) and the same
    result up to float rounding (tests/test_engines_flux_overlap.py). The waits are explicit ops,
    so torch.compile keeps the order (with EngineOptions.overlap).
    Measured on 2x H200 (docs/benchmarks.md, FLUX.1-dev 1024²): with NCCL the q/k/v all-to-all's
    kernel starts only after the MLP GEMM, whose CTAs take every SM, so little is hidden; on copy
    engines (no SM needed) the ring plan's K/V exchange runs entirely under the MLP GEMM.
    """

    def __init__(self, block: FluxSingleTransformerBlock, mesh: ParallelMesh) -> None:
        super().__init__()
        self.block = block
        self.mesh = mesh

    def forward(
        self,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor,
        temb: torch.Tensor,
        image_rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
        joint_attention_kwargs: dict[str, Any] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        block, attn = self.block, self.block.attn
        layout = (joint_attention_kwargs or {}).get("cp_layout")
        if layout is None:
            raise RuntimeError("this FLUX model is parallelized: call the module returned by parallelize_flux")
        mesh = self.mesh
        if mesh.plan.ulysses > 1:
            split = UlyssesAttention(degree=mesh.plan.ulysses, group_name=mesh.ulysses_group_name, layout=layout,
                                     transport=mesh.all_to_all)
        elif _gathers_kv(mesh.plan):
            split = GatherAttention(mesh=mesh, layout=layout)
        else:
            split = RingAttention(mesh=mesh, layout=layout)
        text_len = encoder_hidden_states.shape[1]
        hidden_states = torch.cat([encoder_hidden_states, hidden_states], dim=1)
        norm_hidden_states, gate = block.norm(hidden_states, emb=temb)

        query, key, value = _query_key_value(attn, norm_hidden_states, None, image_rotary_emb)
        pending = split.start(query, key, value)
        mlp = block.act_mlp(block.proj_mlp(norm_hidden_states))
        weight = block.proj_out.weight
        width = weight.shape[1] - block.mlp_hidden_dim  # attention output width
        if isinstance(split, UlyssesAttention):  # its second all-to-all travels under the MLP's proj_out share
            pending = split.attend(pending)
            out = F.linear(mlp, weight[:, width:], block.proj_out.bias)
        else:  # ring: no exchange after the attention; K/V get the MLP's proj_out share too to travel under
            out = F.linear(mlp, weight[:, width:], block.proj_out.bias)
            pending = split.attend(pending)
        attention = split.finish(pending).flatten(2, 3).to(query.dtype)
        out = out + F.linear(attention, weight[:, :width])

        hidden_states = hidden_states + gate.unsqueeze(1) * out
        if hidden_states.dtype == torch.float16:
            hidden_states = hidden_states.clip(-65504, 65504)
        return hidden_states[:, :text_len], hidden_states[:, text_len:]


class _Precomputed(nn.Module):
    """Stands in for an AdaLN modulation projection whose output SharedModulation computed ahead:
    returns columns [start, stop) of what the block now receives as `temb` (the projection's
    output, or, in a double-stream block, the outputs of both its streams' projections side by
    side). The projection stays a child, so that .to() and state_dict still reach its weights."""

    def __init__(self, source: nn.Linear, start: int, stop: int) -> None:
        super().__init__()
        self.source = source
        self.start, self.stop = start, stop

    def forward(self, modulation: torch.Tensor) -> torch.Tensor:
        return modulation[:, self.start:self.stop]


class SharedModulation:
    """FLUX's AdaLN modulations, computed once per forward and shared out over the sequence ranks.

    Every block (and norm_out) projects the same conditioning vector silu(temb) into its shifts,
    scales and gates: 115 matrix-vector products that read 6.5 GB of weights (~2 ms on an H200), the
    same on every rank. Here each rank of the sequence group computes the blocks it owns (balanced
    by output width) and ONE all-gather brings every block's modulation to every rank, so a rank
    reads 1/n of those weights. The blocks then receive their modulation as `temb` and their norm
    layers skip the projection (silu -> Identity, linear -> _Precomputed); install() makes that
    change and restore() undoes it. Only for plans whose sequence ranks form one group (Ulysses-only
    or ring-only).
    """

    def __init__(self, model: FluxTransformer2DModel, group: dist.ProcessGroup, rank: int, size: int) -> None:
        self.group, self.rank, self.size = group, rank, size
        # consumers in call order: each double block (image and text stream), each single block, norm_out
        self.norms: list[list[nn.Module]] = (
            [[b.norm1, b.norm1_context] for b in model.transformer_blocks]
            + [[b.norm] for b in _single_blocks(model)]
            + [[model.norm_out]]
        )
        self.linears = [[norm.linear for norm in norms] for norms in self.norms]
        widths = [sum(linear.out_features for linear in linears) for linears in self.linears]
        # owner of each consumer: the least loaded rank, widest consumers first (the same on every rank)
        load = [0] * size
        self.owner = [0] * len(widths)
        for index in sorted(range(len(widths)), key=lambda i: (-widths[i], i)):
            self.owner[index] = min(range(size), key=lambda r: (load[r], r))
            load[self.owner[index]] += widths[index]
        self.width = max(load)  # every rank's packed length (the others are zero-padded)
        self.spans: list[tuple[int, int]] = []  # (offset, width) of each consumer in its owner's packed row
        offsets = [0] * size
        for index, width in enumerate(widths):
            self.spans.append((offsets[self.owner[index]], width))
            offsets[self.owner[index]] += width
        self._originals: list[tuple[nn.Module, nn.Module, nn.Module]] = []

    def __call__(self, temb: torch.Tensor) -> list[torch.Tensor]:
        """Each consumer's modulation (B, width), in call order, from the model's temb."""
        condition = F.silu(temb)
        mine = [F.linear(condition, linear.weight, linear.bias)
                for index, linears in enumerate(self.linears) if self.owner[index] == self.rank
                for linear in linears]
        missing = self.width - sum(m.shape[1] for m in mine)  # a rank may own less, or (tiny models) nothing
        if missing:
            mine.append(condition.new_zeros(condition.shape[0], missing))
        packed = torch.cat(mine, dim=1)
        gathered = all_gather(packed.unsqueeze(0), 0, self.group, self.size)  # (size, B, width)
        return [gathered[owner, :, offset:offset + width]
                for owner, (offset, width) in zip(self.owner, self.spans, strict=True)]

    def install(self) -> None:
        for norms, linears in zip(self.norms, self.linears, strict=True):
            start = 0
            for norm, linear in zip(norms, linears, strict=True):
                self._originals.append((norm, norm.silu, norm.linear))
                norm.silu = nn.Identity()
                norm.linear = _Precomputed(linear, start, start + linear.out_features)
                start += linear.out_features

    def restore(self) -> None:
        for norm, silu, linear in self._originals:
            norm.silu, norm.linear = silu, linear
        self._originals = []


def _single_blocks(model: FluxTransformer2DModel) -> list[FluxSingleTransformerBlock]:
    """The single-stream blocks, looking through OverlappedSingleBlock."""
    return [b.block if isinstance(b, OverlappedSingleBlock) else b for b in model.single_transformer_blocks]


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
        batch = hidden_states.shape[0]
        check_batch(batch, mesh)
        hidden_states, encoder_hidden_states, pooled_projections, timestep, guidance = (
            split_batch(t, mesh, batch=batch)
            for t in (hidden_states, encoder_hidden_states, pooled_projections, timestep, guidance)
        )
        # diffusers still accepts (deprecated) batched ids and takes the first; do the same before sharding
        txt_ids = txt_ids[0] if txt_ids.ndim == 3 else txt_ids
        img_ids = img_ids[0] if img_ids.ndim == 3 else img_ids
        num_image_tokens = hidden_states.shape[1]
        attention_kwargs = dict(joint_attention_kwargs or {})
        if plan.seq_degree > 1:
            layout = ShardLayout(lengths=(encoder_hidden_states.shape[1], num_image_tokens), degree=plan.seq_degree)
            s = mesh.seq_rank
            hidden_states = shard_tokens(hidden_states, layout, segment=IMAGE, shard=s, dim=1)
            img_ids = shard_tokens(img_ids, layout, segment=IMAGE, shard=s, dim=0)
            encoder_hidden_states = shard_tokens(encoder_hidden_states, layout, segment=TEXT, shard=s, dim=1)
            txt_ids = shard_tokens(txt_ids, layout, segment=TEXT, shard=s, dim=0)
            attention_kwargs["cp_layout"] = layout

        inputs = dict(hidden_states=hidden_states, encoder_hidden_states=encoder_hidden_states,
                      pooled_projections=pooled_projections, timestep=timestep, img_ids=img_ids, txt_ids=txt_ids,
                      guidance=guidance, joint_attention_kwargs=attention_kwargs or None)
        if self.modulation is None:
            output = self.model(**inputs, return_dict=False)[0]
        else:
            output = self._forward_shared_modulation(**inputs)

        if plan.seq_degree > 1:
            output = gather_tokens(output, mesh, length=num_image_tokens, dim=1)
        output = gather_batch(output, mesh)
        return Transformer2DModelOutput(sample=output) if return_dict else (output,)

    def _forward_shared_modulation(
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
        """diffusers' FluxTransformer2DModel.forward (0.42: embeddings, rotary embedding, blocks,
        norm_out, proj_out; without ControlNet residuals and IP-Adapter, which ParallelFlux does not
        take), with each block's modulation from SharedModulation instead of its own projection."""
        model = self.model
        hidden_states = model.x_embedder(hidden_states)
        timestep = timestep.to(hidden_states.dtype) * 1000
        if guidance is None:
            temb = model.time_text_embed(timestep, pooled_projections)
        else:
            temb = model.time_text_embed(timestep, guidance.to(hidden_states.dtype) * 1000, pooled_projections)
        encoder_hidden_states = model.context_embedder(encoder_hidden_states)
        image_rotary_emb = model.pos_embed(torch.cat((txt_ids, img_ids), dim=0))
        modulations = iter(self.modulation(temb))
        for block in [*model.transformer_blocks, *model.single_transformer_blocks]:
            encoder_hidden_states, hidden_states = block(
                hidden_states=hidden_states,
                encoder_hidden_states=encoder_hidden_states,
                temb=next(modulations),
                image_rotary_emb=image_rotary_emb,
                joint_attention_kwargs=joint_attention_kwargs,
            )
        hidden_states = model.norm_out(hidden_states, next(modulations))
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


def parallelize_flux(model: FluxTransformer2DModel, mesh: ParallelMesh) -> ParallelFlux:
    """Shard FLUX's text and image tokens over the mesh's sequence ranks (and its batch over CFG groups).

    With a Ulysses-only or ring-only plan the single-stream blocks become OverlappedSingleBlocks
    (restore() undoes it).
    """
    mesh.plan.check(num_heads=model.config.num_attention_heads)
    replaced = []
    if mesh.plan.seq_degree > 1:
        attentions = [b.attn for b in model.transformer_blocks] + [b.attn for b in model.single_transformer_blocks]
        replaced = replace_processors(attentions, FluxContextParallelProcessor(mesh))
    plan = mesh.plan
    ulysses_only = plan.ulysses > 1 and plan.ring == 1
    ring_only = plan.ulysses == 1 and plan.ring > 1 and plan.kv_exchange == "ring"
    if ulysses_only or ring_only:
        blocks = model.single_transformer_blocks
        for index, block in enumerate(blocks):
            blocks[index] = OverlappedSingleBlock(block, mesh)
    modulation = None
    if ulysses_only:
        modulation = SharedModulation(model, mesh.ulysses_group, mesh.ulysses_rank, plan.ulysses)
    elif plan.ring > 1 and plan.ulysses == 1:
        modulation = SharedModulation(model, mesh.ring_group, mesh.ring_rank, plan.ring)
    if modulation is not None:
        modulation.install()
    return ParallelFlux(model, mesh, replaced, modulation)
