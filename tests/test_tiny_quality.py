"""The embedded tiny-flux draws what it is asked: held-out prompts judged by pixels (training/judge.py).

The prompts combine colours, shapes and backgrounds never shown together in training
(training/shapes.py HELD_OUT_IMAGES), at the registry's default size, steps and guidance, seed = prompt
index. The first 3 prompts run again on 2 gloo ranks through `ulysses-studio launch --nproc 2 batch`, as a
user would run them: the images equal the one-process images within one level, so the scores hold there.
(tiny-cosmos' check is tests/test_tiny_cosmos_quality.py.)
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from pipelines.registry import default_folder, get_spec
from training import shapes
from training.evaluate import generate, judge_images

PROMPTS = shapes.held_out_image_prompts()  # 24
TWO_RANK_PROMPTS = PROMPTS[:3]
"""The 2-rank batch draws these (same seeds) and must match the one process's images: the bars then hold alike.
Three, not more: the check is equality with the one process, which each image tests whole."""


@pytest.fixture(scope="module")
def one_process_images() -> list[np.ndarray]:
    return generate("tiny-flux", default_folder(get_spec("tiny-flux")), PROMPTS)


def _scores(images: list[np.ndarray]) -> tuple[float, float, str]:
    scores = judge_images(images, PROMPTS)
    return scores.colour, scores.shape, "\n".join(f"{prompt!r}: saw {seen}" for prompt, seen in scores.seen)


def test_tiny_flux_draws_the_asked_colour_and_shape(one_process_images):
    assert len(PROMPTS) >= 20
    colour, shape, table = _scores(one_process_images)
    assert colour >= 0.9 and shape >= 0.8, f"colour {colour:.0%} (need 90%), shape {shape:.0%} (need 80%)\n{table}"


def test_tiny_flux_keeps_its_scores_with_fp8(one_process_images):
    """--fp8 (engines/levers/fp8.py): the held-out colour and shape scores within one prompt of float32's."""
    colour, shape, _ = _scores(one_process_images)
    fp8_colour, fp8_shape, table = _scores(generate("tiny-flux", default_folder(get_spec("tiny-flux")), PROMPTS,
                                                    fp8=True))
    one = 1 / len(PROMPTS) + 1e-9
    assert abs(fp8_colour - colour) <= one and abs(fp8_shape - shape) <= one, (
        f"fp8: colour {fp8_colour:.0%} shape {fp8_shape:.0%}; float32: colour {colour:.0%} shape {shape:.0%}\n{table}")


QUANTIZED_PROMPTS = PROMPTS[:6]
"""--attention-precision int8 draws these; each image within MAX_MEAN_LEVELS of the full-precision one's."""
MAX_MEAN_LEVELS = 3.0


def test_tiny_flux_int8_attention_draws_what_full_precision_draws(one_process_images):
    """--attention-precision int8 (engines/levers/quantized_attention.py; first and last steps full): each image's mean
    difference from the float32 one within 3 levels of 255."""
    images = generate("tiny-flux", default_folder(get_spec("tiny-flux")), QUANTIZED_PROMPTS,
                      attention_precision="int8")
    levels = [np.abs(got.astype(float) - want.astype(float)).mean() for got, want in zip(images, one_process_images)]
    assert max(levels) > 0, "int8 attention changed no pixel: it did not run"
    assert max(levels) <= MAX_MEAN_LEVELS, f"mean levels off per image: {levels}"


@pytest.fixture(scope="module")
def every_step_28() -> tuple[float, float]:
    """The held-out colour and shape scores at FLUX.1-dev's 28 steps, every step computed (float32)."""
    colour, shape, _ = _scores(generate("tiny-flux", default_folder(get_spec("tiny-flux")), PROMPTS, steps=28))
    return colour, shape


@pytest.mark.parametrize("fp8", [False, True], ids=["cache", "fp8-and-cache"])
def test_tiny_flux_keeps_its_scores_with_the_step_cache(every_step_28, fp8):
    """--cache fbcache at its default threshold (engines/levers/step_cache.py), alone and with --fp8, at FLUX.1-dev's 28
    steps (at the registry's 8 steps it skips none): the held-out scores within one prompt of every step computed
    in float32, and it skips steps (measured: 38% of them alone, colour 100% and shape 92% against 100% and 88%
    without)."""
    folder = default_folder(get_spec("tiny-flux"))
    colour, shape = every_step_28
    computed: list[int] = []
    cached_colour, cached_shape, table = _scores(generate("tiny-flux", folder, PROMPTS, steps=28, cache="fbcache",
                                                          computed=computed, fp8=fp8))
    skipped = 1 - sum(computed) / (28 * len(PROMPTS))
    print(f"step cache{' with fp8' if fp8 else ''}: {skipped:.0%} of the steps skipped; colour {cached_colour:.0%} "
          f"shape {cached_shape:.0%} (every step: {colour:.0%}, {shape:.0%})")
    one = 1 / len(PROMPTS) + 1e-9
    assert skipped >= 0.2, f"the step cache skipped only {skipped:.0%} of the steps"
    assert abs(cached_colour - colour) <= one and abs(cached_shape - shape) <= one, (
        f"cached: colour {cached_colour:.0%} shape {cached_shape:.0%}; every step: colour {colour:.0%} "
        f"shape {shape:.0%}\n{table}")


def test_tiny_flux_draws_the_same_on_two_ranks(one_process_images, tmp_path: Path):
    prompts = tmp_path / "held-out.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p, "seed": i, "name": f"p{i:02d}"}) + "\n"
                               for i, (p, _, _) in enumerate(TWO_RANK_PROMPTS)))
    out = tmp_path / "out"
    done = subprocess.run([sys.executable, "-m", "app", "launch", "--nproc", "2", "batch", str(prompts),
                           "--out", str(out), "--model", "tiny-flux"], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert all(json.loads(line)["ranks"] == 2 for line in (out / "manifest.jsonl").read_text().splitlines())
    images = [np.asarray(Image.open(out / f"p{i:02d}.png").convert("RGB")) for i in range(len(TWO_RANK_PROMPTS))]
    for i, (parallel, single) in enumerate(zip(images, one_process_images)):
        difference = np.abs(parallel.astype(np.int16) - single.astype(np.int16)).max()
        assert difference <= 1, f"prompt {i}: 2-rank image differs from 1-process image by {difference} levels"
