"""Qwen-Image's conformance cases (pipelines.conformance): Qwen-Image with classifier-free guidance (two calls of
different text lengths, no attention mask) and without, Qwen-Image-Edit, and the Edit Plus checkpoints (2509, and
2511 with zero_cond_t), against diffusers' QwenImagePipeline, QwenImageEditPipeline and QwenImageEditPlusPipeline."""

from __future__ import annotations

import numpy as np
import PIL.Image
import torch

from pipelines.conformance import AppCase, Case, diffusers_run, seeded

SIZE = dict(height=64, width=48, steps=2, negative_prompt="blurry")
CASES = {
    "guidance": Case("qwen-image", {**SIZE, "guidance": 4.0}),
    "no guidance": Case("qwen-image", {**SIZE, "guidance": 1.0}),
    "edit guidance": Case("qwen-image-edit", {**SIZE, "guidance": 4.0, "condition": "image.png"}),
    "edit no guidance": Case("qwen-image-edit", {**SIZE, "guidance": 1.0, "condition": "image.png"}),
    "edit 2509": Case("qwen-image-edit-2509", {**SIZE, "guidance": 4.0, "condition": "image.png"}),
    "edit 2511": Case("qwen-image-edit-2511", {**SIZE, "guidance": 4.0, "condition": "image.png"}),
}
APP = ("--size", "64x48", "--steps", "2")
APP_CASES = {
    # guidance's two calls, of different text lengths, each split, or each on its own rank
    "qwen-image": AppCase("qwen-image", APP,
                          {"ulysses-2": ("--strategy", "ulysses"), "cfg-parallel": ("--cfg-parallel",)}),
    "edit": AppCase("qwen-image-edit", (*APP, "--input", "image.png"), {"ulysses-2": ("--strategy", "ulysses")}),
    # 2511's per-token timestep index (its reference's tokens at timestep 0) split with the tokens (modulate_index)
    "edit 2511": AppCase("qwen-image-edit-2511", (*APP, "--input", "image.png"), {"ring-2": ("--strategy", "ring")}),
}


def reference(spec, folder, req, cond):
    """diffusers' pipeline of the folder's class (an editing one built with our image processor, which is
    Qwen2-VL's preprocessing: tests/test_pipelines_qwen_image_edit.py): its final packed latents and its image."""
    import diffusers

    inputs = dict(prompt=req.prompt, negative_prompt=req.negative_prompt, true_cfg_scale=req.guidance,
                  height=req.height, width=req.width, num_inference_steps=req.steps, generator=seeded(req.seed),
                  output_type="pil")
    if req.condition is None:
        pipe = diffusers.DiffusionPipeline.from_pretrained(folder, local_files_only=True)
    else:
        from pipelines.loading import load_parts
        from pipelines.qwen_image.pipeline import load_edit_processor

        parts = load_parts(folder, ["transformer", "scheduler", "text_encoder", "tokenizer", "vae"],
                           dtype=torch.float32, device="cpu")
        pipe = getattr(diffusers, spec.checkpoint_class)(processor=load_edit_processor(folder), **parts)
        with PIL.Image.open(req.condition) as opened:
            inputs["image"] = opened.convert("RGB")
    latents, out = diffusers_run(pipe, **inputs)
    return latents, np.asarray(out.images[0])
