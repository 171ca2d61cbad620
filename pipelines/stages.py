"""What every pipeline here shares: the three stages' contract, the model's limits and the transformer seam.

A pipeline is encode (rank 0) -> denoise (every rank) -> decode (rank 0). Its denoising loop calls the
transformer in one place, through `self.transformer`, which engines/ replaces (use_transformer) with a
context-parallel or compiled module of the same call signature.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import Any

from pipelines.registry import ModelSpec, family_of
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

    def use_step_cache(self, options: Any, group: Any = None) -> None:
        """A step cache (engines.step_cache; `options`: its CacheOptions) on the transformer as it is now
        (after use_transformer: compiled blocks are wrapped, not traced), deciding over `group`'s ranks."""
        from engines.step_cache import install_step_cache

        family = family_of(self.spec)
        self.step_cache = install_step_cache(self.transformer, options, block_lists=family.repeated_blocks,
                                             outputs=family.block_outputs, stream=family.cache_stream, group=group)

    def cache_step(self, request: GenerationRequest, index: int, total: int) -> AbstractContextManager:
        """Around denoising step `index`'s transformer call(s): the step cache's step, if there is one."""
        if self.step_cache is None:
            return nullcontext()
        return self.step_cache.step(index, total, skip=request.step_cache)

    def computed_steps(self) -> int | None:
        """Steps of the last denoising loop whose transformer blocks all ran; None without a step cache."""
        return self.step_cache.computed if self.step_cache is not None else None
