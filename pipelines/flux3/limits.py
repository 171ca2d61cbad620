"""What a FLUX.3 request may ask for (its record's limits)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from pipelines.family import ModelSpec
from pipelines.flux2.limits import flux2_limits
from pipelines.requests import MediaLimits


def flux3_limits(spec: ModelSpec, folder: Path) -> MediaLimits:
    """FLUX.3: VAE downsampling x the 2x2 latent packing (16) as FLUX.2, up to 4096 px a side (the largest side
    diffusers' FLUX.3 image processor gives a reference's canvas); a reference image may be given. Its reference
    runs through blocks of its own (the image_cond mode blocks), which the work estimate does not count
    (reference_area 0). Its base model's guider runs guidance at every scale but 1."""
    return replace(flux2_limits(spec, folder), reference_area=0, guided_below_1=True)
