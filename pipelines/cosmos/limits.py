"""What a Cosmos-Predict2 request may ask for (its record's limits)."""

from __future__ import annotations

from pathlib import Path

from pipelines.family import ModelSpec
from pipelines.registry import read_component_config
from pipelines.requests import MediaLimits


def cosmos_limits(spec: ModelSpec, folder: Path) -> MediaLimits:
    """Cosmos-style: the Wan VAE's compression x the transformer's patch, up to its position table
    (max_size); frames 1 + k x the VAE's temporal factor."""
    vae = read_component_config(folder, "vae")
    transformer = read_component_config(folder, "transformer")
    spatial = 2 ** len(vae["temperal_downsample"])
    temporal = 2 ** sum(vae["temperal_downsample"])
    max_t, max_h, max_w = transformer["max_size"]
    _, patch_h, patch_w = transformer["patch_size"]
    return MediaLimits(
        size_multiple=spatial * max(patch_h, patch_w),
        max_height=max_h * patch_h * spatial,
        max_width=max_w * patch_w * spatial,
        frame_multiple=temporal,
        max_frames=(max_t - 1) * temporal + 1 if spec.media == "video" else 1,
    )
