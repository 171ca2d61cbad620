"""FLUX's single-stream block with its context-parallel exchanges overlapped by the block's own MLP."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from diffusers.models.transformers.transformer_flux import FluxSingleTransformerBlock
from torch import nn

from engines.levers.fp8 import is_fp8
from engines.parallel.attention import split_attention
from engines.parallel.mesh import ParallelMesh
from engines.parallel.sharding import ShardLayout
from engines.weights.lora import has_lora
from pipelines.flux.attention import query_key_value


class OverlappedSingleBlock(nn.Module):
    """diffusers' FluxSingleTransformerBlock for plans with one sequence axis (Ulysses, ring or
    all-gather), with its exchanges overlapped.

    The block computes mlp = GELU(proj_mlp(x)) and attention(x) side by side, then
    proj_out(cat(attention, mlp)). diffusers runs the MLP first and the attention after, so each
    exchange of the attention waits with nothing to do. Here the attention (engines.parallel.attention's
    split_attention: the plan's strategy) runs the MLP's two steps as its while_waiting work:
    1. q/k/v are projected and the attention's first exchange is issued: the head-scatter
       all-to-all (Ulysses), the all-gather of this rank's K/V (allgather) or its first K/V pass (ring);
    2. the MLP runs while it travels (4x the FLOPs of the q/k/v projections);
    3. the MLP's share of proj_out runs while the next exchange travels: proj_out(cat(a, m)) =
       a W_a^T + m W_m^T + b, W_a and W_m being column slices of proj_out's weight (views: no copy).
       Ulysses: its token-gather all-to-all, after the attention; ring and allgather: the same K/V
       exchange, before the attention (nothing travels after it), so that exchange has both GEMMs to
       hide under: inside a CUDA graph its local copy-out may run as a kernel, which waits for free
       SMs (docs/benchmarks.md);
    4. the attention's share is added. Residual and gate as in diffusers.
    Splitting proj_out also spares the concatenation, which under ring fused with the LSE merge
    into one slow kernel (150 us a block at FLUX 1024², against ~40 us for GELU alone).
    Same parameters (the original block is a child; the parallel model's restore() puts it back) and the same
    result up to float rounding (tests/test_engines_flux_overlap.py). The waits are explicit ops,
    so torch.compile keeps the order (with EngineOptions.overlap).
    Measured on 2x H200 (docs/benchmarks.md, FLUX.1-dev 1024²): with NCCL the q/k/v all-to-all's
    kernel starts only after the MLP GEMM, whose CTAs take every SM, so little is hidden; on copy
    engines (no SM needed) the all-gather plan's K/V exchange runs entirely under the MLP GEMM.
    """

    def __init__(self, block: FluxSingleTransformerBlock, mesh: ParallelMesh,
                 layout: Callable[[], ShardLayout]) -> None:
        super().__init__()
        self.block = block
        self.attention = split_attention(mesh)
        self.layout = layout
        """The layout of the joint sequence in the current call (the generic path's, engines.parallel.generic)."""

    def forward(
        self,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor,
        temb: torch.Tensor,
        image_rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
        joint_attention_kwargs: dict[str, Any] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        block, attn = self.block, self.block.attn
        layout = self.layout()
        text_len = encoder_hidden_states.shape[1]
        hidden_states = torch.cat([encoder_hidden_states, hidden_states], dim=1)
        norm_hidden_states, gate = block.norm(hidden_states, emb=temb)

        query, key, value = query_key_value(attn, norm_hidden_states, None, image_rotary_emb)
        weight = block.proj_out.weight
        width = weight.shape[1] - block.mlp_hidden_dim  # attention output width

        def mlp() -> torch.Tensor:
            return block.act_mlp(block.proj_mlp(norm_hidden_states))

        def mlp_share(activation: torch.Tensor) -> torch.Tensor:  # the MLP's share of proj_out
            return F.linear(activation, weight[:, width:], block.proj_out.bias)

        if is_fp8(weight) or has_lora(block.proj_out):  # a LoRA term (engines.weights.lora) takes proj_out whole too
            # FP8 (--fp8): proj_out runs whole, as in diffusers' block. Its activation is quantized with one
            # scale per token over [attention, MLP]; the two shares quantized apart would round differently
            # from one process (2 gloo ranks: 23 levels off after 3 steps of tiny-flux).
            attention, mlp_out = self.attention(query, key, value, layout=layout, while_waiting=(mlp,))
            out = block.proj_out(torch.cat([attention.flatten(2, 3).to(query.dtype), mlp_out], dim=2))
        else:
            attention, out = self.attention(query, key, value, layout=layout, while_waiting=(mlp, mlp_share))
            out = out + F.linear(attention.flatten(2, 3).to(query.dtype), weight[:, :width])

        hidden_states = hidden_states + gate.unsqueeze(1) * out
        if hidden_states.dtype == torch.float16:
            hidden_states = hidden_states.clip(-65504, 65504)
        return hidden_states[:, :text_len], hidden_states[:, text_len:]
