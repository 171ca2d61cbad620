"""Qwen-Image's transformer called at one size (its record's BenchShapes.inputs; pipelines.transformer_inputs says
what a builder takes and returns)."""

from __future__ import annotations

from typing import Any

import torch

from pipelines.transformer_inputs import VAE_SPACE, Shape


def qwen_image_inputs(config: dict[str, Any], shape: Shape, *, batch: int, device: torch.device,
                      dtype: torch.dtype) -> tuple[dict[str, Any], int]:
    """QwenImageTransformer2DModel keyword arguments for a packed latent of `shape` (2x2 latent patches):
    shape.text_tokens prompt embeddings (all real: no mask), the image's grid in img_shapes per sample, and a
    reference's packed tokens after the image's with its grid beside it (shape.reference: Qwen-Image-Edit)."""
    rows, cols = shape.height // (VAE_SPACE * 2), shape.width // (VAE_SPACE * 2)
    grids = [(1, rows, cols)]
    if shape.reference is not None:
        grids.append((1, shape.reference[0] // (VAE_SPACE * 2), shape.reference[1] // (VAE_SPACE * 2)))
    tokens = sum(r * c for _, r, c in grids)
    g = torch.Generator().manual_seed(0)
    inputs = dict(
        hidden_states=torch.randn(batch, tokens, config.get("in_channels", 64), generator=g),
        encoder_hidden_states=torch.randn(batch, shape.text_tokens, config.get("joint_attention_dim", 3584),
                                          generator=g),
        timestep=torch.full((batch,), 0.5),
    )
    inputs = {k: v.to(device, dtype) for k, v in inputs.items()}
    return {**inputs, "img_shapes": [grids] * batch, "return_dict": False}, tokens
