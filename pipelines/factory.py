"""Load a model's pipeline: the class its family's record names."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from pipelines.family import load
from pipelines.loading import TransformerShare
from pipelines.registry import ModelSpec, family_of


def load_pipeline(
    spec: ModelSpec,
    folder: Path,
    *,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    with_encoders: bool = True,
    with_vae: bool | None = None,
    tp: int = 1,
    tp_rank: int = 0,
) -> Any:
    """Load `spec`'s pipeline from `folder`; ranks other than 0 pass with_encoders=False (and with_vae=True when
    the VAE decode is split over the ranks; None: as with_encoders). With `tp` > 1 the transformer is loaded
    split: only share `tp_rank` of every block's weights is read (pipelines.loading).

    Only the family asked for is imported: diffusers' Cosmos pipeline module alone costs seconds of start-up.
    """
    family = family_of(spec)
    cls = load(family.pipeline)
    share = TransformerShare(tp=tp, rank=tp_rank, weights=family.tensor_parallel) if tp > 1 else None
    return cls.from_folder(spec, folder, device=device, dtype=dtype, with_encoders=with_encoders, with_vae=with_vae,
                           share=share)


def import_pipeline_code(spec: ModelSpec) -> None:
    """Import `spec`'s pipeline module, and with it diffusers' and transformers' code it runs: the largest part of
    a start-up's seconds (start-up times it apart from reading the weights)."""
    load(family_of(spec).pipeline)


def default_dtype(device: torch.device | str) -> torch.dtype:
    """bfloat16 on GPUs (what the checkpoints are trained in), float32 on CPUs (exact, and faster there)."""
    return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
