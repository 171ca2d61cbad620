"""What every pipeline here shares: the three stages' contract, the model's limits and the transformer seam.

A pipeline is encode (rank 0) -> denoise (every rank) -> decode (rank 0). Its denoising loop calls the
transformer in one place, through `self.transformer`, which engines/ replaces (use_transformer) with a
context-parallel or compiled module of the same call signature.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import Any

from pipelines.registry import ModelSpec
from pipelines.requests import GenerationRequest, MediaLimits, read_limits


class StagedPipeline:
    """Base of the family pipelines (pipelines.flux, .cosmos, .cosmos3, .flux2)."""

    spec: ModelSpec
    folder: Path
    transformer: Any
    step_cache: Any = None
    """The transformer's step cache (engines.step_cache.StepCache, `--cache`), or None: every step computed."""

    def limits(self) -> MediaLimits:
        """What sizes and frame counts this pipeline's checkpoint accepts (from its configs)."""
        return read_limits(self.spec, self.folder)

    def use_transformer(self, module: Any) -> None:
        """Replace the module the denoising loop calls (engines/ parallel or compiled wrapper)."""
        self.transformer = module

    def cache_step(self, request: GenerationRequest, index: int, total: int) -> AbstractContextManager:
        """Around denoising step `index`'s transformer call(s): the step cache's step, if there is one."""
        if self.step_cache is None:
            return nullcontext()
        return self.step_cache.step(index, total, skip=request.step_cache)

    def computed_steps(self) -> int | None:
        """Steps of the last denoising loop whose transformer blocks all ran; None without a step cache."""
        return self.step_cache.computed if self.step_cache is not None else None
