"""A family's transformer called at one size: its keyword arguments, random values of the right shapes.

Each family's record names its builder (BenchShapes.inputs). The work estimate (pipelines.work) counts
a request's FLOPs on meta tensors built by it; the benchmarks time real calls built by it. A builder
takes the transformer's config (a dict), a Shape, and batch / device / dtype, and returns the keyword
arguments and the number of image or video tokens the call attends over. A new family may keep its
builder in its own module: the record names it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

VAE_TIME, VAE_SPACE = 4, 8  # latent = ((frames - 1) / 4 + 1, height / 8, width / 8)


@dataclass(kw_only=True, frozen=True)
class Shape:
    """One input size: an image (frames=1) or a video, in pixels."""

    height: int
    width: int
    frames: int = 1
    text_tokens: int = 512
    reference: tuple[int, int] | None = None
    """A reference image's height and width in pixels, whose tokens follow the image's (Qwen-Image-Edit), or None;
    the builders of families without one leave it out."""

    @property
    def label(self) -> str:
        """Human-readable size."""
        return f"{self.height}x{self.width}" if self.frames == 1 else f"{self.frames}x{self.height}x{self.width}"


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


