"""The embedded tiny-cosmos moves the object the asked way: held-out prompts judged by pixels.

It fails with the tiny-cosmos now in assets/ (see its model card), so its file name keeps it out of the
default suite; it becomes part of the suite once a training run passes. Run it with:
python -m pytest tests/tiny_cosmos_quality_check.py. (tiny-flux's check is tests/test_tiny_quality.py.)

Prompts combine colours, shapes and motions never shown together in training
(training/shapes.py HELD_OUT_VIDEOS), at the registry's default size, steps and guidance.
"""

from __future__ import annotations

from pipelines.registry import default_folder, get_spec
from training.evaluate import score_videos

VIDEO_PROMPTS = 20


def _table(scores) -> str:
    return "\n".join(f"{prompt!r}: saw {seen}" for prompt, seen in scores.seen)


def test_tiny_cosmos_moves_the_object_the_asked_way():
    scores = score_videos(default_folder(get_spec("tiny-cosmos")), count=VIDEO_PROMPTS)
    assert len(scores.seen) == VIDEO_PROMPTS
    assert scores.motion >= 0.8, f"motion {scores.motion:.0%} (need 80%)\n{_table(scores)}"
