"""What a FLUX.3 request may ask for (its record's limits)."""

from __future__ import annotations

from pathlib import Path

from pipelines.family import ModelSpec
from pipelines.registry import read_component_config
from pipelines.requests import MediaLimits


def flux3_limits(spec: ModelSpec, folder: Path) -> MediaLimits:
    """FLUX.3: VAE downsampling x the 2x2 latent packing (16) as FLUX.2, up to 4096 px a side (the largest side
    diffusers' FLUX.3 image processor gives a reference's canvas); a reference image may be given."""
    vae = read_component_config(folder, "vae")
    multiple = 2 ** (len(vae["block_out_channels"]) - 1) * 2
    return MediaLimits(size_multiple=multiple, max_height=4096, max_width=4096, reference_image=True)
