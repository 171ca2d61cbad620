"""FLUX's attention made context-parallel: q/k/v as diffusers' FluxAttnProcessor makes them, and the
processor that installs in each FluxAttention of a parallelized FluxTransformer2DModel (its attention
call is engines.parallel.attention's split_attention, whatever the strategy).

The projections are written here, not imported (diffusers keeps its own helper private): plain
to_q/to_k/to_v and add_*_proj, or diffusers' fused to_qkv/to_added_qkv after fuse_qkv_projections().
"""

from __future__ import annotations

from typing import Any

import torch
from diffusers.models.embeddings import apply_rotary_emb
from torch import nn

from engines.levers.fp8 import is_fp8
from engines.parallel.collectives import linear_after
from engines.parallel.generic import SplitProcessor


def _projections(attn: Any, x: torch.Tensor, *, fused: str, plain: tuple[str, str, str]
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k, v projections of one stream: the fused projection `fused` when the module's projections
    are fused, else the three `plain` ones."""
    if attn.fused_projections:
        query, key, value = getattr(attn, fused)(x).chunk(3, dim=-1)
        return query, key, value
    return tuple(getattr(attn, name)(x) for name in plain)


def query_key_value(
    attn: Any,
    hidden_states: torch.Tensor,
    encoder_hidden_states: torch.Tensor | None,
    image_rotary_emb: tuple[torch.Tensor, torch.Tensor] | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k, v (BSHD) as diffusers' FluxAttnProcessor makes them: projections, q/k norms, the text
    stream's in front (double-stream blocks), rotary embedding."""
    query, key, value = _projections(attn, hidden_states, fused="to_qkv", plain=("to_q", "to_k", "to_v"))
    if encoder_hidden_states is None or attn.added_kv_proj_dim is None:  # a single-stream block
        encoder_query = encoder_key = encoder_value = encoder_norm_q = encoder_norm_k = None
    else:
        encoder_query, encoder_key, encoder_value = _projections(
            attn, encoder_hidden_states, fused="to_added_qkv", plain=("add_q_proj", "add_k_proj", "add_v_proj"))
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
    """k of a double-stream block (unfused projections), as query_key_value makes it."""
    return _joint(attn, attn.to_k(hidden_states), attn.add_k_proj(encoder_hidden_states), attn.norm_k,
                  attn.norm_added_k, image_rotary_emb)


def _projected_after(
    hidden_states: torch.Tensor,
    encoder_hidden_states: torch.Tensor,
    proj: nn.Linear,
    encoder_proj: nn.Linear,
    after: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """proj(hidden_states) and encoder_proj(encoder_hidden_states) of a double-stream block, both
    ordered after the op that produced `after` (collectives.linear_after; plain projections for None)."""
    if after is None:
        return proj(hidden_states), encoder_proj(encoder_hidden_states)
    return (linear_after(hidden_states, proj.weight, proj.bias, after),
            linear_after(encoder_hidden_states, encoder_proj.weight, encoder_proj.bias, after))


def _values(attn: Any, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor,
            after: torch.Tensor | None) -> list[torch.Tensor]:
    """v of a double-stream block (unfused projections) as its text and image parts, in the joint
    order: the copy-engine K/V all-gather takes them apart, which spares their concatenation. Both
    projections are ordered after the op that produced `after` (the keys' all-gather, which travels
    meanwhile; None: nothing travels)."""
    value, encoder_value = _projected_after(hidden_states, encoder_hidden_states, attn.to_v, attn.add_v_proj, after)
    return [_joint(attn, encoder_value, None, None, None, None), _joint(attn, value, None, None, None, None)]


def _queries(
    attn: Any,
    hidden_states: torch.Tensor,
    encoder_hidden_states: torch.Tensor,
    image_rotary_emb: tuple[torch.Tensor, torch.Tensor] | None,
    after: torch.Tensor | None,
) -> torch.Tensor:
    """q of a double-stream block (unfused projections), as query_key_value makes it, with both
    projections ordered after the op that produced `after` (collectives.linear_after; None: unordered)."""
    query, encoder_query = _projected_after(hidden_states, encoder_hidden_states, attn.to_q, attn.add_q_proj, after)
    return _joint(attn, query, encoder_query, attn.norm_q, attn.norm_added_q, image_rotary_emb)


def _plain_projections(attn: Any) -> bool:
    """Whether q and v come from plain nn.Linear projections in the run's dtype (not fused, not FP8, not
    wrapped by an adapter), which the all-gather attention reorders with collectives.linear_after.

    --fp8 fuses the projections (engines.levers.fp8), so its double-stream blocks take the plain path: the input
    quantized once and one GEMM per stream are a sure saving, while the reordering gained little under FP8,
    whose layers (Fp8Linear modules, or torchao's tensor subclass as the weight) are no plain weight for linear_after's
    custom op, leaving the projections' order to inductor."""
    return not attn.fused_projections and all(
        type(proj) is nn.Linear and not is_fp8(proj.weight)
        for proj in (attn.to_q, attn.add_q_proj, attn.to_v, attn.add_v_proj))


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


class FluxContextParallelProcessor(SplitProcessor):
    """FluxAttnProcessor with the attention call made context-parallel (same projections, norms, rope).

    A double-stream block with plain projections hands its keys to the attention and its values and
    queries as functions that make them: the all-gather strategy (engines.parallel.attention.GatherAttention)
    projects the keys of both streams first and issues their all-gather, projects the values while
    the keys travel (on copy engines; NCCL gathers both at once) and issues theirs, projects the
    queries while the values travel, then runs one attention kernel over every key; the other
    strategies make them at once, before their first exchange. (Ring attention hides its K/V pass under the
    attention to the own K/V instead, and pays for it with one attention kernel per block and a
    log-sum-exp merge; a double block has no other compute to hide the exchange behind:
    docs/benchmarks.md.)
    """

    def __call__(
        self,
        attn: Any,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        image_rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        layout = self.layout()
        if attention_mask is not None:
            raise ValueError("FLUX attention masks are not supported with context parallelism")
        double = encoder_hidden_states is not None and attn.added_kv_proj_dim is not None
        if double and _plain_projections(attn):
            x, context = hidden_states, encoder_hidden_states
            out = self.attention(
                lambda after: _queries(attn, x, context, image_rotary_emb, after),
                _keys(attn, x, context, image_rotary_emb),
                lambda after: _values(attn, x, context, after),
                layout=layout,
            )
        else:
            query, key, value = query_key_value(attn, hidden_states, encoder_hidden_states, image_rotary_emb)
            out = self.attention(query, key, value, layout=layout).to(query.dtype)
        hidden_states = out.flatten(2, 3)

        if encoder_hidden_states is None:
            return hidden_states
        text_len = encoder_hidden_states.shape[1]
        encoder_hidden_states, hidden_states = hidden_states.split_with_sizes(
            [text_len, hidden_states.shape[1] - text_len], dim=1
        )
        hidden_states = attn.to_out[1](attn.to_out[0](hidden_states.contiguous()))
        encoder_hidden_states = attn.to_add_out(encoder_hidden_states.contiguous())
        return hidden_states, encoder_hidden_states
