"""Load the components of a diffusers-format folder, one by one, from local files only.

Loading component by component (instead of DiffusionPipeline.from_pretrained) lets a rank load only
what it runs: every rank needs the transformer and scheduler, only rank 0 needs text encoders and VAE.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from pipelines.memory import HOST_TEXT_ENCODER_PARAMETERS, fits_beside, on_host
from pipelines.registry import ModelNotFoundError, read_model_index


def component_class(index: dict, name: str) -> type:
    """The class that model_index.json names for component `name`."""
    entry = index.get(name)
    if not entry or entry[0] is None:
        raise ModelNotFoundError(f"model_index.json has no component '{name}'")
    library, class_name = entry
    return getattr(importlib.import_module(library), class_name)


@dataclass(frozen=True, kw_only=True, slots=True)
class TransformerShare:
    """The share of a tensor-parallel transformer that this rank loads: of `tp` ranks, it keeps share `rank`
    (its index in its tp group), split by `weights`, the reference of its family's split function."""

    tp: int
    rank: int
    weights: str


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
    share: TransformerShare | None = None,
) -> dict[str, Any]:
    """Load components `names` of `folder` and move the models to `device`.

    Args:
        dtypes: per-component dtype where it differs from `dtype` (e.g. a VAE kept in float32).
        share: load only this rank's share of the transformer, slice by slice from its safetensors files
            (engines/weights/sharded_loading.py): no rank reads or holds the whole transformer.
    """
    index = read_model_index(folder)
    parts = {}
    for name in names:
        if name in ("transformer", "transformer_2") and share is not None and share.tp > 1:
            parts[name] = _load_share(folder, index, name, share, (dtypes or {}).get(name, dtype), device)
        else:
            parts[name] = load_component(folder, name, (dtypes or {}).get(name, dtype), index)
    for name, part in parts.items():
        if isinstance(part, torch.nn.Module):
            place(name, part, device)
    return parts


def place(name: str, module: torch.nn.Module, device: torch.device | str, *,
          host_above: float = HOST_TEXT_ENCODER_PARAMETERS) -> bool:
    """Move component `name` to `device`, or, for a text encoder of more than `host_above` parameters on a
    GPU run (FLUX.2-dev's 24B Mistral) where the GPU, already holding the transformer, has no room for it,
    keep its weights in host memory and stream each layer to the GPU when it runs (accelerate's cpu_offload,
    as diffusers' enable_sequential_cpu_offload). Measured on an H100: 6.7 s a prompt streamed, 0.05 s
    resident (docs/tensor-parallel.md, which also says why offload rather than split). Returns True when
    it stays in host memory."""
    parameters = sum(p.numel() for p in module.parameters())
    device = torch.device(device)
    if on_host(name, parameters, host_above) and device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        if fits_beside(sum(p.numel() * p.element_size() for p in module.parameters()), free, total):
            module.to(device)
            return False
        from accelerate import cpu_offload

        cpu_offload(module.to("cpu"), execution_device=device)
        return True
    module.to(device)
    return False


def _load_share(folder: Path, index: dict, name: str, share: TransformerShare, dtype: torch.dtype,
                device: torch.device | str) -> torch.nn.Module:
    from engines.weights.sharded_loading import load_split
    from pipelines.family import load

    return load_split(component_class(index, name), folder / name, load(share.weights), tp=share.tp, rank=share.rank,
                      dtype=dtype, device=device)
