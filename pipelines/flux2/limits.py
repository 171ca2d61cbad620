"""What a FLUX.2 request may ask for (its record's limits)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from pipelines.family import ModelSpec
from pipelines.flux.limits import flux_limits
from pipelines.requests import MediaLimits

REFERENCE_MAX_AREA = 1024 * 1024
"""A larger reference image is scaled down to this many pixels first, as diffusers does."""


def flux2_limits(spec: ModelSpec, folder: Path) -> MediaLimits:
    """FLUX.2: VAE downsampling x the 2x2 latent packing, as FLUX.1 (no position table bounds the size);
    a reference image may be given (its pipelines' image editing), whose tokens the work estimate counts at
    REFERENCE_MAX_AREA, the most it keeps (a smaller one is counted as large: the time limit errs on the safe side)."""
    return replace(flux_limits(spec, folder), reference_image=True, reference_area=REFERENCE_MAX_AREA)
