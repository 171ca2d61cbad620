"""What the benchmarks feed a transformer: sizes, random weights of a named architecture, call arguments.

An architecture is a registered checkpoint's published config (pipelines.families: ModelSpec.architecture),
or with `tiny` the family's embedded model's config (assets/), for CPU smoke tests. Call arguments come
from the input builder the family's record names (BenchShapes.inputs, in pipelines.transformer_inputs).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from pipelines.family import ModelFamily, load
from pipelines.registry import MODELS, ModelNotFoundError, default_folder, family_of, get_spec
from pipelines.transformer_inputs import Shape


@dataclass(kw_only=True, frozen=True)
class BenchModel:
    """A transformer architecture to measure: its registry name, family and config."""

    name: str
    family: ModelFamily
    config: dict[str, Any]

    @property
    def model_class(self) -> type[nn.Module]:
        """The diffusers class that `config` configures (after the family's transformer_setup, as the app runs it)."""
        if self.family.transformer_setup:
            load(self.family.transformer_setup)()
        return load(self.family.transformer)

    def inputs(self, shape: Shape, *, batch: int, device: torch.device, dtype: torch.dtype
               ) -> tuple[dict[str, Any], int]:
        """The transformer's keyword arguments for `shape`, and the image/video tokens it attends over."""
        return load(self.family.bench.inputs)(self.config, shape, batch=batch, device=device, dtype=dtype)


def benchmarkable() -> list[str]:
    """Registered checkpoints with a published architecture (what --model may name)."""
    return [name for name, spec in MODELS.items() if spec.architecture is not None]


def bench_model(name: str, *, tiny: bool = False) -> BenchModel:
    """The architecture of checkpoint `name`, or with `tiny` its family's embedded model's (read from assets/)."""
    spec = get_spec(name)
    family = family_of(spec)
    if tiny:
        embedded = next((s for s in family.models if s.embedded), None)
        if embedded is None and family.bench.tiny_config:
            return BenchModel(name=f"tiny-{family.name}", family=family, config=dict(load(family.bench.tiny_config)))
        if embedded is None:
            raise ModelNotFoundError(f"family {family.name!r} has no embedded model for --tiny")
        config = json.loads((default_folder(embedded) / "transformer" / "config.json").read_text())
        return BenchModel(name=embedded.name, family=family,
                          config={k: v for k, v in config.items() if not k.startswith("_")})
    if spec.architecture is None:
        raise ModelNotFoundError(f"no published architecture is recorded for '{name}'; "
                                 f"benchmarkable: {', '.join(benchmarkable())}")
    return BenchModel(name=name, family=family, config=dict(spec.architecture.transformer))


def parse_shapes(text: str, *, video: bool, text_tokens: int) -> list[Shape]:
    """"1024x1024,2048x2048" (images: height x width) or "93x704x1280" (videos: frames x height x width)."""
    shapes = []
    for item in text.split(","):
        dims = [int(d) for d in item.lower().split("x")]
        if video and len(dims) == 3:
            shapes.append(Shape(frames=dims[0], height=dims[1], width=dims[2], text_tokens=text_tokens))
        elif not video and len(dims) == 2:
            shapes.append(Shape(height=dims[0], width=dims[1], text_tokens=text_tokens))
        else:
            raise ValueError(f"bad {'video' if video else 'image'} size {item!r}")
    return shapes


def model_shapes(spec: BenchModel, *, sizes: str | None, video: str | None, text_tokens: int,
                 tiny: bool = False) -> list[Shape]:
    """The shapes to run `spec` at: `video` sizes for a video family, `sizes` for an image one, else its family's
    benchmark sizes (with `tiny`, its tiny configs' sizes)."""
    bench = spec.family.bench
    given = video if bench.video else sizes
    return parse_shapes(given or ",".join(bench.tiny_sizes if tiny else bench.sizes), video=bench.video,
                        text_tokens=text_tokens)


@contextmanager
def parameters_on_meta() -> Iterator[None]:
    """Modules built inside get their parameters on the meta device and their buffers as usual (rotary
    frequency tables hold computed values that random init must not lose): accelerate's
    init_empty_weights(include_buffers=False), which the GPU image does not install."""
    register = nn.Module.register_parameter

    def on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        register(module, name, param)
        if param is not None:
            module._parameters[name] = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)

    nn.Module.register_parameter = on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = register


def build_random(model: BenchModel, *, device: torch.device, dtype: torch.dtype, seed: int = 0) -> nn.Module:
    """Build `model` directly on `device` in `dtype` with random weights (same seed -> same weights).

    Parameters are created on the meta device and materialised uninitialised, then filled in place:
    a 12B model never exists in float32, and no nn.init pass runs (slow for 12B on a CPU). Buffers
    keep the values the model computed for them, cast to `dtype` as a checkpoint load would.
    """
    with parameters_on_meta():
        module = model.model_class(**model.config)
    for owner in module.modules():
        for name, param in owner._parameters.items():
            if param is not None:
                owner._parameters[name] = nn.Parameter(torch.empty(param.shape, dtype=dtype, device=device),
                                                       requires_grad=False)
    # nn.Module.to, not diffusers' override: its fp32-module warning is about checkpoints, moot here.
    module = nn.Module.to(module, device=device, dtype=dtype)
    generator = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, param in module.named_parameters():
            fill_random_(name, param, generator)
    return module.eval().requires_grad_(False)


def fill_random_(name: str, tensor: torch.Tensor, generator: torch.Generator) -> None:
    """build_random's value of parameter `name`, in place: a bias 0, a norm scale (one dimension) 1, the rest
    N(0, 0.02) drawn from `generator` (so the parameters' order of drawing decides the values)."""
    if name.endswith("bias"):
        tensor.zero_()
    elif tensor.ndim == 1:  # norm scales
        tensor.fill_(1.0)
    else:
        tensor.normal_(0.0, 0.02, generator=generator)
