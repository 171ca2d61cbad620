"""The embedded models draw what they are asked: held-out prompts judged by pixels (training/judge.py).

These pass only with trained weights in assets/ (python -m training --out assets); with random weights
they fail. The file name keeps it out of the default suite until trained weights are committed; then it
becomes tests/test_tiny_quality.py. Run it now with: python -m pytest tests/tiny_quality_check.py

Prompts combine colours, shapes and backgrounds (or motions) never shown together in training
(training/shapes.py HELD_OUT_*), at the registry's default size, steps and guidance.
"""

from __future__ import annotations

from pipelines.registry import default_folder, get_spec
from training.evaluate import score_images, score_videos

IMAGE_PROMPTS = 24
VIDEO_PROMPTS = 20


def _table(scores) -> str:
    return "\n".join(f"{prompt!r}: saw {seen}" for prompt, seen in scores.seen)


def test_tiny_flux_draws_the_asked_colour_and_shape():
    scores = score_images(default_folder(get_spec("tiny-flux")), count=IMAGE_PROMPTS)
    assert len(scores.seen) == IMAGE_PROMPTS
    assert scores.colour >= 0.9 and scores.shape >= 0.8, (
        f"colour {scores.colour:.0%} (need 90%), shape {scores.shape:.0%} (need 80%)\n{_table(scores)}")


def test_tiny_cosmos_moves_the_object_the_asked_way():
    scores = score_videos(default_folder(get_spec("tiny-cosmos")), count=VIDEO_PROMPTS)
    assert len(scores.seen) == VIDEO_PROMPTS
    assert scores.motion >= 0.8, f"motion {scores.motion:.0%} (need 80%)\n{_table(scores)}"
