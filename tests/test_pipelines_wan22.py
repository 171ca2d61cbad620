"""Wan 2.2 TI2V through our pipeline: equal to diffusers on a tiny random checkpoint, text-to-video against
WanPipeline and image-to-video against WanImageToVideoPipeline (both with expand_timesteps: a timestep per
token, the input image's latent as the first frame); the checkpoint's limits read from its configs.

The checkpoint is pipelines.wan.tiny' tiny TI2V folder: a UMT5 encoder, a Wan 2.2-style VAE (2x2 patchify then
8x: 16x space, 4x time) with per-channel latent statistics, a 12-head transformer, UniPC with flow sigmas.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import PIL.Image
import pytest
import torch

from pipelines.factory import load_pipeline
from pipelines.registry import resolve_model
from pipelines.requests import RequestError, make_request, read_limits

SEQUENCE = 32  # text tokens: the pipelines pad to max_sequence_length; 32 keeps the tiny runs quick
RELATIVE_TOLERANCE = 1e-5
"""Largest difference of the final latents, relative to their largest magnitude: our one batch-2 guidance call
rounds differently from diffusers' two calls (measured 1.0e-6 relative text-to-video, 1.2e-6 image-to-video,
after 3 steps at guidance 5; without guidance equal to the bit)."""


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    from pipelines.wan.tiny import save_wan, wan_components

    path = tmp_path_factory.mktemp("wan22") / "Wan2.2-TI2V-5B-Diffusers"
    save_wan(path, wan_components(seed=1, kind="ti2v"), expand_timesteps=True)
    return path


@pytest.fixture(scope="module")
def image(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("input") / "start.png"
    pixels = np.random.default_rng(0).integers(0, 256, (80, 120, 3), dtype=np.uint8)  # resized to the request's
    PIL.Image.fromarray(pixels).save(path)
    return path


def request(folder: Path, **fields):
    spec, path = resolve_model("wan2.2-ti2v-5b", folder)
    spec = replace(spec, max_sequence_length=SEQUENCE)
    fields = {"prompt": "a red circle moving right", "seed": 7, "steps": 3, "height": 64, "width": 96, "frames": 9,
              "negative_prompt": "blurry, static", "guidance": 5.0, **fields}
    return spec, path, make_request(spec, read_limits(spec, path), **fields)


def diffusers_run(path: Path, req, cond) -> tuple[torch.Tensor, np.ndarray]:
    """diffusers' own pipeline on the same request: WanPipeline, or WanImageToVideoPipeline with the input image
    (given our prompt embeddings: its prompt cleaning needs ftfy, which WanPipeline's does without). Returns its
    final latents, the first frame's given latent in place as its output has it, and its frames [T, H, W, 3]."""
    from diffusers import WanImageToVideoPipeline, WanPipeline

    final = {}

    def keep(_pipe, _step, _t, tensors):
        final["latents"] = tensors["latents"]
        return {}

    common = dict(height=req.height, width=req.width, num_frames=req.frames, num_inference_steps=req.steps,
                  guidance_scale=req.guidance, generator=torch.Generator().manual_seed(req.seed),
                  max_sequence_length=SEQUENCE, output_type="np", callback_on_step_end=keep)
    if req.condition is None:
        pipe = WanPipeline.from_pretrained(path, local_files_only=True)
        pipe.set_progress_bar_config(disable=True)
        out = pipe(prompt=req.prompt, negative_prompt=req.negative_prompt, **common)
        return final["latents"], out.frames[0]
    pipe = WanImageToVideoPipeline.from_pretrained(path, local_files_only=True)
    pipe.set_progress_bar_config(disable=True)
    embeds = cond.prompt_embeds
    out = pipe(image=PIL.Image.open(req.condition).convert("RGB"), prompt_embeds=embeds[:1],
               negative_prompt_embeds=embeds[1:], **common)
    latents = final["latents"].clone()
    latents[:, :, :1] = cond.image_latents  # what WanImageToVideoPipeline does after its loop
    return latents, out.frames[0]


@pytest.mark.parametrize("with_image", [False, True], ids=["text-to-video", "image-to-video"])
def test_equals_diffusers_pipeline(folder: Path, image: Path, with_image: bool) -> None:
    spec, path, req = request(folder, condition=str(image) if with_image else None)
    pipeline = load_pipeline(spec, path)
    cond = pipeline.encode(req)
    assert (cond.image_latents is not None) == with_image and cond.image_embeds is None
    ours = pipeline.denoise(req, cond)
    latents, frames = diffusers_run(path, req, cond)
    assert ours.shape == latents.shape == (1, 8, 3, 4, 6)
    assert (ours - latents).abs().max().item() <= RELATIVE_TOLERANCE * latents.abs().max().item()
    if with_image:
        assert torch.equal(ours[:, :, :1], cond.image_latents)
    video = pipeline.decode(req, ours)
    assert video.shape == (9, 64, 96, 3) and video.dtype == np.uint8
    expected = (np.clip(frames, 0.0, 1.0) * 255).round()
    assert np.abs(video.astype(np.float64) - expected).max() <= 1
    assert video.std() > 1  # random weights still draw something


def test_limits_from_the_configs_and_bad_requests_refused(folder: Path, image: Path, tmp_path: Path) -> None:
    spec, path = resolve_model("wan2.2-ti2v-5b", folder)
    limits = read_limits(spec, path)
    assert (limits.size_multiple, limits.frame_multiple, limits.max_frames) == (32, 4, 121)  # 16x VAE x 2x2 patch
    assert (limits.max_height, limits.max_width) == (1280, 1280)  # 720p, either orientation
    assert limits.video_input and limits.first_frame_input and not limits.input_required
    assert make_request(spec, limits, prompt="a circle").height == 704  # the published default
    with pytest.raises(RequestError, match="width 80 is not a multiple of 32"):
        make_request(spec, limits, prompt="a circle", width=80)
    clip = tmp_path / "clip.mp4"
    clip.write_bytes(b"")
    with pytest.raises(RequestError, match="is a video; this model starts a video from an image"):
        make_request(spec, limits, prompt="a circle", condition=str(clip))
