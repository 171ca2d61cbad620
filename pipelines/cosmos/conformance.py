"""Cosmos-Predict2's conformance cases (pipelines.conformance): none against diffusers, for the reason below; its
N ranks equal one process in tests/test_parallel_pipelines.py, and its batched guidance equals diffusers' two calls
in tests/test_pipelines.py."""

from __future__ import annotations

from pipelines.conformance import RankCase

NO_REFERENCE = ("diffusers' Cosmos2VideoToWorldPipeline makes no video from text alone and takes the VAE posterior's "
                "sample for its input frames, where ours takes its mode (the same noise on every rank); and it refuses "
                "to run without cosmos_guardrail's safety checker")
CASES = {}
RANK_CASES = {  # with a step cache: guidance's halves of one batch on two groups
    "cfg-2 cache": RankCase("tiny-cosmos", 2, dict(cfg_parallel=True, cache="fbcache:0.3"),
                            dict(prompt="a red circle moving right on a black background", seed=5, steps=8, frames=9,
                                 height=48, width=80)),
}
