"""What a FLUX.3 request may ask for (its record's limits)."""

from __future__ import annotations

from pathlib import Path

from pipelines.family import ModelSpec
from pipelines.flux2.limits import flux2_limits
from pipelines.requests import MediaLimits


def flux3_limits(spec: ModelSpec, folder: Path) -> MediaLimits:
    """FLUX.3: VAE downsampling x the 2x2 latent packing (16) as FLUX.2, up to 4096 px a side (the largest side
    diffusers' FLUX.3 image processor gives a reference's canvas); a reference image may be given."""
    return flux2_limits(spec, folder)
