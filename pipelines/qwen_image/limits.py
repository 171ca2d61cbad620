"""What a Qwen-Image request may ask for (its record's limits), and the checkpoint classes that tell an editing
folder apart."""

from __future__ import annotations

from pathlib import Path

from pipelines.family import ModelSpec
from pipelines.registry import read_component_config
from pipelines.requests import MediaLimits

QWEN_EDIT_CHECKPOINT = "QwenImageEditPipeline"
"""The model_index.json class of a Qwen-Image-Edit folder."""
QWEN_EDIT_PLUS_CHECKPOINT = "QwenImageEditPlusPipeline"
"""The model_index.json class of a Qwen-Image-Edit-2509 or -2511 folder."""
EDIT_AREA = 1024 * 1024
"""Pixels of Qwen-Image-Edit's reference as QwenImageEditPipeline resizes it (its calculate_dimensions' target)."""


def qwen_image_limits(spec: ModelSpec, folder: Path) -> MediaLimits:
    """Qwen-Image: sizes a multiple of the VAE's spatial factor x the transformer's 2x2 packing (16); its rotary
    table (4096 positions from the image's centre, the text after the image's) bounds no size below 4096 px,
    the largest served, as for FLUX. Qwen-Image-Edit (a QwenImageEditPipeline or QwenImageEditPlusPipeline
    checkpoint) requires its input image, the reference it edits (checked as FLUX.2's references are)."""
    vae = read_component_config(folder, "vae")
    transformer = read_component_config(folder, "transformer")
    spatial = 2 ** len(vae.get("temperal_downsample", [False, True, True]))
    multiple = spatial * int(transformer.get("patch_size", 2))
    edit = spec.checkpoint_class in (QWEN_EDIT_CHECKPOINT, QWEN_EDIT_PLUS_CHECKPOINT)
    return MediaLimits(size_multiple=multiple, max_height=4096, max_width=4096, reference_image=edit,
                       input_required=edit, reference_area=EDIT_AREA if edit else 0)
