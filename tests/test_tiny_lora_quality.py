"""The embedded LoRA assets/tiny-flux-lora-gray (trained by `python -m training lora`, training/lora.py) does what
it teaches on tests/test_tiny_quality.py's held-out prompts (same prompts, seeds, registry size and steps), loaded
as the app loads `--lora` files (training.evaluate.generate: StagedPipeline.use_loras, engines/weights/lora.py):

- at scale 1 the background is gray (training.judge.judge_gray_background) in >= 80% of the images; without the
  LoRA and at scale 0 in <= 10% (one prompt asks for gray);
- scale 0 draws what no LoRA draws, within one level;
- colour and shape stay what the prompt asks (>= 90% and >= 80%, tiny-flux's own bars);
- the kohya copy (engines.weights.lora.export_kohya) draws what the diffusers file draws, within one level.

The scale-0 and kohya comparisons run on the first SUBSET (training.evaluate.LORA_SUBSET) prompts, to keep the
test short on a CPU; the generations are made once per module and shared by the checks. Measured numbers: the
LoRA's model card (assets/tiny-flux-lora-gray/README.md, written by training.evaluate.score_lora, the same
generations).
"""

from __future__ import annotations

import numpy as np
import pytest

from pipelines.registry import default_folder, get_spec
from tests.test_tiny_quality import PROMPTS
from training import shapes
from training.evaluate import LORA_SUBSET as SUBSET
from training.evaluate import generate, judge_lora, max_difference
from training.lora_folder import DIFFUSERS_FILE, lora_files

LORA = default_folder(get_spec("tiny-flux")).parent / "tiny-flux-lora-gray"


@pytest.fixture(scope="module")
def images() -> dict[str, list[np.ndarray]]:
    assert PROMPTS == shapes.held_out_image_prompts()
    assert (LORA / DIFFUSERS_FILE).is_file()
    base, files = default_folder(get_spec("tiny-flux")), lora_files(LORA)
    return {
        "none": generate("tiny-flux", base, PROMPTS),
        "one": generate("tiny-flux", base, PROMPTS, loras=files, lora=(("lora", 1.0),)),
        "zero": generate("tiny-flux", base, PROMPTS[:SUBSET], loras=files, lora=(("lora", 0.0),)),
        "kohya": generate("tiny-flux", base, PROMPTS[:SUBSET], loras=files, lora=(("kohya", 1.0),)),
    }


def test_the_lora_turns_backgrounds_gray_at_scale_1_only(images) -> None:
    one, none = judge_lora(images["one"], PROMPTS), judge_lora(images["none"], PROMPTS)
    zero = judge_lora(images["zero"], PROMPTS[:SUBSET])
    print(f"scale 1: {one}; no LoRA: {none}; scale 0 (first {SUBSET}): {zero}")
    assert one["change"] >= 0.8, one
    assert none["change"] <= 0.1 and zero["change"] <= 0.1, (none, zero)


def test_scale_0_is_no_lora(images) -> None:
    assert max_difference(images["zero"], images["none"][:SUBSET]) <= 1


def test_colour_and_shape_hold_with_the_lora(images) -> None:
    one = judge_lora(images["one"], PROMPTS)
    assert one["colour"] >= 0.9 and one["shape"] >= 0.8, one


def test_the_kohya_copy_draws_what_the_diffusers_file_draws(images) -> None:
    assert max_difference(images["kohya"], images["one"][:SUBSET]) <= 1
