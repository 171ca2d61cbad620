"""FLUX.3's conformance cases (pipelines.conformance): the base model with classifier-free guidance (two calls)
and without, the distilled flow map, and a reference image of sides no patch divides, against diffusers' modular
pipelines (Flux3ModularPipeline, Flux3DistilledModularPipeline). Measured on CPU in float32: latents and images
bit for bit diffusers'; the bounds leave room for other kernels."""

from __future__ import annotations

import numpy as np
import torch
from PIL import Image

from pipelines.conformance import AppCase, Case, seeded

SIZE = dict(height=64, width=48, steps=2, negative_prompt="blurry")
CASES = {
    "base guidance": Case("flux3-klein-base", {**SIZE, "guidance": 3.5}),
    "base no guidance": Case("flux3-klein-base", {**SIZE, "guidance": 1.0}),
    "distilled": Case("flux3-klein", {**SIZE, "guidance": 1.0}),
    "base reference": Case("flux3-klein-base", {**SIZE, "guidance": 3.5, "condition": "odd.png"}),
}
APP_CASES = {  # guidance's two calls each split, or each on its own rank
    "base": AppCase("flux3-klein-base", ("--size", "64x48", "--steps", "2"),
                    {"ulysses-2": ("--strategy", "ulysses"), "cfg-parallel": ("--cfg-parallel",)}),
}


def reference(spec, folder, req, cond):
    """diffusers' modular pipeline without its prompt upsampler (we do not offer it), given the tokenizer as ours
    uses it: its final latents, packed as ours, and its image."""
    from diffusers import ModularPipeline
    from diffusers.guiders import ClassifierFreeGuidance

    from pipelines.flux3.pipeline import as_processor

    blocks = ModularPipeline.from_pretrained(str(folder)).blocks
    blocks.sub_blocks.pop("prompt_upsampler")
    pipe = blocks.init_pipeline(str(folder))
    pipe.load_components(dtype=torch.float32)
    pipe.update_components(tokenizer=as_processor(pipe.tokenizer))
    inputs = dict(prompt=req.prompt, height=req.height, width=req.width, num_inference_steps=req.steps,
                  generator=seeded(req.seed), max_sequence_length=512)
    if "guider" in pipe.component_names:
        pipe.update_components(guider=ClassifierFreeGuidance(guidance_scale=req.guidance))
        inputs["negative_prompt"] = req.negative_prompt
    if req.condition is not None:
        inputs["image"] = Image.open(req.condition).convert("RGB")
    out = pipe(**inputs, output=["images", "latents"])
    latents = out["latents"]  # [1, C, h, w]
    return latents.flatten(2).transpose(1, 2), np.asarray(out["images"][0])
