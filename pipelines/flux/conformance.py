"""FLUX.1's conformance case (pipelines.conformance): the embedded tiny-flux against diffusers' FluxPipeline."""

from __future__ import annotations

import numpy as np

from pipelines.conformance import Case, RankCase, diffusers_run, seeded

CASES = {"text": Case("tiny-flux", dict(height=128, width=192, steps=4, guidance=3.5))}
# Its ranks equal one process with every strategy: tests/test_parallel_pipelines.py; here, with a step cache (the
# threshold a little above the default: the trained model skips some of 8 steps).
CACHED = dict(prompt="a big red star in the center on a white background", seed=3, steps=8, height=80, width=112)
RANK_CASES = {  # 35 image tokens: the last shard padded
    "ulysses-2 cache": RankCase("tiny-flux", 2, dict(strategy="ulysses", cache="fbcache:0.25"), CACHED),
    "allgather-4 cache": RankCase("tiny-flux", 4, dict(strategy="allgather", cache="fbcache:0.25"), CACHED),
}


def reference(spec, folder, req, cond):
    """diffusers' FluxPipeline: its final packed latents and its image."""
    from diffusers import FluxPipeline

    latents, out = diffusers_run(
        FluxPipeline.from_pretrained(folder, local_files_only=True), prompt=req.prompt, height=req.height,
        width=req.width, num_inference_steps=req.steps, guidance_scale=req.guidance, generator=seeded(req.seed),
        max_sequence_length=spec.max_sequence_length)
    return latents, np.asarray(out.images[0])
