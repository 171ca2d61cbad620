"""Load the components of a diffusers-format folder, one by one, from local files only.

Loading component by component (instead of DiffusionPipeline.from_pretrained) lets a rank load only
what it runs: every rank needs the transformer and scheduler, only rank 0 needs text encoders and VAE.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

import torch

from pipelines.registry import ModelNotFoundError, read_model_index

# Components a folder may name that ulysses-studio never loads: the Cosmos guardrail is handled
# separately (pipelines.guardrail), the rest are IP-adapter parts we do not support.
SKIPPED_COMPONENTS = {"safety_checker", "image_encoder", "feature_extractor"}


def component_class(index: dict, name: str) -> type:
    """The class that model_index.json names for component `name`."""
    entry = index.get(name)
    if not entry or entry[0] is None:
        raise ModelNotFoundError(f"model_index.json has no component '{name}'")
    library, class_name = entry
    return getattr(importlib.import_module(library), class_name)


def load_component(folder: Path, name: str, dtype: torch.dtype | None = None, index: dict | None = None) -> Any:
    """Load component `name` from `folder/name` (weights cast to `dtype` where it is a model)."""
    index = index if index is not None else read_model_index(folder)
    cls = component_class(index, name)
    subfolder = folder / name
    if not subfolder.is_dir():
        raise ModelNotFoundError(f"{folder} lacks the '{name}' folder that its model_index.json names")
    if issubclass(cls, torch.nn.Module):
        model = cls.from_pretrained(subfolder, torch_dtype=dtype, local_files_only=True)
        return model.eval().requires_grad_(False)
    return cls.from_pretrained(subfolder, local_files_only=True)


def load_parts(
    folder: Path,
    names: list[str],
    *,
    dtype: torch.dtype,
    device: torch.device | str,
    dtypes: dict[str, torch.dtype] | None = None,
) -> dict[str, Any]:
    """Load components `names` of `folder` and move the models to `device`.

    Args:
        dtypes: per-component dtype where it differs from `dtype` (e.g. a VAE kept in float32).
    """
    index = read_model_index(folder)
    parts = {name: load_component(folder, name, (dtypes or {}).get(name, dtype), index) for name in names}
    for part in parts.values():
        if isinstance(part, torch.nn.Module):
            part.to(device)
    return parts
