"""Cosmos 3's conformance cases (pipelines.conformance): text, image and video to video, text to image, and no
guidance, against diffusers' Cosmos3OmniPipeline (its final latents; the decode is the VAE's own), and on 2 and 4
ranks (ring, CFG groups, all-gather K/V) as in one process."""

from __future__ import annotations

import PIL.Image

from pipelines.conformance import AppCase, Case, RankCase, seeded

VIDEO = dict(height=64, width=96, steps=3, frames=9, fps=8, negative_prompt="blurry")
IMAGE = dict(height=64, width=96, steps=3, negative_prompt="blurry")
CASES = {
    "text-to-video": Case("cosmos3-nano", VIDEO),
    "image-to-video": Case("cosmos3-nano", {**VIDEO, "condition": "image.png"}),
    "video-to-video": Case("cosmos3-nano", {**VIDEO, "condition": "clip.mp4"}),
    "text-to-image": Case("cosmos3-nano-image", IMAGE),
    "no guidance": Case("cosmos3-nano", {**VIDEO, "guidance": 1.0}),
}
RANK_CASES = {  # every strategy and hybrid at 2/3/4/8 ranks on the transformer alone: tests/test_engines_cosmos3.py
    "ring-2 t2v": RankCase("cosmos3-nano", 2, dict(strategy="ring"), VIDEO),
    "cfg-2 i2v": RankCase("cosmos3-nano", 2, dict(strategy="ulysses", cfg_parallel=True),
                          {**VIDEO, "condition": "image.png"}),
    "cfg-2 x allgather-2 v2v": RankCase("cosmos3-nano", 4, dict(strategy="allgather", cfg_parallel=True),
                                        {**VIDEO, "condition": "clip.mp4"}),
    # with a step cache (a threshold far below the default: the tiny random weights change fast), one call per
    # branch, one per group, or both branches' calls on every rank
    "cfg-2 cache": RankCase("cosmos3-nano", 2, dict(cfg_parallel=True, cache="fbcache:0.005"), {**VIDEO, "steps": 6}),
    "ulysses-2 cache": RankCase("cosmos3-nano", 2, dict(strategy="ulysses", cache="fbcache:0.005"),
                                {**VIDEO, "steps": 6}),
}
APP = ("--size", "96x64", "--steps", "2")
APP_CASES = {  # one checkpoint, a video and an image model; their 2 ranks: RANK_CASES and tests/test_app_cosmos3.py
    "video": AppCase("cosmos3-nano", (*APP, "--frames", "9", "--fps", "8"), {}),
    "image": AppCase("cosmos3-nano-image", APP, {}),
}


def reference(spec, folder, req, cond):
    """diffusers' Cosmos3OmniPipeline (no safety checker): its final latents, and no output (None)."""
    from diffusers import Cosmos3OmniPipeline

    inputs = {}
    if req.condition is not None and req.condition.endswith(".mp4"):
        from pipelines.media import read_frames

        inputs.update(video=read_frames(req.condition, (req.width, req.height), last=5), condition_video_keep="last")
    elif req.condition is not None:
        inputs["image"] = PIL.Image.open(req.condition).convert("RGB")
    pipe = Cosmos3OmniPipeline.from_pretrained(folder, enable_safety_checker=False)
    pipe.set_progress_bar_config(disable=True)
    latents = pipe(req.prompt, negative_prompt=req.negative_prompt, num_frames=req.frames, height=req.height,
                   width=req.width, fps=float(req.fps), num_inference_steps=req.steps, guidance_scale=req.guidance,
                   generator=seeded(req.seed), output_type="latent", **inputs).video
    return latents.float(), None
