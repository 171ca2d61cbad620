"""Cosmos-Predict2's conformance cases (pipelines.conformance): none against diffusers, for the reason below; its
N ranks equal one process in tests/test_parallel_pipelines.py, and its batched guidance equals diffusers' two calls
in tests/test_pipelines.py."""

from __future__ import annotations

NO_REFERENCE = ("diffusers' Cosmos2VideoToWorldPipeline makes no video from text alone and takes the VAE posterior's "
                "sample for its input frames, where ours takes its mode (the same noise on every rank); and it refuses "
                "to run without cosmos_guardrail's safety checker")
CASES = {}
