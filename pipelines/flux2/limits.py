"""What a FLUX.2 request may ask for (its record's limits)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from pipelines.family import ModelSpec
from pipelines.flux.limits import flux_limits
from pipelines.requests import MediaLimits


def flux2_limits(spec: ModelSpec, folder: Path) -> MediaLimits:
    """FLUX.2: VAE downsampling x the 2x2 latent packing, as FLUX.1 (no position table bounds the size);
    a reference image may be given (its pipelines' image editing)."""
    return replace(flux_limits(spec, folder), reference_image=True)
