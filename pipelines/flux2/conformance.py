"""FLUX.2's conformance cases (pipelines.conformance): dev, Klein and Klein base (classifier-free guidance), from
text alone and with a reference image, against diffusers' Flux2Pipeline and Flux2KleinPipeline."""

from __future__ import annotations

import numpy as np
import PIL.Image

from pipelines.conformance import AppCase, Case, RankCase, diffusers_run, seeded

SPEC = dict(max_sequence_length=32)
"""Text tokens: the pipelines pad to max_sequence_length; 32 keeps the tiny runs quick."""

SIZE = dict(height=64, width=48, steps=3)
CASES = {
    "dev text": Case("flux2-dev", SIZE),
    "dev reference": Case("flux2-dev", {**SIZE, "condition": "image.png"}),
    "klein text": Case("flux2-klein-4b", SIZE),
    "klein-base guidance text": Case("flux2-klein-base-4b", SIZE),
    "klein-base guidance reference": Case("flux2-klein-base-4b", {**SIZE, "condition": "image.png"}),
}
RANK_CASES = {  # every strategy and hybrid at 2/3/4/8 ranks on the transformer alone: tests/test_engines_parallel.py
    "dev ulysses-2 reference": RankCase("flux2-dev", 2, dict(strategy="ulysses"), {**SIZE, "condition": "image.png"}),
    "klein-base cfg-2 reference": RankCase("flux2-klein-base-4b", 2, dict(strategy="ring", cfg_parallel=True),
                                           {**SIZE, "condition": "image.png"}),
    # with a step cache (a threshold far above the default: the tiny random weights' first block changes by more
    # than itself from step to step)
    "klein ulysses-2 cache": RankCase("flux2-klein-4b", 2, dict(strategy="ulysses", cache="fbcache:1.1"),
                                      dict(prompt="a red circle", seed=2, steps=6, height=80, width=112)),
}
APP_CASES = {  # its 2 ranks: RANK_CASES, and a CFG-parallel server's reference image in tests/test_app_flux2.py
    "dev reference": AppCase("flux2-dev", ("--size", "48x64", "--steps", "2", "--input", "image.png"), {}),
}


def reference(spec, folder, req, cond):
    """diffusers' pipeline of the folder's class: its final packed latents and its image."""
    from diffusers import DiffusionPipeline

    inputs = {"image": PIL.Image.open(req.condition).convert("RGB")} if req.condition else {}
    latents, out = diffusers_run(
        DiffusionPipeline.from_pretrained(folder, local_files_only=True), prompt=req.prompt, height=req.height,
        width=req.width, num_inference_steps=req.steps, guidance_scale=req.guidance,
        generator=seeded(req.seed), max_sequence_length=spec.max_sequence_length, output_type="pil", **inputs)
    return latents, np.asarray(out.images[0])

