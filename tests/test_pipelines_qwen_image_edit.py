"""Qwen-Image-Edit through our pipeline, beyond its equality with diffusers (tests/test_conformance.py): the
reference seen at about 1024², the Plus folders told apart, its limits (an input image required), the PIL image
processor against Qwen2-VL's preprocessing arithmetic, the work estimate.

The checkpoint is pipelines.qwen_image.tiny' Qwen-Image-Edit folder: the tiny Qwen-Image parts with a Qwen2.5-VL whose
one-layer vision tower sees the reference, and a processor/ folder (PIL image processor config, tokenizer).
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import PIL.Image
import pytest

from pipelines.factory import load_pipeline
from pipelines.registry import resolve_model
from pipelines.requests import RequestError, make_request, read_limits

PROMPT = "a big red circle on the left"


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    from pipelines.qwen_image.tiny import qwen_image_edit_components, save_qwen_image_edit

    path = tmp_path_factory.mktemp("qwen-image-edit") / "Qwen-Image-Edit"
    save_qwen_image_edit(path, qwen_image_edit_components(seed=1))
    return path


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    """A 96x64 noise picture: its aspect ratio makes the reference 1248x832 (calculate_dimensions)."""
    path = tmp_path_factory.mktemp("input") / "in.png"
    pixels = np.random.default_rng(0).integers(0, 256, (64, 96, 3), dtype=np.uint8)
    PIL.Image.fromarray(pixels).save(path)
    return path


def test_the_reference_is_seen_at_about_1024_squared_in_its_aspect_ratio(folder: Path, reference: Path) -> None:
    spec, path = resolve_model("qwen-image-edit", folder)
    req = make_request(spec, read_limits(spec, path), prompt=PROMPT, steps=2, height=64, width=48, guidance=1.0,
                       condition=str(reference))
    cond = load_pipeline(spec, path).encode(req)
    assert cond.reference_grid == (832 // 16, 1248 // 16) and cond.image_latents.shape[1] == 52 * 78


@pytest.mark.parametrize("name", ["qwen-image-edit-2509", "qwen-image-edit-2511"])
def test_plus_folders_resolve_to_their_names(name: str, tmp_path: Path) -> None:
    """Qwen-Image-Edit-2509 and -2511 folders (QwenImageEditPlusPipeline) are told apart by 2511's zero_cond_t."""
    from pipelines.qwen_image.tiny import write_tiny_qwen_image
    from pipelines.registry import get_spec, spec_for_folder

    write_tiny_qwen_image(get_spec(name), tmp_path / name)
    assert spec_for_folder(tmp_path / name).name == name


def test_limits_require_an_input_image(folder: Path, reference: Path) -> None:
    spec, path = resolve_model("qwen-image-edit", folder)
    assert spec.checkpoint_class == "QwenImageEditPipeline" and (spec.steps, spec.guidance) == (50, 4.0)
    limits = read_limits(spec, path)
    assert (limits.size_multiple, limits.reference_image, limits.input_required) == (16, True, True)
    with pytest.raises(RequestError, match="edits an image: give one as its input"):
        make_request(spec, limits, prompt=PROMPT)
    req = make_request(spec, limits, prompt=PROMPT, condition=str(reference))
    assert (req.height, req.width, req.negative_prompt, req.condition) == (1024, 1024, " ", str(reference))


def test_resolves_from_its_model_index(folder: Path) -> None:
    """A folder whose model_index.json names QwenImageEditPipeline is qwen-image-edit, not qwen-image."""
    from pipelines.registry import spec_for_folder

    assert spec_for_folder(folder).name == "qwen-image-edit"


def _smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """Qwen2-VL's published smart_resize: sides multiples of `factor`, pixels within bounds, aspect kept."""
    h_bar, w_bar = round(height / factor) * factor, round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h_bar, w_bar = math.floor(height / beta / factor) * factor, math.floor(width / beta / factor) * factor
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar, w_bar = math.ceil(height * beta / factor) * factor, math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


@pytest.mark.parametrize("size", [(1248, 832), (100, 30), (5000, 4000)])
def test_pil_image_processor_is_qwen2_vl_preprocessing(folder: Path, size: tuple[int, int]) -> None:
    """pixel_values and image_grid_thw as Qwen2-VL's slow image processor computes them: smart_resize, PIL bicubic,
    rescale, normalise, the frame repeated to the temporal patch, merge-ordered 14x14 patches."""
    from pipelines.qwen_image.pipeline import load_edit_processor

    processor = load_edit_processor(folder)
    config = processor.image_processor
    width, height = size
    image = PIL.Image.fromarray(np.random.default_rng(1).integers(0, 256, (height, width, 3), dtype=np.uint8))
    out = processor(text=["<|vision_start|><|image_pad|><|vision_end|>"], images=image, return_tensors="pt")

    patch, merge, temporal = config.patch_size, config.merge_size, config.temporal_patch_size
    h, w = _smart_resize(height, width, patch * merge, config.size.shortest_edge, config.size.longest_edge)
    pixels = np.asarray(image.resize((w, h), PIL.Image.BICUBIC), np.float64) / 255
    pixels = ((pixels - np.array(config.image_mean)) / np.array(config.image_std)).transpose(2, 0, 1)
    frames = np.repeat(pixels[None], temporal, axis=0)  # [T, C, H, W]
    gh, gw = h // patch, w // patch
    patches = frames.reshape(1, temporal, 3, gh // merge, merge, patch, gw // merge, merge, patch)
    expected = patches.transpose(0, 3, 6, 4, 7, 2, 1, 5, 8).reshape(gh * gw, 3 * temporal * patch * patch)
    assert out["image_grid_thw"].tolist() == [[1, gh, gw]]
    assert np.abs(out["pixel_values"].numpy() - expected).max() < 1e-4
    assert (out["input_ids"] == processor.image_token_id).sum().item() == gh * gw // merge**2


def test_the_work_estimate_counts_the_reference_tokens(folder: Path, reference: Path) -> None:
    """The time limit's work estimate (pipelines.work) counts the reference's tokens beside the image's: a 64x64 edit
    (16 tokens) with its reference at about 1024² (4096 tokens) costs what a 4112-token image costs."""
    from pipelines.work import WorkCounter

    spec, path = resolve_model("qwen-image-edit", folder)
    limits = read_limits(spec, path)
    assert limits.reference_area == 1024 * 1024
    count = WorkCounter(spec, path, limits)
    edit = count(make_request(spec, limits, prompt=PROMPT, height=64, width=64, guidance=1.0,
                              condition=str(reference)))
    alone = count._count(64, 64, 1, 1, None)
    one_grid = count._count(16 * 16, 257 * 16, 1, 1, None)  # 16 x 257 = 4112 tokens in one grid
    assert edit.step_flops == pytest.approx(one_grid.step_flops, rel=1e-9)
    assert edit.step_flops > 10 * alone.step_flops
    assert edit.decode_flops == alone.decode_flops  # the decode is the image's alone
