"""Pick and load the pipeline class for a model spec."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import torch

from pipelines.registry import ModelSpec

if TYPE_CHECKING:
    from pipelines.cosmos import CosmosPipeline
    from pipelines.flux import FluxImagePipeline

    Pipeline = FluxImagePipeline | CosmosPipeline


def load_pipeline(
    spec: ModelSpec,
    folder: Path,
    *,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    with_encoders: bool = True,
) -> Pipeline:
    """Load `spec`'s pipeline from `folder`; ranks other than 0 pass with_encoders=False."""
    # Import only the family asked for: diffusers' Cosmos pipeline module alone costs seconds of start-up.
    if spec.family == "flux":
        from pipelines.flux import FluxImagePipeline as cls
    else:
        from pipelines.cosmos import CosmosPipeline as cls
    return cls.from_folder(spec, folder, device=device, dtype=dtype, with_encoders=with_encoders)


def default_dtype(device: torch.device | str) -> torch.dtype:
    """bfloat16 on GPUs (what the checkpoints are trained in), float32 on CPUs (exact, and faster there)."""
    return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
