"""Score a model folder on the held-out prompts with the pixel judges (training/judge.py).

The quality tests (tests/test_tiny_quality.py, tests/test_tiny_cosmos_quality.py) and the training
command's final report both call these (judge_images, judge_videos), so the numbers in a model card are
the numbers the tests check.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from pipelines.factory import load_pipeline
from pipelines.registry import family_of, get_spec
from pipelines.requests import make_request, read_limits
from training import judge, shapes
from training.lora_folder import lora_files


@dataclass(kw_only=True, slots=True)
class Scores:
    """Fractions of held-out prompts whose output the judges accept, and what they saw."""

    colour: float
    shape: float
    motion: float
    seen: list[tuple[str, str]]
    """(prompt, what the judges saw) per prompt."""


def generate(name: str, folder: Path, prompts: list[tuple[str, ...]], *, device: str = "cpu",
             fp8: bool = False, cache: str | None = None, steps: int | None = None,
             computed: list[int] | None = None, loras: tuple = (),
             lora: tuple[tuple[str, float], ...] | None = None,
             attention_precision: str = "full",
             watch: Callable[[Any], AbstractContextManager] | None = None) -> list[np.ndarray]:
    """What model `name` (a registry name) in `folder` makes for each of `prompts` (the prompt text first
    in each tuple), seed = prompt index, registry defaults: uint8 images [H, W, 3] or videos [T, H, W, 3].

    Args:
        fp8: the transformer blocks' linears as FP8, as `--fp8` runs them (engines/levers/fp8.py).
        cache: a step cache, as `--cache` runs it (engines/levers/step_cache.py); `computed` then receives each
            prompt's number of computed steps.
        steps: denoising steps instead of the registry's.
        loras: LoRA files (engines.options.LoraFile) loaded as `--lora NAME=PATH[:SCALE]` loads them
            (StagedPipeline.use_loras, engines/weights/lora.py); `lora`: the (name, scale) pairs every request chooses
            (GenerationRequest.lora; None: every loaded one at its file's scale, as a request that names none).
        attention_precision: as `--attention-precision` runs it (engines/levers/quantized_attention.py; the first and
            last steps at full precision).
        watch: given the loaded pipeline, a context the generations run in (benchmarks/attention_error.py records
            every attention call of them).
    """
    spec = get_spec(name)
    pipe = load_pipeline(spec, folder, device=device)
    pipe.attention_precision = attention_precision
    if fp8:
        from engines.levers.fp8 import quantize_fp8

        quantize_fp8(pipe.transformer, family_of(spec).compiled_blocks)
    if cache is not None:
        from engines.options import CacheOptions

        pipe.use_step_cache(CacheOptions.parse(cache))
    limits = read_limits(spec, folder)
    extra = {}
    if loras:
        pipe.use_loras(list(loras))
        limits = replace(limits, loras=tuple((file.name, file.scale) for file in loras))
        if lora is not None:
            extra["lora"] = {name: scale for name, scale in lora}
    media = []
    with watch(pipe) if watch is not None else nullcontext():
        for i, prompt in enumerate(prompts):
            media.append(np.asarray(pipe.generate(make_request(spec, limits, prompt=prompt[0], seed=i, steps=steps,
                                                               **extra))))
            if computed is not None and pipe.step_caches:
                computed.append(pipe.computed_steps())
    return media


def score_images(folder: Path, *, count: int = 24, device: str = "cpu", name: str = "tiny-flux") -> Scores:
    """Generate `count` held-out image prompts (seed = index, registry defaults) and judge colour and shape."""
    prompts = shapes.held_out_image_prompts()[:count]
    return judge_images(generate(name, folder, prompts, device=device), prompts)


def judge_images(images: list[np.ndarray], prompts: list[tuple[str, str, str]]) -> Scores:
    """Judge colour and shape of `images`, made for `prompts` ((prompt, colour, shape) each), in order."""
    colour = shape = 0
    seen = []
    for image, (prompt, want_colour, want_shape) in zip(images, prompts, strict=True):
        verdict = judge.judge_image(image)
        colour += verdict.colour == want_colour
        shape += verdict.shape == want_shape
        seen.append((prompt, f"{verdict.colour} {verdict.shape}"))
    count = max(len(seen), 1)
    return Scores(colour=colour / count, shape=shape / count, motion=float("nan"), seen=seen)


def score_videos(folder: Path, *, count: int = 24, device: str = "cpu", name: str = "tiny-cosmos",
                 strip: Path | None = None) -> Scores:
    """Generate `count` held-out video prompts (seed = index, registry defaults) and judge colour, shape, motion;
    with `strip`, also write there a PNG of the first EXAMPLES videos' frames (frame_strip)."""
    prompts = shapes.held_out_video_prompts()[:count]
    videos = generate(name, folder, prompts, device=device)
    if strip is not None:
        frame_strip(videos[:EXAMPLES], strip)
    return judge_videos(videos, prompts)


EXAMPLES = 3
"""Videos a model card shows as frame strips."""


def frame_strip(videos: list[np.ndarray], path: Path, every: int = 2) -> None:
    """A PNG with one row per video ([T, H, W, 3] uint8 each): every `every`-th frame, left to right."""
    from PIL import Image

    rows = [np.concatenate(list(frames[::every]), 1) for frames in videos]
    Image.fromarray(np.concatenate(rows, 0)).save(path)


def judge_videos(videos: list[np.ndarray], prompts: list[tuple[str, str, str, str]]) -> Scores:
    """Judge colour, shape and motion of `videos` ([T, H, W, 3] uint8 each), made for `prompts`
    ((prompt, colour, shape, motion) each), in order. Colour and shape are judged on the middle frame."""
    colour = shape = motion = 0
    seen = []
    for frames, (prompt, want_colour, want_shape, want_motion) in zip(videos, prompts, strict=True):
        verdict = judge.judge_image(frames[len(frames) // 2])
        moved = judge.judge_motion(frames)
        colour += verdict.colour == want_colour
        shape += verdict.shape == want_shape
        motion += moved == want_motion
        seen.append((prompt, f"{verdict.colour} {verdict.shape} {moved}"))
    count = max(len(seen), 1)
    return Scores(colour=colour / count, shape=shape / count, motion=motion / count, seen=seen)


def score_reconstructions(folder: Path, *, count: int = 48, size: int = 128, frames: int = 17,
                          device: str = "cpu", blur: float = 0.0) -> Scores:
    """Encode and decode `count` held-out clips with the video VAE in `folder` alone (posterior mode) and
    score how often the judges see in the reconstruction the colour, shape and motion they see in the
    original: what the transformer's latents can carry at best. With `blur`, the latents are blurred by that
    many latent pixels before decoding (training.autoencoder.blur_latents)."""
    import torch

    from pipelines.loading import load_parts
    from training.autoencoder import blur_latents

    vae = load_parts(folder, ["vae"], dtype=torch.float32, device=device)["vae"]
    scenes = shapes.video_scenes(count, frames, torch.Generator().manual_seed(0), held_out=True)
    clips = shapes.render(scenes, size, size, device)
    with torch.no_grad():
        decoded = torch.cat([vae.decode(blur_latents(vae.encode(clips[i: i + 8]).latent_dist.mode(), blur)).sample
                             for i in range(0, count, 8)])
    return judge_reconstructions(shapes.to_uint8(clips), shapes.to_uint8(decoded), scenes.captions)


def judge_reconstructions(originals: np.ndarray, reconstructions: np.ndarray, captions: list[str]) -> Scores:
    """How often the judges see in each reconstruction ([T, H, W, 3] uint8) the colour and shape (middle
    frame) and the motion that they see in its original."""
    colour = shape = motion = 0
    seen = []
    for caption, original, back in zip(captions, originals, reconstructions, strict=True):
        want, got = judge.judge_image(original[len(original) // 2]), judge.judge_image(back[len(back) // 2])
        want_motion, got_motion = judge.judge_motion(original), judge.judge_motion(back)
        colour += got.colour == want.colour
        shape += got.shape == want.shape
        motion += got_motion == want_motion
        seen.append((caption, f"{got.colour} {got.shape} {got_motion}"))
    count = max(len(seen), 1)
    return Scores(colour=colour / count, shape=shape / count, motion=motion / count, seen=seen)


def save_examples(folder: Path, out: Path, *, device: str = "cpu") -> None:
    """A 4x2 grid PNG of held-out images and a strip of video frames, for a person to look at."""
    from PIL import Image

    images = generate("tiny-flux", folder / "tiny-flux", shapes.held_out_image_prompts()[:8], device=device)
    grid = np.concatenate([np.concatenate(images[:4], 1), np.concatenate(images[4:], 1)], 0)
    Image.fromarray(grid).save(out / "examples-tiny-flux.png")
    videos = generate("tiny-cosmos", folder / "tiny-cosmos", shapes.held_out_video_prompts()[:6], device=device)
    rows = [np.concatenate(list(frames[::4]), 1) for frames in videos]
    Image.fromarray(np.concatenate(rows, 0)).save(out / "examples-tiny-cosmos.png")


@dataclass(kw_only=True, slots=True)
class LoraScores:
    """A LoRA's held-out scores (score_lora): per run, the share of prompts whose change the judge sees, colour and
    shape; and the largest pixel differences of scale 0 against no LoRA and of the kohya copy against the
    diffusers file."""

    rows: dict[str, dict[str, float]]
    zero_vs_none: int
    kohya_vs_diffusers: int

    def summary(self) -> str:
        runs = "; ".join(f"{label}: change {row['change']:.0%} colour {row['colour']:.0%} shape {row['shape']:.0%}"
                         for label, row in self.rows.items())
        return (f"{runs}; scale 0 vs none {self.zero_vs_none} levels, kohya vs diffusers "
                f"{self.kohya_vs_diffusers} levels")


def judge_lora(images: list[np.ndarray], prompts: list[tuple[str, str, str]]) -> dict[str, float]:
    """Share of `images` whose background the gray judge accepts ("change"), and their colour and shape scores."""
    scores = judge_images(images, prompts)
    change = sum(judge.judge_gray_background(image) for image in images) / max(len(images), 1)
    return {"change": change, "colour": scores.colour, "shape": scores.shape}


def max_difference(a: list[np.ndarray], b: list[np.ndarray]) -> int:
    return max(int(np.abs(x.astype(np.int16) - y.astype(np.int16)).max()) for x, y in zip(a, b, strict=True))


LORA_SUBSET = 6
"""Held-out prompts on which score_lora (and tests/test_tiny_lora_quality.py) compare scale 0 with no LoRA and the
kohya copy with the diffusers file (pixel differences: a few prompts show them; CPU time is short)."""


def score_lora(base: Path, folder: Path, *, count: int = 24, device: str = "cpu") -> LoraScores:
    """The LoRA in `folder` (training/lora.py) on `count` held-out image prompts of tiny-flux in `base`: without
    it and at scale 1; at scale 0 and its kohya copy at scale 1 on the first LORA_SUBSET."""
    prompts = shapes.held_out_image_prompts()[:count]
    files = lora_files(folder)
    none = generate("tiny-flux", base, prompts, device=device)
    one = generate("tiny-flux", base, prompts, device=device, loras=files, lora=(("lora", 1.0),))
    subset = prompts[:LORA_SUBSET]
    zero = generate("tiny-flux", base, subset, device=device, loras=files, lora=(("lora", 0.0),))
    kohya = generate("tiny-flux", base, subset, device=device, loras=files, lora=(("kohya", 1.0),))
    rows = {"no LoRA": judge_lora(none, prompts), "scale 1": judge_lora(one, prompts),
            f"scale 0 (first {len(subset)})": judge_lora(zero, subset),
            f"kohya copy, scale 1 (first {len(subset)})": judge_lora(kohya, subset)}
    return LoraScores(rows=rows, zero_vs_none=max_difference(zero, none[:len(subset)]),
                      kohya_vs_diffusers=max_difference(kohya, one[:len(subset)]))
