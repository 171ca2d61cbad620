"""Stand-in for the one torchvision call in diffusers' CosmosTransformer3DModel.

CosmosTransformer3DModel.forward resizes its padding mask with
`torchvision.transforms.functional.resize(mask, size, interpolation=NEAREST)` when the checkpoint
has concat_padding_mask=True (all Cosmos-Predict2 checkpoints do). torchvision is not a dependency:
PyPI's CPU build fails to import beside the CPU torch wheel and breaks diffusers' imports. diffusers
binds the name `transforms` in transformer_cosmos only when torchvision imports, so without it the
forward raises NameError. `install()` binds that name to this module's torch-only equivalent; it does
nothing where torchvision is installed.
"""

from __future__ import annotations

import enum
import types

import torch
import torch.nn.functional as F


def resize_padding_mask(mask: torch.Tensor, size: tuple[int, int] | list[int]) -> torch.Tensor:
    """Nearest-neighbour resize of a (..., H, W) mask: torch-only equivalent of the torchvision
    `transforms.functional.resize(mask, size, InterpolationMode.NEAREST)` call in diffusers' Cosmos."""
    lead = mask.shape[:-2]
    flat = mask.reshape(-1, 1, *mask.shape[-2:]).float()  # interpolate wants (N, C, H, W) floats
    out = F.interpolate(flat, size=tuple(size), mode="nearest")
    return out.reshape(*lead, *out.shape[-2:]).to(mask.dtype)


class InterpolationMode(enum.Enum):
    NEAREST = "nearest"


def resize(image: torch.Tensor, size: list[int], interpolation: InterpolationMode = InterpolationMode.NEAREST,
           **_: object) -> torch.Tensor:
    """torchvision.transforms.functional.resize for NEAREST on [..., H, W] tensors."""
    if interpolation is not InterpolationMode.NEAREST:
        raise NotImplementedError("only NEAREST resizing is provided without torchvision")
    return resize_padding_mask(image, size)


def install() -> None:
    """Give diffusers' Cosmos transformer module its `transforms` name where torchvision is absent."""
    from diffusers.models.transformers import transformer_cosmos

    if hasattr(transformer_cosmos, "transforms"):
        return
    transformer_cosmos.transforms = types.SimpleNamespace(
        functional=types.SimpleNamespace(resize=resize), InterpolationMode=InterpolationMode
    )
