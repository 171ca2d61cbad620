"""How much arithmetic a request asks of a model: FLOPs of one denoising step and of its decode.

Counted, not guessed: the model's own transformer and VAE classes are built from its folder's configs
on the meta device (no weights, no memory, nothing computed) and called at the request's shapes under
torch's FlopCounterMode, which adds up every matmul, convolution and attention. So the count has
attention's quadratic term and the VAE's mid-block attention wherever the architecture has them, for
any family whose record names a transformer input builder (ModelFamily.bench.inputs). The server's
cost model (app.server.budget) turns these counts into seconds with rates it measures.

Counting takes a fraction of a second a shape (its meta forward runs the model's Python); counts are
kept per shape.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

import torch

from pipelines.family import load
from pipelines.registry import ModelSpec, family_of, read_component_config
from pipelines.requests import GenerationRequest, MediaLimits, uses_guidance_batch

META = torch.device("meta")


class _AutocastOffMeta(torch.autocast):
    """torch.autocast, doing nothing on the meta device (where torch refuses it: "unsupported scalarType")."""

    def __init__(self, device_type: str, *args: Any, **kwargs: Any) -> None:
        self._on_meta = device_type == "meta"
        if not self._on_meta:
            super().__init__(device_type, *args, **kwargs)

    def __enter__(self) -> Any:
        return None if self._on_meta else super().__enter__()

    def __exit__(self, *exc: Any) -> Any:
        return None if self._on_meta else super().__exit__(*exc)


@contextlib.contextmanager
def counting_on_meta() -> Iterator[None]:
    """While a meta forward is counted: `torch.autocast` on the meta device does nothing. Cosmos 3's rotary embedding
    turns autocast off around its position matmul on its inputs' device, which made every Cosmos 3 count fail (its
    time estimates fell back to pixels). torch.autocast is swapped for a subclass that behaves as it does on every
    other device, so another thread's autocast meanwhile is the same."""
    autocast = torch.autocast
    torch.autocast = _AutocastOffMeta
    try:
        yield
    finally:
        torch.autocast = autocast


@dataclass(frozen=True)
class Work:
    """FLOPs of one request's denoising step (every transformer call of it) and of its VAE decode."""

    step_flops: float
    decode_flops: float


class WorkCounter:
    """Counts `Work` for requests to one model (thread-safe; counts kept per shape)."""

    def __init__(self, spec: ModelSpec, folder: Path, limits: MediaLimits) -> None:
        self.spec = spec
        self.limits = limits
        self._family = family_of(spec)
        self._transformer_config = read_component_config(folder, "transformer")
        self._vae_config = read_component_config(folder, "vae")
        self._lock = threading.Lock()
        self._models: tuple[torch.nn.Module, torch.nn.Module] | None = None
        self._count = lru_cache(maxsize=256)(self._count_shape)

    def __call__(self, request: GenerationRequest) -> Work:
        # two branches, batched or as two calls (guidance_calls) where the model has them: not FLUX.3's distilled
        # checkpoint, whose family makes two calls for its base checkpoint alone (that spec's guidance_batch)
        guided = uses_guidance_batch(self.spec)
        branches = 2 if guided and self.limits.guided(request.guidance) else 1
        reference = None
        if request.condition is not None and self.limits.reference_area:  # a square of its area: about its tokens
            side = round(self.limits.reference_area ** 0.5)
            reference = (side, side)
        with self._lock:  # one meta forward at a time: FlopCounterMode is a process-wide dispatch mode
            return self._count(request.height, request.width, request.frames, branches, reference)

    def _meta_models(self) -> tuple[torch.nn.Module, torch.nn.Module]:
        if self._models is None:
            import diffusers

            if self._family.transformer_setup:
                load(self._family.transformer_setup)()
            with META:
                transformer = load(self._family.transformer).from_config(self._transformer_config)
                vae = getattr(diffusers, self._vae_config["_class_name"]).from_config(self._vae_config)
            self._models = (transformer.eval(), vae.eval())
        return self._models

    def _count_shape(self, height: int, width: int, frames: int, branches: int,
                     reference: tuple[int, int] | None) -> Work:
        from torch.utils.flop_counter import FlopCounterMode

        from pipelines.transformer_inputs import Shape  # the family's input builder's shape type

        transformer, vae = self._meta_models()
        shape = Shape(height=height, width=width, frames=frames, text_tokens=self.spec.max_sequence_length,
                      reference=reference)
        inputs, _ = load(self._family.bench.inputs)(self._transformer_config, shape, batch=branches, device=META,
                                                     dtype=torch.float32)
        with torch.no_grad(), counting_on_meta():
            with FlopCounterMode(display=False) as counter:
                transformer(**inputs)
            step = counter.get_total_flops()
            with FlopCounterMode(display=False) as counter:
                vae.decode(_latent(self._vae_config, height, width, frames))
            decode = counter.get_total_flops()
        return Work(step_flops=float(step), decode_flops=float(decode))


def _latent(config: dict[str, Any], height: int, width: int, frames: int) -> torch.Tensor:
    """A meta latent of the VAE's shape for `frames` frames of height x width: a video VAE (Wan's, with
    temporal compression) takes [1, C, T, H, W], an image VAE [1, C, H, W]."""
    if "z_dim" in config:
        spatial = int(config.get("scale_factor_spatial", 2 ** len(config["temperal_downsample"])))
        temporal = int(config.get("scale_factor_temporal", 2 ** sum(config["temperal_downsample"])))
        return torch.empty(1, config["z_dim"], (frames - 1) // temporal + 1, height // spatial, width // spatial,
                           device=META)
    spatial = 2 ** (len(config["block_out_channels"]) - 1)
    return torch.empty(1, config["latent_channels"], height // spatial, width // spatial, device=META)
