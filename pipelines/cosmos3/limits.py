"""What a Cosmos 3 request may ask for (its record's limits)."""

from __future__ import annotations

from pathlib import Path

from pipelines.family import ModelSpec
from pipelines.registry import read_component_config
from pipelines.requests import MediaLimits


def cosmos3_limits(spec: ModelSpec, folder: Path) -> MediaLimits:
    """Cosmos 3: sizes a multiple of the VAE's spatial factor (the transformer pads its 2x2 patch grid, so
    720 px works), up to 1280 px a side (its pipeline's 720p class, either orientation); frames 1 + k x
    the VAE's temporal factor, from 1 + that factor (one frame is the image name's) up to 189, its
    pipeline's default and longest documented length. Its mRoPE has no position table to bound sizes."""
    vae = read_component_config(folder, "vae")
    spatial = int(vae.get("scale_factor_spatial", 16))
    temporal = int(vae.get("scale_factor_temporal", 4))
    video = spec.media == "video"
    return MediaLimits(size_multiple=spatial, max_height=1280, max_width=1280, frame_multiple=temporal,
                       max_frames=189 if video else 1, min_frames=1 + temporal if video else 1)
