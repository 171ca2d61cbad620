"""Cosmos-Predict2's transformer called at one size (its record's BenchShapes.inputs; pipelines.transformer_inputs
says what a builder takes and returns)."""

from __future__ import annotations

from typing import Any

import torch

from pipelines.transformer_inputs import VAE_SPACE, VAE_TIME, Shape


def cosmos_inputs(config: dict[str, Any], shape: Shape, *, batch: int, device: torch.device,
                  dtype: torch.dtype) -> tuple[dict[str, Any], int]:
    """CosmosTransformer3DModel (Video2World) keyword arguments for a video of `shape`."""
    frames = (shape.frames - 1) // VAE_TIME + 1
    height, width = shape.height // VAE_SPACE, shape.width // VAE_SPACE
    g = torch.Generator().manual_seed(0)
    latent = (batch, config["out_channels"], frames, height, width)
    inputs: dict[str, Any] = dict(
        hidden_states=torch.randn(*latent, generator=g),
        timestep=torch.rand(batch, 1, frames, 1, 1, generator=g),
        encoder_hidden_states=torch.randn(batch, shape.text_tokens, config["text_embed_dim"], generator=g),
        padding_mask=torch.zeros(1, 1, shape.height, shape.width),
    )
    if config["in_channels"] == config["out_channels"] + 1:
        inputs["condition_mask"] = torch.zeros(batch, 1, frames, height, width)
    inputs = {k: v.to(device, dtype) for k, v in inputs.items()}
    p_t, p_h, p_w = config["patch_size"]
    tokens = (frames // p_t) * (height // p_h) * (width // p_w)
    return {**inputs, "fps": 16, "return_dict": False}, tokens
