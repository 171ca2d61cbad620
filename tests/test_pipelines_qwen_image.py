"""Qwen-Image through our pipeline: equal to diffusers' QwenImagePipeline on a tiny random checkpoint, with
classifier-free guidance (two calls of different text lengths, no attention mask) and without; the limits
read from its configs.

The checkpoint is pipelines.qwen_image.tiny' Qwen-Image folder: a two-layer Qwen2.5-VL text encoder under a
word-level Qwen tokenizer, Qwen-Image's VAE shrunk, a 12-head transformer.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from pipelines.factory import load_pipeline
from pipelines.registry import resolve_model
from pipelines.requests import RequestError, make_request, read_limits

PROMPT = "a big red circle on the left"


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    from pipelines.qwen_image.tiny import qwen_image_components, save_qwen_image

    path = tmp_path_factory.mktemp("qwen-image") / "Qwen-Image"
    save_qwen_image(path, qwen_image_components(seed=1))
    return path


def request(folder: Path, **fields):
    spec, path = resolve_model("qwen-image", folder)
    fields = {"prompt": PROMPT, "seed": 7, "steps": 2, "height": 64, "width": 48, **fields}
    return spec, path, make_request(spec, read_limits(spec, path), **fields)


def diffusers_run(path: Path, req) -> tuple[torch.Tensor, object]:
    """diffusers' own pipeline on the same request: its final packed latents and its image."""
    from diffusers import DiffusionPipeline

    pipe = DiffusionPipeline.from_pretrained(path, local_files_only=True)
    pipe.set_progress_bar_config(disable=True)
    final = {}

    def keep(_pipe, _step, _t, tensors):
        final["latents"] = tensors["latents"]
        return {}

    out = pipe(prompt=req.prompt, negative_prompt=req.negative_prompt, true_cfg_scale=req.guidance,
               height=req.height, width=req.width, num_inference_steps=req.steps,
               generator=torch.Generator().manual_seed(req.seed), output_type="pil", callback_on_step_end=keep)
    return final["latents"], out.images[0]


@pytest.mark.parametrize("guidance", [4.0, 1.0])
def test_equals_diffusers_pipeline(folder: Path, guidance: float) -> None:
    spec, path, req = request(folder, guidance=guidance, negative_prompt="blurry")
    pipeline = load_pipeline(spec, path)
    cond = pipeline.encode(req)
    assert (cond.negative_embeds is not None) == (guidance > 1)
    if cond.negative_embeds is not None:  # the two branches differ in length: two calls, no mask, no padding
        assert cond.negative_embeds.shape[1] != cond.prompt_embeds.shape[1]
    ours = pipeline.denoise(req, cond)
    latents, image = diffusers_run(path, req)
    assert ours.shape == latents.shape
    assert (ours - latents).abs().max().item() < 1e-5
    result = pipeline.decode(req, ours)
    assert result.size == (48, 64)
    assert np.abs(np.asarray(result, np.int16) - np.asarray(image, np.int16)).max() <= 1


def test_limits_from_the_configs(folder: Path) -> None:
    spec, path = resolve_model("qwen-image", folder)
    limits = read_limits(spec, path)
    assert (limits.size_multiple, limits.max_height, limits.reference_image) == (16, 4096, False)
    assert read_limits(spec, path, cfg_parallel=True).guidance_split  # its two calls, one per CFG group
    with pytest.raises(RequestError, match="width 40 is not a multiple of 16"):
        make_request(spec, limits, prompt=PROMPT, width=40)


def test_a_guided_request_counts_both_guidance_calls(folder: Path) -> None:
    """Its two branches are two calls (guidance_calls): the time limit's work estimate counts both."""
    from pipelines.work import WorkCounter

    spec, path = resolve_model("qwen-image", folder)
    count = WorkCounter(spec, path, read_limits(spec, path))
    guided, plain = count(request(folder, guidance=4.0)[2]), count(request(folder, guidance=1.0)[2])
    assert guided.step_flops == pytest.approx(2 * plain.step_flops, rel=1e-6)
    assert guided.decode_flops == plain.decode_flops
