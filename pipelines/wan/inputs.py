"""Wan's transformer called at one size (its records' BenchShapes.inputs; pipelines.transformer_inputs says what a
builder takes and returns)."""

from __future__ import annotations

from typing import Any

import torch

from pipelines.transformer_inputs import VAE_SPACE, VAE_TIME, Shape


def wan_inputs(config: dict[str, Any], shape: Shape, *, batch: int, device: torch.device,
               dtype: torch.dtype) -> tuple[dict[str, Any], int]:
    """WanTransformer3DModel (Wan 2.1) keyword arguments for a video of `shape`: the Wan 2.1 VAE's latent (8x
    space, 4x time; an image-to-video config's in_channels add the image's), shape.text_tokens text embeddings,
    one timestep per batch row; an image-to-video config (image_dim) also gets CLIP ViT-H/14's 257 image tokens."""
    return _wan_call(config, shape, batch=batch, device=device, dtype=dtype, space=VAE_SPACE, per_token=False)


def wan22_inputs(config: dict[str, Any], shape: Shape, *, batch: int, device: torch.device,
                 dtype: torch.dtype) -> tuple[dict[str, Any], int]:
    """WanTransformer3DModel (Wan 2.2 TI2V) keyword arguments for a video of `shape`: the Wan 2.2 VAE's latent (16x
    space, 4x time), shape.text_tokens text embeddings, a timestep per token ([batch, tokens]: expand_timesteps)."""
    return _wan_call(config, shape, batch=batch, device=device, dtype=dtype, space=2 * VAE_SPACE, per_token=True)


WAN_IMAGE_TOKENS = 257
"""CLIP ViT-H/14's hidden states of one 224 px image: a class token and 16 x 16 patches."""


def _wan_call(config: dict[str, Any], shape: Shape, *, batch: int, device: torch.device, dtype: torch.dtype,
              space: int, per_token: bool) -> tuple[dict[str, Any], int]:
    frames = (shape.frames - 1) // VAE_TIME + 1
    height, width = shape.height // space, shape.width // space
    g = torch.Generator().manual_seed(0)
    inputs = dict(
        hidden_states=torch.randn(batch, config.get("in_channels", 16), frames, height, width, generator=g),
        encoder_hidden_states=torch.randn(batch, shape.text_tokens, config.get("text_dim", 4096), generator=g),
    )
    if config.get("image_dim") is not None:
        inputs["encoder_hidden_states_image"] = torch.randn(batch, WAN_IMAGE_TOKENS, config["image_dim"], generator=g)
    inputs = {k: v.to(device, dtype) for k, v in inputs.items()}
    p_t, p_h, p_w = config.get("patch_size", (1, 2, 2))
    tokens = (frames // p_t) * (height // p_h) * (width // p_w)
    timestep = torch.full((batch, tokens) if per_token else (batch,), 500.0, device=device)
    return {**inputs, "timestep": timestep, "return_dict": False}, tokens
