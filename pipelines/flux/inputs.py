"""FLUX.1's transformer called at one size (its record's BenchShapes.inputs; pipelines.transformer_inputs says
what a builder takes and returns)."""

from __future__ import annotations

from typing import Any

import torch

from pipelines.transformer_inputs import VAE_SPACE, Shape


def flux_inputs(config: dict[str, Any], shape: Shape, *, batch: int, device: torch.device,
                dtype: torch.dtype) -> tuple[dict[str, Any], int]:
    """FluxTransformer2DModel keyword arguments for a packed latent of `shape` (2x2 latent patches)."""
    rows, cols = shape.height // (VAE_SPACE * 2), shape.width // (VAE_SPACE * 2)
    g = torch.Generator().manual_seed(0)
    img_ids = torch.zeros(rows, cols, 3)
    img_ids[..., 1] = torch.arange(rows)[:, None]
    img_ids[..., 2] = torch.arange(cols)[None, :]
    inputs = dict(
        hidden_states=torch.randn(batch, rows * cols, config["in_channels"], generator=g),
        encoder_hidden_states=torch.randn(batch, shape.text_tokens, config["joint_attention_dim"], generator=g),
        pooled_projections=torch.randn(batch, config["pooled_projection_dim"], generator=g),
        timestep=torch.full((batch,), 0.5),
        img_ids=img_ids.reshape(-1, 3),
        txt_ids=torch.zeros(shape.text_tokens, 3),
        guidance=torch.full((batch,), 3.5) if config.get("guidance_embeds") else None,
    )
    out = {k: v.to(device, dtype if k not in ("img_ids", "txt_ids") else v.dtype) if v is not None else None
           for k, v in inputs.items()}
    return {**out, "joint_attention_kwargs": None, "return_dict": False}, rows * cols
