"""Qwen-Image through the app, as users run it: generate a PNG from an unchanged diffusers QwenImagePipeline
folder, and the same image from 2 ranks splitting the text and image tokens (Ulysses on the generic
context-parallel engine; guidance's two calls, of different text lengths, each split, or each on its own rank with
--cfg-parallel).

The checkpoint is pipelines.qwen_image.tiny' tiny random Qwen-Image folder, run under the qwen-image name.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from pipelines.media import read_png_settings
from tests.helpers import run_app

COMMON = ["--model", "qwen-image", "--size", "64x48", "--steps", "2", "--prompt", "a big red circle", "--seed", "3"]


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    from pipelines.qwen_image.tiny import qwen_image_components, save_qwen_image

    path = tmp_path_factory.mktemp("qwen-image") / "Qwen-Image"
    save_qwen_image(path, qwen_image_components(seed=2))
    return path


@pytest.fixture(scope="module")
def one_rank_image(folder: Path, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("one") / "i.png"
    result = run_app("generate", *COMMON, "--model-path", str(folder), "--out", str(out))
    assert result.returncode == 0, result.stderr
    return out


def test_generate_writes_an_image(one_rank_image: Path) -> None:
    image = np.asarray(Image.open(one_rank_image), np.int16)
    assert image.shape == (48, 64, 3) and image.std() > 1
    settings = read_png_settings(one_rank_image)
    assert settings["model"] == "qwen-image" and settings["guidance"] == 4.0  # the checkpoint's defaults
    assert settings["negative_prompt"] == " " and settings["steps"] == 2


@pytest.mark.parametrize("plan", [["--strategy", "ulysses"], ["--cfg-parallel"]], ids=["ulysses", "cfg-parallel"])
def test_two_ranks_equal_one_rank(folder: Path, one_rank_image: Path, tmp_path: Path, plan: list[str]) -> None:
    """Ulysses (guidance's two calls each split), or --cfg-parallel (each call whole on its own rank)."""
    out = tmp_path / "i2.png"
    result = run_app("launch", "--nproc", "2", "generate", *COMMON, "--model-path", str(folder), *plan,
                     "--out", str(out))
    assert result.returncode == 0, result.stderr
    difference = np.abs(np.asarray(Image.open(out), np.int16) - np.asarray(Image.open(one_rank_image), np.int16))
    assert difference.max() <= 1, f"max pixel difference {difference.max()}"
