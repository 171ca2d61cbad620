"""FLUX.3's transformer called at one size (its record's BenchShapes.inputs; pipelines.transformer_inputs says
what a builder takes and returns)."""

from __future__ import annotations

from typing import Any

import torch

from pipelines.transformer_inputs import VAE_SPACE, Shape


def flux3_inputs(config: dict[str, Any], shape: Shape, *, batch: int, device: torch.device,
                 dtype: torch.dtype) -> tuple[dict[str, Any], int]:
    """Flux3Transformer2DModel keyword arguments for a packed latent of `shape` (2x2 latent patches), with the
    ids FLUX.3's blocks make: image (0, row / 2, column / 2, 0) (its rotary scale 0.5), text (0, 0, 0, position);
    a flow-map (distilled) config also gets the timestep a step jumps to."""
    rows, cols = shape.height // (VAE_SPACE * 2), shape.width // (VAE_SPACE * 2)
    g = torch.Generator().manual_seed(0)
    img_ids = torch.cartesian_prod(torch.arange(1), torch.arange(rows), torch.arange(cols), torch.arange(1)).float()
    img_ids[:, 1:3] *= 0.5
    txt_ids = torch.cartesian_prod(torch.arange(1), torch.arange(1), torch.arange(1),
                                   torch.arange(shape.text_tokens)).float()
    inputs = dict(
        hidden_states=torch.randn(batch, rows * cols, config.get("in_channels", 128), generator=g),
        encoder_hidden_states=torch.randn(batch, shape.text_tokens, config.get("joint_attention_dim", 20480),
                                          generator=g),
        timestep=torch.full((batch,), 0.5),
        target_timestep=torch.full((batch,), 0.25) if config.get("flow_map") else None,
    )
    out = {k: v.to(device, dtype) if v is not None else None for k, v in inputs.items()}
    return {**out, "img_ids": img_ids.to(device), "txt_ids": txt_ids.to(device), "return_dict": False}, rows * cols
