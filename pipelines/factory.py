"""Pick and load the pipeline class for a model spec."""

from __future__ import annotations

from pathlib import Path

import torch

from pipelines.cosmos import CosmosPipeline
from pipelines.flux import FluxImagePipeline
from pipelines.registry import ModelSpec

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
    cls = FluxImagePipeline if spec.family == "flux" else CosmosPipeline
    return cls.from_folder(spec, folder, device=device, dtype=dtype, with_encoders=with_encoders)


def default_dtype(device: torch.device | str) -> torch.dtype:
    """bfloat16 on GPUs (what the checkpoints are trained in), float32 on CPUs (exact, and faster there)."""
    return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
