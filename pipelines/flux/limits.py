"""What a FLUX.1 request may ask for (its record's limits; FLUX.2's build on them)."""

from __future__ import annotations

from pathlib import Path

from pipelines.family import ModelSpec
from pipelines.registry import read_component_config
from pipelines.requests import MediaLimits


def flux_limits(spec: ModelSpec, folder: Path) -> MediaLimits:
    """FLUX-style: VAE downsampling x the 2x2 latent packing. FLUX's rotary ids have no table limit;
    4096 px is the largest size its authors report."""
    vae = read_component_config(folder, "vae")
    multiple = 2 ** (len(vae["block_out_channels"]) - 1) * 2
    return MediaLimits(size_multiple=multiple, max_height=4096, max_width=4096)
