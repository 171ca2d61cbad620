"""Wan's conformance cases (pipelines.conformance), for the Wan 2.1 and Wan 2.2 records: text-to-video with
classifier-free guidance (our one batch-2 call against diffusers' two calls) and without, image-to-video (CLIP
image context, the first frame's latents and mask as extra channels), Wan 2.2 A14B's two experts (the low-noise one
with its own guidance), and Wan 2.2 TI2V from text and from an image (its first frame's latents in place), against
diffusers' WanPipeline and WanImageToVideoPipeline."""

from __future__ import annotations

import PIL.Image

from pipelines.conformance import AppCase, Case, RankCase, diffusers_run, frames_as_pixels, seeded

SPEC = dict(max_sequence_length=32)
"""Text tokens: the pipelines pad to max_sequence_length; 32 keeps the tiny runs quick."""

RELATIVE = 1e-5
"""With guidance, the largest difference of the final latents relative to their largest magnitude: the batch-2 call
rounds differently from diffusers' two batch-1 calls, and guidance 5 amplifies it (measured 1.0e-6 to 1.6e-6 after
3 steps; without guidance the loops are the same operations and the latents equal to the bit)."""

VIDEO = dict(height=48, width=64, frames=9, steps=3, negative_prompt="blurry, static")
TI2V = {**VIDEO, "height": 64, "width": 96}
CASES = {
    "2.1 guidance": Case("wan2.1-t2v-1.3b", {**VIDEO, "guidance": 5.0}, RELATIVE, relative=True),
    "2.1 no guidance": Case("wan2.1-t2v-1.3b", {**VIDEO, "guidance": 1.0}, 0.0),
    "2.1 image-to-video": Case("wan2.1-i2v-14b", {**VIDEO, "condition": "image.png"}, RELATIVE, relative=True),
    "2.2 A14B experts": Case("wan2.2-t2v-a14b", {**VIDEO, "steps": 4, "guidance": 4.0}, RELATIVE, relative=True),
    "2.2 A14B guidance_2": Case("wan2.2-t2v-a14b", {**VIDEO, "steps": 4, "guidance": 4.0, "guidance_2": 6.0},
                                RELATIVE, relative=True),
    "2.2 A14B image-to-video": Case("wan2.2-i2v-a14b", {**VIDEO, "steps": 4, "condition": "image.png"}, RELATIVE,
                                    relative=True),
    "2.2 TI2V text": Case("wan2.2-ti2v-5b", {**TI2V, "guidance": 5.0}, RELATIVE, relative=True),
    "2.2 TI2V image": Case("wan2.2-ti2v-5b", {**TI2V, "guidance": 5.0, "condition": "image.png"}, RELATIVE,
                           relative=True),
}
RANK_CASES = {  # the CFG groups' batch-1 calls against one batch-2 call: the frames before H.264, within 1/255
    "2.1 cfg-2": RankCase("wan2.1-t2v-1.3b", 2, dict(strategy="ulysses", cfg_parallel=True),
                          {**VIDEO, "guidance": 5.0}),
    # with a step cache: 2 x 3 x 5 tokens, padded
    "2.1 ulysses-2 cache": RankCase("wan2.1-t2v-1.3b", 2, dict(strategy="ulysses", cache="fbcache:0.6"),
                                    dict(seed=2, steps=8, frames=5, height=48, width=80)),
}
APP = ("--frames", "5", "--size", "64x48", "--steps", "2")
APP_CASES = {
    "2.1": AppCase("wan2.1-t2v-1.3b", APP, {}),  # its 2 ranks: RANK_CASES, and Wan 2.2 A14B's in tests/test_app_wan.py
    "2.1 image-to-video": AppCase("wan2.1-i2v-14b", (*APP, "--input", "image.png"),
                                  {"ulysses-2": ("--strategy", "ulysses")}, tolerance=2),
    # 27 tokens (3 latent frames of 3 x 3): the split pads them, and cuts the given first frame's timestep-0 tokens
    # from the others' on rank 0
    "2.2 TI2V image": AppCase("wan2.2-ti2v-5b", ("--frames", "9", "--size", "96x96", "--steps", "2", "--input",
                                                 "image.png"), {"ulysses-2": ("--strategy", "ulysses")}, tolerance=2),
}


def reference(spec, folder, req, cond):
    """WanPipeline from text; WanImageToVideoPipeline from an image, given our prompt embeddings (its prompt
    cleaning needs ftfy, which WanPipeline's, and ours, does without). Its final latents (for TI2V with the given
    first frame's latents in place, as its pipeline puts them after its loop) and its frames in 0-255."""
    from diffusers import WanImageToVideoPipeline, WanPipeline

    common = dict(height=req.height, width=req.width, num_frames=req.frames, num_inference_steps=req.steps,
                  guidance_scale=req.guidance, generator=seeded(req.seed), output_type="np")
    if req.guidance_2 is not None:
        common["guidance_scale_2"] = req.guidance_2
    if req.condition is None:
        pipe = WanPipeline.from_pretrained(folder, local_files_only=True)
        latents, out = diffusers_run(pipe, prompt=req.prompt, negative_prompt=req.negative_prompt,
                                     max_sequence_length=spec.max_sequence_length, **common)
        return latents, frames_as_pixels(out.frames[0])
    pipe = WanImageToVideoPipeline.from_pretrained(folder, local_files_only=True)
    latents, out = diffusers_run(pipe, image=PIL.Image.open(req.condition).convert("RGB"),
                                 prompt_embeds=cond.prompt_embeds[:1], negative_prompt_embeds=cond.prompt_embeds[1:],
                                 max_sequence_length=spec.max_sequence_length, **common)
    if pipe.config.expand_timesteps:  # TI2V: the given first frame's latents, as its pipeline puts them
        latents = latents.clone()
        latents[:, :, :1] = cond.image_latents
    return latents, frames_as_pixels(out.frames[0])
