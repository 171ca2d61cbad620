"""FLUX.2's transformer called at one size (its record's BenchShapes.inputs; pipelines.transformer_inputs says
what a builder takes and returns)."""

from __future__ import annotations

from typing import Any

import torch

from pipelines.transformer_inputs import VAE_SPACE, Shape


def flux2_inputs(config: dict[str, Any], shape: Shape, *, batch: int, device: torch.device,
                 dtype: torch.dtype) -> tuple[dict[str, Any], int]:
    """Flux2Transformer2DModel keyword arguments for a packed latent of `shape` (2x2 latent patches), with
    FLUX.2's 4-axis ids as its pipelines make them: image (0, row, column, 0), text (0, 0, 0, position); a reference
    image's tokens (shape.reference) after the image's, at time 10 (Flux2Pipeline._prepare_image_ids)."""
    rows, cols = shape.height // (VAE_SPACE * 2), shape.width // (VAE_SPACE * 2)
    g = torch.Generator().manual_seed(0)
    img_ids = torch.cartesian_prod(torch.arange(1), torch.arange(rows), torch.arange(cols), torch.arange(1))
    tokens = rows * cols
    if shape.reference is not None:
        ref_rows, ref_cols = (side // (VAE_SPACE * 2) for side in shape.reference)
        img_ids = torch.cat([img_ids, torch.cartesian_prod(torch.tensor([10]), torch.arange(ref_rows),
                                                           torch.arange(ref_cols), torch.arange(1))])
        tokens += ref_rows * ref_cols
    txt_ids = torch.cartesian_prod(torch.arange(1), torch.arange(1), torch.arange(1), torch.arange(shape.text_tokens))
    inputs = dict(
        hidden_states=torch.randn(batch, tokens, config.get("in_channels", 128), generator=g),
        encoder_hidden_states=torch.randn(batch, shape.text_tokens, config["joint_attention_dim"], generator=g),
        timestep=torch.full((batch,), 0.5),
        guidance=torch.full((batch,), 4.0) if config.get("guidance_embeds", True) else None,
    )
    out = {k: v.to(device, dtype) if v is not None else None for k, v in inputs.items()}
    return {**out, "img_ids": img_ids.to(device), "txt_ids": txt_ids.to(device), "joint_attention_kwargs": None,
            "return_dict": False}, tokens
